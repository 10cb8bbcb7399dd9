"""The FP8 product of an RMSNorm-ed x (`fp8_linear_triton(..., norm=(weight, eps))`, moebox/ops/triton/fp8_linear.py):
the single-split GEMV's fused RMSNorm against the unfused rms_norm + product.

- CPU: the dispatch (`fp8_linear`, `linear`, `SharedInputLinear` with norm= give the product of rms_norm(x)), the
  fusion decision (`fuses_norm`), the weight shape check.
- Interpreter: the fused GEMV on tiny shapes (in 256 and 384, out 256, N 1 and 3, split-K 1 and 2, fp32 and fp16 x,
  one and two token blocks, a partial last K step, strided x) against the reference of the rounded normed x; that
  the GEMV ran with no separate rms_norm, and that a dot config runs rms_norm first.
- GPU (marker `gpu`): attention's stacked from_qr product (wq_b + the indexer's wq_b, 40960 x 1024) at N = 1, 2, 8
  with bf16 x into poisoned outputs.
"""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

import moebox.ops.triton.fp8_linear as fp8_mod
from moebox.ops.linear import SharedInputLinear, linear
from moebox.ops.norm import rms_norm, rms_norm_reference
from moebox.ops.triton.fp8_linear import Fp8Config, fp8_linear, fp8_linear_reference, fuses_norm

from tests.interpreter import check_in_interpreter
from tests.test_triton_fp8 import _gpu_weight, block_weight, rel_err

HAVE_TRITON = importlib.util.find_spec("triton") is not None
EPS = 1e-6


def norm_input(n: int, in_f: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [n, in_f] with row magnitudes over 10^-2..10^2, so a wrong per-token rstd shows, norm weight [in_f])."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, in_f, generator=g) * torch.logspace(-2, 2, n)[:, None]
    return x, torch.rand(in_f, generator=g) + 0.5


# ---------------------------------------------------------------------------------------------- CPU
def test_norm_dispatch_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """norm= on CPU tensors is the product of rms_norm(x): the FP8 dispatcher and its reference, `linear` on FP8
    and float weights, `SharedInputLinear` with one stacked product and with separate ones."""
    w, w2 = block_weight(256, 384, seed=1), block_weight(128, 384, seed=2)
    x, nw = norm_input(3, 384)
    xb = x.bfloat16()
    normed = rms_norm(xb, nw, EPS)
    assert torch.equal(fp8_linear(xb, w, norm=(nw, EPS)), fp8_linear_reference(normed, w))
    assert torch.equal(linear(xb, w, norm=(nw, EPS)), linear(normed, w))
    dense = torch.randn(64, 384).bfloat16()
    assert torch.equal(linear(xb, dense, norm=(nw, EPS)), linear(normed, dense))
    for stack in ("1", "0"):
        monkeypatch.setenv("MOEBOX_STACK_LINEARS", stack)
        shared = SharedInputLinear(w, w2)
        assert len(shared.parts) == (1 if stack == "1" else 2)
        for y, ref in zip(shared(xb, norm=(nw, EPS)), shared(normed)):
            assert torch.equal(y, ref)
    with pytest.raises(ValueError, match="norm weight"):
        fp8_linear(xb, w, norm=(nw[:100], EPS))


def test_only_the_single_split_fp8_gemv_fuses_the_norm() -> None:
    scale = torch.zeros(1, dtype=torch.uint8)
    assert fuses_norm(Fp8Config(1, 16, 1, kernel="gemv", block_k=512), scale, 1024)
    assert fuses_norm(Fp8Config(1, 16, 2, kernel="gemv", block_k=512), scale, 512)   # one K step: one split
    assert not fuses_norm(Fp8Config(1, 16, 2, kernel="gemv", block_k=512), scale, 1024)   # split-K
    assert not fuses_norm(Fp8Config(1, 16, kernel="gemv", block_k=512), None, 1024)   # a float weight (dense_gemv)
    assert not fuses_norm(Fp8Config(block_o=64, num_stages=2, kernel="mma"), scale, 1024)
    assert not fuses_norm(Fp8Config(), scale, 1024)


# ---------------------------------------------------------------------------------------------- interpreter
_INTERPRETER_CHECK = textwrap.dedent("""
    import json, os, sys, torch
    assert os.environ.get("TRITON_INTERPRET") == "1"
    sys.path.insert(0, sys.argv[1])
    import moebox.ops.triton.fp8_linear as fp8_mod
    from moebox.ops.norm import rms_norm_reference
    from moebox.ops.triton.fp8_linear import Fp8Config, fp8_linear_reference, fp8_linear_triton, pick_config
    from tests.interpreter import count_calls
    from tests.test_triton_fp8 import block_weight
    from tests.test_triton_fp8_norm import EPS, norm_input
    unfused = count_calls(fp8_mod, "rms_norm")   # the separate norm the fused calls must not run
    g = lambda bn, bk, split: Fp8Config(bn, 32, split, 4, 1, kernel="gemv", block_k=bk)
    results = []

    def check(case, x, w, nw, cfg, fused, tol):
        n, out_f = x.shape[0], w.data.shape[0]
        before = len(unfused)
        out = torch.full((n, out_f), float("nan"), dtype=x.dtype)
        y = fp8_linear_triton(x, w, out=out, config=cfg, norm=(nw, EPS))
        assert len(unfused) - before == (0 if fused else 1), (case, len(unfused) - before)
        ref = fp8_linear_reference(rms_norm_reference(x, nw, EPS), w)   # the rounded normed x, in x's dtype
        results.append(dict(case=case, same_buffer=y.data_ptr() == out.data_ptr(), finite=bool(torch.isfinite(y).all()),
                            rel=float((y.float() - ref.float()).norm() / ref.float().norm()),
                            ref_norm=float(ref.float().norm()), tol=tol))

    # in 256: 2 full K steps of 128; in 384: a full step of 256 and a masked partial one. N 1 (one token) and 3
    # (one token block of 4 without split, two blocks of 2 with it: rows past N clamped), split-K 1 (fused) and
    # 2 (rms_norm first). The fused path does not round the normed x to fp16 as rms_norm does: 1e-3 there (the
    # output's own fp16 rounding is 4.9e-4)
    for in_f, bk in ((256, 128), (384, 256)):
        w = block_weight(256, in_f, seed=in_f)
        for n in (1, 3):
            x, nw = norm_input(n, in_f, seed=n + in_f)
            for dtype in (torch.float32, torch.float16):
                for split in (1, 2):
                    cfg = g(1 if n == 1 else 4 // split, bk, split)
                    check([in_f, n, str(dtype), cfg.label], x.to(dtype), w, nw, cfg, split == 1,
                          1e-5 if dtype == torch.float32 else 1e-3)
    w = block_weight(256, 384, seed=5)
    x, nw = norm_input(3, 384, seed=6)
    assert pick_config(1, 256, 384).kernel == "gemv"
    check("default pick, bf16 norm weight", x[:1], w, nw.bfloat16(), None, True, 1e-5)
    xw, _ = norm_input(3, 416, seed=7)
    check("strided x", xw[:, 20:404], w, nw, g(2, 128, 1), True, 1e-5)
    check("dot config: rms_norm first", x.half(), w, nw, Fp8Config(16, 16, 1), False, 2e-3)
    print("RESULT " + json.dumps(results))
""")


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install triton; Linux only)")
def test_fused_norm_in_triton_interpreter() -> None:
    """The GEMV's fused RMSNorm on tiny shapes in Triton's CPU interpreter, vs the unfused reference."""
    check_in_interpreter(_INTERPRETER_CHECK)


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.parametrize("n", [1, 2, 8])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_from_qr_with_norm(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Attention's from_qr product at V4 size (wq_b 32768 + the indexer's wq_b 8192 rows, in 1024) with the q
    latent's norm, bf16 x, into NaN-poisoned outputs: within bf16 tolerance of the fp32 product of the rounded
    normed x; at N = 1 the picked GEMV fuses the norm (no separate rms_norm), a forced split-K GEMV runs
    rms_norm first; other N equal rms_norm + the product bit for bit."""
    from moebox.ops.triton.fp8_linear import fp8_linear_triton
    w = _gpu_weight(64 * 512 + 64 * 128, 1024)
    x, nw = (t.to("cuda") for t in norm_input(n, 1024, seed=n))
    x = x.bfloat16()
    ref = fp8_linear_reference(rms_norm_reference(x, nw, EPS).float(), w)
    fused = fuses_norm(fp8_mod.pick_config(n, *w.data.shape), w.scale, 1024)
    configs = [None] + ([Fp8Config(1, 16, 2, 4, 1, kernel="gemv", block_k=512)] if n == 1 else [])
    for cfg in configs:
        calls: list = []
        monkeypatch.setattr(fp8_mod, "rms_norm", lambda *a: calls.append(1) or rms_norm(*a))
        out = torch.full((n, w.data.shape[0]), float("nan"), device="cuda", dtype=torch.bfloat16)
        y = fp8_linear_triton(x, w, out=out, config=cfg, norm=(nw, EPS))
        torch.cuda.synchronize()
        assert y.data_ptr() == out.data_ptr() and torch.isfinite(y).all()
        assert rel_err(y, ref) < 1e-2, rel_err(y, ref)
        assert len(calls) == (0 if cfg is None and fused else 1)
        if cfg is None and not fused:
            assert torch.equal(y, fp8_linear_triton(rms_norm(x, nw, EPS), w))
    assert fused or n > 1   # batch 1: the norm's launch is gone
