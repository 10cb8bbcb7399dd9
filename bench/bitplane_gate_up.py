"""A bit-plane gate-up kernel (no dequant: b1 AND-popc mma, BMMA on sm_90) on its own copy of the planes, timed
against the mma gate-up kernel of moebox/ops/triton/w2_moe.py at the V4-Flash shape.

Why: the expert kernels are bound by their dequant's integer ALU issue (w2_moe.py's module doc). A code's level
is linear in its bits, level = 3 b0 + 5 b1 - 4 (c = 2 b1 + b0), so one m16n8k256 b1 mma whose A row holds a
32-column group's b0 word in 3 of its 8 chunks of 32 and its b1 word in the other 5, against B columns that are
8 bit planes of x over that group, gives sum_k (level_k + 4) x_jk for 16 rows and 8 planes j; a second mma takes
planes 8..15. x enters as 16-bit two's-complement integers q with one exponent per group (bench/bitplane_probe.py
measured that 16 bits keep x's error below the bf16 output's). Only this gate-up is built: the store relayout and
the other readers follow only if it gains enough (>= 1.25x at 8 tokens).

Layouts (this module's own; `to_bitplanes`, `pair_scale_words`, `pack_x_planes`), chosen so that each mma operand
is one 16-byte load a lane (ptxas then feeds the BMMA from the load's registers, no moves) and every load's
address runs along the tile's columns:
- weights int32 [E, I/16, H/128, 4 groups, 8 g, 4]: per 16-row block and group the quad (b0 of row g, b0 of row
  g + 8, b1 of row g, b1 of row g + 8), which is the A fragment (chunk t, chunk t + 4) of lanes t < 3; lane 3
  takes b1 for chunk 3 too (a SEL), so a row holds b0 in 3 chunks and b1 in 5. Bit k of a word is column k of the
  group. Same bytes as the w2 codes. Scale bytes uint8 [E, I/16, H/128, 8 g, 8]: byte 2 rho + half of word
  rho // 2 is row g + 8 half's scale for group rho; the kernel reads w1's and w3's paired as int32 [E, I/16,
  H/128, 8 g, 4] (w1 word 0, w1 word 1, w3 word 0, w3 word 1).
- x: planes int32 [N, H/128, 4, 8 g, 4] (plane g twice, plane g + 8 twice: the B registers of the low and high
  mma), corrections int32 [N, H/128, 4, 8] ([-4 sum(q), x, -4 sum(q), x, 0, x, 0, x] with x the exponent bits
  (e - 15) << 23: lanes t = 0 read the first quad, whose slots 0, 2 are the low mma's accumulator input for
  column 0, so the correction is added once a row; the others read the zeros).

The kernel: grid (N k pairs, I/16), S warps a program splitting the H/128 K steps (as `_gate_up_mma_kernel`),
the next step's weight quads and scale words loaded before this step's math. Per group and matrix: 2 BMMA (x
planes 0-7 and 8-15); lane t holds planes 2t, 2t+1 (low mma) and 8+2t, 9+2t (high) of its two rows, folded with 3
IMADs as l0 + 2 l1 + 256 h0 + f h1 (f = 512, -512 in lane 3: plane 15 is the sign); its factor 4^t is applied
after the K loop. Then I2F and one FFMA into an fp32 slot with the row's E8M0 scale times x's group factor, built
as integer bits s * 2^23 + ((e - 15) << 23) with a PRMT and an IMAD. All integers stay below 2^23 (the planes'
part <= 256 * 771, the correction <= 4 * 32 * 2^15), so the I2F is exact.

Triton 3.6 (the GPU image's) gives a load whose address does not run along the columns (an operand that is the
same in a lane's 4 slots, as the scale word and exponent bits were) a column-major layout, and the asm took it:
a wrong lane map (the forty-fifth session's first H100 run: relative error 31, 196 registers). Hence the paired
scale words (one 16-byte load for both matrices; the asm picks word m of its pack with a SELP that ptxas folds)
and the exponent bits inside the correction quads. Its sm_90 build (`--sass`, split 2; Triton 3.6 and 3.9 on the
CPU): 96-100 registers, no spills, 1.77 SASS instructions a weight in the loop against the mma gate-up's
1.66-1.70 (16 BMMA, 16 SEL, 16 PRMT, 16 I2FP, 16 FFMA and ~90 IMAD/LEA an iteration of 227, 17 loads).

    python -m bench.bitplane_gate_up                 # CUDA: the timing table, N = 1 2 4 8 16
    python -m bench.bitplane_gate_up --sass          # any machine: the sm_90 build's loop instructions
"""

from __future__ import annotations

import argparse
from typing import Sequence

import torch

from bench.bitplane_probe import GROUP, quantize_groups
from moebox.ops.triton import w2_moe
from moebox.ops.triton.runtime import (HAVE_TRITON, bench_start, build_sm90, graph_us, loop_sass, packed_asm_layout,
                                       tl, triton, versions)
from moebox.quant.w2 import W2Tensor

BITS = 16
MIN_EXPONENT = -60   # x groups below 2^-60 quantize to zero: their scale's exponent bits stay positive


def _bit_words(bits: torch.Tensor) -> torch.Tensor:
    """int64 [..., 32] of 0/1 -> int32 [...]: bit k of the word is element k (two's complement)."""
    weight = torch.ones(1, dtype=torch.int64, device=bits.device) << torch.arange(GROUP, device=bits.device)
    return (bits.long() * weight).sum(-1).to(torch.int32)


def to_bitplanes(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w2 planes (codes uint8 [E, rows, cols/4], E8M0 scales [E, rows, cols/32]) -> (words int32 [E, rows/16,
    cols/128, 4, 8, 4], scale bytes uint8 [E, rows/16, cols/128, 8, 8]) in the module doc's layout, expert by
    expert so that the full size needs little scratch."""
    e, rows, cb = codes.shape
    steps = cb // 32
    words = torch.empty((e, rows // 16, steps, 4, 8, 4), dtype=torch.int32, device=codes.device)
    sb = torch.empty((e, rows // 16, steps, 8, 8), dtype=torch.uint8, device=codes.device)
    for x in range(e):
        c = W2Tensor(codes[x], scales[x]).level_codes().reshape(rows // 16, 2, 8, steps, 4, GROUP)
        b0, b1 = _bit_words(c & 1), _bit_words(c >> 1)               # [rb, half, g, step, rho]
        quad = torch.stack([b0[:, 0], b0[:, 1], b1[:, 0], b1[:, 1]], dim=-1)   # [rb, g, step, rho, 4]
        words[x] = quad.permute(0, 2, 3, 1, 4)
        s = scales[x].view(torch.uint8).reshape(rows // 16, 2, 8, steps, 4)     # [rb, half, g, step, rho]
        sb[x] = s.permute(0, 3, 2, 4, 1).reshape(rows // 16, steps, 8, 8)       # byte 2 rho + half
    return words, sb


def levels_of_bitplanes(words: torch.Tensor) -> torch.Tensor:
    """`to_bitplanes` words [E, rows/16, cols/128, 4, 8, 4] -> the levels 3 b0 + 5 b1 - 4 (fp32 [E, rows, cols]): the
    relayout's inverse, for the tests."""
    e, rb, steps = words.shape[:3]
    bits = (words.long()[..., None] >> torch.arange(GROUP, device=words.device)) & 1   # [E, rb, step, rho, g, 4, 32]
    lv = 3 * bits[..., 0:2, :] + 5 * bits[..., 2:4, :] - 4                             # [..., half, 32]
    return lv.permute(0, 1, 5, 4, 2, 3, 6).reshape(e, rb * 16, steps * 128).float()


def scales_of_bitplanes(sb: torch.Tensor) -> torch.Tensor:
    """`to_bitplanes` scale bytes -> uint8 [E, rows, cols/32], the w2 order: the relayout's inverse."""
    e, rb, steps = sb.shape[:3]
    return sb.reshape(e, rb, steps, 8, 4, 2).permute(0, 1, 5, 3, 2, 4).reshape(e, rb * 16, steps * 4)


def pair_scale_words(sb1: torch.Tensor, sb3: torch.Tensor) -> torch.Tensor:
    """w1's and w3's `to_bitplanes` scale bytes -> int32 [E, rows/16, cols/128, 8 g, 4]: (w1 word 0, w1 word 1, w3
    word 0, w3 word 1), so that a lane's scales of a K step are one 16-byte load."""
    return torch.cat([sb1.view(torch.int32), sb3.view(torch.int32)], dim=-1)


def quantize_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, H] -> (int64 q [N, H] in [-2^15, 2^15), int64 e [N, H/32]): x ~ q 2^(e - 15), |x| < 2^e a group."""
    return quantize_groups(x, BITS, MIN_EXPONENT)


def pack_x_planes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, H] -> (planes int32 [N, H/128, 4, 8, 4], corrections and exponent bits int32 [N, H/128, 4, 8]), the
    module doc's layout."""
    n, hidden = x.shape
    q, e = quantize_x(x)
    steps = hidden // 128
    u = (q & 0xFFFF).reshape(n, steps, 4, 1, GROUP)
    planes = _bit_words((u >> torch.arange(BITS, device=x.device)[:, None]) & 1)     # [N, step, rho, 16]
    lo, hi = planes[..., :8], planes[..., 8:]
    xq = torch.stack([lo, lo, hi, hi], dim=-1)                                        # [N, step, rho, g, 4]
    cq = torch.zeros((n, steps, 4, 8), dtype=torch.int32, device=x.device)
    cq[..., 0] = cq[..., 2] = (-4 * q.reshape(n, steps, 4, GROUP).sum(-1)).to(torch.int32)
    cq[..., 1::2] = ((e.reshape(n, steps, 4, 1) - (BITS - 1)) << 23).to(torch.int32)
    return xq, cq


def gate_up_reference(x: torch.Tensor, ids: torch.Tensor, rw: torch.Tensor, w1c: torch.Tensor, w1s: torch.Tensor,
                      w3c: torch.Tensor, w3s: torch.Tensor, limit: float | None, quantized: bool) -> torch.Tensor:
    """fp64 h [N k, I] = silu(min(W1 x, L)) * clamp(W3 x, -L, L) * routing weight, from the w2 planes (codes
    [E, I, H/4], scales [E, I, H/32]); `quantized`: x as the kernel takes it (16-bit integers a group), so the only
    difference left to the kernel is its fp32 sums."""
    q, e = quantize_x(x)
    xs = q.double() * torch.exp2((e - BITS + 1).double()).repeat_interleave(GROUP, dim=-1) if quantized else x.double()
    k = ids.shape[1]
    out = []
    for p, ex in enumerate(ids.reshape(-1).tolist()):
        gate, up = (W2Tensor(c[ex], s[ex]).dequantize(torch.float64) @ xs[p // k] for c, s in ((w1c, w1s), (w3c, w3s)))
        if limit:
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        out.append(torch.nn.functional.silu(gate) * up * rw.reshape(-1)[p].double())
    return torch.stack(out)


# ------------------------------------------------------------------------------------------------ kernel
def bitplane_asm(matrix: int) -> str:
    """PTX for one pack of 8 elements (rep rho = group 2 m + rho of the K step, quad slot c: element 4 rho + c) of
    the [32 S, 16] tile, for w1 (`matrix` 0) or w3 (1). Operands: $0.. acc out (slot c = 0 / 1: row g / g + 8; 2, 3
    passed through), $8.. A quads (b0 g, b0 g+8, b1 g, b1 g+8), $16.. x quads (plane g twice, plane g + 8 twice),
    $24.. x's correction quads (correction or 0 in slots 0, 2: the low mma's accumulator input for columns 2t;
    group rho's exponent bits in slots 1, 3), $32..$35 the lane's scale words (`pair_scale_words`; byte 2 rho +
    half of word 2 matrix + m), $40 m, $48 the sign factor f, $56.. acc in. Lane 3 (f < 0) takes b1 for chunk 3."""
    a, xw, cq, sw, m, f, acc = 8, 16, 24, 32 + 2 * matrix, 40, 48, 56
    mma = "mma.sync.aligned.m16n8k256.row.col.s32.b1.b1.s32.and.popc"
    asm = ["{", ".reg .b32 q<2>, l<4>, h<4>, v, z, sw, sb, by;", ".reg .f32 fv, fs, fa;", ".reg .pred p3, pm;",
           "mov.b32 z, 0;", f"setp.lt.s32 p3, ${f}, 0;", f"setp.ne.s32 pm, ${m}, 0;",
           f"selp.b32 sw, ${sw + 1}, ${sw}, pm;"]
    for rho in range(2):
        A = [f"${a + 4 * rho + c}" for c in range(4)]
        X = [f"${xw + 4 * rho + c}" for c in range(4)]
        C = f"${cq + 4 * rho}, z, ${cq + 4 * rho + 2}, z"
        asm += [f"mov.b32 q0, {A[0]};", f"mov.b32 q1, {A[1]};", f"@p3 mov.b32 q0, {A[2]};", f"@p3 mov.b32 q1, {A[3]};",
                f"{mma} {{l0, l1, l2, l3}}, {{q0, q1, {A[2]}, {A[3]}}}, {{{X[0]}, {X[1]}}}, {{{C}}};",
                f"{mma} {{h0, h1, h2, h3}}, {{q0, q1, {A[2]}, {A[3]}}}, {{{X[2]}, {X[3]}}}, {{z, z, z, z}};"]
        for r in range(2):   # D slots 2r, 2r + 1: row g + 8 r, columns 2t, 2t + 1
            asm += [f"mad.lo.s32 v, l{2 * r + 1}, 2, l{2 * r};", f"mad.lo.s32 v, h{2 * r}, 256, v;",
                    f"mad.lo.s32 v, h{2 * r + 1}, ${f}, v;", "cvt.rn.f32.s32 fv, v;",
                    f"prmt.b32 by, sw, 0, {0x4440 + 2 * rho + r};",
                    f"mad.lo.u32 sb, by, 8388608, ${cq + 4 * rho + 1};", "mov.b32 fs, sb;",
                    f"mov.b32 fa, ${acc + 4 * rho + r};", "fma.rn.f32 fa, fv, fs, fa;", f"mov.b32 ${4 * rho + r}, fa;"]
        asm += [f"mov.b32 ${4 * rho + c}, ${acc + 4 * rho + c};" for c in (2, 3)]
    return "\n".join(asm + ["}"])


if HAVE_TRITON:
    _W1_ASM = tl.constexpr(bitplane_asm(0))
    _W3_ASM = tl.constexpr(bitplane_asm(1))
    _CONSTRAINTS = tl.constexpr(",".join(["=r"] * 8 + ["r"] * 56))

    @triton.jit
    def _bitplane_dot(aq, xq, cq, sw, m, f, acc, MATRIX: tl.constexpr):
        args = [aq, xq, cq, sw, m, f, acc.to(tl.int32, bitcast=True)]
        if MATRIX == 0:
            out = tl.inline_asm_elementwise(_W1_ASM, _CONSTRAINTS, args, dtype=tl.int32, is_pure=True, pack=8)
        else:
            out = tl.inline_asm_elementwise(_W3_ASM, _CONSTRAINTS, args, dtype=tl.int32, is_pure=True, pack=8)
        return out.to(tl.float32, bitcast=True)

    @triton.jit
    def _bitplane_tiles(w1b_ptr, w3b_ptr, ws_ptr, a_off, s_off, u, LAST: tl.constexpr):
        """The A quads of w1 and w3 and their scale words for K step u (clamped to the last)."""
        u = tl.minimum(u, LAST)
        return tl.load(w1b_ptr + a_off + u * 128), tl.load(w3b_ptr + a_off + u * 128), tl.load(ws_ptr + s_off + u * 32), u

    @triton.jit
    def _bitplane_gate_up_kernel(xq_ptr, cq_ptr, ids_ptr, rw_ptr, w1b_ptr, w3b_ptr, ws_ptr, h_ptr,
                                 b_expert_stride, s_expert_stride, limit,
                                 I: tl.constexpr, KS: tl.constexpr, K: tl.constexpr, HAS_LIMIT: tl.constexpr,
                                 S: tl.constexpr):
        p = tl.program_id(0)                        # (token, expert) pair, token * K + j
        rb = tl.program_id(1)                       # 16 rows of I
        tok = p // K
        e = tl.load(ids_ptr + p).to(tl.int64)
        # tile row r2 = rho * 8 S + s * 8 + g (rho: the group of the K step, s: the warp, g: the lane group),
        # column 4 t + c (t: the lane in its group, c: the quad slot)
        g, sp, rho, w = w2_moe._tile_coords(S, 4)
        lt, c = w // 4, w % 4
        a_off = e * b_expert_stride + rb.to(tl.int64) * (KS * 128) + rho * 32 + g * 4 + c        # int32 words
        # every load's address runs along the columns (the 4 slots c): an operand whose address does not made
        # Triton 3.6 give it, and then the asm, a column-major layout, which breaks the asm's lane map
        s_off = e * s_expert_stride + rb.to(tl.int64) * (KS * 32) + g * 4 + c
        x_off = tok.to(tl.int64) * (KS * 128) + rho * 32 + g * 4 + c
        c_off = tok.to(tl.int64) * (KS * 32) + rho * 8 + 4 * (lt != 0) + c
        m = rho // 2 + 0 * w                        # the pack's pair of groups: which scale word
        f = tl.where(lt == 3, -512, 512) + 0 * g
        LAST: tl.constexpr = KS - 1
        acc_g = tl.zeros((32 * S, 16), dtype=tl.float32)
        acc_u = tl.zeros((32 * S, 16), dtype=tl.float32)
        a1, a3, sw, u = _bitplane_tiles(w1b_ptr, w3b_ptr, ws_ptr, a_off, s_off, sp, LAST)
        for u0 in tl.range(0, KS, S):
            n1, n3, nw, nu = _bitplane_tiles(w1b_ptr, w3b_ptr, ws_ptr, a_off, s_off, u0 + S + sp, LAST)
            xq = tl.load(xq_ptr + x_off + u * 128)
            cq = tl.load(cq_ptr + c_off + u * 32)
            acc_g = _bitplane_dot(a1, xq, cq, sw, m, f, acc_g, 0)
            acc_u = _bitplane_dot(a3, xq, cq, sw, m, f, acc_u, 1)
            a1, a3, sw, u = n1, n3, nw, nu
        # slot c < 2 of lane t holds row g + 8 c's share of planes 2t, 2t + 1, 8 + 2t, 9 + 2t: weight 4^t. Rows
        # are summed before any reshape (as w2_moe's `_reduce_tile`): a reshape of the 2-D tile made Triton 3.6
        # give the whole loop another layout, which breaks the asm's lane map
        lane_factor = (1 << (2 * lt)).to(tl.float32)
        rw = tl.load(rw_ptr + p).to(tl.float32)
        for half in tl.static_range(2):
            gate = tl.sum(tl.reshape(tl.sum(tl.where(c == half, acc_g * lane_factor, 0.0), axis=1), (4 * S, 8)), axis=0)
            up = tl.sum(tl.reshape(tl.sum(tl.where(c == half, acc_u * lane_factor, 0.0), axis=1), (4 * S, 8)), axis=0)
            if HAS_LIMIT:
                gate = tl.minimum(gate, limit)
                up = tl.minimum(tl.maximum(up, -limit), limit)
            h = gate / (1.0 + tl.exp(-gate)) * up * rw
            tl.store(h_ptr + p.to(tl.int64) * I + 16 * rb + 8 * half + tl.arange(0, 8), h)


def bitplane_gate_up(xq: torch.Tensor, cq: torch.Tensor, ids: torch.Tensor, rw: torch.Tensor, w1b: torch.Tensor,
                     w3b: torch.Tensor, ws: torch.Tensor, limit: float | None, split: int = 2) -> torch.Tensor:
    """h fp32 [N k, I] from x's planes (`pack_x_planes`), the weights' bit planes (`to_bitplanes`) and their scale
    words (`pair_scale_words`); ids int [N, k], rw fp32 [N, k]. CUDA only (the asm does not run in Triton's
    interpreter)."""
    n, steps = xq.shape[:2]
    k = ids.shape[1]
    inter = 16 * w1b.shape[1]
    if w1b.stride() != w3b.stride() or steps % split:
        raise ValueError("w1 and w3 must share strides; H/128 a multiple of the split")
    h = torch.empty((n * k, inter), dtype=torch.float32, device=xq.device)
    has_limit = bool(limit)
    _bitplane_gate_up_kernel[(n * k, inter // 16)](
        xq, cq, ids.reshape(-1).contiguous(), rw.reshape(-1).float().contiguous(), w1b, w3b, ws, h, w1b.stride(0),
        ws.stride(0), float(limit) if has_limit else 0.0,
        I=inter, KS=steps, K=k, HAS_LIMIT=has_limit, S=split, num_warps=split, num_stages=1)
    return h


def sass_report(split: int = 2) -> dict:
    """Build the kernel for sm_90 (V4-Flash constants) on any machine: the asm's lane layout, registers, spills
    and the loop's SASS (op counts; instructions per weight as w2_moe's `sass_report` counts them: a loop
    iteration is 2 matrices x 16 rows x 128 columns a warp, 128 weights a lane)."""
    fn = _bitplane_gate_up_kernel
    types = ("*i32", "*i32", "*i64", "*fp32", "*i32", "*i32", "*i32", "*fp32", "i32", "i32", "fp32")
    sig = dict(zip(fn.arg_names, types))
    compiled = build_sm90(fn, sig, dict(I=2048, KS=32, K=6, HAS_LIMIT=True, S=split),
                          [a for a, ty in sig.items() if ty != "fp32"], num_warps=split, num_stages=1)
    ops, registers, spills, looped = loop_sass(compiled.asm["cubin"])
    weights = 2 * 16 * 128 // 32
    return {"split": split, "asm_layout": packed_asm_layout(compiled.asm["ttgir"]), "registers": registers,
            "spills": spills, "looped": looped, "loop_ops": ops, "weights_per_iter": weights,
            "instructions_per_weight": sum(ops.values()) / weights}


# ------------------------------------------------------------------------------------------------ bench
def random_gate_up_planes(experts: int, hidden: int, intermediate: int, device: torch.device, seed: int = 0
                          ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """w2_moe's random w1/w3 planes ((w1 codes, w1 scales, w3 codes, w3 scales) views of the stacked w13) and
    their bit-plane copies ((w1 words, w3 words, scale words))."""
    w13c, w13s = w2_moe.random_planes(experts, hidden, intermediate, device=device, seed=seed)[:2]
    w1c, w1s, w3c, w3s = w2_moe._split_w13(w13c, w13s)
    (w1b, sb1), (w3b, sb3) = to_bitplanes(w1c, w1s), to_bitplanes(w3c, w3s)
    return (w1c, w1s, w3c, w3s), (w1b, w3b, pair_scale_words(sb1, sb3))


def bench(tokens: Sequence[int] = (1, 2, 4, 8, 16), hidden: int = 4096, intermediate: int = 2048,
          experts: int = 256, k: int = 6, limit: float = 10.0, splits: Sequence[int] = (1, 2, 4),
          l2_miss_bytes: int = 256 << 20, rep: int = 100) -> list[dict]:
    """Time the mma gate-up (w2_moe's default tiling for N) and the bit-plane one at each split, on the same random
    planes and routings, as CUDA-graph replays of back-to-back calls on different routings (their planes miss L2).
    GB/s counts the distinct experts' w1 + w3 bytes a call reads."""
    device = torch.device("cuda")
    (w1c, w1s, w3c, w3s), (w1b, w3b, ws) = random_gate_up_planes(experts, hidden, intermediate, device)
    w1c32, w1u, w3c32, w3u = w2_moe.gate_up_operands(w1c, w1s, w3c, w3s)
    per_expert = 2 * w2_moe.expert_bytes(hidden, intermediate) // 3
    print(f"gate-up alone, H {hidden} I {intermediate} E {experts} k {k}, bf16 x\n"
          f"{'kernel':18s} {'N':>3s} {'us':>8s} {'GB/s':>7s} {'vs mma':>7s}", flush=True)
    rows = []
    for n in tokens:
        routes, nbytes = w2_moe.miss_routes(n, experts, k, per_expert, l2_miss_bytes, device)
        x = torch.randn((n, hidden), device=device).to(torch.bfloat16)
        xp = w2_moe._pack_x(x, w2_moe._empty_packed(x))
        xq, cq = pack_x_planes(x)
        cfg = w2_moe.default_config(n)
        flat = [(ids.reshape(-1).contiguous(), w.reshape(-1).float().contiguous(), ids, w) for ids, w in routes]
        variants = [("mma " + f"g{cfg.gate_split}", [lambda f=f: w2_moe._gate_up_mma(x, xp, f[0], f[1], w1c32, w1u,
                                                                                     w3c32, w3u, limit, k, cfg)
                                                     for f in flat])]
        variants += [(f"bitplane s{s}", [lambda f=f, s=s: bitplane_gate_up(xq, cq, f[2], f[3], w1b, w3b, ws, limit,
                                                                           s) for f in flat])
                     for s in splits]
        base = None
        for name, fns in variants:
            us = graph_us(fns, rep)
            base = base or us
            rows.append({"kernel": name, "tokens": n, "us": us, "GB/s": nbytes / us / 1e3, "speedup": base / us})
            print(f"{name:18s} {n:3d} {us:8.1f} {nbytes / us / 1e3:7.0f} {base / us:7.2f}x", flush=True)
    return rows


def check(hidden: int = 512, intermediate: int = 256, experts: int = 8, k: int = 2, tokens: int = 3,
          limit: float = 10.0) -> dict:
    """The kernel against `gate_up_reference` on random planes (CUDA): relative errors against the quantized-x
    reference (only fp32 sums differ) and the exact-x one, and whether every output is finite."""
    device = torch.device("cuda")
    (w1c, w1s, w3c, w3s), (w1b, w3b, ws) = random_gate_up_planes(experts, hidden, intermediate, device, 3)
    ids, rw = w2_moe.random_routing(tokens, experts, k, device=device, seed=5)
    x = torch.randn((tokens, hidden), device=device).to(torch.bfloat16).float()
    got = bitplane_gate_up(*pack_x_planes(x), ids, rw, w1b, w3b, ws, limit).double()
    out = {"finite": bool(torch.isfinite(got).all())}
    for quantized in (True, False):
        ref = gate_up_reference(x, ids, rw, w1c, w1s, w3c, w3s, limit, quantized)
        out["quantized" if quantized else "exact"] = float((got - ref).norm() / ref.norm())
    return out


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.bitplane_gate_up", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--sass", action="store_true", help="only build for sm_90 and report the loop (no GPU needed)")
    args = p.parse_args(argv)
    print(versions())
    if args.sass:
        for s in args.splits:
            print(sass_report(s))
        return
    bench_start()
    print("check against the fp64 reference:", check())
    bench(tokens=args.tokens, splits=args.splits)


if __name__ == "__main__":
    main()
