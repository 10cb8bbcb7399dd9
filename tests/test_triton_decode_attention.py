"""The fused decode attention read (moebox/ops/triton/decode_attention.py) against the torch path (`attend` of
moebox/model/decode_attention.py, via `attend_reference`).

- CPU: `attend_reference` is `attend` over the gathered keys; `supported` (each bound); the tiling choice; the
  dispatch falls back to torch off CUDA; the bench's argument parsing and bookkeeping (timer and kernel
  stubbed). The kernels themselves in Triton's
  interpreter (TRITON_INTERPRET=1 is read when triton is imported, so that check runs in a subprocess), fp32
  and fp16 only (the interpreter's bf16 dot is wrong): nh 2, 4 (padded to 16) and 32 (two head groups), d 16
  and 32, R 8 and 16, E 4 and 12, k 3 and 4, B 1 and 3; window only, window + selected rows, window + all rows
  (rows None and [1, E]); sequences with every key masked; one split (the direct path), several, one tile per
  split; storage dtypes other than q's; int32 indices; -1 rows where invalid; a q with a row stride. Outputs
  poisoned with NaN, every element compared. The default tiling built for sm_90 (no GPU needed): no spills,
  tensor cores, cp.async key tiles.
- GPU (marker `gpu`, skipped without CUDA): the V4-Flash shape (nh 64, d 512, R 128 + 2, k 512 of a 4097-row
  table; HCA: all of 513 or 4097 rows; sliding: the window alone) at B 1, 4, 16 in bf16, outputs and the
  caching allocator poisoned with NaN, vs the fp32 reference (bf16 tolerance) and the bf16 torch path;
  other dtypes; forced tilings; determinism; a CUDA-graph replay.
"""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

from moebox.model.decode_attention import attend
from moebox.ops.attention import matmul_tf32
from moebox.ops.triton import decode_attention as da
from moebox.ops.triton.decode_attention import (AttendConfig, attend_decode, attend_reference, pick_config,
                                                random_inputs, resolve_config, supported)

from tests.interpreter import check_in_interpreter
from tests.poison import poison_allocator

HAVE_TRITON = importlib.util.find_spec("triton") is not None


@pytest.fixture(autouse=True)
def _eager_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch path eager on CUDA too (the same math as compiled; saves a compile per shape and dtype)."""
    monkeypatch.setenv("MOEBOX_COMPILE", "0")


def tiny(kind: str, b: int = 3, nh: int = 4, d: int = 32, r: int = 16, e: int = 12, k: int = 4,
         dtype: torch.dtype = torch.float32, seed: int = 0, **kw) -> dict:
    return random_inputs(b, nh=nh, d=d, ring_rows=r, window=max(1, r - 2), table_rows=e, k=k, kind=kind,
                         dtype=dtype, device="cpu", seed=seed, **kw)


# ---------------------------------------------------------------------------------------------- CPU
@pytest.mark.parametrize("kind", ["sliding", "csa", "hca"])
def test_reference_is_attend_over_the_gathered_keys(kind: str) -> None:
    inp = tiny(kind, masked=(1,))
    ref = attend_reference(**inp)
    keys = inp["ring"][inp["slot"]]
    vis = inp["window_visible"]
    if kind != "sliding":
        rows = inp["rows"] if inp["rows"] is not None else torch.arange(inp["valid"].shape[1])[None, :]
        ent = inp["entries"][inp["slot"][:, None], rows.expand(len(inp["slot"]), -1)]
        keys, vis = torch.cat([keys, ent], dim=1), torch.cat([vis, inp["valid"]], dim=1)
    s = torch.einsum("bhd,bkd->bhk", inp["q"].double(), keys.double()) * inp["scale"]
    s = s.masked_fill(~vis[:, None, :], float("-inf"))
    p = torch.exp(s - torch.maximum(s.amax(-1), inp["sink"].double()[None, :]).unsqueeze(-1))
    den = p.sum(-1) + torch.exp(inp["sink"].double()[None, :] - torch.maximum(s.amax(-1), inp["sink"].double()))
    want = torch.einsum("bhk,bkd->bhd", p, keys.double()) / den.unsqueeze(-1)
    assert torch.allclose(ref.double(), want, atol=1e-6, rtol=1e-5)
    assert torch.equal(ref[1], torch.zeros_like(ref[1]))          # every key masked: the sink alone -> 0
    if kind == "hca":   # rows None is all rows
        rows = torch.arange(inp["valid"].shape[1])[None, :]
        assert torch.equal(ref, attend_reference(**{**inp, "rows": rows}))
        assert torch.equal(ref, attend(inp["q"], inp["ring"][inp["slot"]], inp["window_visible"], inp["sink"],
                                       inp["scale"], inp["entries"], inp["slot"], rows, inp["valid"]))


def test_dispatch_falls_back_to_torch_on_cpu() -> None:
    for kind in ("sliding", "csa", "hca"):
        inp = tiny(kind, seed=3)
        assert torch.equal(attend_decode(**inp), attend_reference(**inp))


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_supported(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every bound of `supported`, with the interpreter pretended on (CPU tensors count as a device)."""
    from moebox.model.cache import FP8Rows
    inp = tiny("csa")
    assert not supported(**{n: v for n, v in inp.items() if n != "scale"})     # CPU without the interpreter
    monkeypatch.setattr(da, "interpreting", lambda: True)

    def ok(**over) -> bool:
        args = {**{n: v for n, v in inp.items() if n != "scale"}, **over}
        return supported(**args)

    assert ok()
    assert ok(rows=inp["rows"][:1]) and ok(rows=inp["rows"].int(), slot=inp["slot"].int())
    assert ok(entries=inp["entries"].half()) and ok(ring=inp["ring"].half(), q=inp["q"].half())
    assert ok(entries=None, rows=None, valid=None)                              # window only
    assert not ok(entries=None)                                                 # rows without a table
    hca = tiny("hca")
    assert supported(**{n: v for n, v in hca.items() if n != "scale"})
    assert not ok(rows=None)                                                    # all rows: k must be E (12 != 4)
    assert not ok(q=inp["q"].bfloat16())                                        # interpreter: no bf16 dot
    assert not ok(q=inp["q"].double()) and not ok(ring=inp["ring"].double())
    q24 = torch.randn(3, 4, 24)
    assert not ok(q=q24)                                                        # d % 16
    assert not ok(q=torch.randn(3, 4, 2048), ring=torch.randn(7, 16, 2048), entries=torch.randn(7, 12, 2048))
    assert not ok(ring=FP8Rows(7, 16, 32, 16, "cpu"))                           # FP8-layout cache rows
    assert not ok(ring=inp["ring"][:, :, :16])                                  # d mismatch
    assert not ok(ring=inp["ring"].transpose(1, 2).contiguous().transpose(1, 2))  # d not unit stride
    assert not ok(window_visible=inp["window_visible"].int())
    assert not ok(window_visible=inp["window_visible"][:, :8])
    assert not ok(valid=inp["valid"].int()) and not ok(valid=inp["valid"][:2])
    assert not ok(rows=inp["rows"][:, :3]) and not ok(rows=inp["rows"].float()) and not ok(rows=inp["rows"][:2])
    assert not ok(slot=inp["slot"].float()) and not ok(slot=inp["slot"][:2])
    assert not ok(sink=inp["sink"][:3])
    with pytest.raises(ValueError):
        da.attend_triton(**{**inp, "q": q24})


def test_resolve_config() -> None:
    # V4-Flash CSA: 130 window rows + 512 rows = 5 + 16 tiles of 32
    for b in (1, 4, 16):
        cfg = resolve_config(AttendConfig(), b, 64, 21, sms=132)
        per = -(-21 // cfg.split)
        assert cfg.heads == 16 and 1 <= cfg.split <= 21 // 2 + 1 and -(-21 // per) == cfg.split
        assert b * 4 * cfg.split <= 2 * 132
    assert resolve_config(AttendConfig(), 1, 64, 21).split == 11                # min_tiles 2
    assert resolve_config(AttendConfig(), 4, 64, 21).split == 7                 # ~132 programs
    assert resolve_config(AttendConfig(), 16, 64, 21).split == 3
    assert resolve_config(AttendConfig(heads=0), 1, 64, 21).heads == 64
    assert resolve_config(AttendConfig(heads=0), 1, 4, 3).heads == 16           # padded to the MMA's M
    assert resolve_config(AttendConfig(heads=64), 1, 20, 3).heads == 32
    assert resolve_config(AttendConfig(split=1000), 1, 64, 21).split == 21
    assert resolve_config(AttendConfig(split=0), 1, 64, 1).split == 1
    # decode batches take 2 pipeline stages (the H200 sweep's pick), prefill's token-batches keep 3
    assert [pick_config(b, 64, 21).num_stages for b in (1, 16, 17, 2048)] == [2, 2, 3, 3]


def test_batch_1_splits_of_one_tile_and_the_min_tiles_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batch 1 takes splits of one tile (a CSA call's 21 tiles: 21 splits; the H200 measured it faster at 4K),
    batch 16 of two; MOEBOX_ATTEND_MIN_TILES=n sets the least tiles a split; a bad value names the variable."""
    assert pick_config(1, 64, 21).split == 21 and pick_config(16, 64, 21).split == 3
    monkeypatch.setenv("MOEBOX_ATTEND_MIN_TILES", "2")
    assert pick_config(1, 64, 21).split == 11
    monkeypatch.setenv("MOEBOX_ATTEND_MIN_TILES", "0")
    with pytest.raises(ValueError, match="MOEBOX_ATTEND_MIN_TILES"):
        da.default_config(1)


def test_the_inverse_rope_goes_in_the_combine_at_batch_1_and_from_4() -> None:
    """The measured policy (`rope_in_combine`): batch 2 lost with the rotation in the combine, 1 and 4-16 did
    not."""
    assert [da.rope_in_combine(b) for b in (1, 2, 3, 4, 8, 16)] == [True, False, False, True, True, True]


def test_bench_entry_point_parses() -> None:
    args = da._parse(["--batch", "1", "16", "--kind", "csa", "hca", "--no-torch"])
    assert args.batch == [1, 16] and args.kind == ["csa", "hca"] and args.no_torch and not args.sweep
    assert da._parse([]).batch == [1, 4, 16]
    with pytest.raises(SystemExit):
        da._parse(["--kind", "mla"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            da.main(["--batch", "1"])
    inp = random_inputs(2, device="cpu", table_rows=600)
    assert da.key_bytes(inp) == 2 * (130 + 512) * 512 * 2


def test_bench_logic_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench's bookkeeping end to end on CPU, with the CUDA-graph timer and the kernel stubbed (the torch
    path stands in for both): inputs, copies, key bytes, rows of the table."""
    calls = []

    def timer(fns, rep=100):
        for f in fns:
            f()
        calls.append(len(fns))
        return 2.0

    def kernel(q, ring, slot, window_visible, sink, scale, entries=None, rows=None, valid=None, *, out, config):
        return out.copy_(attend_reference(q, ring, slot, window_visible, sink, scale, entries, rows, valid))

    monkeypatch.setattr(da, "graph_us", timer)
    monkeypatch.setattr(da, "attend_triton", kernel)
    rows = da.bench("cpu", batches=(1, 2), l2_miss_bytes=2 << 20, quiet=True,
                    configs=(("default", AttendConfig()), ("h32", AttendConfig(heads=32))))
    assert [(r["kind"], r["B"], r["config"]) for r in rows][:4] == [("csa", 1, "default"), ("csa", 1, "h32"),
                                                                   ("csa", 2, "default"), ("csa", 2, "h32")]
    assert len(rows) == 12 and all(r["rel_err"] == 0 and r["us"] == 2.0 for r in rows)
    csa1 = rows[0]
    assert csa1["key_bytes"] == (130 + 512) * 512 * 2 and csa1["copies"] == -(-(2 << 20) // csa1["key_bytes"])
    assert rows[-1]["key_bytes"] == 2 * 130 * 512 * 2                    # sliding, B = 2
    assert calls[0] == csa1["copies"] and len(calls) == 18               # torch + 2 configs per (kind, B)


_INTERPRETER_CHECK = textwrap.dedent("""
    import json, os, sys, torch
    assert os.environ.get("TRITON_INTERPRET") == "1"
    sys.path.insert(0, sys.argv[1])
    from moebox.ops.triton.decode_attention import AttendConfig, attend_reference, attend_triton, supported
    from tests.test_triton_decode_attention import tiny
    results = []

    def add(case, inp, cfg, tol, masked=()):
        args = {n: v for n, v in inp.items()}
        assert supported(**{n: v for n, v in args.items() if n != "scale"}), case
        out = torch.full_like(inp["q"], float("nan"))
        got = attend_triton(**args, out=out, config=cfg)
        ref = attend_reference(**args)
        # every element: |got - ref| <= tol (|ref| + 1e-2 max|ref| of its head)
        g, r = got.double(), ref.double()
        floor = 1e-2 * r.abs().amax(dim=-1, keepdim=True) + 1e-30
        rel = float(((g - r).abs() / (r.abs() + floor)).max())
        for i in masked:   # every key masked: exactly 0, as the reference
            if not (bool(got[i].eq(0).all()) and bool(ref[i].eq(0).all())):
                rel = float("inf")
        results.append(dict(case=f"{case} {cfg}", same_buffer=got.data_ptr() == out.data_ptr(),
                            finite=bool(torch.isfinite(got).all()), rel=rel, ref_norm=float(r.norm()), tol=tol))

    f32, f16 = torch.float32, torch.float16
    tol = {f32: 1e-4, f16: 2e-3}
    one, two, auto = AttendConfig(block_k=16, split=1), AttendConfig(block_k=16, split=2), AttendConfig(block_k=16)
    # (kind, B, nh, d, R, E, k, dtype, config, masked)
    cases = [("sliding", 1, 2, 16, 8, 4, 3, f32, one, ()),
             ("sliding", 3, 4, 32, 16, 4, 3, f16, auto, (1,)),
             ("csa", 3, 4, 32, 16, 12, 4, f32, two, (2,)),
             ("csa", 1, 2, 16, 8, 12, 3, f16, one, ()),
             ("csa", 3, 2, 32, 8, 4, 3, f32, auto, (0,)),
             ("csa", 3, 4, 16, 16, 12, 4, f16, two, (1,)),
             ("hca", 3, 4, 32, 16, 12, 0, f32, auto, (1,)),
             ("hca", 1, 4, 16, 8, 4, 0, f16, one, ()),
             ("hca", 3, 2, 16, 16, 4, 0, f32, two, (0, 2)),
             ("csa", 3, 4, 32, 16, 12, 4, f32, AttendConfig(block_k=16, split=1, num_warps=2), (1,)),
             ("hca", 3, 4, 32, 16, 12, 0, f16, AttendConfig(block_k=32), (2,)),
             # the combine's splits unrolled (3 splits in 4 slots: one masked) and looped over, fp32 and fp16
             ("csa", 3, 4, 32, 16, 12, 4, f32, AttendConfig(block_k=8, split=3, combine_unroll=4), (1,)),
             ("hca", 3, 4, 32, 16, 12, 0, f16, AttendConfig(block_k=8, split=3, combine_heads=2, combine_block_d=16,
                                                          combine_unroll=4), (0,))]
    for i, (kind, b, nh, d, r, e, k, dt, cfg, masked) in enumerate(cases):
        inp = tiny(kind, b, nh, d, r, e, k, dt, seed=i, masked=masked, fill=0.5 if i % 2 else 1.0)
        add(f"{kind} B={b} nh={nh} d={d} R={r} E={e} k={k} {dt}", inp, cfg, tol[dt], masked)

    # two head groups (nh 32, 16 heads a program), one tile per split
    inp = tiny("csa", 3, 32, 16, 16, 12, 4, f32, seed=20, masked=(1,))
    add("csa nh=32 two head groups", inp, AttendConfig(heads=16, block_k=16, split=3), 1e-4, (1,))
    # HCA through rows [1, E] (the expanded arange the model passes today), int32 indices
    inp = tiny("hca", 3, 4, 32, 16, 12, 0, f32, seed=21, masked=(0,))
    inp.update(rows=torch.arange(12, dtype=torch.int32)[None, :], slot=inp["slot"].int())
    add("hca rows [1, E] int32", inp, AttendConfig(block_k=16, split=2), 1e-4, (0,))
    # storage dtypes other than q's: keys rounded to q's dtype first, as the reference does
    inp = tiny("csa", 3, 4, 32, 16, 12, 4, f32, seed=22)
    inp.update(q=inp["q"].half(), ring=inp["ring"], entries=inp["entries"])
    add("csa fp32 storage, fp16 q", inp, AttendConfig(block_k=16, split=2), 2e-3)
    inp = tiny("hca", 3, 4, 32, 16, 12, 0, f16, seed=23)
    inp.update(q=inp["q"].float(), ring=inp["ring"].float())
    add("hca fp32 ring + fp16 table, fp32 q", inp, AttendConfig(block_k=16), 1e-4)
    # invalid rows padded with -1 (as prefill pads the top-k): never read
    inp = tiny("csa", 3, 4, 32, 16, 12, 4, f32, seed=25, masked=(1,))
    inp["rows"][~inp["valid"]] = -1
    assert bool((inp["rows"] == -1).any())
    add("csa rows -1 where invalid", inp, AttendConfig(block_k=16, split=2), 1e-4, (1,))
    # q with a row stride (every other head of a wider q), a sink in fp16
    inp = tiny("csa", 3, 4, 32, 16, 12, 4, f32, seed=24, masked=(2,))
    wide = torch.randn(3, 8, 32) * 1.5
    inp.update(q=wide[:, ::2], sink=inp["sink"].half())
    add("csa strided q", inp, AttendConfig(block_k=16, split=2), 1e-4, (2,))
    # the inverse RoPE of the output in the combine's store (split 2; the rope columns in one or two column
    # blocks) and, with one split, by apply_rope after the kernel: against apply_rope of the torch path
    from moebox.ops.rope import apply_rope, rope_inv_freq
    for i, (rd, cfg) in enumerate(((16, AttendConfig(block_k=16, split=2)),
                                   (24, AttendConfig(block_k=16, split=2, combine_block_d=16)),
                                   (24, AttendConfig(block_k=16, split=2, combine_block_d=16, combine_unroll=2)),
                                   (16, AttendConfig(block_k=16, split=1)))):
        inp = tiny("csa", 3, 4, 32, 16, 12, 4, f32, seed=30 + i, masked=(1,))
        rope = (torch.tensor([5, 4093, 70000]), rope_inv_freq(rd, 10000.0, None))
        out = torch.full_like(inp["q"], float("nan"))
        got = attend_triton(**inp, out=out, config=cfg, rope=rope)
        ref = apply_rope(attend_reference(**inp), *rope, inverse=True)
        results.append(dict(case=f"inverse rope rd={rd} {cfg}", same_buffer=got.data_ptr() == out.data_ptr(),
                            finite=bool(torch.isfinite(got).all()),
                            rel=float((got - ref).abs().max() / ref.abs().max()), ref_norm=float(ref.norm()),
                            tol=1e-5))
    # q as the raw product, normed and rotated by the kernel (`query`) against the reference of norm_rope(q):
    # one and two splits, a strided q, a head padded in registers (d 48 -> 64), fp16
    from moebox.ops.rope import norm_rope
    for i, (d, rd, dt, cfg) in enumerate(((32, 16, f32, AttendConfig(block_k=16, split=2)),
                                          (32, 32, f32, AttendConfig(block_k=16, split=1)),
                                          (48, 8, f32, AttendConfig(block_k=16, split=2)),
                                          (32, 16, f16, AttendConfig(block_k=16)))):
        inp = tiny("csa", 3, 4, d, 16, 12, 4, dt, seed=40 + i, masked=(1,))
        if i == 0:
            inp["q"] = (torch.randn(3, 8, d) * 1.5)[:, ::2]
        pos, inv = torch.tensor([5, 4093, 70000]), rope_inv_freq(rd, 10000.0, None)
        out = torch.full_like(inp["q"], float("nan"))
        got = attend_triton(**inp, out=out, config=cfg, query=(pos, inv, 1e-6))
        ref = attend_reference(**dict(inp, q=norm_rope(inp["q"], None, 1e-6, pos, inv)))
        results.append(dict(case=f"query d={d} rd={rd} {dt} {cfg}", same_buffer=got.data_ptr() == out.data_ptr(),
                            finite=bool(torch.isfinite(got).all()),
                            rel=float((got - ref).abs().max() / ref.abs().max()), ref_norm=float(ref.norm()),
                            tol=tol[dt]))
    print("RESULT " + json.dumps(results))
""")


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install triton; Linux only)")
def test_kernels_in_triton_interpreter() -> None:
    """Tiny shapes through the real kernels in Triton's CPU interpreter, vs the torch path."""
    check_in_interpreter(_INTERPRETER_CHECK)


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_default_tiling_builds_for_sm90() -> None:
    """Build the main kernel for sm_90 here (no GPU needed) at the V4-Flash shape: no spills, tensor-core dots,
    and the key tiles pipelined with cp.async (which needs the masks loaded one tile ahead)."""
    from moebox.ops.triton.decode_attention import sass_report
    for kind in ("csa", "hca", "sliding"):
        rep = sass_report(kind=kind)
        assert rep["spills"] == 0 and "LDL" not in rep["sass"] and "STL" not in rep["sass"], rep
        assert rep["sass"].get("HMMA", 0) + rep["sass"].get("HGMMA", 0) > 0, rep
        assert rep["sass"].get("LDGSTS", 0) > 0 and rep["ptx_cp_async"] > 0, rep
        assert rep["ptx_ld_v4"] > 0, rep           # q in 16-byte loads
    # batch 1's tiling with the raw queries normed and rotated in the kernel: still 16-byte q loads, the same
    # registers give or take one; its only stack is libdevice's cos/sin slow path (huge angles)
    from moebox.ops.triton.decode_attention import DECODE_CONFIG_1
    for kind in ("csa", "hca4k"):
        plain, raw = (sass_report(DECODE_CONFIG_1, batch=1, kind=kind, query_rd=rd) for rd in (0, 64))
        assert raw["ptx_ld_v4"] >= plain["ptx_ld_v4"] > 0 and "LDG.E.U16" not in set(raw["sass"]) - set(plain["sass"])
        assert raw["registers"] <= plain["registers"] + 1 and raw["spills"] <= 32, (plain, raw)


# ---------------------------------------------------------------------------------------------- GPU
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
V4 = dict(nh=64, d=512, ring_rows=130, window=128)
V4_KINDS = {"csa": dict(kind="csa", table_rows=4097, k=512), "hca": dict(kind="hca", table_rows=513),
            "hca4097": dict(kind="hca", table_rows=4097), "sliding": dict(kind="sliding", table_rows=1)}


def _v4(kind: str, b: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0, **kw) -> dict:
    masked = (b - 2,) if b > 2 else ()
    return random_inputs(b, **V4, **V4_KINDS[kind], dtype=dtype, device="cuda", seed=seed, masked=masked, **kw)


def _fp32_reference(inp: dict) -> torch.Tensor:
    """The reference's math with keys rounded to q's dtype and everything after in fp32 (no final rounding)."""
    kd = inp["q"].dtype
    args = dict(inp, q=inp["q"].float(), ring=inp["ring"].to(kd), sink=inp["sink"].float())
    if inp.get("entries") is not None:
        args["entries"] = inp["entries"].to(kd)
    with matmul_tf32(False):
        return attend_reference(**args)


def _check(inp: dict, config: AttendConfig | None = None) -> torch.Tensor:
    """attend_triton into a NaN-poisoned output vs the fp32 reference: finite, every element within one
    rounding of q's dtype (plus 1e-4, fp32: 1e-5, of its head's largest), rel L2 error within the dtype's
    tolerance; fully masked sequences exactly 0; close to the torch path in q's dtype."""
    from moebox.ops.triton.decode_attention import attend_triton
    ref = _fp32_reference(inp)
    out = torch.full_like(inp["q"], float("nan"))
    poison_allocator()
    got = attend_triton(**inp, out=out, config=config)
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr() and torch.isfinite(got).all()
    dt = inp["q"].dtype
    half_ulp = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}[dt]   # relative
    slack = {torch.bfloat16: 1e-4, torch.float16: 1e-4, torch.float32: 1e-5}[dt]
    d = (got.double() - ref.double()).abs()
    bound = half_ulp * ref.double().abs() + slack * ref.double().abs().amax(dim=-1, keepdim=True) + 1e-30
    assert bool((d <= bound).all()), float((d / bound).max())
    tol = {torch.bfloat16: 4e-3, torch.float16: 5e-4, torch.float32: 1e-5}[dt]
    rel = float((got.double() - ref.double()).norm() / ref.double().norm())
    assert rel < tol, rel
    dead = ~inp["window_visible"].any(dim=1)
    if inp.get("valid") is not None:
        dead &= ~inp["valid"].any(dim=1)
    assert bool(got[dead].eq(0).all())
    torch_path = attend_reference(**inp)        # rounded to q's dtype too: within one rounding of each other
    assert float((got.double() - torch_path.double()).norm() / torch_path.double().norm()) < tol
    return got


@pytest.mark.parametrize("b", [1, 4, 16])
@pytest.mark.parametrize("kind", ["csa", "hca", "sliding"])
@pytest.mark.gpu
@needs_cuda
def test_gpu_v4_flash_shape(kind: str, b: int) -> None:
    _check(_v4(kind, b, seed=b))


@pytest.mark.parametrize("hold", ["0", "1"])
@pytest.mark.parametrize("b", [1, 8, 16])
@pytest.mark.gpu
@needs_cuda
def test_gpu_inverse_rope_in_the_combine(b: int, hold: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """MOEBOX_ATTENTION_ROPE's path at the V4-Flash shape (CSA, bf16, positions up to 64K): the kernel with
    `rope` against apply_rope(inverse) of the fp32 reference, within one bf16 rounding; with the combine's
    PDL trigger at its start and held to its end (MOEBOX_COMBINE_HOLD)."""
    from moebox.ops.rope import apply_rope, rope_inv_freq
    from moebox.ops.triton.decode_attention import attend_triton
    monkeypatch.setenv("MOEBOX_COMBINE_HOLD", hold)
    inp = _v4("csa", b, seed=40 + b)
    rope = (torch.randint(0, 65536, (b,), device="cuda"), rope_inv_freq(64, 10000.0, None).cuda())
    out = torch.full_like(inp["q"], float("nan"))
    got = attend_triton(**inp, out=out, rope=rope)
    ref = apply_rope(_fp32_reference(inp), *rope, inverse=True)
    assert torch.isfinite(got).all()
    assert float((got.double() - ref.double()).norm() / ref.double().norm()) < 4e-3


@pytest.mark.parametrize("b", [1, 4])
@pytest.mark.parametrize("kind", ["csa", "hca"])
@pytest.mark.gpu
@needs_cuda
def test_gpu_raw_queries_normed_and_rotated_in_the_kernel(kind: str, b: int) -> None:
    """`query`: the raw query product (bf16, not unit RMS) normed and rotated in the kernel, positions up to 64K,
    against the fp32 reference of norm_rope(q) (query_rope's bf16 q), within one bf16 rounding; CSA's read before
    the PDL wait (`query_early`)."""
    from moebox.ops.rope import norm_rope, rope_inv_freq
    from moebox.ops.triton.decode_attention import attend_triton
    inp = _v4(kind, b, seed=50 + b)
    raw = (inp["q"].float() * 3.0 + 0.5).to(inp["q"].dtype)
    pos, inv = torch.randint(0, 65536, (b,), device="cuda"), rope_inv_freq(64, 10000.0, None).cuda()
    out = torch.full_like(raw, float("nan"))
    poison_allocator()
    got = attend_triton(**dict(inp, q=raw), out=out, query=(pos, inv, 1e-6), query_early=kind == "csa")
    ref = _fp32_reference(dict(inp, q=norm_rope(raw, None, 1e-6, pos, inv)))
    assert got.data_ptr() == out.data_ptr() and torch.isfinite(got).all()
    assert float((got.double() - ref.double()).norm() / ref.double().norm()) < 4e-3


@pytest.mark.gpu
@needs_cuda
def test_gpu_v4_hca_large_table_and_expanded_rows() -> None:
    inp = _v4("hca4097", 4, seed=5)
    got = _check(inp)
    rows = torch.arange(4097, device="cuda")[None, :]
    assert torch.equal(got, _check(dict(inp, rows=rows)))         # [1, E] arange = rows None, bit for bit


@pytest.mark.parametrize("case", ["fp16", "fp32 storage bf16 q", "fp32", "bf16 ring fp32 table"])
@pytest.mark.gpu
@needs_cuda
def test_gpu_dtypes(case: str) -> None:
    if case == "fp16":
        inp = _v4("csa", 4, torch.float16, seed=11)
    elif case == "fp32 storage bf16 q":
        inp = _v4("csa", 4, torch.float32, seed=12)
        inp["q"] = inp["q"].bfloat16()
    elif case == "fp32":
        inp = _v4("hca", 3, torch.float32, seed=13)
    else:
        inp = _v4("csa", 3, torch.bfloat16, seed=14)
        inp["entries"] = inp["entries"].float()
    _check(inp)


@pytest.mark.parametrize("config", [AttendConfig(split=1), AttendConfig(split=21), AttendConfig(heads=64, num_warps=8),
                                    AttendConfig(heads=32, block_k=64), AttendConfig(block_k=16, num_stages=3),
                                    AttendConfig(heads=16, block_k=64, split=5, combine_heads=64,
                                                 combine_block_d=512),
                                    AttendConfig(split=11, combine_heads=8, combine_block_d=64, combine_unroll=16)],
                         ids=lambda c: f"h{c.heads}k{c.block_k}s{c.split}w{c.num_warps}")
@pytest.mark.gpu
@needs_cuda
def test_gpu_forced_tilings(config: AttendConfig) -> None:
    for b in (1, 5):
        _check(_v4("csa", b, seed=20 + b), config)
    _check(random_inputs(3, nh=20, d=80 * 2, ring_rows=37, window=30, table_rows=50, k=19, kind="csa",
                         device="cuda", seed=7, masked=(1,)), config)     # nh 20, d 160: padded


@pytest.mark.gpu
@needs_cuda
def test_gpu_deterministic_and_cuda_graph_replay() -> None:
    from moebox.ops.cuda_graphs import capture
    from moebox.ops.triton.decode_attention import attend_triton
    inp = _v4("csa", 4, seed=30)
    first = attend_triton(**inp).clone()
    for _ in range(3):
        assert torch.equal(attend_triton(**inp), first)
    graph, out = capture(lambda: attend_triton(**inp))
    for seed in (31, 32):
        new = _v4("csa", 4, seed=seed)
        for name in ("q", "ring", "entries", "rows", "valid", "window_visible", "sink"):
            inp[name].copy_(new[name])
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = _fp32_reference(inp)
        assert torch.isfinite(out).all()
        assert float((out.double() - ref.double()).norm() / ref.double().norm()) < 4e-3


_MODEL_CHECK = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, sys.argv[1])
    from tests.interpreter import tiny_decode_logits, tiny_model
    cfg, model = tiny_model()
    import moebox.ops.triton.decode_attention as da
    real = da.attend_triton
    kernel_calls = []           # the kernel's launches: with the inverse RoPE or not, the raw queries or not
    da.attend_triton = lambda *a, **kw: kernel_calls.append(
        (kw.get("rope") is not None, kw.get("query") is not None)) or real(*a, **kw)
    os.environ["MOEBOX_PREFILL_ATTENTION_KERNEL"] = "0"   # count the decode steps' launches only
    os.environ["MOEBOX_TOPK_KERNEL"] = "0"               # only the attention read differs (top-k: its own check)
    runs = {}
    # two sequences, past entries of both ratios: the kernel (by default the raw queries of CSA layers normed and
    # rotated in it and in the indexer's score kernel, the others' by query_rope first), the kernel with the
    # inverse RoPE in its combine (MOEBOX_ATTENTION_ROPE=1) and every layer's raw queries in it
    # (MOEBOX_QUERY_IN_ATTENTION=1), the torch path
    for flag, rope, raw in (("1", "0", "csa"), ("1", "1", "1"), ("0", "0", "csa")):
        os.environ.update(MOEBOX_ATTENTION_KERNEL=flag, MOEBOX_ATTENTION_ROPE=rope, MOEBOX_QUERY_IN_ATTENTION=raw)
        runs[flag + rope + raw] = tiny_decode_logits(model, cfg, 14, cache_len=96)
    assert {"csa", "hca"} <= set(cfg.attn_types), cfg.attn_types
    assert kernel_calls == ([(False, kind == "csa") for kind in cfg.attn_types] * 14
                            + [(True, True)] * (14 * cfg.num_layers)), kernel_calls
    ref = runs["00csa"]
    print("RESULT " + json.dumps([{"case": run, "same_buffer": True, "finite": bool(got.isfinite().all()),
                                   "rel": ((got - ref).norm() / ref.norm()).item(), "ref_norm": ref.norm().item(),
                                   "tol": 1e-5} for run, got in runs.items() if run != "00csa"]))
""")


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install triton; Linux only)")
def test_the_model_decode_step_with_the_kernel_equals_the_torch_path() -> None:
    """Attention._decode takes the kernel where it applies (here: Triton's interpreter on CPU fp32, tiny model
    with sliding, CSA and HCA layers): 14 decode steps of two sequences give the torch path's logits, with the
    inverse RoPE after the kernel and in its combine, the queries normed and rotated in the kernels that read
    them and before them."""
    check_in_interpreter(_MODEL_CHECK)
