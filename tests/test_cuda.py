"""The model on CUDA (torch reference ops) against the CPU fp32 run: skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from moebox.model.batch import FlatBatch
from moebox.runtime.loader import load_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def logits(model, ids: list[int], device: str) -> torch.Tensor:
    batch = FlatBatch.build([(0, 0, ids)], device)
    return model.forward(batch, None, logits_rows=torch.arange(len(ids), device=device)).logits.float().cpu()


@pytest.mark.parametrize("kv_cache_dtype", ["model", "auto"])
def test_cuda_matches_cpu(tiny_ckpt, kv_cache_dtype):
    ids = torch.randint(2, 320, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    cpu, _ = load_model(tiny_ckpt, kv_cache_dtype=kv_cache_dtype, progress=False)
    ref = logits(cpu, ids, "cpu")
    gpu32, _ = load_model(tiny_ckpt, device="cuda", kv_cache_dtype=kv_cache_dtype, progress=False)
    got32 = logits(gpu32, ids, "cuda")
    gpu16, _ = load_model(tiny_ckpt, device="cuda", dtype=torch.bfloat16, kv_cache_dtype=kv_cache_dtype,
                          progress=False)
    got16 = logits(gpu16, ids, "cuda")
    top1_32 = (got32.argmax(-1) == ref.argmax(-1)).float().mean().item()
    top1_16 = (got16.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"\n{kv_cache_dtype}: fp32 CUDA max|diff| {(got32 - ref).abs().max().item():.2e} top-1 {top1_32:.3f}; "
          f"bf16 CUDA max|diff| {(got16 - ref).abs().max().item():.2e} top-1 {top1_16:.3f}")
    assert got16.isfinite().all()
    if kv_cache_dtype == "model":            # no rounding flips: fp32 on the GPU is the CPU result to 1e-4
        assert (got32 - ref).abs().max().item() <= 1e-4
    assert top1_32 >= 0.95


def test_w2_decode_kernels_in_the_model_match_the_cpu(tiny_ckpt, tmp_path):
    """Decode steps (<= 16 tokens) of w2 experts on CUDA take the fused Triton kernels; the CPU runs the torch
    reference over the same planes."""
    ids = torch.randint(2, 320, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    outs = []
    for device in ("cpu", "cuda"):
        model, _ = load_model(tiny_ckpt, device=device, kv_cache_dtype="model", experts="w2",
                              store_dir=tmp_path / "store", progress=False)
        assert model.layers[0].ffn.layer_planes is not None
        cache, rows = model.new_cache(1, 64, device), []
        for start, n in [(0, 20)] + [(20 + i, 1) for i in range(10)]:
            batch = FlatBatch.build([(0, start, ids[start:start + n])], device)
            rows.append(model.forward(batch, cache).logits.float().cpu())
        outs.append(torch.cat(rows))
    diff = (outs[0] - outs[1]).abs().max().item()
    print(f"\nw2 decode kernels in the model: max |logit diff| vs CPU {diff:.2e}")
    assert diff <= 1e-3
