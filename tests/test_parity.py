"""moebox's DeepSeek-V4 against transformers' DeepseekV4ForCausalLM (fp32, CPU) on the same weights."""

from __future__ import annotations

import pytest
import torch

from moebox import LLM, SamplingParams
from moebox.config import CSA, HCA, SLIDING
from tests.hf_oracle import DeepseekV4Config, DeepseekV4ForCausalLM, hf_model_from_checkpoint, randomize_hidden_paths

SEQ = 80
GREEDY = 32


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by full forwards (no cache), the plainest possible reference."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def check_parity(llm: LLM, hf_model, seed: int) -> None:
    cfg = llm.config
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, cfg.vocab_size, (SEQ,), generator=g)
    # the sequence must exercise every path: window eviction, indexer selection, HCA entries, both routings
    assert SEQ > cfg.sliding_window
    csa_entries = SEQ // min(r for k, r in zip(cfg.attn_types, cfg.compress_ratios) if k == CSA)
    assert csa_entries > cfg.index_topk
    assert SEQ // max(r for k, r in zip(cfg.attn_types, cfg.compress_ratios) if k == HCA) >= 4
    assert any(cfg.hash_layers) and not all(cfg.hash_layers)
    assert {SLIDING, CSA, HCA} <= set(cfg.attn_types)

    ours = llm.logits(ids.tolist())
    with torch.no_grad():
        ref = hf_model(ids.unsqueeze(0)).logits[0]
    assert ours.shape == ref.shape == (SEQ, cfg.vocab_size)
    assert ref.std() > 0.1  # not a degenerate model
    diff = (ours - ref).abs().max().item()
    assert diff <= 1e-4, f"max |logit diff| {diff}"

    prompt = ids[:40].tolist()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=GREEDY, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(hf_model, prompt, GREEDY)


def test_tiny_official_layout_matches_transformers(tiny_ckpt):
    llm = LLM(tiny_ckpt, kv_cache_dtype="model", progress=False)   # QAT simulation off: HF has none
    hf_model, _ = hf_model_from_checkpoint(tiny_ckpt)
    check_parity(llm, hf_model, seed=1)


SECOND = dict(
    vocab_size=300, hidden_size=96, num_hidden_layers=7, num_attention_heads=6, num_key_value_heads=1, head_dim=32,
    partial_rotary_factor=0.25, q_lora_rank=48, o_groups=3, o_lora_rank=24, n_routed_experts=16,
    num_experts_per_tok=3, n_shared_experts=1, moe_intermediate_size=64, index_n_heads=12, index_head_dim=16,
    index_topk=5, sliding_window=16,
    layer_types=["sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention",
                 "heavily_compressed_attention", "compressed_sparse_attention", "compressed_sparse_attention",
                 "sliding_attention"],
    mlp_layer_types=["hash_moe", "hash_moe", "hash_moe", "moe", "moe", "moe", "moe"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    rope_theta=10000.0, compress_rope_theta=50000.0,
    rope_parameters={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 32,
                     "beta_slow": 1},
    max_position_embeddings=2048, hc_mult=2, hc_sinkhorn_iters=7, swiglu_limit=7.0, routed_scaling_factor=2.0,
)


@pytest.fixture(scope="module")
def second_model(tmp_path_factory):
    torch.manual_seed(7)
    cfg = DeepseekV4Config(**SECOND)
    cfg._attn_implementation = "eager"
    model = DeepseekV4ForCausalLM(cfg).float().eval()
    randomize_hidden_paths(model, seed=7)
    path = tmp_path_factory.mktemp("hf-second")
    model.save_pretrained(path)
    return model, path


def test_second_config_transformers_layout_matches_transformers(second_model):
    hf_model, path = second_model
    llm = LLM(path, progress=False)          # HF layout: QAT off by default, as transformers computes
    assert llm.checkpoint.layout == "hf" and not llm.model.qat
    assert llm.config.hc_mult == 2 and llm.config.compress_ratios[1] == 16
    check_parity(llm, hf_model, seed=2)
