"""The FP8 gate-up of the routed experts on Hopper (moebox/ops/triton/w2_fp8.py).

- CPU: x's scale exponent at its edges; the torch packing holds x in the permuted K order; the packing kernel in
  Triton's interpreter (a subprocess); the reader of h's pair layout that the GPU check uses, against the mma
  gate-up in the interpreter; the Gluon kernels' sm_90 builds (Gluon has no interpreter), the gate-up's and the
  FP8 down's (moebox/ops/triton/w2_fp8_down.py): wgmmas in the loop, no CTA barrier, no spills, the registers that
  keep their occupancy.
- GPU (marker `gpu`): the packing kernel bit for bit against torch; every variant's h against the planes' fp64
  product, poisoned first; the e4m3 h and the FP8 down's output, poisoned first, against fp64 products; the decode
  path takes the kernels on sm_90 (the decode tests of test_triton_w2.py then run them at every shape they check).
"""

from __future__ import annotations

import importlib.util
import json
import textwrap

import pytest
import torch

from bench.fp8_gate_up import DOWN_FORMS
from moebox.ops.triton import w2_fp8
from tests.interpreter import run_in_interpreter

HAVE_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
needs_sm90 = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                                reason="needs an sm_90 GPU (wgmma)")


def _x(rows: int, hidden: int, seed: int = 0) -> torch.Tensor:
    """Rows of widely spread magnitudes (a heavy tail of small elements), bf16."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn((rows, hidden), generator=g) * torch.rand((rows, hidden), generator=g) ** 4).bfloat16()


def _rebuild(xq: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x from its packed terms, back in column order."""
    n, steps = xq.shape[:2]
    terms = xq.float().sum(3).reshape(n, steps, w2_fp8.STEP)[:, :, torch.argsort(w2_fp8.x_permutation())]
    return terms.reshape(n, -1) * scale[:, None]


def test_x_scale_exponent_is_the_least_that_fits_448() -> None:
    """amax <= 448 * 2^X < 2 amax, exactly at the edges (448 * 2^k itself, one ulp above, powers of two)."""
    edges = torch.tensor([448.0, 448.0 * 2 ** -20, 448.0 * 2 ** 30, 1.0, 2.0 ** -100, 3.0e38])
    above = torch.nextafter(edges, torch.full_like(edges, float("inf")))
    amax = torch.cat([edges, above, torch.rand(1000) * 10.0 ** torch.randint(-30, 30, (1000,)).float()])
    x = w2_fp8.x_scale_exponent(amax).double()
    assert (amax.double() <= 448 * 2 ** x).all() and (448 * 2 ** (x - 1) < amax.double()).all()
    assert w2_fp8.x_scale_exponent(torch.zeros(1)).item() == -126


def test_packed_terms_hold_x_in_the_permuted_order() -> None:
    """The torch packing: the permutation is one of a step's 256 columns, and the 3 e4m3 terms, put back in
    column order and scaled, give x to ~2^-12 of its largest element."""
    assert sorted(w2_fp8.x_permutation().tolist()) == list(range(w2_fp8.STEP))
    x = _x(3, 1024)
    xq, scale = w2_fp8.pack_x_reference(x)
    assert xq.shape == (3, 4, 2, 3, 128) and xq.dtype == torch.float8_e4m3fn
    err = (_rebuild(xq, scale) - x.float()).abs().amax(dim=1) / x.float().abs().amax(dim=1)
    assert float(err.max()) < 2 ** -12, err


@pytest.mark.slow
@needs_triton
def test_pack_kernel_in_the_interpreter() -> None:
    """The packing kernel: the reference's scales exactly, terms that rebuild x as closely (the interpreter's
    e4m3 rounding is not the GPU's, so the terms themselves are compared on the GPU), zeros for a row of zeros."""
    out = run_in_interpreter(textwrap.dedent("""
        import json, sys
        sys.path.insert(0, sys.argv[1])
        import torch
        from moebox.ops.triton import w2_fp8
        from tests.test_triton_w2_fp8 import _rebuild, _x
        x = _x(3, 1024)
        x[2] = 0
        xq, scale = w2_fp8.pack_x(x)
        ref_q, ref_scale = w2_fp8.pack_x_reference(x)
        err = (_rebuild(xq, scale) - x.float()).abs().amax(dim=1) / x.float().abs().amax(dim=1).clamp_min(1e-30)
        print("RESULT " + json.dumps({"scales": torch.equal(scale, ref_scale), "err": err[:2].tolist(),
                                      "zero": not xq[2].float().any().item()}))
        """))
    got = json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[7:])
    assert got["scales"] and got["zero"] and max(got["err"]) < 2 ** -12, got


@pytest.mark.slow
@needs_triton
def test_h_reader_inverts_the_pair_layout_of_the_mma_gate_up() -> None:
    """bench.fp8_gate_up.h_from_terms (how the GPU check reads the FP8 kernel's h) on the mma gate-up's h, which
    writes the same layout, in the interpreter: it gives that kernel's h against the planes' fp64 product."""
    out = run_in_interpreter(textwrap.dedent("""
        import json, sys
        sys.path.insert(0, sys.argv[1])
        import torch
        from bench.bitplane_gate_up import gate_up_reference
        from bench.fp8_gate_up import h_from_terms
        from moebox.ops.triton import w2_moe
        hidden, inter, experts, k, n = 256, 512, 4, 2, 2
        w13c, w13s = w2_moe.random_planes(experts, hidden, inter, seed=3)[:2]
        planes = w2_moe._split_w13(w13c, w13s)
        ids, rw = w2_moe.random_routing(n, experts, k, seed=3)
        x = torch.randn((n, hidden))
        xp = w2_moe._pack_x(x, w2_moe._empty_packed(x))
        hp = w2_moe._gate_up_mma(x, xp, ids.reshape(-1), rw.reshape(-1).float(), *w2_moe.gate_up_operands(*planes),
                                 10.0, k, w2_moe.DEFAULT_CONFIG)
        ref = gate_up_reference(x, ids, rw, *planes, 10.0, quantized=False).float()
        print("RESULT " + json.dumps(float((h_from_terms(hp, inter) - ref).abs().max() / ref.abs().max())))
        """))
    assert json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[7:]) < 1e-5


@pytest.mark.slow
@pytest.mark.skipif(not w2_fp8.HAVE_GLUON, reason="needs triton with Gluon")
def test_fp8_gate_up_builds_for_sm90() -> None:
    """The sm_90 build: its layout conversions are trivial (asserted while it compiles), its K loop issues 8
    native e4m3 wgmmas a K step with A from registers and no CTA barrier, nothing spills, and with Triton 3.6 (the
    GPU image's) the default and the split keep to <= 80 registers: a row's R computed before the x wait took it to
    127, a third fewer warps an SM (Triton 3.9 builds the same source with ~50% more registers either way)."""
    import triton
    for variant in (w2_fp8.DEFAULT_VARIANT, w2_fp8.ONE_TOKEN_VARIANT,
                    w2_fp8.Variant(pair=False, prefetch=2, tiled=True), w2_fp8.Variant(split=2)):
        rep = w2_fp8.sass_report(variant)
        steps = 2 if variant.pair else 1
        assert rep["loop_ops"]["QGMMA"] == 8 * steps and "BAR" not in rep["loop_ops"] and rep["spills"] == 0, rep
    for variant in (w2_fp8.DEFAULT_VARIANT, w2_fp8.Variant(split=2)):   # the split: 3 programs an SM at 1 token
        assert w2_fp8.sass_report(variant)["registers"] <= (80 if triton.__version__.startswith("3.6") else 128)


def test_gate_up_split_is_asked_for_where_two_programs_get_whole_pairs(monkeypatch) -> None:
    """MOEBOX_FP8_GATE_UP_SPLIT=1: each row block's K over two programs, pairs one ahead at every token count, where
    H gives each program whole pairs of K steps (a multiple of 1024); else, and by default, the variants as before."""
    monkeypatch.setenv("MOEBOX_FP8_GATE_UP_SPLIT", "1")
    assert w2_fp8.variant_for(1) == w2_fp8.variant_for(8) == w2_fp8.Variant(split=2)
    assert w2_fp8.variant_for(1, tiled=True) == w2_fp8.Variant(tiled=True, split=2)
    assert w2_fp8.variant_for(1, hidden=1536) == w2_fp8.ONE_TOKEN_VARIANT
    monkeypatch.delenv("MOEBOX_FP8_GATE_UP_SPLIT")
    assert (w2_fp8.variant_for(1), w2_fp8.variant_for(8)) == (w2_fp8.ONE_TOKEN_VARIANT, w2_fp8.DEFAULT_VARIANT)


@pytest.mark.slow
@pytest.mark.skipif(not w2_fp8.HAVE_GLUON, reason="needs triton with Gluon")
def test_fp8_down_and_its_gate_up_build_for_sm90() -> None:
    """The FP8 down kernel's sm_90 build: 16 native e4m3 wgmmas in its inner loop (a pair of K steps), no CTA
    barrier, no spills (Triton 3.9 spilled with the experts' loop not unrolled), and at most 128 registers (two
    programs an SM, as many as its 96 KB of h allow); with the h ring, and with each token's experts split over two
    programs, three programs an SM fit; the same holds for codes stored tile by tile; the gate-up that writes e4m3 h
    for it keeps the bf16-h build's loop and registers."""
    import triton
    from moebox.ops.triton import w2_fp8_down
    for tiled in (False, True):
        rep = w2_fp8_down.sass_report(tiled=tiled)
        assert rep["loop_ops"]["QGMMA"] == 16 and "BAR" not in rep["loop_ops"] and rep["spills"] == 0, rep
        assert rep["registers"] <= 128, rep
        # the h ring: three programs an SM fit (registers and shared memory); no CTA barrier in the pair loop with
        # Triton 3.6 (the GPU image's), where 3.9 puts one there (seen in the fifty-third session, cause not known)
        ring = w2_fp8_down.build_sm90(ring=True, tiled=tiled)
        rep = w2_fp8_down.sass_report(ring=True, tiled=tiled)
        assert rep["loop_ops"]["QGMMA"] == 16 and rep["loop_ops"].get("BAR", 0) <= (
            0 if triton.__version__.startswith("3.6") else 1), rep
        assert rep["registers"] <= w2_fp8_down.CAPPED_REGISTERS and 3 * (ring.metadata.shared + 1024) <= 228 << 10, rep
        # two programs a token, each on half of the experts: three an SM fit, no barrier in the pair loop
        split = w2_fp8_down.build_sm90(split=2, tiled=tiled)
        rep = w2_fp8_down.sass_report(split=2, tiled=tiled)
        assert rep["loop_ops"]["QGMMA"] == 16 and "BAR" not in rep["loop_ops"], rep
        assert rep["registers"] <= w2_fp8_down.CAPPED_REGISTERS and 3 * (split.metadata.shared + 1024) <= 228 << 10, rep
    rep = w2_fp8.sass_report(fp8_h=True)
    assert rep["loop_ops"]["QGMMA"] == 16 and rep["spills"] == 0, rep
    assert rep["registers"] <= (80 if triton.__version__.startswith("3.6") else 128)


@pytest.mark.skipif(not w2_fp8.HAVE_GLUON, reason="needs triton with Gluon")
def test_fp8_down_split_takes_an_even_k_and_h_staged_whole(monkeypatch) -> None:
    """Two programs a token and row block split its experts evenly and stage their h whole: MOEBOX_FP8_DOWN_SPLIT=1
    asks for them where that holds, and asking for them elsewhere is refused before any launch."""
    from moebox.ops.triton import w2_fp8_down
    monkeypatch.setenv("MOEBOX_FP8_DOWN_SPLIT", "1")
    assert [w2_fp8_down.split_for(k, ring) for k, ring in ((6, False), (3, False), (6, True))] == [2, 1, 1]
    monkeypatch.setenv("MOEBOX_FP8_DOWN_SPLIT", "0")
    assert w2_fp8_down.split_for(6, False) == 1
    z, out = torch.zeros(1), torch.empty(1, 128)
    for kw in (dict(k=3, split=2), dict(k=6, split=2, ring=True), dict(k=6, split=3)):
        with pytest.raises(ValueError, match="split"):
            w2_fp8_down.down(z, z, z, torch.zeros(1, 128, 8), z, out, **kw)


@pytest.mark.gpu
@needs_sm90
def test_gpu_pack_kernel_matches_torch_bit_for_bit() -> None:
    x = _x(5, 4096).cuda()
    x[3] = 0
    got, ref = w2_fp8.pack_x(x), w2_fp8.pack_x_reference(x)
    assert torch.equal(got[1], ref[1]) and torch.equal(got[0].view(torch.uint8), ref[0].view(torch.uint8))


@pytest.mark.gpu
@needs_sm90
def test_gpu_fp8_gate_up_matches_the_planes_product() -> None:
    """Every variant of bench/fp8_gate_up.py (h poisoned with NaN first) against the planes' fp64 product: within
    bf16 rounding and the same bits on a second call, at V4-Flash's H (16 K steps) and at an H that gives each
    program an odd count of pairs (1536: 6 steps; 3072 for the split's two programs)."""
    from bench.fp8_gate_up import VARIANTS, check, odd_pairs_hidden
    for variant in VARIANTS:
        assert check(variant) < 2e-3, variant
        assert check(variant, hidden=odd_pairs_hidden(variant)) < 2e-3, variant


_DOWN_CASES = [(shape, form) for shape in (dict(), dict(tokens=2, hidden=512, inter=1536, k=3),
                                            dict(tokens=5, hidden=512, inter=1536, k=4))
               for form in DOWN_FORMS if form[2] == 1 or shape.get("k", 6) % 2 == 0]


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("shape,form", _DOWN_CASES, ids=[f"{s}-{f}" for s, f in _DOWN_CASES])
def test_gpu_fp8_down_matches_the_planes_product(shape, form) -> None:
    """The gate-up's e4m3 h against the planes' fp64 product, and the FP8 down's output against w2's fp64 product
    with that h (both poisoned first): within bf16 rounding, the same bits on a second call. The V4-Flash shape,
    and small ones whose rows are shorter than a program's scale read and whose chunk count is not a power of two
    (k = 3: the h ring refills one slot); each form (ring, tiled, split): h staged whole and by the ring, the
    kernels on codes row-major and tile by tile (the references on the row-major ones), one program a token and
    row block or two (each on half of the experts, the second adding the first's sum)."""
    from bench.fp8_gate_up import check_down
    ring, tiled, split = form
    err_h, err_out = check_down(**shape, ring=ring, tiled=tiled, split=split)
    assert err_h < 2e-3 and err_out < 4e-3, (err_h, err_out)


@pytest.mark.gpu
@needs_sm90
def test_gpu_decode_takes_the_fp8_gate_up_for_bf16_not_fp32() -> None:
    x = torch.zeros((1, 4096), device="cuda")
    assert w2_fp8.fp8_gate_up_takes(x.bfloat16(), 4096, 2048) and not w2_fp8.fp8_gate_up_takes(x, 4096, 2048)
