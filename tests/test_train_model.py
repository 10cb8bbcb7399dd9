"""Training through the serving model code: gradients reach the weights and both losses fall."""

from __future__ import annotations

import torch

from moebox.config import parse_config
from moebox.train.model import FROZEN, init_params, losses, trainable_model
from moebox.weights.synth import preset_config


def test_a_few_adamw_steps_fit_a_fixed_batch():
    """Over-fitting two fixed sequences must drive both the next-token and the MTP loss far down; a broken
    gradient path (a detached op, a frozen block, a mis-shifted target) stalls one of them."""
    cfg = parse_config(preset_config("tiny"))
    torch.manual_seed(0)
    params = init_params(cfg, seed=0)
    model = trainable_model(cfg, params)
    learned = [p for p in params.values() if isinstance(p, torch.nn.Parameter)]
    assert not any(isinstance(params[n], torch.nn.Parameter) for n in params if n.endswith(FROZEN))
    opt = torch.optim.AdamW(learned, lr=3e-3)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(2, cfg.vocab_size, (n,), generator=g).tolist() for n in (40, 27)]
    first = None
    for _ in range(25):
        main, mtp = losses(model, seqs)
        first = first or (main.item(), mtp.item())
        opt.zero_grad()
        (main + 0.3 * mtp).backward()
        opt.step()
    main, mtp = losses(model, seqs)
    print(f"\nloss main {first[0]:.3f} -> {main.item():.3f}, mtp {first[1]:.3f} -> {mtp.item():.3f}")
    assert main.item() < 0.5 * first[0] and mtp.item() < 0.7 * first[1]
    touched = {n for n, p in params.items() if isinstance(p, torch.nn.Parameter) and p.grad is not None
               and p.grad.abs().sum() > 0}
    csa = cfg.attn_types.index("csa")
    for part in ("embed.weight", "head.weight", "layers.0.attn.wq_b.weight", "layers.0.hc_attn_fn",
                 f"layers.{csa}.attn.compressor.wkv.weight", f"layers.{csa}.attn.compressor.wgate.weight",
                 "mtp.0.e_proj.weight", "mtp.0.attn.wkv.weight", "mtp.0.ffn.shared_experts.w2.weight"):
        assert part in touched, part


def test_batched_rows_match_the_per_segment_path_in_values_and_gradients():
    """A training batch (B rows of T tokens from position 0, no cache) runs attention for all rows at once
    (`Attention._fresh`); the per-segment path (what serving prefill runs) must give the same logits and the
    same gradients. T = 70 crosses the tiny preset's window, compressor windows and the indexer's top-k."""
    from moebox.model.batch import FlatBatch
    cfg = parse_config(preset_config("tiny"))
    params = init_params(cfg, seed=2)
    model = trainable_model(cfg, params)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(2, cfg.vocab_size, (70,), generator=g).tolist() for _ in range(3)]
    assert 70 > cfg.sliding_window and 70 // max(cfg.compress_ratios) > cfg.index_topk
    results = []
    for extra in ([], [(3, 0, seqs[0][:9])]):          # an odd-length extra segment forces the per-segment path
        batch = FlatBatch.build([(i, 0, s) for i, s in enumerate(seqs)] + extra)
        assert (batch.uniform_length() is None) == bool(extra)
        logits = model.forward(batch, None, logits_rows=torch.arange(3 * 70)).logits
        for p in params.values():
            p.grad = None
        (logits.log_softmax(-1)[:, 5].sum()).backward()
        results.append((logits.detach(), {n: p.grad.clone() for n, p in params.items()
                                           if isinstance(p, torch.nn.Parameter) and p.grad is not None}))
    (fresh, g_fresh), (ref, g_ref) = results
    assert (fresh - ref).abs().max().item() <= 1e-4
    assert g_fresh.keys() == g_ref.keys() and len(g_ref) > 20
    for n in g_ref:
        assert torch.allclose(g_fresh[n], g_ref[n], rtol=1e-3, atol=1e-5), n


def test_export_loads_as_an_official_checkpoint(tmp_path):
    """The exported checkpoint passes the checkpoint validator and, loaded by the serving loader (FP8/FP4
    dequantized by the reference ops), gives the logits of the trainable model over the same quantized values."""
    from moebox.model.batch import FlatBatch
    from moebox.runtime.loader import load_model
    from moebox.train.export import dequantized, export_checkpoint
    from moebox.weights.checkpoint import Checkpoint
    from moebox.weights.schema import official_schema
    from moebox.weights.tokenizer import build_tokenizer

    raw = preset_config("tiny")
    cfg = parse_config(raw)
    params = init_params(cfg, seed=3)
    out = export_checkpoint(tmp_path / "ckpt", raw, params, build_tokenizer(cfg.vocab_size), shard_mb=0.25,
                            progress=False)
    Checkpoint(out).validate()
    served, _ = load_model(out, kv_cache_dtype="model", progress=False)
    schema = official_schema(cfg)
    rounded = {n: dequantized(schema[n], v) for n, v in params.items()}
    reference = trainable_model(cfg, rounded)
    ids = torch.randint(2, cfg.vocab_size, (50,), generator=torch.Generator().manual_seed(4)).tolist()
    batch = FlatBatch.build([(0, 0, ids)])
    with torch.no_grad():
        got = served.forward(batch, None, logits_rows=torch.arange(50)).logits
        want = reference.forward(batch, None, logits_rows=torch.arange(50)).logits
    assert (got - want).abs().max().item() <= 1e-4
    assert len(list(out.glob("model-*.safetensors"))) > 1


def test_the_demo_preset_ships_within_40_mb():
    """Issue G's size budget for the shipped model, in the official layout (MTP included)."""
    from moebox.weights.schema import official_schema
    cfg = parse_config(preset_config("demo"))
    assert sum(spec.stored_nbytes() for spec in official_schema(cfg).values()) <= 40e6
    assert {"sliding", "csa", "hca"} <= set(cfg.attn_types) and any(cfg.hash_layers)
    assert cfg.n_routed_experts >= 16 and cfg.n_shared_experts and cfg.num_mtp_layers == 1


def test_expert_qat_forwards_the_exported_fp4_experts_and_trains_the_fp32_ones():
    """With `expert_qat` the forward must see exactly the routed-expert values the export writes (FP4, what the
    served native model multiplies by), while the gradient still reaches every hit expert's fp32 parameter."""
    import re

    from moebox.model.batch import FlatBatch
    from moebox.train.export import dequantized
    from moebox.weights.schema import official_schema
    cfg = parse_config(preset_config("tiny"))
    params = init_params(cfg, seed=5)
    schema = official_schema(cfg)
    expert = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
    assert all(schema[n].kind == "fp4" for n in params if expert.search(n))
    rounded = {n: dequantized(schema[n], v) if expert.search(n) else v for n, v in params.items()}
    ids = torch.randint(2, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(6)).tolist()
    batch = FlatBatch.build([(0, 0, ids)])
    rows = torch.arange(40)
    qat = trainable_model(cfg, params, expert_qat=True).forward(batch, None, logits_rows=rows).logits
    with torch.no_grad():
        want = trainable_model(cfg, rounded).forward(batch, None, logits_rows=rows).logits
        plain = trainable_model(cfg, params).forward(batch, None, logits_rows=rows).logits
    assert (qat.detach() - want).abs().max().item() <= 1e-5
    assert (plain - want).abs().max().item() > 1e-3          # the rounding changes the logits: the check can fail
    qat.log_softmax(-1)[:, 7].sum().backward()
    hit = [n for n, p in params.items() if expert.search(n) and p.grad is not None and p.grad.abs().sum() > 0]
    assert len(hit) >= 3 * cfg.num_experts_per_tok
