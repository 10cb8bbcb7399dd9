"""The Triton FP8 block-scaled linear (moebox/ops/triton/fp8_linear.py) against the torch reference.

- CPU: the reference/dispatcher, the kernel and tiling choice, argument and config checks; the kernels themselves
  in Triton's interpreter (TRITON_INTERPRET=1 is read when triton is imported, so those checks run in a
  subprocess) on tiny odd shapes: the dot kernel with fp32 x (and fp16 x, and bf16 x with bf16_as_fp16, which
  run the GPU's single-dot path: the interpreter's bf16 dot is broken), the GEMV with fp32, fp16 and bf16 x
  (no dot), full and partial K steps, split-K, several token blocks, strided x.
- GPU (marker `gpu`, skipped without CUDA): the V4-Flash dense shapes and odd shapes, N in {1, 3, 16, 64, 300}
  with the default picks and N in {1, 3, 16} with the GEMV forced, bf16 and fp32 x, weights from
  `quant_fp8_block` of random floats whose magnitude differs per 128x128 block, outputs poisoned with NaN before
  each run (and two runs bitwise equal); forced tilings of both kernels, fp16 x, strided x, CUDA-graph replay.
- The grouped call (`fp8_grouped_linear`, one launch for g groups): the reference against a dense einsum, its
  argument checks and the bench's command line on CPU; tiny shapes in the interpreter; on the GPU the V4-Flash
  wo_a shape and a small one, strided x and out views, forced tilings, CUDA-graph replay, `grouped_linear`.
"""

from __future__ import annotations

import importlib.util
import textwrap
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import moebox.ops.triton.fp8_linear as fp8_mod
from moebox.ops.attention import matmul_tf32
from moebox.ops.triton.fp8_linear import (BLOCK, GEMV_MAX_N, V4_FLASH_GROUPED, V4_FLASH_SHAPES, Fp8Config,
                                          fp8_grouped_linear, fp8_grouped_linear_reference, fp8_linear,
                                          fp8_linear_reference, pick_config, resolve_split)
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


def test_pick_config_fills_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The heuristics (TUNED_DECODE emptied): GEMV for N <= GEMV_MAX_N, dot decode tiles up to 16, GEMM tiles
    above; every split has work, and decode calls on weights of 2 MB and up give every SM a program or more."""
    monkeypatch.setattr(fp8_mod, "TUNED_DECODE", {})
    for _, out_f, in_f in V4_FLASH_SHAPES + (("odd", 300, 200), ("odd", 130, 4100)):
        for n in (1, 3, 8, 9, 16, 64, 300, 2048):
            cfg = pick_config(n, out_f, in_f, sms=132)
            steps = -(-in_f // cfg.block_k)
            assert 1 <= cfg.split_k <= steps
            assert -(-steps // -(-steps // cfg.split_k)) == cfg.split_k  # every split has work
            programs = -(-n // cfg.block_n) * -(-out_f // cfg.block_o) * cfg.split_k
            if n <= GEMV_MAX_N:
                assert cfg.kernel == "gemv" and cfg.block_n == min(4, 1 << (n - 1).bit_length()), (n, cfg)
                assert BLOCK <= cfg.block_k <= max(BLOCK, 2 * in_f) and cfg.block_o <= 16
                assert cfg.block_o * cfg.block_k <= 8192 and cfg.num_stages == (3 if steps > 1 else 1)
                if out_f * in_f >= 1 << 21:
                    assert programs >= 132, (out_f, in_f, cfg)
            else:
                assert cfg.kernel == "dot" and cfg.block_k == BLOCK
                assert cfg.block_n == 16 if n <= 16 else cfg.block_n >= 64
                if n <= 16 and out_f * in_f >= 1 << 21:  # dot decode: ~2+ programs per SM
                    assert programs >= 256, (out_f, in_f, cfg)
    assert pick_config(1, 4096, 8192).block_k == 1024  # wo_b: 8 rows x 1024 columns per step
    assert resolve_split(Fp8Config(split_k=3), 1, 512, 4096).split_k == 3
    gemv = Fp8Config(1, 1, 0, kernel="gemv", block_k=512)
    assert resolve_split(gemv, 1, 64, 8192).split_k == 4      # 64 programs < 132 SMs: 16 steps, 4 splits
    assert resolve_split(gemv, 1, 512, 8192).split_k == 1


def test_pick_config_takes_tuned_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    a = Fp8Config(1, 8, 0, 4, 3, kernel="gemv", block_k=1024)
    b = Fp8Config(16, 32, 2, 4, 4)
    monkeypatch.setattr(fp8_mod, "TUNED_DECODE", {(4096, 8192): ((1, a), (16, b))})
    assert pick_config(1, 4096, 8192) == replace(a, split_k=1)
    assert pick_config(9, 4096, 8192) == b and pick_config(16, 4096, 8192) == b
    # N = 2..8: no entry was timed there (max N / 2 < N <= max N), so the heuristic: the GEMV up to GEMV_MAX_N
    assert pick_config(3, 4096, 8192) == fp8_mod.resolve_split(fp8_mod._gemv_config(3, 4096, 8192, 132), 3, 4096,
                                                               8192)
    assert pick_config(17, 4096, 8192).block_n >= 64              # prefill ignores the table
    assert pick_config(1, 4096, 4096).kernel == "gemv"            # other shapes: the heuristic


def test_two_token_gemvs_hold_their_dependents(monkeypatch: pytest.MonkeyPatch) -> None:
    """The measured policy (`gemv_holds`): the V4-Flash products that take the GEMV at batch 2 hold the kernel
    after them to their end (batch 2 6.76 -> 6.33 ms on the H200), those at batch 1 do not (a small loss there);
    MOEBOX_GEMV_HOLD=0 lets every GEMV's dependent launch at its start."""
    monkeypatch.delenv("MOEBOX_GEMV_HOLD", raising=False)
    two = [pick_config(2, out_f, in_f) for _, out_f, in_f in V4_FLASH_SHAPES]
    assert [c for c in two if c.kernel == "gemv"] and all(fp8_mod.gemv_holds(c) for c in two if c.kernel == "gemv")
    assert not any(fp8_mod.gemv_holds(pick_config(1, out_f, in_f)) for _, out_f, in_f in V4_FLASH_SHAPES)
    monkeypatch.setenv("MOEBOX_GEMV_HOLD", "0")
    assert not any(fp8_mod.gemv_holds(c) for c in two)


def test_sweep_variants_are_valid() -> None:
    """What --sweep times: the dot default first, then the GEMV default, all distinct and accepted by the
    config checks, at most 128 bytes of weight per thread and K step; at one token the pick both with and
    without early loads (so a sweep can overturn an early pick)."""
    for _, out_f, in_f in V4_FLASH_SHAPES:
        for n in (1, 4, 16):
            vs = fp8_mod._sweep_variants(n, out_f, in_f)
            assert vs[0].kernel == "dot" and vs[1] == fp8_mod._gemv_config(n, out_f, in_f, 132)
            assert len(set(vs)) == len(vs) >= 4
            pick = pick_config(n, out_f, in_f)   # split resolved, as the sweep times it
            if n == 1 and pick.kernel == "gemv":
                assert {replace(pick, early=False), replace(pick, early=True)} <= set(vs)
            for cfg in vs:
                fp8_mod._check_config(cfg)
                assert cfg.kernel != "gemv" or cfg.block_o * cfg.block_k <= 128 * 32 * cfg.num_warps


def test_launch_cost_fit_recovers_a_line() -> None:
    """The sweep's fit: rows on time = 2 us + bytes / 4 TB/s (MB / 4e6 MB/s = us / 4) give back 2 us and 4 TB/s;
    fewer than three sizes give nothing."""
    rows = [{"bytes": mb * 1e6, "us": 2.0 + mb / 4.0} for mb in (6.3, 8.4, 16.8, 33.5, 41.9)]
    fixed, rate = fp8_mod.launch_cost_fit(rows)
    assert abs(fixed - 2.0) < 1e-9 and abs(rate - 4.0) < 1e-9
    assert fp8_mod.launch_cost_fit(rows[:2] + [dict(rows[1])]) is None


def test_config_checks() -> None:
    for bad in (Fp8Config(kernel="wmma"), Fp8Config(kernel="gemv", block_k=192), Fp8Config(block_k=256),
                Fp8Config(block_o=24, kernel="gemv"), Fp8Config(kernel="mma"),   # 32 rows for 4 warps
                Fp8Config(kernel="mma", block_o=256, num_warps=4), Fp8Config(kernel="mma", block_o=64, num_warps=4,
                                                                              num_stages=3),
                Fp8Config(kernel="mma", block_o=64, early=True)):   # early loads are the GEMV's
        with pytest.raises(ValueError):
            fp8_mod._check_config(bad)
    assert "gemv 4x8x1024 w4 s3" in Fp8Config(4, 8, 0, 4, 3, kernel="gemv", block_k=1024).label
    assert Fp8Config(1, 8, kernel="gemv", block_k=1024, early=True).label.endswith(" early")
    assert fp8_mod._config_src(Fp8Config(1, 8, kernel="gemv", block_k=1024)) == \
        "Fp8Config(block_n=1, block_o=8, kernel='gemv', block_k=1024)"


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
    # (N, x dtype, config): the dot kernel (decode N picks the GEMV by default) with its automatic splits
    # (decode split-K, the prefill tile), then forced ones: decode without split, split-K with a short last
    # split, several N blocks, a wide prefill tile
    cases = [(1, torch.float32, Fp8Config()), (20, torch.float32, None),
             (1, torch.float32, Fp8Config(16, 16, 1)), (3, torch.float32, Fp8Config(16, 32, 2, 4, 3)),
             (20, torch.float32, Fp8Config(16, 64, 2)), (20, torch.float32, Fp8Config(32, 128, 1, 4, 2)),
             (3, torch.float16, Fp8Config(16, 16)), (20, torch.float16, Fp8Config(16, 16, 2)),
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
    y = fp8_linear_triton(x, w, config=Fp8Config())
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


_GEMV_INTERPRETER_CHECK = textwrap.dedent("""
    import dataclasses, json, os, sys, torch
    assert os.environ.get("TRITON_INTERPRET") == "1"
    sys.path.insert(0, sys.argv[1])
    from moebox.ops.triton.fp8_linear import Fp8Config, fp8_linear_reference, fp8_linear_triton, pick_config
    from moebox.weights.formats import QuantTensor
    from tests.test_triton_fp8 import block_weight
    torch.manual_seed(0)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
    g = lambda bn, bo, bk, split=0, warps=4, stages=1: Fp8Config(bn, bo, split, warps, stages, kernel="gemv",
                                                                 block_k=bk)
    results = []
    # 130 x 200: 2 x 2 scale blocks, both with a tail; 37 x 261: in not a multiple of 4 (byte-wise loads)
    w1 = block_weight(130, 200, seed=3)
    w2 = block_weight(37, 261, seed=4)
    w1_u8 = QuantTensor("fp8", w1.data, w1.scale.view(torch.uint8))
    # (weight, N, x dtype, config): the default pick (one partial step), then a full + a partial step, split-K
    # with the partial step alone in the last split, several token blocks (the last one short), a step past
    # the row, 2 warps, the pipelined loop (run unpipelined here) with fp16 x, bf16 x (no dot in the GEMV)
    cases = [(w2, 1, torch.float32, None), (w1, 1, torch.float32, g(1, 4, 128)),
             (w1, 3, torch.float32, g(4, 8, 128, split=2, stages=3)), (w1_u8, 5, torch.float32, g(2, 8, 256)),
             (w2, 1, torch.float32, g(1, 16, 128, warps=2)), (w2, 6, torch.float32, g(4, 4, 128, split=3)),
             (w1, 3, torch.float16, g(4, 32, 128, stages=2)), (w2, 2, torch.bfloat16, g(2, 4, 256))]
    for w, n, dtype, cfg in cases:
        out_f, in_f = w.data.shape
        assert cfg is not None or pick_config(n, out_f, in_f).kernel == "gemv"
        x = torch.randn(n, in_f).to(dtype)
        out = torch.full((n, out_f), float("nan"), dtype=dtype)
        y = fp8_linear_triton(x, w, out=out, config=cfg)
        ref = fp8_linear_reference(x.float(), w1 if w is w1_u8 else w)
        results.append(dict(case=[n, str(dtype), str(cfg)], same_buffer=y.data_ptr() == out.data_ptr(),
                            finite=bool(torch.isfinite(y).all()), rel=float((y.float() - ref).norm() / ref.norm()),
                            ref_norm=float(ref.norm()), tol=tol[dtype]))
    # one token with its first K step's weights loaded before the (here absent) PDL wait (Fp8Config.early): a full +
    # a partial step, one partial step, split-K with the partial step alone in the last split
    for w, cfg in ((w1, g(1, 4, 128)), (w2, g(1, 8, 512)), (w1, g(1, 8, 128, split=2)), (w2, g(1, 4, 128, split=3))):
        cfg = dataclasses.replace(cfg, early=True)
        out_f, in_f = w.data.shape
        x = torch.randn(1, in_f)
        y = fp8_linear_triton(x, w, config=cfg)
        ref = fp8_linear_reference(x, w)
        results.append(dict(case=["early", out_f, str(cfg)], same_buffer=True, finite=bool(torch.isfinite(y).all()),
                            rel=float((y - ref).norm() / ref.norm()), ref_norm=float(ref.norm()), tol=1e-5))
    # x with a row stride (a column slice of a wider tensor)
    xw = torch.randn(3, 300)
    x = xw[:, 30:291]
    y = fp8_linear_triton(x, w2, config=g(4, 4, 128))
    ref = fp8_linear_reference(x, w2)
    results.append(dict(case="strided x", same_buffer=True, finite=bool(torch.isfinite(y).all()),
                        rel=float((y - ref).norm() / ref.norm()), ref_norm=float(ref.norm()), tol=1e-5))
    # the same kernel on float weights (dense_gemv): (N, out, in, weight/x dtype, out dtype, config), the default
    # pick (fp32 weights: 4-byte steps), odd shapes, split-K with a partial last step, fp16 in, fp32 out
    from moebox.ops.triton.fp8_linear import dense_gemv
    for n, out_f, in_f, dt, out_dt, cfg in [(1, 37, 261, torch.float32, torch.float32, None),
                                            (5, 130, 200, torch.float32, torch.float32, g(4, 8, 128, split=2)),
                                            (3, 64, 300, torch.float16, torch.float32, g(2, 4, 256)),
                                            (16, 40, 96, torch.float16, torch.float16, None)]:
        x, w = torch.randn(n, in_f).to(dt), torch.randn(out_f, in_f).to(dt)
        y = dense_gemv(x, w, out_dt, config=cfg)
        ref = x.double() @ w.double().T
        results.append(dict(case=["dense", n, out_f, in_f, str(dt), str(cfg)], same_buffer=y.dtype == out_dt,
                            finite=bool(torch.isfinite(y).all()), ref_norm=float(ref.norm()),
                            rel=float((y.double() - ref).norm() / ref.norm()), tol=tol[out_dt]))
    print("RESULT " + json.dumps(results))
""")


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install triton; Linux only)")
def test_gemv_in_triton_interpreter() -> None:
    """The CUDA-core GEMV on tiny odd shapes in Triton's CPU interpreter, vs the reference."""
    check_in_interpreter(_GEMV_INTERPRETER_CHECK)


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install triton; Linux only)")
def test_bad_config_is_rejected_before_launch() -> None:
    from moebox.ops.triton.fp8_linear import fp8_linear_triton
    w = block_weight(130, 200)
    with pytest.raises(ValueError):
        fp8_linear_triton(torch.randn(1, 200), w, config=Fp8Config(1, 4, kernel="gemv", block_k=100))


# ---------------------------------------------------------------------------------------------- GPU
GPU_SHAPES = [(name, o, i) for name, o, i in V4_FLASH_SHAPES] + [("odd300x200", 300, 200), ("odd130x4100", 130, 4100)]
_WEIGHTS: dict[tuple[int, int], QuantTensor] = {}


def _gpu_weight(out_f: int, in_f: int) -> QuantTensor:
    key = (out_f, in_f)
    if key not in _WEIGHTS:  # all shapes together are ~110 MB of FP8
        _WEIGHTS[key] = block_weight(out_f, in_f, seed=out_f + in_f).to("cuda")
    return _WEIGHTS[key]


def _check_gpu(w: QuantTensor, n: int, dtype: torch.dtype, config: Fp8Config | None = None,
               x: torch.Tensor | None = None, tol: float | None = None) -> torch.Tensor:
    from moebox.ops.triton.fp8_linear import fp8_linear_triton
    out_f, in_f = w.data.shape
    if x is None:
        x = torch.randn(n, in_f, device="cuda").to(dtype)
    with matmul_tf32(False):
        ref = fp8_linear_reference(x.float(), w)  # fp32 reference on the same inputs
    if tol is None:
        tol = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}[dtype]
    ys = []
    for _ in range(2):  # a second run into a re-poisoned buffer: nothing stale is left from the first
        out = torch.full((n, out_f), float("nan"), device="cuda", dtype=dtype)
        y = fp8_linear_triton(x, w, out=out, config=config)
        torch.cuda.synchronize()
        assert y.data_ptr() == out.data_ptr() and y.dtype == dtype
        assert torch.isfinite(y).all(), f"{int((~torch.isfinite(y)).sum())} elements not written or not finite"
        assert rel_err(y, ref) < tol, (rel_err(y, ref), tol)
        assert float((y.float() - ref).abs().max()) <= 4 * tol * float(ref.abs().max())
        ys.append(y)
    assert torch.equal(ys[0], ys[1])  # deterministic (split-K sums in a fixed order)
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("n", [1, 3, 16])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=[s[0] for s in GPU_SHAPES])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_gemv_matches_reference(shape: tuple, n: int, dtype: torch.dtype) -> None:
    """The GEMV with its default tiling for the shape, whatever pick_config chooses (fp32 math: fp32 x is
    exact to ~1e-7, so 1e-5 here)."""
    _, out_f, in_f = shape
    cfg = fp8_mod._gemv_config(n, out_f, in_f, torch.cuda.get_device_properties(0).multi_processor_count)
    _check_gpu(_gpu_weight(out_f, in_f), n, dtype, config=cfg, tol=1e-5 if dtype == torch.float32 else None)


GEMV_CONFIGS = [Fp8Config(1, 1, 0, 4, 1, kernel="gemv", block_k=4096),
                Fp8Config(1, 2, 0, 8, 1, kernel="gemv", block_k=4096),
                Fp8Config(4, 8, 0, 4, 3, kernel="gemv", block_k=1024),
                Fp8Config(2, 16, 3, 4, 4, kernel="gemv", block_k=512),
                Fp8Config(8, 32, 0, 4, 3, kernel="gemv", block_k=256),
                Fp8Config(4, 4, 8, 2, 2, kernel="gemv", block_k=128),
                Fp8Config(1, 8, 2, 8, 3, kernel="gemv", block_k=2048),
                Fp8Config(1, 8, 0, 4, 3, kernel="gemv", block_k=512, early=True),
                Fp8Config(1, 4, 3, 4, 1, kernel="gemv", block_k=256, early=True)]


@pytest.mark.parametrize("config", GEMV_CONFIGS, ids=lambda c: c.label.replace(" ", "-"))
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_gemv_forced_tilings(config: Fp8Config) -> None:
    """Forced GEMV tilings (rows, K step, warps, stages, tokens per program, split-K): bf16 x at N = 1, 3, 16 on
    an odd and two V4 shapes, fp16 and fp32 x at N = 3."""
    for out_f, in_f in ((300, 200), (512, 4096), (4096, 2048)):
        w = _gpu_weight(out_f, in_f)
        for n in (1, 3, 16):
            _check_gpu(w, n, torch.bfloat16, config=config)
    _check_gpu(w, 3, torch.float16, config=config)
    _check_gpu(w, 3, torch.float32, config=config, tol=1e-5)


@pytest.mark.parametrize("key", sorted(fp8_mod.TUNED_DECODE), ids=str)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_tuned_decode_entries(key: tuple[int, int]) -> None:
    """Every TUNED_DECODE entry, as pick_config takes it at its largest N and its smallest (max N / 2 + 1; rows
    past N clamped), against the fp32 reference with bf16 x (the fp16 dots and mma convert x in the kernel)."""
    w = _gpu_weight(*key)
    for max_n, cfg in fp8_mod.TUNED_DECODE[key]:
        for n in sorted({max_n, max_n // 2 + 1}):
            assert pick_config(n, *key).kernel == cfg.kernel
            _check_gpu(w, n, torch.bfloat16)


@pytest.mark.parametrize("n", [1, 3, 4])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_dense_gemv_and_its_dispatch(n: int) -> None:
    """dense_gemv on the router's gate (256 x 4096 bf16) and a compressor-like 1024 x 4096 weight, fp32 and bf16
    out, against an fp64 reference; decode-size `linear` / `logits_linear` (N <= 4) take it, the head-size
    weight and 5 rows do not."""
    from moebox.ops import linear as linear_mod
    from moebox.ops.triton.fp8_linear import dense_gemv
    for out_f in (256, 1024):
        w = (torch.randn(out_f, 4096, device="cuda") * 0.02).bfloat16()
        x = torch.randn(n, 4096, device="cuda").bfloat16()
        ref = x.double() @ w.double().T
        for out_dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 4e-3)):
            y = dense_gemv(x, w, out_dtype)
            assert y.dtype == out_dtype and torch.isfinite(y).all()
            assert rel_err(y, ref) < tol, rel_err(y, ref)
        assert torch.equal(linear_mod.logits_linear(x, w), dense_gemv(x, w, torch.float32))
        assert torch.equal(linear_mod.linear(x, w), dense_gemv(x, w))
    assert linear_mod._dense_gemv_takes(x, w)
    assert not linear_mod._dense_gemv_takes(torch.randn(5, 4096, device="cuda").bfloat16(), w)
    assert not linear_mod._dense_gemv_takes(x, torch.empty(1 << 15, 4096, device="cuda", dtype=torch.bfloat16))


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
    """Decode calls capture in a CUDA graph: the default picks, a GEMV with split-K and a pipelined K loop, and
    the dot path with split-K; replays follow new x written into the inputs."""
    from moebox.ops.triton.fp8_linear import fp8_linear_triton
    calls = [((512, 4096), None), ((4096, 2048), None), ((32768, 1024), None),
             ((4096, 8192), Fp8Config(4, 8, 4, 4, 3, kernel="gemv", block_k=512)),
             ((1024, 4096), Fp8Config(16, 16, 4, 4, 4))]
    ws = [block_weight(o, i, seed=o).to("cuda") for (o, i), _ in calls]
    n = 4
    xs = [torch.randn(n, w.data.shape[1], device="cuda", dtype=torch.bfloat16) for w in ws]
    outs = [torch.empty(n, w.data.shape[0], device="cuda", dtype=torch.bfloat16) for w in ws]
    cfgs = [c for _, c in calls]
    for x, w, o, c in zip(xs, ws, outs, cfgs):
        fp8_linear_triton(x, w, out=o, config=c)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x, w, o, c in zip(xs, ws, outs, cfgs):
            fp8_linear_triton(x, w, out=o, config=c)
    for _ in range(2):
        for x, o in zip(xs, outs):
            x.copy_(torch.randn_like(x))
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for x, w, o in zip(xs, ws, outs):
            ref = fp8_linear_reference(x.float(), w)
            assert torch.isfinite(o).all() and rel_err(o, ref) < 1e-2


# ------------------------------------------------------------------------------------------ grouped
def _dense_grouped(x: torch.Tensor, w: QuantTensor, groups: int) -> torch.Tensor:
    """The grouped product on the dequantized weight, in fp32."""
    dense = w.dequantize(torch.float32).view(groups, w.data.shape[0] // groups, -1)
    return torch.einsum("ngk,grk->ngr", x.float(), dense)


def test_grouped_reference_on_cpu() -> None:
    from moebox.ops.linear import grouped_linear
    for groups, rows, in_f in ((2, 128, 200), (3, 256, 128), (1, 128, 300)):
        w = block_weight(groups * rows, in_f, seed=groups)
        x = torch.randn(5, groups, in_f)
        ref = fp8_grouped_linear_reference(x, w, groups)
        assert ref.shape == (5, groups, rows) and ref.dtype == torch.float32
        assert rel_err(ref, _dense_grouped(x, w, groups)) < 1e-6
        for i in range(groups):  # group i is fp8_linear_reference on its own rows, bit for bit
            s0 = i * rows // BLOCK
            part = QuantTensor("fp8", w.data[i * rows:(i + 1) * rows], w.scale[s0:s0 + rows // BLOCK])
            assert torch.equal(ref[:, i], fp8_linear_reference(x[:, i], part))
        assert torch.equal(fp8_grouped_linear(x, w, groups), ref)  # the dispatcher off CUDA
        assert rel_err(grouped_linear(x, w, groups), ref) < 1e-6  # the CPU fallback (einsum)
        # bf16 x into a poisoned out view (a slice of a wider buffer: group and row strides of its own)
        xb = x.bfloat16()
        big = torch.full((5, groups + 1, rows + 64), float("nan"), dtype=torch.bfloat16)
        out = big[:, 1:, 32:32 + rows]
        y = fp8_grouped_linear(xb, w, groups, out=out)
        assert y.data_ptr() == out.data_ptr() and y.dtype == torch.bfloat16
        assert torch.equal(out, _dense_grouped(xb, w, groups).bfloat16())
        assert big[:, 0].isnan().all() and big[:, :, :32].isnan().all() and big[:, :, 32 + rows:].isnan().all()
    empty = fp8_grouped_linear_reference(torch.randn(0, 2, 200), block_weight(256, 200), 2)
    assert empty.shape == (0, 2, 128)


def test_grouped_argument_checks() -> None:
    w = block_weight(256, 200)
    x = torch.randn(3, 2, 200)
    for bad_x, groups in ((torch.randn(3, 400), 2), (torch.randn(3, 2, 100), 2), (x, 3), (torch.randn(3, 1, 200), 2),
                          (x, 0)):
        with pytest.raises(ValueError):
            fp8_grouped_linear_reference(bad_x, w, groups)
    with pytest.raises(ValueError, match=r"multiple of 128.*\(260, 200\) in 2 groups"):  # 130 rows a group
        fp8_grouped_linear_reference(x, block_weight(260, 200), 2)
    with pytest.raises(ValueError, match="multiple of 128"):  # 256 rows do not split into 3 groups
        fp8_grouped_linear_reference(torch.randn(3, 3, 200), w, 3)
    for out in (torch.empty(3, 2, 129), torch.empty(3, 256), torch.empty(3, 2, 128, dtype=torch.float16),
                torch.empty(3, 128, 2).transpose(1, 2)):
        with pytest.raises(ValueError):
            fp8_grouped_linear_reference(x, w, 2, out=out)
    with pytest.raises(ValueError):
        fp8_grouped_linear_reference(x, QuantTensor("fp8", w.data, w.scale, (1, 128)), 2)
    with pytest.raises(ValueError):
        fp8_grouped_linear_reference(x, QuantTensor("fp8", w.data, w.scale[:1]), 2)
    with pytest.raises(TypeError):
        fp8_grouped_linear_reference(x, torch.randn(256, 200), 2)  # type: ignore[arg-type]


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install triton; Linux only)")
def test_grouped_triton_rejects_before_launch() -> None:
    from moebox.ops.triton.fp8_linear import fp8_grouped_linear_triton
    w = block_weight(256, 200)
    x = torch.randn(3, 2, 200)
    with pytest.raises(ValueError, match="block_o 256 must divide the 128 rows"):
        fp8_grouped_linear_triton(x, w, 2, config=Fp8Config(16, 256))
    with pytest.raises(ValueError):
        fp8_grouped_linear_triton(x.to(torch.float64), w, 2)
    with pytest.raises(ValueError):
        fp8_grouped_linear_triton(x, block_weight(260, 200), 2)


def test_bench_command_line() -> None:
    """`python -m moebox.ops.triton.fp8_linear` parses its options (it runs on an H200, not here)."""
    args = fp8_mod._parser().parse_args(["--grouped", "--tokens", "1", "4", "16", "--groups", "4", "--rows", "256"])
    assert args.grouped and args.tokens == [1, 4, 16] and (args.groups, args.rows) == (4, 256)
    assert args.in_features == V4_FLASH_GROUPED[3] and not args.sweep
    assert fp8_mod._parser().parse_args([]).groups == V4_FLASH_GROUPED[1]
    with pytest.raises(SystemExit, match="multiple of 128"):
        fp8_mod.main(["--grouped", "--rows", "100"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="CUDA"):
            fp8_mod.main(["--grouped"])


_GROUPED_INTERPRETER_CHECK = textwrap.dedent("""
    import json, os, sys, torch
    assert os.environ.get("TRITON_INTERPRET") == "1"
    sys.path.insert(0, sys.argv[1])
    from moebox.ops.triton.fp8_linear import Fp8Config, fp8_grouped_linear_reference, fp8_grouped_linear_triton
    from tests.test_triton_fp8 import block_weight
    torch.manual_seed(0)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3}
    gemv = lambda bn, bo, bk, split=0: Fp8Config(bn, bo, split, 4, 1, kernel="gemv", block_k=bk)
    results = []

    def check(case, x, w, groups, cfg, out=None):
        n, rows = x.shape[0], w.data.shape[0] // groups
        poisoned = torch.full((n, groups, rows), float("nan"), dtype=x.dtype) if out is None else out
        y = fp8_grouped_linear_triton(x, w, groups, out=poisoned, config=cfg)
        ref = fp8_grouped_linear_reference(x.float(), w, groups)
        err = (y.float() - ref).abs()
        # every element: written (finite) and within tol of the largest output
        assert torch.isfinite(y).all(), (case, int((~torch.isfinite(y)).sum()))
        assert float(err.max()) <= 4 * tol[x.dtype] * float(ref.abs().max()), (case, float(err.max()))
        results.append(dict(case=case, same_buffer=y.data_ptr() == poisoned.data_ptr(), finite=True,
                            rel=float((y.float() - ref).norm() / ref.norm()), ref_norm=float(ref.norm()),
                            tol=tol[x.dtype]))

    # g in {2, 3}, R = 128, in in {128, 256} (one or two scale columns), N in {1, 3, 20}, fp32 and fp16 x: the GEMV
    # at N = 1, 3 (64 rows per program, 2 programs per group; split-K 2 when there are 2 K steps; one token block
    # or two), the default prefill tile (the dot kernel, 64 x 128) at N = 20
    for groups in (2, 3):
        for in_f in (128, 256):
            w = block_weight(groups * 128, in_f, seed=groups + in_f)
            for n in (1, 3, 20):
                for dtype in (torch.float32, torch.float16):
                    cfg = gemv(2 if n == 3 else 1, 64, 128, split=in_f // 128) if n <= 3 else None
                    check([groups, in_f, n, str(dtype), str(cfg)], torch.randn(n, groups, in_f).to(dtype), w,
                          groups, cfg)
    # a partial K block: the GEMV with one masked step (16 rows per program), then the dot decode tile with
    # split-K (the split sum writes the groups), the GEMV with split-K and the prefill tile, x with group and
    # row strides of its own and out a view of a wider poisoned buffer, whose other elements must stay NaN
    check("partial step", torch.randn(1, 2, 200), block_weight(2 * 128, 200, seed=6), 2, gemv(1, 16, 256))
    w = block_weight(3 * 128, 200, seed=7)
    for cfg in (Fp8Config(16, 32, 2), gemv(4, 32, 128, split=2), Fp8Config(64, 128, 1)):
        xw = torch.randn(5, 4, 264)
        big = torch.full((5, 4, 160), float("nan"))
        out = big[:, 1:, 16:144]
        check(["strided", str(cfg)], xw[:, :3, 40:240], w, 3, cfg, out=out)
        assert big[:, 0].isnan().all() and big[:, :, :16].isnan().all() and big[:, :, 144:].isnan().all()
    print("RESULT " + json.dumps(results))
""")


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install triton; Linux only)")
def test_grouped_in_triton_interpreter() -> None:
    """The grouped call on tiny shapes in Triton's CPU interpreter, vs the reference, every element checked."""
    check_in_interpreter(_GROUPED_INTERPRETER_CHECK)


GROUPED_SHAPES = [V4_FLASH_GROUPED, ("small", 3, 256, 200)]


def _grouped_gpu_weight(groups: int, rows: int, in_f: int) -> QuantTensor:
    return _gpu_weight(groups * rows, in_f)


def _check_gpu_grouped(w: QuantTensor, groups: int, n: int, dtype: torch.dtype, config: Fp8Config | None = None,
                       x: torch.Tensor | None = None, tol: float | None = None, view: bool = False) -> torch.Tensor:
    """fp8_grouped_linear_triton against the fp32 reference, twice into a poisoned out (with `view`, a view of a
    wider poisoned buffer whose other elements must stay NaN); every element finite and within 4 x tol of the
    largest output, the two runs bitwise equal."""
    from moebox.ops.triton.fp8_linear import fp8_grouped_linear_triton
    out_f, in_f = w.data.shape
    rows = out_f // groups
    if x is None:
        x = torch.randn(n, groups, in_f, device="cuda").to(dtype)
    with matmul_tf32(False):
        ref = fp8_grouped_linear_reference(x.float(), w, groups)
    if tol is None:
        tol = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}[dtype]
    ys = []
    for _ in range(2):
        big = torch.full((n, groups + 1, rows + 256) if view else (n, groups, rows), float("nan"), device="cuda",
                         dtype=dtype)
        out = big[:, 1:, 128:128 + rows] if view else big
        y = fp8_grouped_linear_triton(x, w, groups, out=out, config=config)
        torch.cuda.synchronize()
        assert y.data_ptr() == out.data_ptr() and y.dtype == dtype and y.shape == (n, groups, rows)
        assert torch.isfinite(y).all(), f"{int((~torch.isfinite(y)).sum())} elements not written or not finite"
        assert rel_err(y, ref) < tol, (rel_err(y, ref), tol)
        assert float((y.float() - ref).abs().max()) <= 4 * tol * float(ref.abs().max())
        if view:
            assert big[:, 0].isnan().all() and big[:, :, :128].isnan().all() and big[:, :, 128 + rows:].isnan().all()
        ys.append(y.clone())
    assert torch.equal(ys[0], ys[1])
    return ys[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("n", [1, 3, 16, 64])
@pytest.mark.parametrize("shape", GROUPED_SHAPES, ids=[s[0] for s in GROUPED_SHAPES])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_grouped_matches_reference(shape: tuple, n: int, dtype: torch.dtype) -> None:
    _, groups, rows, in_f = shape
    _check_gpu_grouped(_grouped_gpu_weight(groups, rows, in_f), groups, n, dtype)


@pytest.mark.parametrize("config", [None, Fp8Config(1, 1, 0, 4, 1, kernel="gemv", block_k=4096),
                                    Fp8Config(4, 16, 3, 4, 3, kernel="gemv", block_k=512),
                                    Fp8Config(16, 32, 0, 4, 4), Fp8Config(16, 64, 4, 4, 4),
                                    Fp8Config(64, 128, 2, 4, 3), Fp8Config(128, 128, 0, 8, 3)], ids=str)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_grouped_strided_and_forced(config: Fp8Config | None) -> None:
    """Forced tilings (GEMV and dot, split-K through the grouped split sum) with x and out as views: x a slice
    of a wider tensor (group and row strides of its own), out a slice of a wider poisoned buffer."""
    for _, groups, rows, in_f in GROUPED_SHAPES:
        w = _grouped_gpu_weight(groups, rows, in_f)
        for n in (1, 3, 17):
            for dtype in (torch.bfloat16, torch.float16):
                wide = torch.randn(n, groups + 2, in_f + 64, device="cuda").to(dtype)
                _check_gpu_grouped(w, groups, n, dtype, config=config, x=wide[:, 1:groups + 1, 32:32 + in_f],
                                   view=True)
        fp32_ok = config is None or config.block_n * config.block_o <= 64 * 128   # as test_gpu_forced_tilings
        _check_gpu_grouped(w, groups, 3, torch.float32, config=config if fp32_ok else None, view=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_grouped_linear_dispatch_and_graph() -> None:
    """`grouped_linear` on CUDA runs the grouped kernel (equal to it bit for bit, and to the reference within
    tolerance), and the grouped call replays from a CUDA graph with new x."""
    from moebox.ops.linear import grouped_linear
    from moebox.ops.triton.fp8_linear import fp8_grouped_linear_triton
    _, groups, rows, in_f = V4_FLASH_GROUPED
    w = _grouped_gpu_weight(groups, rows, in_f)
    for n in (1, 4, 64):
        x = torch.randn(n, groups, in_f, device="cuda", dtype=torch.bfloat16)
        y = grouped_linear(x, w, groups)
        assert torch.equal(y, fp8_grouped_linear_triton(x, w, groups))
        assert rel_err(y, fp8_grouped_linear_reference(x.float(), w, groups)) < 1e-2
    for cfg in (None, Fp8Config(16, 32, 4, 4, 4)):  # one launch, and two with split-K
        x = torch.randn(4, groups, in_f, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(4, groups, rows, device="cuda", dtype=torch.bfloat16)
        fp8_grouped_linear_triton(x, w, groups, out=out, config=cfg)   # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fp8_grouped_linear_triton(x, w, groups, out=out, config=cfg)
        for _ in range(2):
            x.copy_(torch.randn_like(x))
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.isfinite(out).all()
            assert rel_err(out, fp8_grouped_linear_reference(x.float(), w, groups)) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_stacked_projections_equal_the_separate_calls() -> None:
    """The attention's stacked FP8 projections at the V4-Flash shapes (x -> wq_a + wkv, qr -> wq_b +
    indexer.wq_b) through the kernel: each output slice within bf16 tolerance of the fp32 reference of its own
    weight, and one product per set."""
    from moebox.ops.linear import SharedInputLinear
    for shapes in (((1024, 4096), (512, 4096)), ((32768, 1024), (8192, 1024))):
        ws = [_gpu_weight(o, i) for o, i in shapes]
        stacked = SharedInputLinear(*ws)
        assert len(stacked.parts) == 1
        for n in (1, 4, 16):
            x = torch.randn(n, shapes[0][1], device="cuda", dtype=torch.bfloat16)
            for y, w in zip(stacked(x), ws):
                assert torch.isfinite(y).all() and rel_err(y, fp8_linear_reference(x.float(), w)) < 1e-2
