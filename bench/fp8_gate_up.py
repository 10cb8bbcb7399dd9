"""A probe: the routed experts' gate-up with the 2-bit codes unpacked to FP8 e4m3 and fed to Hopper's wgmma.

Why: the production mma gate-up (`w2_moe._gate_up_mma_kernel`) spends 19 integer ALU ops a 16-code word making
bf16 weight pairs (8 PRMT of a per-group table, 11 to build the selectors), and the forty-eighth session's probe
(`bench/gate_up_bound.py`) found its math alone as slow as its loads from 4 tokens on. An e4m3 weight is one byte,
so one PRMT of a 4-byte table makes 4 weights and the selectors are the code bits themselves masked into nibbles:
9 ALU ops a word. mma.sync has no native FP8 form on sm_90 (ptxas emulates it; the eighteenth session's try lost),
but wgmma does, with A from registers. Plain Triton routes computed A operands through shared memory, so this is
written in Gluon, whose explicit layouts let the unpacked registers be the wgmma's A fragment as they are.

Math. w = level * 2^(s - 127), levels -4, -1, 1, 4 for codes 0..3, s the E8M0 byte of a row's 32-column group.
With R the largest s of the row, q = level * 2^(s - R + 6) is an exact e4m3 value (|q| <= 256) for s >= R - 12;
groups below that are flushed to zero (2^-12 of the row's largest group; none in the bench's random planes). Then
w = q * 2^(R - 133). The table of a group: byte c = e4m3(q of code c) = sign | exponent field << 3, the field of
+-1 being m = s - R + 13 and of +-4 m + 2: lut = m * 0x08080808 + 0x10008090 (1 IMAD). x is given as T e4m3 terms
x = 2^X (x_0 + x_1 + x_2), which sit in the wgmma's N columns (8; one token), so they cost no tensor time.
Accumulation: each 256-column K step's wgmma starts from zero and is added to an fp32 total (FP8 wgmma keeps
fewer accumulator bits; the short chains bound that).

Layout. A program of 8 warps (two warpgroups) owns 64 rows of I: rows 0-63 of its [128, K] A operand are w1 rows
(gate), 64-127 the same w3 rows (up). A program of 4 warps (`Variant(warps=4)`, one warpgroup) owns 32: A row
16w + g is gate row 8w + g and A row 16w + g + 8 its up row, so a lane holds both in its accumulator and twice the
programs share the SMs. Lane 4g + t of warp w loads words 4t..4t+3 of rows 16w + g and 16w + g + 8 of each
16-word K step, the production kernels' per-lane load, and that is the wgmma A fragment's lane map. A
word's 16 codes give 4 registers of 4 e4m3 bytes: codes {0,2,4,6}, {8,..,14}, {1,..,7}, {9,..,15}; the K order
of x is permuted to match (`x_permutation`), so no byte moves. x's terms for the token go to shared memory once
a program, by the TMA ([32 half steps, 8 rows, 128] e4m3; rows >= T are the zeros of its out-of-bounds fill, so
only the T rows are read): after plain shared-memory stores Triton put a CTA barrier before every step's wgmma
(docs/benchmarks.md, forty-ninth session).

Measured and dropped there (commit 6a0156e has the code): the K loop unrolled (slower), and one accumulator
chained through all steps with each step's wgmmas left in flight under the next step's unpack (wrong: ptxas lets
the unpack overwrite A registers that wgmmas in flight still read).

    python -m bench.fp8_gate_up --sass          # build for sm_90 on any machine, count the loop's SASS
    python -m bench.fp8_gate_up                 # on a GPU: check against the planes' fp32 product, time it
"""

from __future__ import annotations

import argparse
from typing import NamedTuple, Sequence

import torch

from moebox.ops.triton.runtime import HAVE_TRITON, loop_sass

if HAVE_TRITON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared   # Triton 3.9 | 3.6

STEP = 256          # K columns a step (16 code words)


class Variant(NamedTuple):
    """How the kernel reads its codes: prefetch depth (K steps ahead, 1 or 2); tiled: stored tile by tile
    (`w2_moe.tile_codes`), so each warp's K step reads one contiguous KB; pair: two steps' codes loaded together
    one pair ahead (a row's whole 128-byte line at once where row-major codes give a step half of it)."""

    prefetch: int = 1
    tiled: bool = False
    pair: bool = False
    warps: int = 8


VARIANTS = (Variant(), Variant(prefetch=2), Variant(tiled=True), Variant(prefetch=2, tiled=True),
            Variant(pair=True), Variant(warps=4), Variant(warps=4, pair=True))



# The 16 codes of a word -> 4 registers of 4 e4m3 bytes (operands: $0-$3 out, $4-$7 the word, $8-$11 its
# group's table; each input comes 4 times, a broadcast). Selector nibble k of a PRMT picks table byte code k.
_UNPACK_TEXT = "\n".join([
    "{", ".reg .b32 se, so, t;",
    "and.b32 se, $4, 0x33333333;",
    "shr.b32 t, $4, 2;", "and.b32 so, t, 0x33333333;",
    "prmt.b32 $0, $8, $8, se;",
    "shr.b32 t, se, 16;", "prmt.b32 $1, $8, $8, t;",
    "prmt.b32 $2, $8, $8, so;",
    "shr.b32 t, so, 16;", "prmt.b32 $3, $8, $8, t;",
    "}"])
_UNPACK_ASM = gl.constexpr(_UNPACK_TEXT) if HAVE_TRITON else None


def x_permutation() -> torch.Tensor:
    """long [256]: the column of a K step that A's K index kk (= 64 i + 32 h + 16 half + 4 t + b) holds: word
    4t + i, register P_(h + 2 half), byte b = code 8 h + 2 b + half."""
    kk = torch.arange(STEP)
    i, h, half, t, b = kk // 64, (kk // 32) % 2, (kk // 16) % 2, (kk // 4) % 4, kk % 4
    return 16 * (4 * t + i) + 8 * h + 2 * b + half


def pack_x(x: torch.Tensor, terms: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, H] -> (xq e4m3 [N, H/256, 2, terms, 128]: K step, half, term, the half's columns in the permuted K
    order; 2^X fp32 [N]) with x = 2^X * sum of the terms."""
    n, hidden = x.shape
    x = x.float()
    amax = x.abs().amax(dim=1).clamp_min(1e-30)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    r = x / scale[:, None]
    xq = torch.empty((n, hidden // STEP, terms, STEP), dtype=torch.float8_e4m3fn, device=x.device)
    perm = x_permutation().to(x.device)
    for tau in range(terms):
        q = r.to(torch.float8_e4m3fn)
        r = r - q.float()
        xq[:, :, tau] = q.view(n, hidden // STEP, STEP)[:, :, perm]
    return xq.view(n, hidden // STEP, terms, 2, 128).transpose(2, 3).contiguous(), scale


def row_exponents(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 scale bytes [E, rows, groups] -> each row's largest (int32 [E, rows]): R of the module doc."""
    return scales.view(torch.uint8).amax(dim=-1).to(torch.int32)


if HAVE_TRITON:
    def _layouts(warps: int) -> tuple:
        """The program's layouts for 8 warps (A rows 0-63 gate, 64-127 up) or 4 (A rows 16w + g gate, 16w + g + 8
        up: both in one lane's registers): (codes [M rows, 16 words, 4 bytes], scales [M, 8 groups, 2 words],
        accumulator). Lane 4g + t, warp w -> rows 16w + g (+8 in a register), words 4t + i, groups 2t, 2t + 1."""
        m = 16 * warps
        wb = [[16 << b, 0, 0] for b in range(warps.bit_length() - 1)]
        l3 = gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 2, 0], [8, 0, 0]],
            lane_bases=[[0, 4, 0], [0, 8, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
            warp_bases=wb, block_bases=[], shape=[m, 16, 4])
        lg3 = gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 1], [0, 1, 0], [8, 0, 0]],
            lane_bases=[[0, 2, 0], [0, 4, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
            warp_bases=wb, block_bases=[], shape=[m, 8, 2])
        acc = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, 8, 32])
        return l3, lg3, acc

    # x in shared memory, filled by the TMA (so Triton puts no CTA barrier before each step's wgmma, as it does
    # after plain stores); a box row is at most the 128-byte swizzle, so a K step's x is two [8, 128] halves. The
    # TMA writes [1, 8, 128] boxes of the [., T, 128] terms (_XD) into [1, 8, 128] views of the [8, 128] slices
    # that the wgmma reads (_XS): the same bytes, as the swizzle acts on the last two dimensions
    _XS = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2))
    _XD = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=3))

    @gluon.jit
    def _w13_rows(m, rb, I: gl.constexpr, M: gl.constexpr):
        """Program rows m -> rows of the stacked w13 planes (M // 2 rows of I from rb M // 2). M 128: 0-63 gate,
        64-127 the same up rows; M 64: 16w + g gate row 8w + g, 16w + g + 8 its up row."""
        if M == 128:
            r = (m // 64) * I + rb * 64 + m % 64
        else:
            r = ((m // 8) % 2) * I + rb * 32 + (m // 16) * 8 + m % 8
        return r

    @gluon.jit
    def _step_mma(a0, a1, x_smem, u, zero):
        """A K step's 8 wgmmas (64x8x32 e4m3 a warpgroup) from zero, on its two x halves."""
        d = warpgroup_mma(a0, x_smem.index(2 * u).permute((1, 0)), zero, use_acc=False)
        return warpgroup_mma(a1, x_smem.index(2 * u + 1).permute((1, 0)), d)

    @gluon.jit
    def _unpack(codes, sc, base, M: gl.constexpr, LW: gl.constexpr, DOT: gl.constexpr):
        """One K step's A operand as two [M, 128] e4m3 halves in the wgmma register layout: the words' tables
        from their scale bytes, then the unpack (no data moves between lanes or registers: the conversions are
        trivial)."""
        mm = sc.to(gl.int32) - gl.expand_dims(base, 1)
        lut = gl.where(mm >= 1, mm * 0x08080808 + 0x10008090, 0)
        lutw = gl.reshape(gl.expand_dims(lut, 2).broadcast_to([M, 8, 2]), [M, 16])
        lutw = gl.convert_layout(lutw, LW, assert_trivial=True)
        c4 = gl.expand_dims(codes, 2).broadcast_to([M, 16, 4])
        l4 = gl.expand_dims(lutw, 2).broadcast_to([M, 16, 4])
        o0, o1, o2, o3 = gl.inline_asm_elementwise(
            _UNPACK_ASM, "=r,=r,=r,=r,r,r,r,r,r,r,r,r", [c4, l4],
            dtype=(gl.float8e4nv, gl.float8e4nv, gl.float8e4nv, gl.float8e4nv), is_pure=True, pack=4)
        j = gl.join(gl.join(o0, o1), gl.join(o2, o3))          # [m, word, b, h, half]
        j = gl.reshape(j, [M, 4, 2, 2, 4, 2, 2])                 # [m, t, i_hi, i_lo, b, h, half]: word 4t + i
        a = gl.reshape(gl.permute(j, (0, 3, 5, 6, 1, 4, 2)), [M, 128, 2])
        a0, a1 = gl.split(a)                                      # K halves: i_hi = 0, 1
        return gl.convert_layout(a0, DOT, assert_trivial=True), gl.convert_layout(a1, DOT, assert_trivial=True)

    @gluon.jit
    def _fp8_gate_up_kernel(x_desc, xe_ptr, ids_ptr, rw_ptr, wc_ptr, ws_ptr, rr_ptr, h_ptr,
                            c_expert_stride, s_expert_stride, r_expert_stride, limit,
                            I: gl.constexpr, HW: gl.constexpr, K: gl.constexpr, T: gl.constexpr,
                            HAS_LIMIT: gl.constexpr, PREFETCH: gl.constexpr, TILED: gl.constexpr,
                            PAIR: gl.constexpr, L3: gl.constexpr, LG3: gl.constexpr, ACC: gl.constexpr):
        STEPS: gl.constexpr = HW // 16
        M: gl.constexpr = 16 * gl.num_warps()
        LW: gl.constexpr = gl.SliceLayout(2, L3)
        LG: gl.constexpr = gl.SliceLayout(2, LG3)
        DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=4)

        p = gl.program_id(0)
        rb = gl.program_id(1)
        tok = p // K
        e = gl.load(ids_ptr + p).to(gl.int64)

        m = gl.arange(0, M, layout=gl.SliceLayout(1, LW))
        w = gl.arange(0, 16, layout=gl.SliceLayout(0, LW))
        row = _w13_rows(m, rb, I, M)
        if TILED:   # tile (row // 16, u) of 256 words at (row // 16 * STEPS + u) * 256, row % 16 at 16 words each
            c_ptrs = (wc_ptr + e * c_expert_stride + gl.expand_dims((row // 16).to(gl.int64) * (16 * HW)
                                                                    + (row % 16) * 16, 1) + gl.expand_dims(w, 0))
        else:
            c_ptrs = wc_ptr + e * c_expert_stride + gl.expand_dims(row.to(gl.int64) * HW, 1) + gl.expand_dims(w, 0)
        C_STEP: gl.constexpr = 256 if TILED else 16
        mg = gl.arange(0, M, layout=gl.SliceLayout(1, LG))
        grp = gl.arange(0, 8, layout=gl.SliceLayout(0, LG))
        rowg = _w13_rows(mg, rb, I, M)
        s_ptrs = (ws_ptr + e * s_expert_stride + gl.expand_dims(rowg.to(gl.int64) * (HW // 2), 1)
                  + gl.expand_dims(grp, 0))
        base = gl.load(rr_ptr + e * r_expert_stride + rowg) - 13

        acc = gl.zeros([M, 8], gl.float32, ACC)
        zero = gl.zeros([M, 8], gl.float32, ACC)
        codes = gl.load(c_ptrs)
        sc = gl.load(s_ptrs)
        # x's terms -> shared memory by the TMA, all steps on one barrier (after the first code loads are issued)
        x_smem = gl.allocate_shared_memory(gl.float8e4nv, [2 * STEPS, 8, 128], _XS)
        bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(bar, count=1)
        mbarrier.expect(bar, STEPS * 2048)
        for s in gl.static_range(2 * STEPS):
            _tma_load(x_desc, [tok * 2 * STEPS + s, 0, 0], bar, x_smem.index(s).reshape([1, 8, 128]))
        mbarrier.wait(bar, phase=0)
        mbarrier.invalidate(bar)

        # each step loads the codes and scales PREFETCH steps ahead before its math (clamped at the last step)
        if PAIR:    # steps 2v, 2v + 1 in hand, pair v + 1 loaded before their math
            codes_b, sc_b = gl.load(c_ptrs + C_STEP), gl.load(s_ptrs + 8)
            for v in range(STEPS // 2):
                nxt = gl.minimum(2 * v + 2, STEPS - 2)
                codes_n, sc_n = gl.load(c_ptrs + nxt * C_STEP), gl.load(s_ptrs + nxt * 8)
                codes_nb, sc_nb = gl.load(c_ptrs + (nxt + 1) * C_STEP), gl.load(s_ptrs + (nxt + 1) * 8)
                a0, a1 = _unpack(codes, sc, base, M, LW, DOT)
                acc = acc + _step_mma(a0, a1, x_smem, 2 * v, zero)
                a0, a1 = _unpack(codes_b, sc_b, base, M, LW, DOT)
                acc = acc + _step_mma(a0, a1, x_smem, 2 * v + 1, zero)
                codes, sc, codes_b, sc_b = codes_n, sc_n, codes_nb, sc_nb
        else:
            if PREFETCH == 2:
                codes_a, sc_a = gl.load(c_ptrs + C_STEP), gl.load(s_ptrs + 8)
            for u in range(STEPS):
                nxt = gl.minimum(u + PREFETCH, STEPS - 1)
                codes_n, sc_n = gl.load(c_ptrs + nxt * C_STEP), gl.load(s_ptrs + nxt * 8)
                a0, a1 = _unpack(codes, sc, base, M, LW, DOT)
                acc = acc + _step_mma(a0, a1, x_smem, u, zero)
                if PREFETCH == 2:
                    codes, sc, codes_a, sc_a = codes_a, sc_a, codes_n, sc_n
                else:
                    codes, sc = codes_n, sc_n

        n = gl.arange(0, 8, layout=gl.SliceLayout(0, ACC))
        v = gl.sum(gl.where(gl.expand_dims(n < T, 0), acc, 0.0), axis=1)
        ma = gl.arange(0, M, layout=gl.SliceLayout(1, ACC))
        rowa = _w13_rows(ma, rb, I, M)
        ra = gl.load(rr_ptr + e * r_expert_stride + rowa)
        v = v * ((ra - 6) << 23).to(gl.float32, bitcast=True) * gl.load(xe_ptr + tok)
        EP: gl.constexpr = gl.BlockedLayout([1, 2], [32, 1], [2, gl.num_warps() // 2], [1, 0])
        if M == 128:    # [up, row] -> [row, up]
            gu = gl.permute(gl.reshape(v, [2, 64]), (1, 0))
        else:           # [w, up, g] -> [8w + g, up]
            gu = gl.reshape(gl.permute(gl.reshape(v, [4, 2, 8]), (0, 2, 1)), [32, 2])
        gate, up = gl.split(gl.convert_layout(gu, EP))
        if HAS_LIMIT:
            gate = gl.minimum(gate, limit)
            up = gl.minimum(gl.maximum(up, -limit), limit)
        h = gate / (1.0 + gl.exp(-gate)) * up * gl.load(rw_ptr + p)
        r_out = gl.arange(0, M // 2, layout=h.type.layout)
        gl.store(h_ptr + p.to(gl.int64) * I + rb * (M // 2) + r_out, h)


def gate_up(x: torch.Tensor, ids: torch.Tensor, rw: torch.Tensor, w13c: torch.Tensor, w13s: torch.Tensor,
            rr: torch.Tensor, limit: float | None, packed: tuple[torch.Tensor, torch.Tensor] | None = None,
            terms: int = 3, variant: Variant = Variant(), out: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the probe: h fp32 [N k, I]. w13c/w13s the stacked planes ([E, 2I, H/4] uint8, [E, 2I, H/32];
    w13c through `w2_moe.tile_codes` for a tiled variant), rr = row_exponents(w13s); packed: pack_x(x) if done
    already (a bench times the kernel alone)."""
    n, hidden = x.shape
    k = ids.shape[1]
    inter = w13c.shape[1] // 2
    xq, xe = packed if packed is not None else pack_x(x, terms)
    wc = w13c.view(torch.int32)
    ws = w13s.view(torch.uint8)
    h = torch.empty((n * k, inter), dtype=torch.float32, device=x.device) if out is None else out
    rows = xq.shape[3]      # the box's rows past the terms are out of bounds: the TMA fills them with zeros
    x_desc = TensorDescriptor(xq, [xq.numel() // (128 * rows), rows, 128], [128 * rows, 128, 1], [1, 8, 128],
                              _XD.value)
    assert not (variant.tiled and variant.warps == 4), "the tiled codes are 16 rows of one matrix a tile"
    l3, lg3, acc = _layouts(variant.warps)
    _fp8_gate_up_kernel[(n * k, inter // (8 * variant.warps))](
        x_desc, xe, ids.reshape(-1), rw.reshape(-1).float(), wc, ws, rr, h,
        wc.stride(0), ws.stride(0), rr.stride(0), float(limit) if limit else 0.0,
        I=inter, HW=hidden // 16, K=k, T=terms, HAS_LIMIT=bool(limit),
        PREFETCH=variant.prefetch, TILED=variant.tiled, PAIR=variant.pair, L3=l3, LG3=lg3, ACC=acc,
        num_warps=variant.warps)
    return h


def build_sm90(variant: Variant = Variant(), hidden: int = 4096, inter: int = 2048, k: int = 6, terms: int = 3):
    """The probe built for sm_90 (no GPU needed), specialised as a V4-Flash launch."""
    from moebox.ops.triton.runtime import build_sm90 as build
    types = (f"tensordesc<fp8e4nv[1, 8, 128],{_XD.value!r}>", "*fp32", "*i64", "*fp32", "*i32", "*u8", "*i32", "*fp32",
             "i32", "i32", "i32", "fp32")
    sig = dict(zip(_fp8_gate_up_kernel.arg_names, types))
    const = dict(I=inter, HW=hidden // 16, K=k, T=terms, HAS_LIMIT=True, PREFETCH=variant.prefetch,
                 TILED=variant.tiled, PAIR=variant.pair)
    const.update(zip(("L3", "LG3", "ACC"), _layouts(variant.warps)))
    return build(_fp8_gate_up_kernel, sig, const, [a for a, ty in sig.items() if ty[0] in "*i"],
                 num_warps=variant.warps)


def sass_report(variant: Variant = Variant()) -> dict:
    """The sm_90 build: registers, spill stack, and the SASS of the K loop (the shortest loop around the wgmmas;
    the TMA wait's retry loop spans the kernel): op counts and instructions a weight (a lane handles 2 rows x 64
    columns = 128 weights a step; a pair variant's loop is two steps)."""
    ops, registers, spills, _ = loop_sass(build_sm90(variant).asm["cubin"], around="QGMMA")
    return {"variant": variant, "registers": registers, "spills": spills, "loop_ops": ops,
            "instructions_per_weight": sum(ops.values()) / (256 if variant.pair else 128)}


def check(hidden: int = 4096, inter: int = 2048, experts: int = 16, tokens: int = 2, k: int = 6,
          limit: float = 10.0, device: str = "cuda", variant: Variant = Variant()) -> float:
    """Relative error (max |h - ref| / max |ref|) of the probe against the planes' fp64 product
    (`bitplane_gate_up.gate_up_reference`) on random planes and routing, the output poisoned with NaN first."""
    from bench.bitplane_gate_up import gate_up_reference
    from moebox.ops.triton import w2_moe
    w13c, w13s = w2_moe.random_planes(experts, hidden, inter, device=device)[:2]
    ids, rw = w2_moe.random_routing(tokens, experts, k, device=device)
    x = torch.randn((tokens, hidden), device=device)
    out = torch.full((tokens * k, inter), float("nan"), device=device)
    codes = w2_moe.tile_codes(w13c) if variant.tiled else w13c
    h = gate_up(x, ids, rw, codes, w13s, row_exponents(w13s), limit, variant=variant, out=out)
    ref = gate_up_reference(x, ids, rw, *w2_moe._split_w13(w13c, w13s), limit, quantized=False).float()
    return float((h - ref).abs().max() / ref.abs().max())


def bench(tokens: Sequence[int], hidden: int = 4096, inter: int = 2048, experts: int = 256, k: int = 6,
          limit: float = 10.0, l2_miss_bytes: int = 256 << 20, rep: int = 100,
          variants: Sequence[Variant] = VARIANTS) -> list[dict]:
    """us a call: the production mma gate-up (default tiling for N, bf16 x) against each probe variant, on the
    same random planes, CUDA-graph replay of back-to-back calls on routings that miss L2; x packed beforehand
    for both (each kernel alone)."""
    from moebox.ops.triton import w2_moe
    from moebox.ops.triton.runtime import graph_us
    device = torch.device("cuda")
    w13c, w13s = w2_moe.random_planes(experts, hidden, inter, device=device)[:2]
    w1c, w1s, w3c, w3s = w2_moe.gate_up_operands(*w2_moe._split_w13(w13c, w13s))
    rr = row_exponents(w13s)
    tiled = w2_moe.tile_codes(w13c) if any(v.tiled for v in variants) else None
    per_expert = 2 * w2_moe.expert_bytes(hidden, inter) // 3
    rows = []
    names = ["mma"] + [f"p{v.prefetch}{' tiled' if v.tiled else ''}{' pair' if v.pair else ''}" for v in variants]
    print(" ".join(f"{c:>13s}" for c in ["N"] + names + ["best x mma"]), flush=True)
    for n in tokens:
        routes, nbytes = w2_moe.miss_routes(n, experts, k, per_expert, l2_miss_bytes, device)
        x = torch.randn((n, hidden), device=device).to(torch.bfloat16)
        xp = w2_moe._pack_x(x, w2_moe._empty_packed(x))
        packed = pack_x(x)
        cfg = w2_moe.default_config(n)
        flat = [(ids.reshape(-1).contiguous(), w.reshape(-1).float().contiguous()) for ids, w in routes]
        us = [graph_us([lambda f=f: w2_moe._gate_up_mma(x, xp, f[0], f[1], w1c, w1s, w3c, w3s, limit, k, cfg)
                        for f in flat], rep)]
        us += [graph_us([lambda r=r, v=v: gate_up(x, r[0], r[1], tiled if v.tiled else w13c, w13s, rr, limit, packed,
                                                  variant=v)
                         for r in routes], rep) for v in variants]
        rows.append({"tokens": n, "bytes": nbytes, **dict(zip(names, us))})
        print(" ".join(f"{c:>13s}" for c in [str(n)] + [f"{u:.1f}" for u in us] + [f"{us[0] / min(us[1:]):.2f}"]),
              flush=True)
    return rows


def once(n: int, hidden: int = 4096, inter: int = 2048, experts: int = 256, k: int = 6) -> None:
    """One call of the production mma gate-up and one of the probe (prefetch 1) on one random routing: what a
    profiler run (ncu) reads the counters of."""
    from moebox.ops.triton import w2_moe
    device = torch.device("cuda")
    w13c, w13s = w2_moe.random_planes(experts, hidden, inter, device=device)[:2]
    w1c, w1s, w3c, w3s = w2_moe.gate_up_operands(*w2_moe._split_w13(w13c, w13s))
    ids, rw = w2_moe.random_routing(n, experts, k, device=device)
    x = torch.randn((n, hidden), device=device).to(torch.bfloat16)
    xp = w2_moe._pack_x(x, w2_moe._empty_packed(x))
    packed, rr = pack_x(x), row_exponents(w13s)
    w2_moe._gate_up_mma(x, xp, ids.reshape(-1), rw.reshape(-1).float(), w1c, w1s, w3c, w3s, 10.0, k,
                        w2_moe.default_config(n))
    gate_up(x, ids, rw, w13c, w13s, rr, 10.0, packed)
    torch.cuda.synchronize()


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.fp8_gate_up", description=__doc__.splitlines()[0])
    p.add_argument("--sass", action="store_true", help="build for sm_90 and report the SASS (no GPU needed)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--once", type=int, metavar="N", help="one call of each kernel at N tokens (for ncu)")
    args = p.parse_args(argv)
    if args.once:
        once(args.once)
        return
    if args.sass:
        for v in VARIANTS:
            print(sass_report(v))
        return
    from moebox.ops.triton.fp8_linear import copy_bandwidth
    from moebox.ops.triton.runtime import bench_start
    bench_start()
    print(f"copy bandwidth {copy_bandwidth(torch.device('cuda')):.0f} GB/s")
    for v in VARIANTS:
        print(f"check {v}: rel. error against the planes' fp64 product {check(variant=v):.2e}", flush=True)
    bench(args.tokens)


if __name__ == "__main__":
    main()
