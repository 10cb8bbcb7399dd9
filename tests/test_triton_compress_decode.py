"""The fused compressor decode step (moebox/ops/triton/compress_decode.py) against the torch `compress_step` of
moebox/model/decode_attention.py (via `compress_step_reference`, eager).

- CPU: the reference is compress_step; `supported` (each bound); the tiling choice; the dispatch falls back to
  torch off CUDA (and equals compress_step bit for bit); random_inputs' positions; the bench's argument
  parsing and bookkeeping (timer and kernel stubbed).
- The kernel in Triton's interpreter (TRITON_INTERPRET=1 is read when triton is imported: a subprocess), fp32 /
  fp16 entries: d 16, 24 (not a power of two), 32, 64; ratio 2, 3, 4, 8, 16; overlap (CSA) and not (HCA);
  finish None, "kv" (nope 24, 48, 16, all channels) and "index" (d 16 (a partial FP4 block), 32); B 1 and 3;
  positions that close a window with and without a previous window (w = 0), that close none, below the ratio,
  rings that wrap (slack rows, large positions); one tile and several (the prefetching loop, a partial last
  tile); int32 positions / slots, row-strided kv / gate, fp16 ape, bf16 norm; a speculative verify step (one
  sequence's consecutive tokens in one batch, the closing one first). Every ring row, entry row and
  slot the step must not touch is poisoned with NaN; rings, mask and untouched rows are compared bit for bit with the
  reference on copies of the same inputs, the written entry rows within fp32 rounding, and a rounded entry
  bit for bit with the torch rounding of the kernel's own unrounded entry (the FP8 / Hadamard + FP4 emulation
  is exact). The rounding helpers alone on crafted values (ties, exact powers of two, subnormals, zeros).
  The kernel built for sm_90 (no GPU needed) at the V4-Flash shapes: no spills beyond libdevice's trig
  reduction array. The tiny model decoding with `compress_decode` in place of compress_step (interpreter, QAT
  on: "kv" and "index" finishes) gives the torch path's logits.
- GPU (marker `gpu`, skipped without CUDA): the V4-Flash shapes (CSA main d 512 r 4, indexer d 128 r 4 with
  "index", HCA d 512 r 128) at B 1, 4, 16 with bf16 entries vs the fp32 reference; the dispatch on CUDA; a
  speculative verify step; a CUDA graph captured once and replayed over consecutive decode positions (windows
  closing and not).
"""

from __future__ import annotations

import importlib.util
import os
import textwrap

import pytest
import torch

from moebox.model.decode_attention import compress_step
from moebox.ops.triton import compress_decode as cd
from moebox.ops.triton.compress_decode import (CompressConfig, V4_SHAPES, clone_inputs, compress_decode,
                                               compress_step_reference, pick_config, positional, random_inputs,
                                               supported)

from tests.interpreter import check_in_interpreter

HAVE_TRITON = importlib.util.find_spec("triton") is not None


@pytest.fixture(autouse=True)
def _eager_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch path eager on CUDA too (the same math as compiled; saves a compile per shape)."""
    monkeypatch.setenv("MOEBOX_COMPILE", "0")


def tiny(b: int = 3, d: int = 32, ratio: int = 4, overlap: bool = True, rope: int = 8, finish: str | None = "kv",
         seed: int = 0, **kw) -> dict:
    kw.setdefault("table_rows", 12)
    kw.setdefault("entry_dtype", torch.float32)
    return random_inputs(b, d=d, ratio=ratio, overlap=overlap, rope_dim=rope, finish=finish, device="cpu", seed=seed,
                         **kw)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN == NaN)."""
    ints = {4: torch.int32, 2: torch.int16, 1: torch.int8}
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(ints[a.element_size()]),
                                                                      b.view(ints[b.element_size()]))


# ---------------------------------------------------------------------------------------------- CPU
def test_reference_is_compress_step_eagerly() -> None:
    os.environ.pop("MOEBOX_COMPILE")
    inp = tiny(positions=[3, 2, 11])
    a, b = clone_inputs(inp), clone_inputs(inp)
    vis = compress_step_reference(**a)
    assert "MOEBOX_COMPILE" not in os.environ                    # restored
    assert torch.equal(vis, compress_step(*positional(b)))
    for name in ("ring_kv", "ring_gate", "entries"):
        assert torch.equal(a[name], b[name])
    assert torch.equal(vis, torch.arange(12)[None, :] < torch.tensor([1, 0, 3])[:, None])


def test_dispatch_falls_back_to_torch_on_cpu() -> None:
    for finish, overlap in ((None, True), ("kv", False), ("index", True)):
        inp = tiny(finish=finish, overlap=overlap, ratio=2 if overlap else 4, positions=[1, 4, 7], seed=5)
        a, b = clone_inputs(inp), clone_inputs(inp)
        vis = compress_decode(**a)
        assert torch.equal(vis, compress_step(*positional(b)))
        for name in ("ring_kv", "ring_gate", "entries"):      # the torch path: the scratch row written too
            assert torch.equal(a[name], b[name])


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_supported(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every bound of `supported`, with the interpreter pretended on (CPU tensors count as a device)."""
    from moebox.model.cache import FP8Rows
    inp = tiny()
    assert not supported(**inp)                                     # CPU without the interpreter
    monkeypatch.setattr(cd, "interpreting", lambda: True)

    def ok(**over) -> bool:
        return supported(**{**inp, **over})

    assert ok()
    assert ok(finish=None) and ok(finish="index") and ok(nope_dim=0) and ok(nope_dim=32)
    assert ok(pos=inp["pos"].int(), slot=inp["slot"].int())
    assert ok(kv=inp["kv"].half(), gate=inp["gate"].bfloat16())           # the projections' dtype, widened
    assert not ok(kv=inp["kv"].to(torch.int32))
    assert ok(entries=inp["entries"].half()) and ok(ape=inp["ape"].half(), norm=inp["norm"].half())
    assert ok(ring_kv=inp["ring_kv"][:, :8], ring_gate=inp["ring_gate"][:, :8])     # ring rows == span
    assert ok(kv=torch.randn(3, 80)[:, :64])                                          # row-strided kv
    assert ok(ape=inp["ape"].bfloat16(), norm=inp["norm"].bfloat16())      # bf16 loads are exact there
    assert not ok(entries=inp["entries"].bfloat16())        # the interpreter truncates fp32 -> bf16 stores
    assert not ok(entries=FP8Rows(7, 12, 32, 24, "cpu"))           # FP8-layout cache rows
    assert not ok(finish="fp8") and not ok(nope_dim=33) and not ok(nope_dim=-1)
    assert not ok(ratio=0) and not ok(ratio=4.0) and not ok(ratio=True)
    assert not ok(overlap=False)                                    # C = 64 would be d = 64 != entries' 32
    assert not ok(kv=inp["kv"][:, :48], gate=inp["gate"][:, :48])
    assert not ok(kv=inp["kv"].double()) and not ok(gate=inp["gate"][:2]) and not ok(kv=torch.randn(3, 128)[:, ::2])
    assert not ok(pos=inp["pos"].float()) and not ok(slot=inp["slot"][:2]) and not ok(pos=inp["pos"][:, None])
    assert not ok(ring_kv=inp["ring_kv"][:, :7])                    # fewer rows than the span
    assert not ok(ring_gate=inp["ring_gate"].half()) and not ok(ring_kv=inp["ring_kv"][..., :32])
    assert not ok(ring_kv=inp["ring_kv"].transpose(1, 2).contiguous().transpose(1, 2))
    assert not ok(entries=inp["entries"][..., :16]) and not ok(entries=inp["entries"].double())
    assert not ok(entries=inp["entries"][:, :0])
    assert not ok(ape=inp["ape"][:3]) and not ok(ape=inp["ape"].double()) and not ok(norm=inp["norm"][:16])
    assert not ok(inv_freq=inp["inv_freq"].double()) and not ok(inv_freq=torch.ones(17))
    d17 = tiny(d=17, finish=None)                                   # d - rope dim odd: pairs misaligned
    assert not supported(**d17) and supported(**{**d17, "inv_freq": d17["inv_freq"][:0].new_ones(8)}) is False
    assert supported(**tiny(d=18, finish=None))
    assert ok(inv_freq=torch.ones(16)) and not ok(inv_freq=torch.ones(0))    # RoPE over all of d; none
    assert not ok(ape=inp["ape"].to("meta"))                        # another device
    d24 = tiny(d=24)
    assert supported(**{**d24, "finish": "kv"}) and not supported(**{**d24, "finish": "index"})   # Hadamard 2^k
    big = tiny(d=2048, b=1, table_rows=2)
    assert not supported(**big)
    assert supported(**tiny(b=1024, d=16)) and not supported(**tiny(b=1025, d=16))    # batch rows scanned
    with pytest.raises(ValueError):
        cd.compress_step_triton(**{**inp, "finish": "fp8"})


def test_pick_config() -> None:
    assert pick_config(512, 4, "kv") == CompressConfig(block_rows=4, num_warps=8)          # CSA main
    assert pick_config(128, 4, "index") == CompressConfig(block_rows=4, num_warps=4)      # indexer
    assert pick_config(512, 128, "kv") == CompressConfig(block_rows=8, num_warps=16)      # HCA
    assert pick_config(16, 3, None).block_rows == 4 and pick_config(16, 3, None).num_warps == 4
    assert pick_config(512, 128, None, CompressConfig(block_rows=6, num_warps=8)) == CompressConfig(8, 8)
    assert cd._d_pad(16, "kv") == 64 and cd._d_pad(16, "index") == 32 and cd._d_pad(24, None) == 32
    assert cd._d_pad(512, "kv") == 512 and cd._d_pad(1, None) == 16


def test_random_inputs_positions() -> None:
    for ratio in (4, 128):
        inp = random_inputs(6, d=32, ratio=ratio, overlap=False, rope_dim=8, table_rows=9, device="cpu",
                            close=[True, False] * 3, seed=ratio)
        closes = ((inp["pos"] + 1) % ratio == 0).tolist()
        assert closes == [True, False] * 3
        assert bool((inp["pos"] < (9 - 1) * ratio).all()) and bool((inp["pos"] >= 0).all())
        assert inp["slot"].tolist() == [1, 3, 5, 7, 9, 11] and inp["ring_kv"].shape == (13, ratio + 2, 32)
    inp = random_inputs(2, device="cpu", positions=[5, 9])
    assert inp["pos"].tolist() == [5, 9] and inp["kv"].shape == (2, 1024) and inp["entries"].shape == (5, 4097, 512)
    assert inp["nope_dim"] == 448 and inp["inv_freq"].shape == (32,)


def test_bench_entry_point_parses() -> None:
    args = cd._parse(["--batch", "1", "16", "--kind", "csa", "hca", "--no-torch", "--block-rows", "8"])
    assert args.batch == [1, 16] and args.kind == ["csa", "hca"] and args.no_torch and args.block_rows == 8
    assert cd._parse([]).kind == ["csa", "index", "hca"] and not cd._parse([]).sass
    with pytest.raises(SystemExit):
        cd._parse(["--kind", "sliding"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            cd.main(["--batch", "1"])


def test_bench_logic_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench's bookkeeping end to end on CPU at the V4-Flash shapes, with the CUDA-graph timer stubbed and
    the torch reference standing in for the kernel."""
    calls = []

    def timer(fns, rep=100):
        for f in fns:
            f()
        calls.append(len(fns))
        return 2.0

    def kernel(*args, out=None, config=None, **kw):
        vis = compress_step_reference(*args, **kw)
        return vis if out is None else out.copy_(vis)

    monkeypatch.setattr(cd, "graph_us", timer)
    monkeypatch.setattr(cd, "compress_step_triton", kernel)
    rows = cd.bench("cpu", batches=(1, 2), l2_miss_bytes=100_000, quiet=True)
    assert [(r["kind"], r["B"]) for r in rows] == [(k, b) for k in ("csa", "index", "hca") for b in (1, 2)]
    assert all(r["close_us"] == r["open_us"] == r["torch_us"] == 2.0 for r in rows)
    assert all(r["close_rel_err"] == 0 and r["open_rel_err"] == 0 for r in rows)
    assert rows[0]["copies"] == 2 and rows[-1]["copies"] == 1      # CSA B=1: 80 KB of rings; HCA: 532 KB
    assert len(calls) == 6 * 3 and calls[0] == 2


# ---------------------------------------------------------------------------------------------- interpreter
if HAVE_TRITON:
    import triton
    import triton.language as tl

    from moebox.ops.triton.compress_decode import _blockwise_round, _hadamard

    @triton.jit
    def _round_rows(x_ptr, o_ptr, sqrt_d, D_PAD: tl.constexpr, FP8: tl.constexpr, HAD: tl.constexpr,
                    LOG2D: tl.constexpr):
        """The kernel's rounding helpers alone on rows of D_PAD: (Hadamard then) FP8 / 64 or FP4 / 32."""
        offs = tl.program_id(0) * D_PAD + tl.arange(0, D_PAD)
        x = tl.load(x_ptr + offs)
        if HAD:
            x = _hadamard(x, sqrt_d, D_PAD, LOG2D)
        if FP8:
            o = _blockwise_round(x, D_PAD, 64, 448.0, True)
        else:
            o = _blockwise_round(x, D_PAD, 32, 6.0, False)
        tl.store(o_ptr + offs, o)

_INTERPRETER_CHECK = textwrap.dedent("""
    import json, os, sys, torch
    assert os.environ.get("TRITON_INTERPRET") == "1"
    sys.path.insert(0, sys.argv[1])
    from moebox.ops.qat import fp4_round, fp8_round, round_index_vectors, round_kv_nope
    from moebox.ops.triton.compress_decode import (CompressConfig, clone_inputs, compress_decode,
                                                   compress_step_reference, compress_step_triton, supported)
    from tests.test_triton_compress_decode import _round_rows, _same_bits, tiny
    results = []
    NAN = float("nan")

    def poison(inp):
        # NaN everywhere the step must not read or write: ring rows outside each sequence's last span
        # positions, every entry row of the used slots, all of the unused slots
        size, span = inp["ring_kv"].shape[1], (2 if inp["overlap"] else 1) * inp["ratio"]
        keep = torch.zeros(inp["ring_kv"].shape[:2], dtype=torch.bool)
        for p, s in zip(inp["pos"].tolist(), inp["slot"].tolist()):
            for q in range(max(0, p - span + 1), p + 1):
                keep[s, q % size] = True
        for name in ("ring_kv", "ring_gate"):
            inp[name][~keep] = NAN
        inp["entries"].fill_(NAN)

    def finish_of(e, inp):
        if inp["finish"] == "kv":
            return round_kv_nope(e, inp["nope_dim"])
        return round_index_vectors(e) if inp["finish"] == "index" else e

    def add(case, inp, config=None):
        args = dict(inp)
        assert supported(**args), case
        poison(args)
        got_in, ref_in = clone_inputs(args), clone_inputs(args)
        out = torch.zeros(inp["pos"].shape[0], inp["entries"].shape[1], dtype=torch.bool)
        vis = compress_step_triton(**got_in, out=out, config=config)
        vis_ref = compress_step_reference(**ref_in)
        bad = []
        if not torch.equal(vis, vis_ref):
            bad.append("mask")
        for name in ("ring_kv", "ring_gate"):
            if not _same_bits(got_in[name], ref_in[name]):
                bad.append(name)
        n, r = inp["entries"].shape[1], inp["ratio"]
        pos, slot = inp["pos"].long(), inp["slot"].long()
        closes = (pos + 1) % r == 0
        es, ew = slot[closes], ((pos + 1) // r - 1)[closes]
        untouched = torch.ones(inp["entries"].shape[:2], dtype=torch.bool)
        untouched[es, ew] = False
        untouched[slot, n - 1] = False                     # the reference's scratch rows: its garbage
        g, rf = got_in["entries"], ref_in["entries"]
        if not (_same_bits(g[untouched], rf[untouched]) and _same_bits(g[untouched], args["entries"][untouched])):
            bad.append("untouched entries")
        if not _same_bits(g[slot, n - 1], args["entries"][slot, n - 1]):
            bad.append("scratch row written")            # the kernel leaves it alone
        ge, re = g[es, ew].double(), rf[es, ew].double()
        size = args["ring_kv"].shape[1]
        rel, ref_norm = 0.0, float(re.norm()) if es.numel() else float(got_in["ring_kv"][slot, pos % size].norm())
        if es.numel():
            scale = re.abs().amax(dim=-1, keepdim=True)
            if inp["finish"] is None:
                rel = float(((ge - re).abs() / scale).max())
            else:
                # the rounding is exact: the kernel's entry = torch's rounding of the kernel's unrounded entry
                raw = clone_inputs(args)
                raw.update(finish=None, entries=raw["entries"].float())
                compress_step_triton(**raw, config=config)
                want = finish_of(raw["entries"][es, ew], inp).to(g.dtype)
                if not _same_bits(g[es, ew], want):
                    bad.append("rounding")
                # vs the reference: equal but for rare flips at a rounding midpoint (a few ulp of fp32 apart)
                flips = ((ge - re).abs() > 1e-5 * scale)
                rel = float(flips.sum()) / flips.numel() * 10       # tol 0.1: under 1% of the elements
                if flips.any() and float(((ge - re).abs() / scale)[flips].max()) > 0.34:
                    bad.append("flip larger than a grid step")
        tol = 2e-3 if inp["entries"].dtype == torch.float16 else 2e-6
        if bad:
            rel = float("inf")
        results.append(dict(case=case, bad=bad, same_buffer=vis.data_ptr() == out.data_ptr(),
                            finite=bool(torch.isfinite(g[es, ew].float()).all()), rel=rel, ref_norm=ref_norm,
                            tol=0.1 if inp["finish"] else tol))

    f16 = torch.float16
    # (case, tiny(...) kwargs, config)
    cases = [
        ("csa w0 / p<r / w2", dict(finish=None, positions=[3, 2, 11]), None),
        ("csa kv open / p0", dict(positions=[7, 9, 0], nope_dim=24), None),
        ("csa kv d64 B1 fp16", dict(b=1, d=64, rope=16, nope_dim=48, positions=[15], entry_dtype=f16), None),
        ("index d32", dict(finish="index", rope=16, positions=[3, 6, 19]), None),
        ("index d16 r2 fp16", dict(finish="index", d=16, ratio=2, positions=[1, 4, 5], entry_dtype=f16), None),
        ("hca kv r8 4 tiles", dict(d=64, ratio=8, overlap=False, rope=16, nope_dim=48, positions=[7, 12, 23]),
         CompressConfig(block_rows=2)),
        ("hca none d16 r2 fp16", dict(finish=None, d=16, ratio=2, overlap=False, positions=[1, 2, 0],
                                      entry_dtype=f16), None),
        ("csa kv d24 r3 partial tile", dict(d=24, ratio=3, nope_dim=16, positions=[2, 5, 13], ring_rows=9),
         CompressConfig(block_rows=2)),
        ("csa ring wraps", dict(positions=[107, 98, 203], ring_rows=11, table_rows=60, nope_dim=24), None),
        ("hca kv r16 4 tiles", dict(ratio=16, overlap=False, nope_dim=24, positions=[15, 31, 40]),
         CompressConfig(block_rows=4)),
        ("hca kv nope = d B1", dict(b=1, ratio=2, overlap=False, nope_dim=32, positions=[1]), None),
    ]
    for i, (case, kw, cfg) in enumerate(cases):
        add(case, tiny(seed=i, **kw), cfg)
    # int32 indices, row-strided kv / gate, fp16 ape, bf16 norm (as the checkpoint's)
    inp = tiny(seed=20, positions=[11, 14, 3], nope_dim=24)
    wide = torch.randn(3, 80)
    inp.update(pos=inp["pos"].int(), slot=inp["slot"].int(), kv=torch.randn(3, 2, 64)[:, 1], gate=wide[:, 8:72],
               ape=inp["ape"].half(), norm=inp["norm"].bfloat16())
    add("csa int32 strided kv, fp16 ape, bf16 norm", inp)
    # fp16 kv / gate rows, column slices of one wider product (as the attention's stacked projections give them)
    inp = tiny(seed=21, positions=[11, 14, 3], nope_dim=24)
    product = torch.randn(3, 160).half()
    inp.update(kv=product[:, :64], gate=product[:, 96:])
    add("csa fp16 kv / gate slices", inp)
    # a speculative verify step: several consecutive tokens of one sequence (one slot) in the batch, the
    # closing one first (the interpreter runs programs in order: its window's rows of this step are not in the
    # ring yet, as on a GPU they may not be); compress_step stores every row before pooling any
    for case, kw, slots, cfg in (
            ("csa verify rows", dict(b=4, positions=[11, 9, 10, 6], nope_dim=24), [1, 1, 1, 3], None),
            ("hca verify rows 4 tiles", dict(b=4, ratio=8, overlap=False, positions=[15, 13, 12, 14], ring_rows=11,
                                             finish="index"), [5, 5, 5, 5], CompressConfig(block_rows=2))):
        inp = tiny(seed=len(results), **kw)
        inp["slot"] = torch.tensor(slots)
        add(case, inp, cfg)
    # the dispatch takes the kernel under the interpreter: the scratch row stays untouched
    inp = tiny(seed=21, positions=[2, 3, 5])
    inp["entries"].fill_(NAN)
    before = inp["entries"].clone()
    vis = compress_decode(**clone_inputs(inp) | {"entries": inp["entries"]})
    ok = _same_bits(inp["entries"][:, -1], before[:, -1]) and not _same_bits(inp["entries"], before)
    results.append(dict(case="dispatch", same_buffer=True, finite=ok, rel=0.0, ref_norm=1.0))

    # the rounding helpers alone (`_round_rows`), on crafted values, bit for bit with torch
    g = torch.Generator().manual_seed(7)
    fp8_grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    fp8_grid = fp8_grid[torch.isfinite(fp8_grid) & (fp8_grid >= 0)].unique()
    mids = (fp8_grid[1:] + fp8_grid[:-1]) / 2                        # every tie of e4m3 (exact in fp32)
    rows = [torch.cat([torch.tensor([448.0]), mids[:63]]), torch.cat([torch.tensor([-448.0]), -mids[63:126]]),
            torch.cat([torch.tensor([448.0 * 2 ** -20]), mids[:63] * 2 ** -20]),
            torch.zeros(64), torch.full((64,), 1e-39), torch.full((64,), -0.0),
            torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 8),       # the e2m1 ties, amax 6
            torch.tensor([3.0, 0.125, 0.375, 0.625, 0.875, 1.25, 1.75, 2.5] * 8) * 2.0 ** 40,
            # amax / qmax an exact power of two, values only representable at that exponent (not one above)
            torch.cat([torch.tensor([448.0]), fp8_grid[1:64]]) * 2.0 ** -30,
            torch.tensor([6.0, 0.5, 1.5, 0.5, -1.5, 3.0, 4.0, 1.0] * 8) * 2.0 ** -50,
            # subnormal amax: the scale clamps at 2^-127 (a quotient <= 2^-127), not 2^-126
            torch.tensor([2.0 ** -130] + [2.0 ** -136] * 63), torch.tensor([-2.0 ** -131] + [2.0 ** -137] * 63)]
    rows += [torch.randn(64, generator=g) * 2.0 ** float(torch.randint(-60, 60, (1,), generator=g)) for _ in range(8)]
    x = torch.stack(rows).reshape(-1, 128).contiguous()                 # blocks of 64 / 32 inside rows of 128
    for fp8, had, want in ((True, False, fp8_round(x)), (False, False, fp4_round(x)),
                           (False, True, round_index_vectors(x))):
        o = torch.full_like(x, NAN)
        _round_rows[(x.shape[0],)](x, o, float(torch.tensor(128.0).sqrt()), D_PAD=128, FP8=fp8, HAD=had, LOG2D=7)
        same = _same_bits(o, want) or bool(((o == want) | (o.isnan() & want.isnan())).all())
        results.append(dict(case=f"round fp8={fp8} hadamard={had}", same_buffer=True, finite=same, rel=0.0,
                            ref_norm=1.0))
    print("RESULT " + json.dumps(results))
""")


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install triton; Linux only)")
def test_kernel_in_triton_interpreter() -> None:
    """Tiny shapes through the real kernel in Triton's CPU interpreter, vs compress_step on copies of the inputs."""
    check_in_interpreter(_INTERPRETER_CHECK)


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_builds_for_sm90() -> None:
    """The kernel built for sm_90 here (no GPU needed) at the V4-Flash shapes: at most libdevice's 32-byte
    trig reduction array on the stack (Payne-Hanek, for huge angles), no register spills beyond it."""
    for kind in ("csa", "index", "hca"):
        rep = cd.sass_report(kind)
        assert rep["spills"] <= 32 and rep["registers"] <= 255, rep
        assert rep["sass"].get("LDL", 0) <= 12 and rep["sass"].get("STL", 0) <= 8, rep
        assert rep["sass"].get("LDG", 0) > 0 and rep["sass"].get("STG", 0) > 0, rep
        if kind == "hca":
            assert rep["config"].num_warps == 16 and rep["registers"] <= 128, rep   # 65536 / 512 threads


_MODEL_CHECK = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, sys.argv[1])
    import torch
    torch.set_num_threads(1)
    from moebox.bench.synthetic import synthetic_weights
    from moebox.config import CSA, SLIDING, parse_config
    from moebox.model.batch import DecodeBatch, FlatBatch
    from moebox.model.deepseek_v4 import DeepseekV4
    from moebox.weights.synth import preset_config
    import moebox.model.attention as attention
    import moebox.ops.triton.compress_decode as cd
    os.environ["MOEBOX_ATTENTION_KERNEL"] = "0"          # the attention read in torch: only the compressor differs
    os.environ["MOEBOX_TOPK_KERNEL"] = "0"               # (and the top-k, which has its own check)
    cfg = parse_config(preset_config("tiny"))
    torch.manual_seed(0)
    model = DeepseekV4(cfg, synthetic_weights(cfg, "cpu", progress=False).__getitem__, qat=True,
                       dtype=torch.float32, load_mtp=False)
    ids = torch.randint(2, cfg.vocab_size, (80,), generator=torch.Generator().manual_seed(1)).tolist()
    kernel, supported, torch_step, calls = cd.compress_step_triton, cd.supported, attention.compress_step, []
    cd.compress_step_triton = lambda *a, **k: calls.append(a[13]) or kernel(*a, **k)    # counts launches
    runs = {}
    for flag in ("kernel", "torch"):
        attention.compress_step = cd.compress_decode if flag == "kernel" else torch_step
        cd.supported = supported if flag == "kernel" else (lambda *a, **k: False)
        counted = len(calls)
        cache = model.new_cache(3, 96, "cpu")
        model.forward(FlatBatch.build([(1, 0, ids[:20]), (2, 0, ids[30:33])], "cpu"), cache)
        rows = []
        for i in range(14):                      # two sequences: windows of both ratios close, most steps none
            t = torch.tensor
            batch = DecodeBatch(t([ids[20 + i], ids[33 + i]]), t([20 + i, 3 + i]), t([1, 2]))
            rows.append(model.forward(batch, cache).logits)
        runs[flag] = torch.stack(rows)
        if flag == "torch":
            assert len(calls) == counted
    got, ref = runs["kernel"], runs["torch"]
    per_step = sum(2 if k == CSA else 1 for k in cfg.attn_types if k != SLIDING)
    assert len(calls) == 14 * per_step and set(calls) == {"kv", "index"}, (len(calls), set(calls))
    rel = ((got - ref).norm() / ref.norm()).item()
    print("RESULT " + json.dumps([{"same_buffer": True, "finite": bool(got.isfinite().all()), "rel": rel,
                                   "ref_norm": ref.norm().item(), "tol": 1e-5}]))
""")


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install triton; Linux only)")
def test_the_model_decode_step_with_the_kernel_equals_the_torch_path() -> None:
    """The tiny model (CSA with its indexer, HCA; QAT finishes "kv" and "index") decoding 14 steps of two
    sequences with `compress_decode` in place of compress_step (Triton's interpreter, CPU fp32) gives the torch
    path's logits. Only the compressor differs (the attention read runs in torch in both)."""
    check_in_interpreter(_MODEL_CHECK)


# ---------------------------------------------------------------------------------------------- GPU
needs_cuda = pytest.mark.skipif(not (HAVE_TRITON and torch.cuda.is_available()), reason="needs CUDA and triton")


def _v4(kind: str, b: int, seed: int = 0, **kw) -> dict:
    kw.setdefault("close", [i % 2 == 0 for i in range(b)])
    return random_inputs(b, **V4_SHAPES[kind], device="cuda", seed=seed, **kw)


def _check_step(inp: dict, got: dict, vis: torch.Tensor) -> None:
    """After the kernel ran on `got` (a copy of `inp`): vs compress_step eagerly on fp32-entry copies of `inp`:
    mask, rings bit for bit, untouched entry rows unchanged, written rows within bf16 rounding of the fp32
    reference (a rounded entry may differ by one grid step where it sits at a rounding midpoint: rare)."""
    ref = clone_inputs(inp)
    ref["entries"] = ref["entries"].float()
    vis_ref = compress_step_reference(**ref)
    torch.cuda.synchronize()
    assert torch.equal(vis, vis_ref)
    assert _same_bits(got["ring_kv"], ref["ring_kv"]) and _same_bits(got["ring_gate"], ref["ring_gate"])
    r = inp["ratio"]
    pos, slot = inp["pos"].long(), inp["slot"].long()
    closes = (pos + 1) % r == 0
    es, ew = slot[closes], ((pos + 1) // r - 1)[closes]
    untouched = torch.ones(inp["entries"].shape[:2], dtype=torch.bool, device="cuda")
    untouched[es, ew] = False
    assert _same_bits(got["entries"][untouched], inp["entries"][untouched])    # scratch rows included
    if es.numel():
        g, want = got["entries"][es, ew].double(), ref["entries"][es, ew].double()
        assert torch.isfinite(g).all()
        scale = want.abs().amax(dim=-1, keepdim=True)
        off = (g - want).abs() > 2.0 ** -8 * want.abs() + 1e-6 * scale
        assert int(off.sum()) <= max(2, off.numel() // 1000), int(off.sum())
        assert float(((g - want).abs() / scale).max()) <= 0.34
        rel = float((g - want).norm() / want.norm())
        assert rel < 4e-3, rel


@pytest.mark.parametrize("b", [1, 4, 16])
@pytest.mark.parametrize("kind", ["csa", "index", "hca"])
@pytest.mark.gpu
@needs_cuda
def test_gpu_v4_flash_shapes(kind: str, b: int) -> None:
    inp = _v4(kind, b, seed=b)
    assert supported(**inp)
    got = clone_inputs(inp)
    vis = cd.compress_step_triton(**got)
    _check_step(inp, got, vis)
    for finish in (None, "kv"):                     # the other finishes at this shape
        alt = dict(inp, finish=finish)
        got = clone_inputs(alt)
        _check_step(alt, got, cd.compress_step_triton(**got))


@pytest.mark.gpu
@needs_cuda
def test_gpu_dispatch_takes_the_kernel() -> None:
    inp = _v4("csa", 3, seed=3, close=[False, True, False])
    got = clone_inputs(inp)
    vis = compress_decode(**got)
    _check_step(inp, got, vis)                       # the scratch rows untouched: the kernel ran
    fp8 = dict(inp, entries=object())
    assert not supported(**fp8)


@pytest.mark.parametrize("kind", ["csa", "index", "hca"])
@pytest.mark.gpu
@needs_cuda
def test_gpu_speculative_verify_rows(kind: str) -> None:
    """Consecutive tokens of one sequence in one batch (a speculative verify step), the closing one first: its
    window's rows of this step come from kv/gate, not from the ring other programs are storing them to."""
    r = V4_SHAPES[kind]["ratio"]
    inp = _v4(kind, 6, seed=50, positions=[5 * r - 1, 5 * r - 3, 5 * r - 2, 3 * r + 1, 7 * r - 1, 7 * r - 2])
    inp["slot"] = torch.tensor([1, 1, 1, 3, 5, 5], device="cuda")
    for _ in range(3):
        got = clone_inputs(inp)
        _check_step(inp, got, cd.compress_step_triton(**got))


@pytest.mark.parametrize("kind", ["csa", "index", "hca"])
@pytest.mark.gpu
@needs_cuda
def test_gpu_cuda_graph_replay_over_decode_steps(kind: str) -> None:
    """One capture, replayed for consecutive positions (windows closing and not) with new kv / gate rows each
    step, against compress_step stepped alongside."""
    from moebox.ops.cuda_graphs import capture
    r = V4_SHAPES[kind]["ratio"]
    start = [r - 3, 5 * r - 2, 9 * r + 1, 2 * r - 1]           # HCA: all within 3 steps of a window's end
    inp = _v4(kind, 4, seed=40, positions=start)
    state = clone_inputs(inp)                                    # the graph's tensors, mutated by replays
    out = torch.empty(4, inp["entries"].shape[1], dtype=torch.bool, device="cuda")
    graph, vis = capture(lambda: cd.compress_step_triton(**state, out=out))
    # the warm-up and capture ran the step once (rings/entries changed): start the comparison from here
    g = torch.Generator(device="cuda").manual_seed(41)
    for step in range(2 * min(r, 4) + 1):
        before = clone_inputs(state)
        state["pos"].copy_(torch.tensor(start, device="cuda") + step + 1)
        state["kv"].copy_(torch.randn(state["kv"].shape, generator=g, device="cuda"))
        state["gate"].copy_(torch.randn(state["gate"].shape, generator=g, device="cuda"))
        before.update(pos=state["pos"].clone(), kv=state["kv"].clone(), gate=state["gate"].clone())
        out.fill_(True)
        graph.replay()
        torch.cuda.synchronize()
        assert vis.data_ptr() == out.data_ptr()
        _check_step(before, state, out)


@pytest.mark.parametrize("kind", ["csa", "index", "hca"])
@pytest.mark.gpu
@needs_cuda
def test_gpu_the_compiled_torch_step_replays_from_a_cuda_graph(kind: str) -> None:
    """The torch path (what serves with MOEBOX_COMPRESS_KERNEL=0 or after a kernel fallback), compiled and
    captured with its QAT finish, replays the eager step. A host constant inside the compiled code (the FP4 value
    table of the index finish, once) makes the capture fail."""
    from moebox.ops.cuda_graphs import capture
    inp = _v4(kind, 4, seed=60, close=True)
    state, ref = clone_inputs(inp), clone_inputs(inp)
    graph, vis = capture(lambda: compress_step(*positional(state)))
    for name in ("ring_kv", "ring_gate", "entries"):        # undo the warm-up and capture runs, then replay once
        state[name].copy_(inp[name])
    graph.replay()
    vis_ref = compress_step_reference(**ref)
    torch.cuda.synchronize()
    assert torch.equal(vis, vis_ref)
    assert torch.equal(state["ring_kv"], ref["ring_kv"]) and torch.equal(state["ring_gate"], ref["ring_gate"])
    got, want = state["entries"].double(), ref["entries"].double()
    assert torch.isfinite(got).all() and float((got - want).norm() / want.norm()) < 4e-3


def test_a_kernel_that_fails_to_launch_is_reported_once_then_torch_serves(monkeypatch, caplog) -> None:
    """The model's kernel dispatch (`kernel_or_fallback`, used by compress_decode and attend_decode): a build or
    launch error on a CUDA device gives one warning naming the switch, and the torch path from then on; under
    the interpreter (the tests) the error propagates."""
    from moebox.ops.triton import runtime
    monkeypatch.setattr(runtime, "_failed", {})
    calls: list[str] = []

    def kernel() -> int:
        calls.append("kernel")
        raise RuntimeError("unknown launch option enable_fp_fusion")

    def torch_path() -> int:
        calls.append("torch")
        return 7

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError):
        runtime.kernel_or_fallback("test", "MOEBOX_TEST_KERNEL", kernel, torch_path)
    monkeypatch.delenv("TRITON_INTERPRET")
    calls.clear()
    with caplog.at_level("WARNING", logger="moebox"):
        results = [runtime.kernel_or_fallback("test", "MOEBOX_TEST_KERNEL", kernel, torch_path) for _ in range(3)]
    assert results == [7] * 3
    assert calls == ["kernel", "torch", "torch", "torch"]
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "enable_fp_fusion" in warning and "MOEBOX_TEST_KERNEL=0" in warning
