"""The FP8/FP4 cache layout of `kv_cache_dtype="fp8"`: lossless for QAT-rounded rows, smaller, same model."""

from __future__ import annotations

import torch

from moebox.config import load_config
from moebox.model.batch import FlatBatch
from moebox.model.cache import FP4Rows, FP8Rows, KVCache, cache_bytes_per_slot
from moebox.ops.qat import round_index_vectors, round_kv_nope
from moebox.runtime.loader import load_model


def test_fp8_rows_store_qat_rounded_rows_exactly_but_rope_in_bf16():
    g = torch.Generator().manual_seed(0)
    rows = round_kv_nope(torch.randn(2, 5, 512, generator=g) * 3, 448)
    store = FP8Rows(2, 7, 512, 448, "cpu")
    store[1, torch.tensor([0, 3, 4, 5, 6])] = rows[1]
    back = store[1, torch.tensor([0, 3, 4, 5, 6])]
    assert torch.equal(back[:, :448], rows[1, :, :448])
    assert torch.equal(back[:, 448:], rows[1, :, 448:].to(torch.bfloat16).float())
    assert store.nbytes == 2 * 7 * (448 + 7 + 2 * 64)        # 583 B per row (deepseek_v4.md §3: ~584)


def test_fp4_rows_store_rounded_index_keys_exactly():
    g = torch.Generator().manual_seed(1)
    keys = round_index_vectors(torch.randn(6, 128, generator=g))
    store = FP4Rows(1, 6, 128, "cpu")
    store[0, :6] = keys
    assert torch.equal(store[0, :6], keys)
    assert store.nbytes == 6 * (64 + 4)


def test_fp8_layout_allocates_what_the_plan_counts_and_less(tiny_ckpt):
    cfg = load_config(tiny_ckpt)
    fp8 = KVCache(cfg, 3, 256, torch.bfloat16, kv_layout="fp8")
    assert fp8.nbytes() == 3 * cache_bytes_per_slot(cfg, 256, torch.bfloat16, kv_layout="fp8")
    assert fp8.nbytes() < KVCache(cfg, 3, 256, torch.bfloat16).nbytes()


def test_fp8_layout_serves_the_same_model(tiny_ckpt):
    """With QAT on and bf16 activations the fp8 layout is lossless: the same logits bit for bit as a bf16 cache
    (the nope channels and index keys sit on the FP8/FP4 grids, the rope channels are bf16 either way)."""
    ref, _ = load_model(tiny_ckpt, kv_cache_dtype="auto", dtype=torch.bfloat16, progress=False)   # bf16 cache
    fp8, _ = load_model(tiny_ckpt, kv_cache_dtype="fp8", dtype=torch.bfloat16, progress=False)
    assert ref.qat and fp8.qat and fp8.kv_layout == "fp8"
    ids = torch.randint(2, ref.cfg.vocab_size, (60,), generator=torch.Generator().manual_seed(2)).tolist()
    out = []
    for model in (ref, fp8):
        cache, logits = model.new_cache(1, 128, "cpu"), []
        for start, n in ((0, 20), (20, 1), (21, 19), (40, 1), (41, 19)):
            batch = FlatBatch.build([(0, start, ids[start:start + n])])
            logits.append(model.forward(batch, cache, logits_rows=torch.arange(n)).logits)
        out.append(torch.cat(logits))
    assert out[0].isfinite().all() and torch.equal(out[0], out[1])
