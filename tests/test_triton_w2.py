"""The Triton w2 routed-expert decode kernels (moebox/ops/triton/w2_moe.py) against the torch reference.

- CPU: the reference/dispatcher, the plane helpers, config checks; the kernels themselves in Triton's
  interpreter (TRITON_INTERPRET=1 is read when triton is imported, so those checks run in a subprocess): the mma
  variant (its interpreter twin of the inline asm, same x/h pair layout, bf16 terms, scale bytes, K split over
  warps, prefetch depths) with fp32 and fp16 x and on codes stored tile by tile, the fma variant with fp32 x; an
  sm_90 build of the mma kernels on CPU (no GPU needed) that checks what the inline asm relies on: its operands in
  the mma fragment layout, no layout conversion in the loop, every HMMA in the loop, the SASS instructions per
  weight; and the inline PTX itself run in a one-warp emulator (mma.sync fragments as the PTX ISA defines them) vs
  a plain dot.
- GPU (marker `gpu`, skipped without CUDA): small and real V4-Flash shapes (H=4096, I=2048, E=256, k=6),
  N in {1, 3, 16}, bf16 / fp16 / fp32 activations, the default config, the fma variant and other mma configs,
  outputs poisoned with NaN before each run; a shape the mma kernels do not take; layer-buffer views; codes
  stored tile by tile (`tile_codes`) at each token count's kernels; a CUDA-graph replay of the default and the fma
  variant.
"""

from __future__ import annotations

import importlib.util
import json
import textwrap
from dataclasses import replace

import pytest
import torch

import moebox.ops.triton.w2_moe as w2_mod
from moebox.ops.triton.w2_moe import (DEFAULT_CONFIG, SWEEP, DecodeConfig, expert_bytes, layer_views,
                                      random_planes, random_routing, stack_planes, w2_moe_decode,
                                      w2_moe_decode_reference)
from moebox.quant.w2 import W2Tensor, from_float

from tests.interpreter import check_in_interpreter
from tests.ptx_warp import f32, run_warp

HAVE_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install triton; Linux only)")


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30))


def _from_float_experts(e: int, hidden: int, inter: int, seed: int = 0) -> list[tuple[W2Tensor, W2Tensor, W2Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [tuple(from_float(torch.randn(shape, generator=g) * 0.05)
                  for shape in ((inter, hidden), (inter, hidden), (hidden, inter))) for _ in range(e)]


# ---------------------------------------------------------------------------------------------- CPU
def test_reference_is_routed_experts_and_dispatch_on_cpu() -> None:
    """The dispatcher runs the reference off CUDA; the reference equals a plain dense fp32 computation."""
    hidden, inter, e, k, n, limit = 64, 32, 4, 2, 3, 0.5
    planes = random_planes(e, hidden, inter, seed=1, scale_byte=(122, 128))
    ids, w = random_routing(n, e, k, seed=1)
    x = torch.randn(n, hidden)
    y = w2_moe_decode(x, ids, w, *planes, limit)
    w13c, w13s, w2c, w2s = planes
    dense = []
    for t in range(n):
        acc = torch.zeros(hidden)
        for j in range(k):
            ex = int(ids[t, j])
            w13 = W2Tensor(w13c[ex], w13s[ex]).dequantize()
            g, u = w13[:inter] @ x[t], w13[inter:] @ x[t]
            h = torch.nn.functional.silu(g.clamp(max=limit)) * u.clamp(-limit, limit) * w[t, j]
            acc += W2Tensor(w2c[ex], w2s[ex]).dequantize() @ h
        dense.append(acc)
    assert rel_err(y, torch.stack(dense)) < 1e-5


def test_stack_planes_and_layer_views_layout() -> None:
    from moebox.store.plane_store import StoreShape, slot_buffers, slot_views
    hidden, inter, e = 64, 32, 3
    experts = _from_float_experts(e, hidden, inter)
    w13c, w13s, w2c, w2s = stack_planes(experts)
    assert w13c.shape == (e, 2 * inter, hidden // 4) and w13c.dtype == torch.uint8
    assert w13s.shape == (e, 2 * inter, hidden // 32) and w13s.dtype == torch.float8_e8m0fnu
    assert w2c.shape == (e, hidden, inter // 4) and w2s.shape == (e, hidden, inter // 32)
    shape = StoreShape(layers=1, experts=e, hidden=hidden, intermediate=inter)
    buf = torch.zeros(e, shape.stride, dtype=torch.uint8)
    for i, planes in enumerate(experts):
        raw = b"".join(bytes(p) for p in slot_buffers(planes, shape))
        buf[i, :len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    w1c, w1s, w3c, w3s, v2c, v2s = layer_views(buf, hidden, inter)
    for i in range(e):
        s1, s3, s2 = slot_views(buf[i], shape)
        assert torch.equal(w1c[i], s1.codes) and torch.equal(w3c[i], s3.codes) and torch.equal(v2c[i], s2.codes)
        assert torch.equal(w1s[i].view(torch.uint8), s1.scales.view(torch.uint8))
        assert torch.equal(torch.cat([w1c[i], w3c[i]]), w13c[i]) and torch.equal(v2c[i], w2c[i])
        assert torch.equal(torch.cat([w1s[i], w3s[i]]).view(torch.uint8), w13s[i].view(torch.uint8))
        assert torch.equal(v2s[i].view(torch.uint8), w2s[i].view(torch.uint8))
    assert expert_bytes(4096, 2048) == 7_077_888


def test_config_checks() -> None:
    assert DEFAULT_CONFIG.variant == "mma"
    assert len({name for name, _ in SWEEP}) == len(SWEEP) and DEFAULT_CONFIG in {cfg for _, cfg in SWEEP}
    for bad in (dict(variant="wgmma"), dict(gate_split=3), dict(down_split=0), dict(prefetch=3)):
        with pytest.raises(ValueError):
            DecodeConfig(**bad)


_INTERPRETER_SETUP = textwrap.dedent("""
    import dataclasses, json, os, sys, torch
    assert os.environ.get("TRITON_INTERPRET") == "1"
    sys.path.insert(0, sys.argv[1])
    from moebox.ops.triton.w2_moe import (DecodeConfig, layer_views, pack_x_ahead, random_planes, random_routing,
                                          stack_planes, w2_moe_decode_reference, w2_moe_decode_split,
                                          w2_moe_decode_triton)
    from moebox.quant.w2 import from_float
    from moebox.store.plane_store import StoreShape, slot_buffers
    torch.manual_seed(0)
    results = []

    def run(cases):
        for hidden, inter, e, k, n, limit, dtype, cfg, tol in cases:
            planes = random_planes(e, hidden, inter, seed=hidden + n, scale_byte=(122, 128))
            ids, w = random_routing(n, e, k, seed=n)
            x = torch.randn(n, hidden).to(dtype)
            out = torch.full((n, hidden), float("nan"), dtype=dtype)
            y = w2_moe_decode_triton(x, ids, w, *planes, limit, out=out, config=cfg)
            ref = w2_moe_decode_reference(x.float(), ids, w, *planes, limit)
            results.append(dict(case=[hidden, inter, e, k, n, limit, str(dtype), str(cfg)], tol=tol,
                                same_buffer=y.data_ptr() == out.data_ptr(), finite=bool(torch.isfinite(y).all()),
                                rel=float((y.float() - ref).norm() / ref.norm()), ref_norm=float(ref.norm())))

    def run_layer_views(hidden, inter, n, cfg):
        # planes from real quantized experts in zero-copy plane-store layer views (expert stride = slot)
        e, k = 4, 2
        g = torch.Generator().manual_seed(0)
        experts = [tuple(from_float(torch.randn(s, generator=g) * 0.05) for s in ((inter, hidden),
                   (inter, hidden), (hidden, inter))) for _ in range(e)]
        ids, w = random_routing(n, e, k, seed=5)
        x = torch.randn(n, hidden)
        ref = w2_moe_decode_reference(x, ids, w, *stack_planes(experts), 10.0)
        shape = StoreShape(layers=1, experts=e, hidden=hidden, intermediate=inter)
        buf = torch.zeros(e, shape.stride, dtype=torch.uint8)
        for i, planes in enumerate(experts):
            raw = b"".join(bytes(p) for p in slot_buffers(planes, shape))
            buf[i, :len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        views = layer_views(buf, hidden, inter)
        y = w2_moe_decode_split(x, ids, w, *views, 10.0, config=cfg)
        results.append(dict(case=["layer views", hidden, inter, cfg.variant], same_buffer=True,
                            finite=bool(torch.isfinite(y).all()), rel=float((y - ref).norm() / ref.norm()),
                            ref_norm=float(ref.norm())))
        # x packed ahead (as the model packs it beside the routing): the mma kernels read it, bit for bit
        packed = pack_x_ahead(x, views[0], views[2], views[4], config=cfg)
        assert (packed is not None) == (cfg.variant == "mma" and hidden % 256 == 0), (packed, cfg)
        if packed is not None:
            assert torch.equal(w2_moe_decode_split(x, ids, w, *views, 10.0, config=cfg, packed=packed), y)
""")

_INTERPRETER_MMA = _INTERPRETER_SETUP + textwrap.dedent("""
    # the mma variant takes H, I multiples of 256. Cases: the default config (one K tile per warp); splits and
    # prefetch depths that give warps several tiles and clamp the prefetch past the end (odd k, no limit);
    # fp16 x (2 bf16 terms of x, 2 of h) with a clamp-dominated limit
    default = DecodeConfig()
    run([(256, 256, 4, 2, 2, 10.0, torch.float32, default, 1e-5),
         (256, 512, 5, 3, 1, None, torch.float32, DecodeConfig(gate_split=1, down_split=2, prefetch=1), 1e-5),
         (512, 256, 4, 2, 1, 0.05, torch.float16, DecodeConfig(gate_split=1, down_split=1, prefetch=2), 2e-3)])
    run_layer_views(256, 256, 1, default)
    print("RESULT " + json.dumps(results))
""")

_INTERPRETER_FMA = _INTERPRETER_SETUP + textwrap.dedent("""
    # the fma variant: default blocks (one K step), then small blocks (2 words = 32 columns) so both kernels
    # loop over several K steps and row blocks: an odd k with no limit, a clamp-dominated case with N = 1 and
    # x word-transposed or not; H = 64 also sends the default (mma) config here
    fma = DecodeConfig(variant="fma")
    small = DecodeConfig(16, 2, 1, 32, 2, 1, 1, transpose_x=False, variant="fma")
    run([(64, 32, 4, 2, 2, 10.0, torch.float32, DecodeConfig(), 1e-5),
         (64, 64, 5, 3, 2, None, torch.float32, small, 1e-5),
         (64, 64, 4, 2, 1, 0.05, torch.float32, dataclasses.replace(small, transpose_x=True), 1e-5)])
    run_layer_views(64, 32, 2, fma)
    print("RESULT " + json.dumps(results))
""")


def test_bench_entry_point_parses() -> None:
    """`python -m moebox.ops.triton.w2_moe`: its flags, and a clear exit where there is no GPU."""
    args = w2_mod._parse(["--tokens", "1", "--k", "4", "6", "8", "--sweep"])
    assert args.tokens == [1] and args.k == [4, 6, 8] and args.sweep and not args.sass
    assert w2_mod._parse([]).tokens == [1, 4, 16] and w2_mod._parse([]).k == [6]
    with pytest.raises(SystemExit):
        w2_mod._parse(["--k", "six"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="CUDA"):
            w2_mod.main(["--tokens", "1"])


@pytest.mark.slow
@needs_triton
def test_mma_kernels_in_triton_interpreter() -> None:
    """The mma variant's kernels (their interpreter path) on small shapes vs the reference."""
    check_in_interpreter(_INTERPRETER_MMA)


@pytest.mark.slow
@needs_triton
def test_fma_kernels_in_triton_interpreter() -> None:
    """The fma variant's kernels on tiny shapes in Triton's CPU interpreter, fp32, vs the reference."""
    check_in_interpreter(_INTERPRETER_FMA)


@pytest.mark.slow
@needs_triton
def test_mma_kernels_build_for_sm90() -> None:
    """Compile the mma kernels for sm_90 on this machine and check what the inline asm relies on."""
    from moebox.ops.triton.w2_moe import sass_report
    for kernel, split in (("gate_up", DEFAULT_CONFIG.gate_split), ("down", DEFAULT_CONFIG.down_split)):
        rep = sass_report(kernel, split, DEFAULT_CONFIG.prefetch)
        # the asm's 8-element packs must be one lane's 4 words x 2 rows, lanes 4 g + t as in mma.sync fragments
        assert rep["asm_layout"] == {"sizePerThread": [1, 4], "threadsPerWarp": [8, 4],
                                     "warpsPerCTA": [split, 1], "order": [1, 0]}, rep
        assert rep["loop_converts"] == 0 and rep["spills"] == 0, rep
        assert rep["loop_ops"].get("HMMA", 0) == rep["weights_per_iter"] // 8, rep   # every mma in the loop
        assert rep["instructions_per_weight"] < 2.1, rep   # 1.66 (gate_up) and 1.88-1.92 (down) with Triton 3.6-3.9
        # selector_fma: each word's 4 upper-selector shifts become f16x2 adds with the half swizzle folded in
        # (no PRMT/MOV for it), so the integer ALU pipe loses 4 ops a word and nothing else is added
        fma = sass_report(kernel, split, DEFAULT_CONFIG.prefetch, selector_fma=True)
        ops, base = fma["loop_ops"], rep["loop_ops"]
        moved = rep["weights_per_iter"] // 4          # 4 per word of 16 weights
        assert ops.get("HADD2", 0) == moved and ops["SHF"] == base["SHF"] - moved, (ops, base)
        assert ops["PRMT"] <= base["PRMT"] + 1 and ops.get("MOV", 0) <= base.get("MOV", 0), (ops, base)
        assert fma["spills"] == 0, fma
        if kernel == "gate_up":   # bench/gate_up_bound.py's loads-only probe keeps every load and drops the math
            probe = sass_report(kernel, split, DEFAULT_CONFIG.prefetch, loads_only=True)
            assert probe["loop_ops"]["LDG"] == base["LDG"] and "HMMA" not in probe["loop_ops"], (probe, base)
            assert probe["instructions_per_weight"] < rep["instructions_per_weight"] / 2, probe


@pytest.mark.parametrize("terms,selector_fma", [(1, False), (3, False), (1, True), (3, True)])
@needs_triton
def test_mma_asm_emulated_against_direct_dot(terms: int, selector_fma: bool) -> None:
    """The inline PTX of the mma kernels, executed for one warp on a 16-row x 16-word tile in the lane layout
    the sm_90 build gives (see test_mma_kernels_build_for_sm90), with x in the pair layout of `_pack_x_kernel`
    and scale bytes as the kernels load them: the masked tile sum equals the plain dot of the dequantized rows."""
    import numpy as np
    from moebox.ops.triton import w2_moe
    gen = np.random.default_rng(terms)
    codes = gen.integers(0, 2 ** 32, (16, 16), dtype=np.uint64).astype(np.uint32)   # [row, word]
    scales = gen.integers(110, 140, (16, 8))                                         # [row, 32-column block]
    x = gen.standard_normal(256).astype(np.float32)
    cols = np.arange(256)
    levels = np.array([-4.0, -1.0, 1.0, 4.0])[(codes[:, cols // 16] >> (2 * (cols % 16))) & 3]
    want = (levels * np.exp2(scales[:, cols // 32] - 127.0)) @ x.astype(np.float64)
    # x as bf16 terms (round to nearest even), pairs j = (c, c + 4), c = j + (j & 4), of each word
    term_bits, r = [], x.copy()
    for _ in range(terms):
        b = r.view(np.uint32).astype(np.uint64)
        bits = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF
        term_bits.append(bits)
        r = r - (bits << 16).astype(np.uint32).view(np.float32)
    c_lo = np.array([j + (j & 4) for j in range(8)])
    xp = [[[int(tb[16 * w + c_lo[j]] | (tb[16 * w + c_lo[j] + 4] << 16)) for j in range(8)] for w in range(16)]
          for tb in term_bits]                                                        # [term, word, pair]
    inputs = []
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        col = min(g, terms - 1)
        ops = [int(codes[8 * rho + g, 4 * t + i]) for rho in range(2) for i in range(4)]
        ops += [int(scales[8 * rho + g, 2 * t + i % 2]) for rho in range(2) for i in range(4)]
        ops += [xp[col][4 * t + a][4 * rho + i] for a in range(4) for rho in range(2) for i in range(4)]
        inputs.append(ops + [0] * 8)
    outs = run_warp(w2_moe._mma_asm(selector_fma), inputs, first_in=8, outputs=8)
    got = np.zeros(16)
    for lane, out in enumerate(outs):
        g, t = lane >> 2, lane & 3
        for rho in range(2):
            for i in range(4):
                if 2 * t + i % 2 < terms:   # _reduce_tile's mask: slot i of lane t is mma column 2t + i % 2
                    got[8 * rho + g] += f32(out[4 * rho + i])
    assert np.abs(got - want).max() <= (1e-2 if terms == 1 else 1e-5) * np.abs(want).max(), (got, want)


# ---------------------------------------------------------------------------------------------- GPU
SMALL = dict(hidden=512, inter=256, experts=8, k=2)
ODD = dict(hidden=288, inter=160, experts=8, k=3)      # not multiples of 256: the fma kernels
V4_FLASH = dict(hidden=4096, inter=2048, experts=256, k=6)
_PLANES: dict[tuple, tuple] = {}
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def _gpu_planes(hidden: int, inter: int, experts: int) -> tuple:
    key = (hidden, inter, experts)
    if key not in _PLANES:
        _PLANES.clear()  # keep one shape (the real one is 1.8 GB) on the device at a time
        _PLANES[key] = random_planes(experts, hidden, inter, device="cuda", seed=7)
    return _PLANES[key]


def _check_gpu(shape: dict, n: int, dtype: torch.dtype, limit: float | None,
               config: DecodeConfig | None = None, tiled: bool = False) -> None:
    """`config` None: the tiling the call picks for n tokens (`default_config`); tiled: the kernels read the codes
    tile by tile (`tile_codes`), the reference the row-major planes."""
    from moebox.ops.triton.w2_moe import tile_codes, w2_moe_decode_triton
    hidden, inter, experts, k = shape["hidden"], shape["inter"], shape["experts"], shape["k"]
    planes = _gpu_planes(hidden, inter, experts)
    kernel_planes = (tile_codes(planes[0]), planes[1], tile_codes(planes[2]), planes[3]) if tiled else planes
    ids, w = random_routing(n, experts, k, device="cuda", seed=n)
    if n > 1:
        ids[1] = ids[0]  # two tokens on the same experts: the L2-shared path
    x = torch.randn(n, hidden, device="cuda").to(dtype)
    ref = w2_moe_decode_reference(x.float(), ids, w, *planes, limit)  # fp32 reference on the same inputs
    tol = TOL[dtype]
    first = None
    for run in range(2):  # a second run into a re-poisoned buffer: nothing stale is left, the result is the same
        if run:     # a call on other x in between: a split's scratch then holds other sums than this call's
            w2_moe_decode_triton(-x, ids, w, *kernel_planes, limit, config=config, tiled=tiled)
        out = torch.full((n, hidden), float("nan"), device="cuda", dtype=dtype)
        y = w2_moe_decode_triton(x, ids, w, *kernel_planes, limit, out=out, config=config, tiled=tiled)
        torch.cuda.synchronize()
        assert y.data_ptr() == out.data_ptr() and y.dtype == dtype
        assert torch.isfinite(y).all(), f"{int((~torch.isfinite(y)).sum())} elements not written or not finite"
        assert rel_err(y, ref) < tol, (rel_err(y, ref), tol)
        atol = 4 * (tol if dtype == torch.float32 else 1e-2) * float(ref.abs().max())
        assert float((y.float() - ref).abs().max()) <= atol
        assert first is None or torch.equal(y, first)
        first = y.clone()
    if config is None and not tiled:  # the dispatcher takes the Triton path on CUDA
        assert torch.equal(w2_moe_decode(x, ids, w, *planes, limit), y)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("n", [1, 3, 16])
@pytest.mark.parametrize("shape", [SMALL, V4_FLASH], ids=["small", "v4flash"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_decode_matches_reference(shape: dict, n: int, dtype: torch.dtype) -> None:
    # limit 3 clamps a good share of gate/up values at these scales; the unclamped path is checked below
    _check_gpu(shape, n, dtype, limit=3.0)


@pytest.mark.parametrize("n", [1, 3, 8, 16])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_decode_on_codes_tile_by_tile_matches_reference(n: int, monkeypatch) -> None:
    """Codes stored tile by tile: each token count's kernels (on sm_90 the mma gate-up at 1 token, the FP8 gate-up
    and mma down at 3, both FP8 kernels from 8) read them right, and fp32 x's mma kernels at every count; no
    kernel fell back to another (`kernel_or_fallback`), and the FP8 ones were asked for tile order."""
    seen = _fp8_calls(monkeypatch)
    _check_gpu(V4_FLASH, n, torch.bfloat16, limit=3.0, tiled=True)
    _check_gpu(SMALL, n, torch.float32, limit=3.0, tiled=True)
    _assert_fp8_calls(seen, n, tiled=True, split=1, gate_up=n >= 2)


def _fp8_calls(monkeypatch) -> dict:
    """Record the FP8 kernels' calls (gate-up variants, down `tiled` flags) and start a fresh record of kernels
    given up for their fallbacks (`runtime._failed`): a test whose kernel fell back would test the fallback."""
    from moebox.ops.triton import runtime, w2_fp8, w2_fp8_down
    monkeypatch.setattr(runtime, "_failed", {})
    seen: dict = {"gate_up": [], "down": [], "failed": runtime._failed}
    gate_up, down = w2_fp8.gate_up, w2_fp8_down.down

    def record_gate_up(*a, **kw):
        seen["gate_up"].append(kw["variant"])
        return gate_up(*a, **kw)

    def record_down(*a, **kw):      # a[6]: k
        seen["down"].append((kw["tiled"], w2_fp8_down.split_for(a[6], False)))
        return down(*a, **kw)
    monkeypatch.setattr(w2_fp8, "gate_up", record_gate_up)
    monkeypatch.setattr(w2_fp8_down, "down", record_down)
    return seen


def _assert_fp8_calls(seen: dict, n: int, tiled: bool, split: int, gate_up: bool = True) -> None:
    """No kernel fell back; on sm_90 the FP8 gate-up ran (where `gate_up`) and the FP8 down from 8 tokens, in the
    order and split asked for."""
    from moebox.ops.triton.runtime import compute_capability
    from moebox.ops.triton.w2_fp8 import HAVE_GLUON
    assert not seen["failed"], seen["failed"]
    if not HAVE_GLUON or compute_capability(torch.device("cuda")) != (9, 0):
        return                      # the FP8 kernels are Hopper's
    assert bool(seen["gate_up"]) == gate_up and all(v.tiled == tiled and v.split == split for v in seen["gate_up"])
    assert bool(seen["down"]) == (n >= 8) and all(d == (tiled, split) for d in seen["down"]), seen


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("n", [1, 3, 8, 16])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_decode_with_the_fp8_splits_matches_reference(n: int, tiled: bool, monkeypatch) -> None:
    """MOEBOX_FP8_GATE_UP_SPLIT=1 and MOEBOX_FP8_DOWN_SPLIT=1 (on sm_90, the FP8 gate-up at every token count and
    its down from 8 tokens, each with two programs a row block, the second to finish adding the first's sums):
    within bf16 rounding, the same bits on a second call."""
    for switch in ("MOEBOX_FP8_GATE_UP_SPLIT", "MOEBOX_FP8_DOWN_SPLIT", "MOEBOX_FP8_GATE_UP"):
        monkeypatch.setenv(switch, "1")
    seen = _fp8_calls(monkeypatch)
    _check_gpu(V4_FLASH, n, torch.bfloat16, limit=3.0, tiled=tiled)
    _assert_fp8_calls(seen, n, tiled=tiled, split=2)


@pytest.mark.parametrize("config", [cfg for _, cfg in SWEEP if cfg != DEFAULT_CONFIG],
                         ids=[name for name, cfg in SWEEP if cfg != DEFAULT_CONFIG])
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_sweep_variants_match_reference(config: DecodeConfig, n: int) -> None:
    _check_gpu(V4_FLASH, n, torch.bfloat16, limit=3.0, config=config)
    _check_gpu(SMALL, n, torch.float32, limit=3.0, config=config)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fp16_no_limit_odd_shape_and_layer_views() -> None:
    from moebox.ops.triton.w2_moe import w2_moe_decode_split
    from moebox.store.plane_store import StoreShape, slot_buffers
    _check_gpu(SMALL, 4, torch.float16, limit=3.0)
    _check_gpu(SMALL, 4, torch.float32, limit=None)
    _check_gpu(ODD, 3, torch.bfloat16, limit=3.0)
    _check_gpu(ODD, 16, torch.float32, limit=None)
    hidden, inter, e, k, n = 512, 256, 6, 3, 4
    experts = _from_float_experts(e, hidden, inter, seed=3)
    shape = StoreShape(layers=1, experts=e, hidden=hidden, intermediate=inter)
    buf = torch.zeros(e, shape.stride, dtype=torch.uint8)
    for i, planes in enumerate(experts):
        raw = b"".join(bytes(p) for p in slot_buffers(planes, shape))
        buf[i, :len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    ids, w = random_routing(n, e, k, device="cuda", seed=2)
    x = torch.randn(n, hidden, device="cuda")
    ref = w2_moe_decode_reference(x, ids, w, *stack_planes(experts, device="cuda"), 10.0)
    for cfg in (DEFAULT_CONFIG, replace(DEFAULT_CONFIG, variant="fma")):
        out = torch.full((n, hidden), float("nan"), device="cuda")
        y = w2_moe_decode_split(x, ids, w, *layer_views(buf.cuda(), hidden, inter), 10.0, out=out, config=cfg)
        torch.cuda.synchronize()
        assert torch.isfinite(y).all() and rel_err(y, ref) < 1e-5, (cfg.variant, rel_err(y, ref))


@pytest.mark.parametrize("variant", ["mma", "fma"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_cuda_graph_replay(variant: str) -> None:
    """The call captures in a CUDA graph; replays follow new routing written into the static inputs."""
    from moebox.ops.triton.w2_moe import w2_moe_decode_triton
    cfg = replace(DEFAULT_CONFIG, variant=variant)
    hidden, inter, experts, k, n = SMALL["hidden"], SMALL["inter"], SMALL["experts"], SMALL["k"], 4
    planes = _gpu_planes(hidden, inter, experts)
    ids, w = random_routing(n, experts, k, device="cuda", seed=0)
    x = torch.randn(n, hidden, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(n, hidden, device="cuda", dtype=torch.bfloat16)
    w2_moe_decode_triton(x, ids, w, *planes, 3.0, out=out, config=cfg)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w2_moe_decode_triton(x, ids, w, *planes, 3.0, out=out, config=cfg)
    for seed in (1, 2):
        new_ids, new_w = random_routing(n, experts, k, device="cuda", seed=seed)
        ids.copy_(new_ids)
        w.copy_(new_w)
        x.copy_(torch.randn(n, hidden, device="cuda"))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = w2_moe_decode_reference(x.float(), ids, w, *planes, 3.0)
        assert torch.isfinite(out).all() and rel_err(out, ref) < 1e-2


@needs_triton
def test_mma_kernels_on_codes_tile_by_tile_in_triton_interpreter() -> None:
    """Codes relaid tile by tile (`tile_codes`: each 16-row block's K tiles of 16 words contiguous) and read with
    `tiled`: the mma kernels (their interpreter path) give the reference's output on the row-major planes, with
    one and several K tiles a warp and both prefetch depths; `tile_layer_codes` relays a layer buffer's codes so
    (its scales and padding unchanged), and the fma kernels refuse the layout."""
    check_in_interpreter(_INTERPRETER_SETUP + textwrap.dedent("""
        from moebox.ops.triton.w2_moe import tile_codes, tile_layer_codes

        def run_tiled(hidden, inter, e, k, n, cfg):
            planes = random_planes(e, hidden, inter, seed=11, scale_byte=(122, 128))
            tiled = (tile_codes(planes[0]), planes[1], tile_codes(planes[2]), planes[3])
            assert not torch.equal(tiled[0], planes[0]) and not torch.equal(tiled[2], planes[2])
            ids, w = random_routing(n, e, k, seed=n)
            x = torch.randn(n, hidden)
            y = w2_moe_decode_triton(x, ids, w, *tiled, 10.0, config=cfg, tiled=True)
            ref = w2_moe_decode_reference(x, ids, w, *planes, 10.0)
            results.append(dict(case=["tiled", hidden, inter, n, str(cfg)], same_buffer=True,
                                finite=bool(torch.isfinite(y).all()), rel=float((y - ref).norm() / ref.norm()),
                                ref_norm=float(ref.norm())))

        # (one K tile a row, H or I = 256, is the same bytes in either order)
        run_tiled(512, 512, 4, 2, 2, DecodeConfig())
        run_tiled(512, 512, 5, 3, 1, DecodeConfig(gate_split=1, down_split=1, prefetch=2))
        # a layer buffer: its code views relaid, everything else as it was
        hidden, inter, e = 512, 512, 3
        shape = StoreShape(layers=1, experts=e, hidden=hidden, intermediate=inter)
        buf = torch.randint(0, 256, (e, shape.stride), dtype=torch.uint8)
        before = buf.clone()
        tile_layer_codes(buf, hidden, inter)
        views, old = layer_views(buf, hidden, inter), layer_views(before, hidden, inter)
        mask = torch.ones_like(buf, dtype=torch.bool)
        for v in views[::2]:
            mask[:, v.storage_offset() % shape.stride:][:, :v[0].numel()] = False
        assert all(torch.equal(a, tile_codes(b)) for a, b in zip(views[::2], old[::2]))
        assert torch.equal(buf[mask], before[mask])
        # quantized experts in a layer buffer, relaid in place, read through its zero-copy views
        g = torch.Generator().manual_seed(1)
        experts = [tuple(from_float(torch.randn(s, generator=g) * 0.05) for s in ((inter, hidden), (inter, hidden),
                   (hidden, inter))) for _ in range(e)]
        buf = torch.zeros(e, shape.stride, dtype=torch.uint8)
        for i, planes in enumerate(experts):
            raw = b"".join(bytes(p) for p in slot_buffers(planes, shape))
            buf[i, :len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        tile_layer_codes(buf, hidden, inter)
        ids, w = random_routing(2, e, 2, seed=6)
        x = torch.randn(2, hidden)
        y = w2_moe_decode_split(x, ids, w, *layer_views(buf, hidden, inter), 10.0, tiled=True)
        ref = w2_moe_decode_reference(x, ids, w, *stack_planes(experts), 10.0)
        results.append(dict(case="tiled layer views", same_buffer=True, finite=bool(torch.isfinite(y).all()),
                            rel=float((y - ref).norm() / ref.norm()), ref_norm=float(ref.norm())))
        views = layer_views(buf, hidden, inter)
        try:
            w2_moe_decode_split(torch.randn(1, hidden), torch.tensor([[0]]), torch.ones(1, 1), *views, 10.0,
                                config=DecodeConfig(variant="fma"), tiled=True)
            raise AssertionError("the fma kernels took codes tile by tile")
        except ValueError as err:
            assert "tile by tile" in str(err), err
        print("RESULT " + json.dumps(results))
    """))
