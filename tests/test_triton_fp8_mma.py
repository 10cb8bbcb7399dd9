"""The tensor-core FP8 decode kernel (moebox/ops/triton/fp8_mma.py, `Fp8Config(kernel="mma")`).

- CPU: its inline PTX run in a one-warp emulator (mma.sync.m16n8k16 fragments as the PTX ISA lays them out,
  e4m3 and bf16 -> f16 conversions by numpy/torch) against a plain fp64 dot of the same rows and tokens; the
  kernel through `fp8_linear_triton` in Triton's interpreter (plain loads instead of the asm: the addressing,
  splits, groups, masks and the final reduction) on odd shapes; the sm_90 build (no spills, no shared memory in
  the K loop, every HMMA and conversion counted); where the dispatch falls back to the GEMV.
- GPU (marker `gpu`): the V4-Flash decode shapes at N = 1..16 with each sweep tiling, poisoned outputs, bf16 and
  fp16 x, the grouped wo_a call, against the fp32 reference.
"""

from __future__ import annotations

import importlib.util
import textwrap

import numpy as np
import pytest
import torch

from moebox.ops.triton.fp8_linear import Fp8Config, V4_FLASH_DECODE_SHAPES
from tests.interpreter import check_in_interpreter
from tests.ptx_warp import f32, run_warp
from tests.test_triton_fp8 import _check_gpu, _gpu_weight, block_weight

HAVE_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")


# ---------------------------------------------------------------------------------------------- the PTX
@pytest.mark.parametrize("token_sets", [1, 2])
def test_mma_asm_emulated_against_a_plain_dot(token_sets: int) -> None:
    """One mma tile of one K block: 16 weight rows x 128 columns of random e4m3 bytes, x bf16 (converted by the
    kernel's own bf16 -> f16 PTX) for 8 or 16 tokens, fed to the PTX in the lane layout the kernel loads
    (lane 4g + t: words 4t..4t+3 of rows g and g + 8 of each 64-column chunk; x pairs 8t..8t+7 of token g
    (+ 8 h)); the slots, reduced as the kernel does, equal the fp64 dot of the decoded weights and x."""
    from moebox.ops.triton.fp8_mma import BF16_TO_F16_ASM, mma_asm
    gen = np.random.default_rng(token_sets)
    codes = gen.integers(0, 256, (16, 128), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C                                   # no NaN bytes
    w = torch.from_numpy(codes).view(torch.float8_e4m3fn).double().numpy()
    tokens = 8 * token_sets
    x = torch.randn(tokens, 128, generator=torch.Generator().manual_seed(token_sets)).bfloat16()
    x_pairs = x.view(torch.int32).numpy().astype(np.int64) & 0xFFFFFFFF  # [token, 64] bf16 pairs
    f16_pairs = np.array([[run_warp(BF16_TO_F16_ASM, [[int(p)]], first_in=1, outputs=1)[0][0] for p in row]
                          for row in x_pairs])
    words = codes.view(np.uint32)                                         # [row, 32] little-endian words
    inputs = []
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        ops = [int(words[8 * rho + g, 16 * c + 4 * t + j]) for c in range(2) for rho in range(2) for j in range(4)]
        for c in range(2):
            for half in range(2):   # pairs 0-3, then 4-7 of the lane's 16 columns, slot 4 h + q
                ops += [int(f16_pairs[min(g + 8 * h, tokens - 1), 32 * c + 8 * t + 4 * half + q])
                        for h in range(2) for q in range(4)]
        inputs.append(ops)
    outs = run_warp(mma_asm(token_sets), inputs, first_in=8, outputs=8)
    got = np.zeros((16, tokens))
    for lane, out in enumerate(outs):
        g, t = lane >> 2, lane & 3
        for rho in range(2):
            for i in range(4):
                tok = 2 * t + i % 2 + (8 * (i // 2) if token_sets == 2 else 0)
                got[8 * rho + g, tok] += f32(out[4 * rho + i])
    want = w @ x.double().numpy().T
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max(), np.abs(got - want).max()


# ---------------------------------------------------------------------------------------------- interpreter
_INTERPRETER_CHECK = textwrap.dedent("""
    import json, os, sys, torch
    assert os.environ.get("TRITON_INTERPRET") == "1"
    sys.path.insert(0, sys.argv[1])
    import moebox.ops.triton.fp8_linear as linear_mod
    from moebox.ops.triton.fp8_linear import (Fp8Config, fp8_grouped_linear_reference, fp8_grouped_linear_triton,
                                              fp8_linear_reference, fp8_linear_triton)
    from tests.interpreter import count_calls
    from tests.test_triton_fp8 import block_weight
    calls = count_calls(linear_mod, "launch_mma")
    torch.manual_seed(0)
    tol = {torch.float16: 2e-3, torch.bfloat16: 1e-2}
    results = []
    w = block_weight(200, 384, seed=5)      # 2 x 3 scale blocks, rows past 200 clamped in the last program
    cases = [(1, torch.bfloat16, Fp8Config(kernel="mma", block_o=32, num_warps=2, num_stages=2)),
             (5, torch.float16, Fp8Config(kernel="mma", block_o=64, num_warps=1, num_stages=1)),
             (8, torch.bfloat16, Fp8Config(kernel="mma", block_o=16, num_warps=1, num_stages=2, split_k=2)),
             (9, torch.float16, Fp8Config(kernel="mma", block_o=128, num_warps=4, num_stages=2)),
             (16, torch.bfloat16, Fp8Config(kernel="mma", block_o=32, num_warps=1, num_stages=2, split_k=3))]
    for n, dtype, cfg in cases:
        x = torch.randn(n, 384).to(dtype)
        out = torch.full((n, 200), float("nan"), dtype=dtype)
        y = fp8_linear_triton(x, w, out=out, config=cfg)
        ref = fp8_linear_reference(x.float(), w)
        results.append(dict(case=[n, str(dtype), cfg.label], same_buffer=y.data_ptr() == out.data_ptr(),
                            finite=bool(torch.isfinite(y).all()), rel=float((y.float() - ref).norm() / ref.norm()),
                            ref_norm=float(ref.norm()), tol=tol[dtype]))
    # x with a row stride; the grouped call (2 groups of 128 rows, each with its x row)
    x = torch.randn(3, 512).bfloat16()[:, 64:448]
    y = fp8_linear_triton(x, w, config=Fp8Config(kernel="mma", block_o=64, num_warps=2, num_stages=2))
    ref = fp8_linear_reference(x.float(), w)
    results.append(dict(case="strided x", same_buffer=True, finite=bool(torch.isfinite(y).all()),
                        rel=float((y.float() - ref).norm() / ref.norm()), ref_norm=float(ref.norm()), tol=1e-2))
    wg = block_weight(256, 256, seed=6)
    xg = torch.randn(4, 2, 256).half()
    out = torch.full((4, 2, 128), float("nan"), dtype=torch.float16)
    y = fp8_grouped_linear_triton(xg, wg, 2, out=out,
                                  config=Fp8Config(kernel="mma", block_o=64, num_warps=4, num_stages=2, split_k=2))
    ref = fp8_grouped_linear_reference(xg.float(), wg, 2)
    results.append(dict(case="grouped", same_buffer=y.data_ptr() == out.data_ptr(),
                        finite=bool(torch.isfinite(y).all()), rel=float((y.float() - ref).norm() / ref.norm()),
                        ref_norm=float(ref.norm()), tol=2e-3))
    assert len(calls) == len(cases) + 2, len(calls)
    # what the mma kernel does not take runs the GEMV: fp32 x, in % 128 != 0, more than 16 tokens
    for n, k, dtype in ((3, 384, torch.float32), (3, 200, torch.bfloat16), (17, 384, torch.bfloat16)):
        wk = w if k == 384 else block_weight(200, k, seed=7)
        x = torch.randn(n, k).to(dtype)
        y = fp8_linear_triton(x, wk, config=Fp8Config(kernel="mma", block_o=32, num_warps=2, num_stages=2))
        ref = fp8_linear_reference(x.float(), wk)
        results.append(dict(case=["fallback", n, k, str(dtype)], same_buffer=True,
                            finite=bool(torch.isfinite(y).all()), rel=float((y.float() - ref).norm() / ref.norm()),
                            ref_norm=float(ref.norm()), tol=1e-5 if dtype == torch.float32 else 1e-2))
    assert len(calls) == len(cases) + 2, len(calls)
    print("RESULT " + json.dumps(results))
""")


@pytest.mark.slow
@needs_triton
def test_mma_kernel_in_the_interpreter() -> None:
    check_in_interpreter(_INTERPRETER_CHECK)


@pytest.mark.slow
@needs_triton
def test_mma_kernel_builds_for_sm90() -> None:
    """The sm_90 build: no spills, no shared memory or shuffles in the K loop (the asm operands come straight
    from the loads), and per step exactly the HMMAs and conversions the module doc counts."""
    from moebox.ops.triton.fp8_mma import sass_report
    for tiles, warps, sets in ((1, 4, 1), (2, 2, 1), (1, 8, 2)):
        rep = sass_report(tiles, warps, sets)
        ops = rep["loop_ops"]
        # the asm's 8-element packs are one lane's 4 words of rows g and g + 8, lanes 4 g + t as in mma.sync
        assert rep["asm_layout"] == {"sizePerThread": [1, 4], "threadsPerWarp": [8, 4], "warpsPerCTA": [warps, 1],
                                     "order": [1, 0]}, rep
        assert rep["spills"] == 0 and not {"LDS", "STS", "BAR", "SHFL"} & set(ops), rep
        assert ops.get("HMMA", 0) == 8 * tiles * sets, rep
        assert ops.get("F2FP", 0) == 32 * tiles + 16 * sets, rep   # weights: a pair each; x: a pair each
        assert rep["instructions_per_weight"] < (2.5 if sets == 1 else 3.5), rep


# ---------------------------------------------------------------------------------------------- GPU
MMA_CONFIGS = [Fp8Config(kernel="mma", block_o=bo, num_warps=w, num_stages=st)
               for bo, w, st in ((64, 4, 2), (128, 8, 2), (128, 2, 2), (32, 2, 1))]


@pytest.mark.parametrize("config", MMA_CONFIGS, ids=lambda c: c.label.replace(" ", "-"))
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_mma_on_the_decode_shapes(config: Fp8Config) -> None:
    for _, out_f, in_f in V4_FLASH_DECODE_SHAPES:
        w = _gpu_weight(out_f, in_f)
        for n in (1, 2, 5, 8, 9, 16):
            _check_gpu(w, n, torch.bfloat16, config=config)
        _check_gpu(w, 4, torch.float16, config=config)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_mma_grouped_wo_a() -> None:
    from moebox.ops.triton.fp8_linear import fp8_grouped_linear_reference, fp8_grouped_linear_triton
    w = block_weight(8192, 4096, seed=3).to("cuda")
    for n in (1, 4, 16):
        x = torch.randn(n, 8, 4096, device="cuda").bfloat16()
        out = torch.full((n, 8, 1024), float("nan"), device="cuda", dtype=torch.bfloat16)
        y = fp8_grouped_linear_triton(x, w, 8, out=out, config=MMA_CONFIGS[1])
        ref = fp8_grouped_linear_reference(x.float(), w, 8)
        assert torch.isfinite(y).all() and float((y.float() - ref).norm() / ref.norm()) < 1e-2
