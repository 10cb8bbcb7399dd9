"""The Triton FP8 block-scaled linear (moebox/ops/triton/fp8_linear.py) against the torch reference.

- CPU: the reference/dispatcher, the tiling choice, argument checks; the kernels themselves in Triton's
  interpreter (TRITON_INTERPRET=1 is read when triton is imported, so that check runs in a subprocess), fp32 x
  (and fp16 x, and bf16 x with bf16_as_fp16, which run the GPU's single-dot path: the interpreter's bf16 dot is
  broken), tiny odd shapes.
- GPU (marker `gpu`, skipped without CUDA): the V4-Flash dense shapes and odd shapes, N in {1, 3, 16, 64, 300},
  bf16 and fp32 x, weights from `quant_fp8_block` of random floats whose magnitude differs per 128x128 block,
  outputs poisoned with NaN before each run; forced tilings (split-K on/off), fp16 x, strided x, a CUDA graph.
"""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch
import torch.nn.functional as F

from moebox.ops.triton.fp8_linear import (BLOCK, V4_FLASH_SHAPES, Fp8Config, fp8_linear, fp8_linear_reference,
                                          pick_config, resolve_split)
from moebox.weights.formats import QuantTensor, quant_fp8_block

from tests.interpreter import check_in_interpreter

HAVE_TRITON = importlib.util.find_spec("triton") is not None



def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30))


def block_weight(out_f: int, in_f: int, seed: int = 0) -> QuantTensor:
    """quant_fp8_block of random floats whose scale differs per 128x128 block (2^-4..2^4 x N(0, 0.02)), so a
    wrong scale row/column shows up."""
    g = torch.Generator().manual_seed(seed)
    nr, nc = -(-out_f // BLOCK), -(-in_f // BLOCK)
    mag = torch.exp2(torch.randint(-4, 5, (nr, nc), generator=g).float())
    mag = mag.repeat_interleave(BLOCK, 0)[:out_f].repeat_interleave(BLOCK, 1)[:, :in_f]
    q, s = quant_fp8_block(torch.randn(out_f, in_f, generator=g) * 0.02 * mag)
    return QuantTensor("fp8", q, s)


# ---------------------------------------------------------------------------------------------- CPU
def test_reference_and_dispatch_on_cpu() -> None:
    w = block_weight(130, 200, seed=1)
    x = torch.randn(5, 200)
    dense = w.dequantize(torch.float32)
    assert rel_err(fp8_linear_reference(x, w), x @ dense.T) < 1e-6
    assert torch.equal(fp8_linear(x, w), fp8_linear_reference(x, w))  # the dispatcher off CUDA
    xb = x.bfloat16()
    out = torch.full((5, 130), float("nan"), dtype=torch.bfloat16)
    y = fp8_linear(xb, w, out=out)
    assert y.data_ptr() == out.data_ptr() and y.dtype == torch.bfloat16
    assert torch.equal(y, F.linear(xb.float(), dense).bfloat16())


def test_argument_checks() -> None:
    w = block_weight(130, 200)
    with pytest.raises(ValueError):
        fp8_linear_reference(torch.randn(3, 100), w)
    with pytest.raises(ValueError):
        fp8_linear_reference(torch.randn(3, 200), w, out=torch.empty(3, 129))
    with pytest.raises(ValueError):
        fp8_linear_reference(torch.randn(3, 200), QuantTensor("fp8", w.data, w.scale, (1, 128)))
    with pytest.raises(TypeError):
        fp8_linear_reference(torch.randn(3, 200), torch.randn(130, 200))  # type: ignore[arg-type]


def test_pick_config_fills_the_device() -> None:
    for _, out_f, in_f in V4_FLASH_SHAPES + (("odd", 300, 200),):
        kb = -(-in_f // BLOCK)
        for n in (1, 3, 16, 64, 300, 2048):
            cfg = pick_config(n, out_f, in_f, sms=132)
            assert cfg.block_n == 16 if n <= 16 else cfg.block_n >= 64
            assert 1 <= cfg.split_k <= kb
            per = -(-kb // cfg.split_k)
            assert -(-kb // per) == cfg.split_k  # every split has work
            if n <= 16 and out_f * in_f >= 1 << 21:  # decode, weights of 2 MB and up: ~2+ programs per SM
                assert -(-out_f // cfg.block_o) * cfg.split_k >= 256, (out_f, in_f, cfg)
    assert resolve_split(Fp8Config(split_k=3), 1, 512, 4096).split_k == 3


_INTERPRETER_CHECK = textwrap.dedent("""
    import json, os, sys, torch
    assert os.environ.get("TRITON_INTERPRET") == "1"
    sys.path.insert(0, sys.argv[1])
    from moebox.ops.triton.fp8_linear import Fp8Config, fp8_linear_reference, fp8_linear_triton
    from moebox.weights.formats import QuantTensor
    from tests.test_triton_fp8 import block_weight
    torch.manual_seed(0)
    results = []
    w = block_weight(130, 200, seed=3)            # 2 x 2 scale blocks, both with a tail
    w_u8 = QuantTensor("fp8", w.data, w.scale.view(torch.uint8))
    # (N, x dtype, config): the automatic tilings (decode split-K, prefill tile), then forced ones:
    # decode without split, split-K with a short last split, several N blocks, a wide prefill tile
    cases = [(1, torch.float32, None), (20, torch.float32, None),
             (1, torch.float32, Fp8Config(16, 16, 1)), (3, torch.float32, Fp8Config(16, 32, 2, 4, 3)),
             (20, torch.float32, Fp8Config(16, 64, 2)), (20, torch.float32, Fp8Config(32, 128, 1, 4, 2)),
             (3, torch.float16, None), (20, torch.float16, Fp8Config(16, 16, 2)),
             (3, torch.bfloat16, Fp8Config(16, 32, 0, bf16_as_fp16=True))]
    for n, dtype, cfg in cases:
        x = torch.randn(n, 200).to(dtype)
        out = torch.full((n, 130), float("nan"), dtype=dtype)
        y = fp8_linear_triton(x, w_u8 if n == 3 else w, out=out, config=cfg)
        ref = fp8_linear_reference(x.float(), w)
        results.append(dict(case=[n, str(dtype), str(cfg)], same_buffer=y.data_ptr() == out.data_ptr(),
                            finite=bool(torch.isfinite(y).all()), rel=float((y.float() - ref).norm() / ref.norm()),
                            ref_norm=float(ref.norm()),
                            tol={torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]))
    # x with a row stride (a column slice of a wider tensor)
    xw = torch.randn(4, 256)
    x = xw[:, 20:220]
    y = fp8_linear_triton(x, w)
    ref = fp8_linear_reference(x, w)
    results.append(dict(case="strided x", same_buffer=True, finite=bool(torch.isfinite(y).all()),
                        rel=float((y - ref).norm() / ref.norm()), ref_norm=float(ref.norm()), tol=1e-5))
    print("RESULT " + json.dumps(results))
""")


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install triton; Linux only)")
def test_kernel_in_triton_interpreter() -> None:
    """Tiny odd shapes through the real kernels in Triton's CPU interpreter, vs the reference."""
    check_in_interpreter(_INTERPRETER_CHECK)


# ---------------------------------------------------------------------------------------------- GPU
GPU_SHAPES = [(name, o, i) for name, o, i in V4_FLASH_SHAPES] + [("odd300x200", 300, 200), ("odd130x4100", 130, 4100)]
_WEIGHTS: dict[tuple[int, int], QuantTensor] = {}


def _gpu_weight(out_f: int, in_f: int) -> QuantTensor:
    key = (out_f, in_f)
    if key not in _WEIGHTS:  # all shapes together are ~110 MB of FP8
        _WEIGHTS[key] = block_weight(out_f, in_f, seed=out_f + in_f).to("cuda")
    return _WEIGHTS[key]


def _check_gpu(w: QuantTensor, n: int, dtype: torch.dtype, config: Fp8Config | None = None,
               x: torch.Tensor | None = None) -> torch.Tensor:
    from moebox.ops.triton.fp8_linear import fp8_linear_triton
    out_f, in_f = w.data.shape
    if x is None:
        x = torch.randn(n, in_f, device="cuda").to(dtype)
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        ref = fp8_linear_reference(x.float(), w)  # fp32 reference on the same inputs
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    tol = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}[dtype]
    for _ in range(2):  # a second run into a re-poisoned buffer: nothing stale is left from the first
        out = torch.full((n, out_f), float("nan"), device="cuda", dtype=dtype)
        y = fp8_linear_triton(x, w, out=out, config=config)
        torch.cuda.synchronize()
        assert y.data_ptr() == out.data_ptr() and y.dtype == dtype
        assert torch.isfinite(y).all(), f"{int((~torch.isfinite(y)).sum())} elements not written or not finite"
        assert rel_err(y, ref) < tol, (rel_err(y, ref), tol)
        assert float((y.float() - ref).abs().max()) <= 4 * tol * float(ref.abs().max())
    return y


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("n", [1, 3, 16, 64, 300])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=[s[0] for s in GPU_SHAPES])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_matches_reference(shape: tuple, n: int, dtype: torch.dtype) -> None:
    _, out_f, in_f = shape
    w = _gpu_weight(out_f, in_f)
    _check_gpu(w, n, dtype)
    if n == 3:  # the dispatcher takes the Triton path on CUDA
        from moebox.ops.triton.fp8_linear import fp8_linear_triton
        x = torch.randn(n, in_f, device="cuda").to(dtype)
        assert torch.equal(fp8_linear(x, w), fp8_linear_triton(x, w))


@pytest.mark.parametrize("config", [Fp8Config(16, 16, 1), Fp8Config(16, 64, 3, 4, 3), Fp8Config(16, 32, 8, 2, 6),
                                    Fp8Config(64, 128, 2, 4, 3), Fp8Config(128, 128, 1, 8, 3),
                                    Fp8Config(64, 256, 1, 8, 3), Fp8Config(16, 32, 0, bf16_as_fp16=True),
                                    Fp8Config(128, 128, 0, 8, 3, bf16_as_fp16=True)], ids=str)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_forced_tilings(config: Fp8Config) -> None:
    for out_f, in_f in ((300, 200), (512, 4096), (4096, 2048)):
        w = _gpu_weight(out_f, in_f)
        for n in (1, 17, 300):
            for dtype in (torch.bfloat16, torch.float16):
                _check_gpu(w, n, dtype, config=config)
        _check_gpu(w, 17, torch.float32, config=config if config.block_n * config.block_o <= 64 * 128 else None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_strided_x_and_fp16() -> None:
    w = _gpu_weight(1024, 4096)
    wide = torch.randn(16, 4096 + 256, device="cuda", dtype=torch.bfloat16)
    _check_gpu(w, 16, torch.bfloat16, x=wide[:, 128:128 + 4096])
    for n in (1, 3, 16, 64, 300):
        _check_gpu(w, n, torch.float16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_cuda_graph_replay() -> None:
    """Decode calls (split-K and not) capture in a CUDA graph; replays follow new x written into the input."""
    from moebox.ops.triton.fp8_linear import fp8_linear_triton
    ws = [block_weight(o, i, seed=o).to("cuda") for o, i in ((512, 4096), (4096, 2048), (32768, 1024))]
    n = 4
    xs = [torch.randn(n, w.data.shape[1], device="cuda", dtype=torch.bfloat16) for w in ws]
    outs = [torch.empty(n, w.data.shape[0], device="cuda", dtype=torch.bfloat16) for w in ws]
    for x, w, o in zip(xs, ws, outs):
        fp8_linear_triton(x, w, out=o)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x, w, o in zip(xs, ws, outs):
            fp8_linear_triton(x, w, out=o)
    for _ in range(2):
        for x, o in zip(xs, outs):
            x.copy_(torch.randn_like(x))
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for x, w, o in zip(xs, ws, outs):
            ref = fp8_linear_reference(x.float(), w)
            assert torch.isfinite(o).all() and rel_err(o, ref) < 1e-2
