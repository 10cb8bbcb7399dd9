"""One compressor step of the decode batch (`compress_step` of moebox/model/decode_attention.py) as ONE Triton
launch: ring stores, window gather, gated softmax pool, RMSNorm, RoPE, the QAT rounding of the entry (FP8 nope
channels, or Hadamard + FP4 for index keys), the entry store and the visibility mask.

What it computes (`compress_step_triton`, = `compress_step_reference` = `compress_step`), per sequence b of a
decode batch (one new token each), with p = pos[b], s = slot[b], size = ring rows, r = ratio, span = 2r (CSA,
`overlap`) or r (HCA), C = 2d (overlap) or d the raw row width:
  1. ring_kv[s, p % size] = kv[b]; ring_gate[s, p % size] = gate[b] (fp32 rows of width C);
  2. when the token closes window w = (p + 1) // r - 1, i.e. (p + 1) % r == 0: the span rows of positions
     (w + 1) r - span + j pool per channel: softmax over the rows of gate + ape[j % r], weights on the values;
     with overlap rows j < r (window w - 1, channels [:d]; absent when w == 0) and rows j >= r (window w,
     channels [d:]). e = RMSNorm(pooled; norm, eps), the trailing 2 len(inv_freq) channels rotated (interleaved
     pairs) at position w r; finish "kv": the first nope_dim channels rounded to FP8 e4m3 in blocks of 64 with
     a power-of-two scale; "index": a Hadamard transform over the d channels (a power of two) then FP4 e2m1
     in blocks of 32 with a power-of-two scale. entries[s, w] = e in the table's dtype;
  3. returns visible [B, n] bool: column c < (p + 1) // r (n = entries rows).
ONE DIFFERENCE from `compress_step`: a step that closes no window writes nothing to `entries`. The torch
code pools a meaningless window into the table's scratch last row n - 1 on such steps (shape-static torch
cannot skip the work); the kernel skips it. The scratch row is never visible (visible[:, n - 1] needs
p >= (n - 1) r, past the table) and is only ever read masked, so nothing that the model computes changes. It
keeps whatever it held (zeros from the cache allocation, or the last garbage of a torch step): finite values.
Everything else (real entry rows, ring rows, visibility mask) is what compress_step writes: ring rows bit for
bit, entries in fp32 math up to summation order / transcendental rounding (see Precision).

Why: compiled with torch.compile, compress_step is several kernels per compressor (ring scatters, the window
gather, the softmax pool, RMSNorm + RoPE + rounding, the entry scatter, the mask), each a few us even
replayed from a CUDA graph, and it pools (and reads span rows of) every sequence at every step although only
one step in r closes a window. CSA layers run it twice (main + indexer compressor), HCA layers once.

Kernel `_compress_kernel`, grid (B,): program b loads pos[b] and slot[b] on the device (no host sync; CUDA
graph capturable: the same launch serves every position), stores the new raw rows into the rings, writes the
mask row, and only if (p + 1) % r == 0 pools: the rows of the window are read in tiles of BLOCK_R rows x
D_PAD channels (fp32), the next tile loaded (and carried) before the current one is reduced, with a per-channel
online softmax (running max m, sum l, weighted sum acc: O(d) state, so HCA's 128 rows never sit in registers
at once). Rows of the window that this step stores (the token itself; in a speculative verify step also the
sequence's earlier tokens in the batch: rows with the same slot) are taken from kv/gate of the batch row that
stores them, found by scanning the batch's (slot, pos) on the device, never read back from the ring, where
another program may be storing them at that moment (compress_step stores every row before pooling any). The
other rows of the window are older positions (size >= span + the step's extra tokens - 1, as the cache's
speculative slack provides, so none is overwritten by this step). Then
RMSNorm over the row (it is whole in the program), RoPE (pairs split off with tl.split), the rounding, store.
One program per sequence: the pooling of a closing HCA window (512 KB of fp32 rows) runs on one SM; it runs
for 1 step in 128 of a sequence. A channel-split grid would need a grid-wide reduction for RMSNorm (a second
launch or a last-program-finishes counter); not done.

Precision: fp32 throughout, as the torch code. Ring rows are copies (bit for bit). Entries differ from the
torch code only by summation order (softmax pool, sum of squares) and the rounding of exp/cos/sin (CUDA:
libdevice expf/cosf/sinf, accurate with full range reduction; the interpreter: numpy), i.e. a few ulp before
the finish; the FP8/FP4 roundings are exact emulations (integer bit manipulation, round half to even, the
ue8m0 exponent ceil(log2(amax / qmax)) computed exactly from the float's bits), so a finish differs from the
torch one only where a value sits within those few ulp of a rounding midpoint (rare; one grid step then).
The Hadamard is the same butterfly (same adds in the same order) as `moebox.ops.qat.hadamard`, then a
correctly rounded division by fp32 sqrt(d), as torch's CPU division by a Python float. FMA contraction is off.

Bounds (`supported`): kv, gate [B, C] fp32/bf16/fp16 (the projections' rows; stored widened to fp32) with unit
stride on C; pos, slot [B] int32/int64; ring_kv, ring_gate plain fp32 tensors [S, size, C] with unit stride on
C and size >= span; entries a plain tensor [S, n, d] fp32/bf16/fp16 with unit stride on d (not the FP8/FP4
row objects of model/cache.py: kv_layout="fp8" takes the torch path); C = 2d with overlap else d; 1 <= d <=
1024; ape [r, C], norm [d] float; inv_freq 1-D fp32 with 2 <= 2 len(inv_freq) <= d, d - 2 len(inv_freq) even;
ratio >= 1; finish None, "kv" (0 <= nope_dim <= d) or "index" (d a power of two); everything on one device:
CUDA, or CPU under TRITON_INTERPRET=1 (no bf16 table there: the interpreter truncates fp32 -> bf16); B <= 1024.
A slot may appear in several batch rows (a verify step's consecutive tokens; the CUDA graphs' padding rows,
all at position 0 of one scratch slot): rows of one slot whose positions share a ring row race for it, as
torch's duplicate-index stores do (of the engine's batches only the padding rows do, in the scratch slot).
Anything else: `compress_decode` calls the torch `compress_step`.

Wiring: `Attention._compress` (moebox/model/attention.py) calls `compress_decode` on CUDA (MOEBOX_COMPRESS_KERNEL=0
turns it off), with the same arguments as `compress_step`.

`python -m moebox.ops.triton.compress_decode [--batch 1 4 16] [--kind csa index hca]` times it against the
compiled torch compress_step at the V4-Flash shapes in CUDA-graph replay (`--sass`: the sm_90 build report,
no GPU needed).
"""

from __future__ import annotations

import argparse
import functools
import math
from dataclasses import dataclass
from typing import Sequence

import torch

from moebox.ops.fuse import eager
from moebox.ops.triton.runtime import (HAVE_TRITON, bench_start, build_sm90, cubin_dump, device_cos,  # noqa: F401
                                       device_exp, device_sin, graph_us, interpreting, kernel_or_fallback,
                                       next_pow2, pdl_args, pdl_start, plain_tensor, tl, triton)

__all__ = ["CompressConfig", "pick_config", "supported", "compress_step_triton", "compress_step_reference",
           "compress_decode", "random_inputs", "clone_inputs", "positional", "V4_SHAPES", "sass_report", "bench",
           "main"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_INDEX_DTYPES = (torch.int32, torch.int64)
_FINISH = {None: 0, "kv": 1, "index": 2}
FP8_BLOCK, FP4_BLOCK = 64, 32
MAX_D = 1024
MAX_B = 1024      # batch rows a program scans for rows of its slot written in the same step


@dataclass(frozen=True)
class CompressConfig:
    """`block_rows` window rows per tile (0: automatic, up to 4K fp32 elements a tile, at most the ratio rounded
    up to a power of two), `num_warps` (0: one warp per 256 elements of a tile, 4 to 16), `vis_block` mask
    columns per store. Built for sm_90 (`sass_report`), V4-Flash: CSA main 4 rows x 512 / 8 warps, indexer
    4 x 128 / 4, HCA 8 x 512 / 16 warps (~105 registers, nothing spilled but libdevice's trig array; HCA
    16 x 512 spills at 16 warps (128 registers a thread) and needs ~255 at 8). NOT YET TIMED on a GPU:
    `--block-rows` / `--num-warps` of the bench try others."""

    block_rows: int = 0
    num_warps: int = 0
    vis_block: int = 1024


DEFAULT_CONFIG = CompressConfig()


def _batch_pad(b: int) -> int:
    """The batch rows a program scans for rows written into its slot: B rounded up to a power of two >= 16."""
    return max(16, next_pow2(b))


def _d_pad(d: int, finish: str | None) -> int:
    """Channels a program holds: d rounded up to a power of two, at least one rounding block."""
    return max(next_pow2(d), {None: 16, "kv": FP8_BLOCK, "index": FP4_BLOCK}[finish], 16)


def pick_config(d: int, ratio: int, finish: str | None = None, config: CompressConfig | None = None) -> CompressConfig:
    """`config` (default DEFAULT_CONFIG) with block_rows and num_warps resolved for d channels and this ratio."""
    cfg = config or DEFAULT_CONFIG
    dp = _d_pad(d, finish)
    br = next_pow2(cfg.block_rows or max(1, min(next_pow2(ratio), 4096 // dp)))
    nw = cfg.num_warps or max(4, min(16, br * dp // 256))
    return CompressConfig(block_rows=br, num_warps=nw, vis_block=next_pow2(max(16, cfg.vis_block)))


# ----------------------------------------------------------------------------------------------- kernels
if HAVE_TRITON:
    @triton.jit
    def _pow2f(k):
        """2^k as fp32 for int32 k in [-127, 127], exactly (2^-127 is subnormal)."""
        normal = ((k + 127) << 23).to(tl.float32, bitcast=True)
        sub = (k * 0 + 0x400000).to(tl.float32, bitcast=True)
        return tl.where(k >= -126, normal, sub)

    @triton.jit
    def _pow2_exponent(amax, QMAX: tl.constexpr):
        """ceil(log2(max(amax, tiny) / QMAX)) clamped to [-127, 127] (weights/formats.py pow2_exponent), exactly:
        from the bits of the quotient (normal: the exponent, +1 unless the mantissa is 0)."""
        v = tl.div_rn(tl.maximum(amax, 1.1754943508222875e-38), tl.full(amax.shape, QMAX, tl.float32))
        bits = v.to(tl.int32, bitcast=True)
        ex = (bits >> 23) & 0xFF
        man = bits & 0x7FFFFF
        e = ex - 127 + (man != 0).to(tl.int32)
        e = tl.where(ex == 0, tl.where(man > 0x400000, -126, -127), e)       # subnormal quotient
        return tl.minimum(tl.maximum(e, -127), 127)

    @triton.jit
    def _rne(t):
        """t >= 0 (< 2^31) rounded to the nearest integer, ties to even, exactly."""
        f = t.to(tl.int32)
        fr = t - f.to(tl.float32)
        up = (fr > 0.5) | ((fr == 0.5) & ((f & 1) == 1))
        return (f + up.to(tl.int32)).to(tl.float32)

    @triton.jit
    def _round_e4m3(y):
        """y (|y| <= 448) to the nearest FP8 e4m3fn value, ties to even (torch's .to(float8_e4m3fn))."""
        a = tl.abs(y)
        ex = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) & 0xFF, 121)     # below 2^-6: subnormal step 2^-9
        q = _rne(a * _pow2f(130 - ex)) * _pow2f(ex - 130)                      # 3 mantissa bits
        q = tl.minimum(q, 448.0)
        return tl.where(y < 0, -q, q)

    @triton.jit
    def _round_e2m1(y):
        """y to the nearest FP4 e2m1 value (grid 0 .5 1 1.5 2 3 4 6, magnitudes clamped to 6), ties to even
        (weights/formats.py fp4_codes_from_values + fp4_values_from_codes)."""
        mag = tl.minimum(tl.abs(y), 6.0)
        k = tl.where(mag < 2.0, 2.0, tl.where(mag < 4.0, 1.0, 0.5))
        inv = tl.where(mag < 2.0, 0.5, tl.where(mag < 4.0, 1.0, 2.0))
        q = _rne(mag * k) * inv
        return tl.where(y < 0, -q, q)

    @triton.jit
    def _blockwise_round(x, D_PAD: tl.constexpr, BLOCK: tl.constexpr, QMAX: tl.constexpr, FP8: tl.constexpr):
        """x [D_PAD] (zero where not rounded) in blocks of BLOCK, each with its power-of-two scale
        (qat.py _blockwise_round)."""
        xb = tl.reshape(x, (D_PAD // BLOCK, BLOCK))
        e = _pow2_exponent(tl.max(tl.abs(xb), axis=1), QMAX)
        y = xb * _pow2f(-e)[:, None]
        if FP8:
            q = _round_e4m3(y)
        else:
            q = _round_e2m1(y)
        return tl.reshape(q * _pow2f(e)[:, None], (D_PAD,))

    @triton.jit
    def _hadamard(x, sqrt_d, D_PAD: tl.constexpr, LOG2D: tl.constexpr):
        """qat.py hadamard over the first 2^LOG2D channels of x [D_PAD] (the rest zero and left zero): the same
        butterfly stages (y0 + y1, y0 - y1) with the same pairing, then / fp32 sqrt(d) correctly rounded."""
        for st in tl.static_range(LOG2D):
            y = tl.permute(tl.reshape(x, (D_PAD // (2 << st), 2, 1 << st)), (0, 2, 1))     # [blocks, h, 2]
            y0, y1 = tl.split(y)
            x = tl.reshape(tl.permute(tl.join(y0 + y1, y0 - y1), (0, 2, 1)), (D_PAD,))
        return tl.div_rn(x, tl.full(x.shape, 1.0, tl.float32) * sqrt_d)

    @triton.jit
    def _window_tile(rkv_b, rgate_b, kv_ptr, gate_ptr, s_kv, s_gate, ape_ptr, s_rkr, s_rgr, s_ape, base, j0, J_END,
                     SIZE, pos_same, CH: tl.constexpr, R: tl.constexpr, BR: tl.constexpr, B_PAD: tl.constexpr, offs,
                     md):
        """Values and gates (+ ape, -inf on rows past J_END) [BR, D_PAD] of window rows j0.. (channels CH..): the
        row of position q = base + j from kv/gate of the batch row that writes q into this slot in this step
        (`pos_same`: each batch row's position if it has this program's slot, else -1), otherwise from the ring."""
        jj = j0 + tl.arange(0, BR)
        valid = jj < J_END
        q = base + jj
        src = tl.max(tl.where(pos_same[None, :] == q.to(tl.int32)[:, None], tl.arange(0, B_PAD)[None, :], -1), axis=1)
        new = valid & (src >= 0)
        old = valid & (src < 0)
        rr = (q % SIZE).to(tl.int64)
        src = tl.maximum(src, 0).to(tl.int64)
        cols = CH + offs[None, :]
        m2 = md[None, :]
        v = tl.where(new[:, None], tl.load(kv_ptr + src[:, None] * s_kv + cols, mask=new[:, None] & m2,
                                           other=0.0).to(tl.float32),
                     tl.load(rkv_b + rr[:, None] * s_rkr + cols, mask=old[:, None] & m2, other=0.0))
        g = tl.where(new[:, None], tl.load(gate_ptr + src[:, None] * s_gate + cols, mask=new[:, None] & m2,
                                           other=0.0).to(tl.float32),
                     tl.load(rgate_b + rr[:, None] * s_rgr + cols, mask=old[:, None] & m2, other=0.0))
        a = tl.load(ape_ptr + (jj % R).to(tl.int64)[:, None] * s_ape + cols, mask=valid[:, None] & m2,
                    other=0.0).to(tl.float32)
        g = tl.where(valid[:, None], g + a, float("-inf"))
        return v, g

    @triton.jit
    def _pool_rows(m, l, acc, rkv_b, rgate_b, kv_ptr, gate_ptr, s_kv, s_gate, ape_ptr, s_rkr, s_rgr, s_ape, base,
                   SIZE, pos_same, J0: tl.constexpr, J_END: tl.constexpr, CH: tl.constexpr, R: tl.constexpr,
                   BR: tl.constexpr, B_PAD: tl.constexpr, offs, md, PRECISE: tl.constexpr):
        """Online per-channel softmax pool of window rows [J0, J_END) into (m, l, acc) [D_PAD]. With several
        tiles, each is loaded one iteration ahead of its reduction (carried), so its load is in flight while the
        previous tile is reduced. The first tile must hold a row (m may start at -inf)."""
        NT: tl.constexpr = (J_END - J0 + BR - 1) // BR
        v, g = _window_tile(rkv_b, rgate_b, kv_ptr, gate_ptr, s_kv, s_gate, ape_ptr, s_rkr, s_rgr, s_ape, base, J0,
                            J_END, SIZE, pos_same, CH, R, BR, B_PAD, offs, md)
        if NT == 1:
            m, l, acc = _softmax_tile(m, l, acc, v, g, PRECISE)
        else:
            for t in range(1, NT + 1):          # the last iteration's load is masked off entirely
                v_n, g_n = _window_tile(rkv_b, rgate_b, kv_ptr, gate_ptr, s_kv, s_gate, ape_ptr, s_rkr, s_rgr, s_ape,
                                        base, J0 + t * BR, J_END, SIZE, pos_same, CH, R, BR, B_PAD, offs, md)
                m, l, acc = _softmax_tile(m, l, acc, v, g, PRECISE)
                v = v_n
                g = g_n
        return m, l, acc

    @triton.jit
    def _softmax_tile(m, l, acc, v, g, PRECISE: tl.constexpr):
        """One tile of rows into the running per-channel (max m, sum l, weighted sum acc)."""
        m_new = tl.maximum(m, tl.max(g, axis=0))
        alpha = device_exp(m - m_new, PRECISE)
        p = device_exp(g - m_new[None, :], PRECISE)
        l = l * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p * v, axis=0)
        return m_new, l, acc

    @triton.jit
    def _compress_kernel(kv_ptr, gate_ptr, pos_ptr, slot_ptr, rkv_ptr, rgate_ptr, ent_ptr, ape_ptr, norm_ptr,
                         freq_ptr, vis_ptr,
                         B, SIZE, N, eps, sqrt_d,
                         s_pos, s_slot, s_kv, s_gate, s_rks, s_rkr, s_rgs, s_rgr, s_es, s_er, s_ape, s_vis,
                         D: tl.constexpr, D_PAD: tl.constexpr, R: tl.constexpr, OVERLAP: tl.constexpr,
                         HALF_RD: tl.constexpr, NOPE: tl.constexpr, FINISH: tl.constexpr, LOG2D: tl.constexpr,
                         BR: tl.constexpr, B_PAD: tl.constexpr, VB: tl.constexpr, PRECISE: tl.constexpr,
                         PDL: tl.constexpr):
        """Program b: sequence b's ring stores, mask row, and (when its token closes a window) entry."""
        pdl_start(PDL)
        b = tl.program_id(0).to(tl.int64)
        p = tl.load(pos_ptr + b * s_pos).to(tl.int64)
        s = tl.load(slot_ptr + b * s_slot).to(tl.int64)
        offs = tl.arange(0, D_PAD)
        md = offs < D
        kv_b = kv_ptr + b * s_kv
        gate_b = gate_ptr + b * s_gate
        rkv_b = rkv_ptr + s * s_rks
        rgate_b = rgate_ptr + s * s_rgs
        # 1. the raw rows into the rings (the pool below takes the rows written in this step from kv/gate)
        row = p % SIZE
        for h in tl.static_range(2 if OVERLAP else 1):
            x = tl.load(kv_b + h * D + offs, mask=md).to(tl.float32)
            tl.store(rkv_b + row * s_rkr + h * D + offs, x, mask=md)
            x = tl.load(gate_b + h * D + offs, mask=md).to(tl.float32)
            tl.store(rgate_b + row * s_rgr + h * D + offs, x, mask=md)
        # 2. visibility: entries [0, (p + 1) // r)
        nv = (p + 1) // R
        for c0 in range(0, N, VB):
            cols = c0 + tl.arange(0, VB)
            tl.store(vis_ptr + b * s_vis + cols, (cols < nv).to(tl.uint8), mask=cols < N)
        # 3. the entry of the window this token closes
        SPAN: tl.constexpr = 2 * R if OVERLAP else R
        if (p + 1) % R == 0:
            w = (p + 1) // R - 1
            base = (w + 1) * R - SPAN                         # position of window row 0
            # the batch rows that store into this slot in this step (this one; a speculative verify step's
            # earlier tokens of the sequence): their rows come from kv/gate, as other programs may be storing them
            bb = tl.arange(0, B_PAD)
            pb = tl.load(pos_ptr + bb * s_pos, mask=bb < B, other=-1).to(tl.int64)
            sb = tl.load(slot_ptr + bb * s_slot, mask=bb < B, other=-1).to(tl.int64)
            pos_same = tl.where((bb < B) & (sb == s), pb, -1).to(tl.int32)        # positions < 2^31
            m = tl.full([D_PAD], float("-inf"), tl.float32)
            l = tl.zeros([D_PAD], dtype=tl.float32)
            acc = tl.zeros([D_PAD], dtype=tl.float32)
            # window w's rows (channels [d:] with overlap) first: they always exist, so m is finite after them
            m, l, acc = _pool_rows(m, l, acc, rkv_b, rgate_b, kv_ptr, gate_ptr, s_kv, s_gate, ape_ptr, s_rkr, s_rgr,
                                   s_ape, base, SIZE, pos_same, SPAN - R, SPAN, D if OVERLAP else 0, R, BR, B_PAD,
                                   offs, md, PRECISE)
            if OVERLAP:
                if w > 0:                                      # window w-1's rows, channels [:d]
                    m, l, acc = _pool_rows(m, l, acc, rkv_b, rgate_b, kv_ptr, gate_ptr, s_kv, s_gate, ape_ptr, s_rkr,
                                           s_rgr, s_ape, base, SIZE, pos_same, 0, R, 0, R, BR, B_PAD, offs, md,
                                           PRECISE)
            e = tl.where(md, tl.div_rn(acc, l), 0.0)
            # RMSNorm (fp32): e * 1/sqrt(mean(e^2) + eps) * norm
            ms = tl.div_rn(tl.sum(e * e, axis=0), D * 1.0)
            rs = tl.div_rn(1.0, tl.sqrt_rn(ms + eps))
            e = (e * rs) * tl.load(norm_ptr + offs, mask=md, other=0.0).to(tl.float32)
            # RoPE on the trailing 2 * HALF_RD channels, pairs (2i, 2i+1), at position w * r
            if HALF_RD > 0:
                ev, od = tl.split(tl.reshape(e, (D_PAD // 2, 2)))
                k = tl.arange(0, D_PAD // 2)
                f = k - (D // 2 - HALF_RD)
                rope = (f >= 0) & (k < D // 2)
                ang = (w * R).to(tl.float32) * tl.load(freq_ptr + f, mask=rope, other=0.0).to(tl.float32)
                c = device_cos(ang, PRECISE)
                sn = device_sin(ang, PRECISE)
                ev2 = tl.where(rope, ev * c - od * sn, ev)
                od2 = tl.where(rope, od * c + ev * sn, od)
                e = tl.reshape(tl.join(ev2, od2), (D_PAD,))
            if FINISH == 1:      # FP8 e4m3 on channels [0, NOPE), blocks of 64 from channel 0
                if NOPE > 0:
                    e = tl.where(offs < NOPE, _blockwise_round(tl.where(offs < NOPE, e, 0.0), D_PAD, 64, 448.0, True),
                                 e)
            elif FINISH == 2:    # Hadamard over d, FP4 e2m1 in blocks of 32
                e = _blockwise_round(_hadamard(e, sqrt_d, D_PAD, LOG2D), D_PAD, 32, 6.0, False)
            in_table = (offs * 0 + w) < N                      # a position past the table writes nothing
            tl.store(ent_ptr + s * s_es + w * s_er + offs, e.to(ent_ptr.dtype.element_ty), mask=md & in_table)


# ----------------------------------------------------------------------------------------------- wrappers
def supported(kv: torch.Tensor, gate: torch.Tensor, pos: torch.Tensor, slot: torch.Tensor, ring_kv: object,
              ring_gate: object, entries: object, ape: torch.Tensor, norm: torch.Tensor, inv_freq: torch.Tensor,
              ratio: int, overlap: bool, eps: float = 1e-6, finish: str | None = None, nope_dim: int = 0) -> bool:
    """Whether `compress_step_triton` takes these arguments (the module docstring's Bounds); `compress_decode`
    calls the torch `compress_step` otherwise."""
    if not HAVE_TRITON or not plain_tensor(kv, 2) or finish not in _FINISH:
        return False
    dev = kv.device
    if not (dev.type == "cuda" or (interpreting() and dev.type == "cpu")):
        return False
    if not isinstance(ratio, int) or isinstance(ratio, bool) or ratio < 1:
        return False
    b, c = kv.shape
    d = c // 2 if overlap else c
    if d < 1 or d > MAX_D or c != (2 if overlap else 1) * d or b > MAX_B:
        return False

    def same(t: object, dims: int, dtypes: tuple) -> bool:
        return plain_tensor(t, dims) and t.dtype in dtypes and t.device == dev

    for t in (kv, gate):        # the projections' rows, any float dtype (widened to the rings' fp32)
        if not (same(t, 2, _FLOATS) and tuple(t.shape) == (b, c) and t.stride(1) == 1):
            return False
    for t in (pos, slot):
        if not (same(t, 1, _INDEX_DTYPES) and t.shape[0] == b):
            return False
    span = (2 if overlap else 1) * ratio
    for t in (ring_kv, ring_gate):
        if not (same(t, 3, (torch.float32,)) and t.shape[2] == c and t.shape[1] >= span and t.stride(2) == 1):
            return False
    # the interpreter truncates fp32 -> bf16 (no round to nearest even): no bf16 table there
    table_dtypes = _FLOATS if dev.type == "cuda" else (torch.float32, torch.float16)
    if not (same(entries, 3, table_dtypes) and entries.shape[2] == d and entries.shape[1] >= 1
            and entries.stride(2) == 1):
        return False
    if not (same(ape, 2, _FLOATS) and tuple(ape.shape) == (ratio, c)):
        return False
    if not (isinstance(norm, torch.Tensor) and norm.numel() == d and norm.dtype in _FLOATS and norm.device == dev):
        return False
    rd = 2 * inv_freq.numel() if isinstance(inv_freq, torch.Tensor) else 0
    if not (same(inv_freq, 1, (torch.float32,)) and 2 <= rd <= d and (d - rd) % 2 == 0):
        return False
    if finish == "kv" and not 0 <= nope_dim <= d:
        return False
    if finish == "index" and d & (d - 1):
        return False
    return True


def compress_step_triton(kv: torch.Tensor, gate: torch.Tensor, pos: torch.Tensor, slot: torch.Tensor,
                         ring_kv: torch.Tensor, ring_gate: torch.Tensor, entries: torch.Tensor, ape: torch.Tensor,
                         norm: torch.Tensor, inv_freq: torch.Tensor, ratio: int, overlap: bool, eps: float,
                         finish: str | None, nope_dim: int, *, out: torch.Tensor | None = None,
                         config: CompressConfig | None = None) -> torch.Tensor:
    """`compress_step` in one launch (see the module docstring; a step that closes no window leaves the scratch
    row alone). Mutates ring_kv, ring_gate, entries; returns visible [B, n] bool (into `out` when given: a
    contiguous bool [B, n]). Runs on CUDA, or on CPU tensors under TRITON_INTERPRET=1; raises ValueError where
    `supported` is False."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed")
    if not supported(kv, gate, pos, slot, ring_kv, ring_gate, entries, ape, norm, inv_freq, ratio, overlap, eps,
                     finish, nope_dim):
        raise ValueError(f"unsupported arguments: kv {tuple(kv.shape)} {kv.dtype} on {kv.device}, ring "
                         f"{getattr(ring_kv, 'shape', type(ring_kv))}, entries "
                         f"{getattr(entries, 'shape', type(entries))} {getattr(entries, 'dtype', '')}, ratio "
                         f"{ratio}, overlap {overlap}, finish {finish!r} (see `supported`)")
    b, c = kv.shape
    d = c // 2 if overlap else c
    n = entries.shape[1]
    if out is None:
        out = torch.empty((b, n), dtype=torch.bool, device=kv.device)
    elif tuple(out.shape) != (b, n) or out.dtype != torch.bool or out.device != kv.device or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous bool [{b}, {n}] on {kv.device}")
    if b == 0:
        return out
    cfg = pick_config(d, ratio, finish, config)
    dp = _d_pad(d, finish)
    ape = ape if ape.stride(1) == 1 else ape.contiguous()
    norm = norm.reshape(d)
    norm = norm if norm.stride(0) == 1 else norm.contiguous()
    inv_freq = inv_freq if inv_freq.stride(0) == 1 else inv_freq.contiguous()
    vis = out.view(torch.uint8)
    kwargs = {} if interpreting() else {"enable_fp_fusion": False}
    _compress_kernel[(b,)](
        kv, gate, pos, slot, ring_kv, ring_gate, entries, ape, norm, inv_freq, vis,
        b, ring_kv.shape[1], n, float(eps), _fp32_sqrt(d),
        pos.stride(0), slot.stride(0), kv.stride(0), gate.stride(0), ring_kv.stride(0), ring_kv.stride(1),
        ring_gate.stride(0), ring_gate.stride(1), entries.stride(0), entries.stride(1), ape.stride(0), vis.stride(0),
        D=d, D_PAD=dp, R=ratio, OVERLAP=bool(overlap), HALF_RD=inv_freq.numel(), NOPE=int(nope_dim) if finish == "kv"
        else 0, FINISH=_FINISH[finish], LOG2D=max(0, d.bit_length() - 1) if finish == "index" else 0,
        BR=cfg.block_rows, B_PAD=_batch_pad(b), VB=cfg.vis_block, PRECISE=kv.device.type == "cuda",
        num_warps=cfg.num_warps, **kwargs, **pdl_args(kv, _compress_kernel))
    return out


@functools.lru_cache(maxsize=None)
def _fp32_sqrt(d: int) -> float:
    """sqrt(d) rounded to fp32: the divisor torch uses for `x / math.sqrt(d)` on an fp32 tensor."""
    return float(torch.tensor(math.sqrt(d), dtype=torch.float32))


def compress_step_reference(kv: torch.Tensor, gate: torch.Tensor, pos: torch.Tensor, slot: torch.Tensor,
                            ring_kv, ring_gate, entries, ape: torch.Tensor, norm: torch.Tensor,
                            inv_freq: torch.Tensor, ratio: int, overlap: bool, eps: float, finish: str | None,
                            nope_dim: int) -> torch.Tensor:
    """The torch `compress_step` (moebox/model/decode_attention.py), run eagerly (no torch.compile)."""
    from moebox.model.decode_attention import compress_step
    with eager():
        return compress_step(kv, gate, pos, slot, ring_kv, ring_gate, entries, ape, norm, inv_freq, ratio, overlap,
                             eps, finish, nope_dim)


def compress_decode(kv: torch.Tensor, gate: torch.Tensor, pos: torch.Tensor, slot: torch.Tensor, ring_kv,
                    ring_gate, entries, ape: torch.Tensor, norm: torch.Tensor, inv_freq: torch.Tensor, ratio: int,
                    overlap: bool, eps: float, finish: str | None, nope_dim: int) -> torch.Tensor:
    """The dispatch for the model: `compress_step_triton` where `supported`, else the torch `compress_step`
    (compiled on CUDA as today). Same arguments and return value as `compress_step`."""
    from moebox.model.decode_attention import compress_step
    args = (kv, gate, pos, slot, ring_kv, ring_gate, entries, ape, norm, inv_freq, ratio, overlap, eps, finish,
            nope_dim)
    if supported(*args):
        return kernel_or_fallback("compressor step", "MOEBOX_COMPRESS_KERNEL", lambda: compress_step_triton(*args),
                                  lambda: compress_step(*args))
    return compress_step(*args)


# ----------------------------------------------------------------------------------------------- inputs
V4_SHAPES = {   # kind -> V4-Flash compressor: d, ratio, overlap, table rows (+ scratch), QAT finish
    "csa": dict(d=512, ratio=4, overlap=True, table_rows=4097, finish="kv"),        # 16K context
    "index": dict(d=128, ratio=4, overlap=True, table_rows=4097, finish="index"),   # the CSA indexer's keys
    "hca": dict(d=512, ratio=128, overlap=False, table_rows=513, finish="kv"),      # 64K context
}


def random_inputs(batch: int, d: int = 512, ratio: int = 4, overlap: bool = True, rope_dim: int = 64,
                  ring_rows: int | None = None, table_rows: int = 4097, finish: str | None = "kv",
                  nope_dim: int | None = None, entry_dtype: torch.dtype = torch.bfloat16, slots: int | None = None,
                  close: bool | Sequence[bool] | None = None, positions: Sequence[int] | None = None,
                  device: torch.device | str = "cuda", seed: int = 0, eps: float = 1e-6) -> dict:
    """Keyword arguments of `compress_step` for one decode step (V4-Flash CSA main compressor by default):
    kv, gate [B, C] ~N(0, 1) fp32 (C = 2d with overlap), rings [slots, ring_rows (default span + 2), C] filled
    with random values (every row "written"), entries [slots, table_rows, d] zeros, ape ~N(0, 0.5^2) [ratio, C],
    norm ~1 + N(0, 0.1^2), inv_freq of a rope_dim RoPE with theta 1.6e5. Sequence b uses slot 2b + 1 (of
    `slots`, default 2B + 1). Positions: `positions`, else random below the table's end, each closing a window
    if `close` says so (a bool for all, or one per sequence; None: random)."""
    from moebox.ops.rope import rope_inv_freq
    device = torch.device(device)
    g = torch.Generator(device="cpu").manual_seed(seed)
    c = (2 if overlap else 1) * d
    span = (2 if overlap else 1) * ratio
    ring_rows = ring_rows or span + 2
    slots = slots or 2 * batch + 1
    if positions is None:
        top = max(1, (table_rows - 1) * ratio)              # positions whose window has a real table row
        pos = torch.randint(0, top, (batch,), generator=g)
        if close is not None:
            flags = [close] * batch if isinstance(close, bool) else list(close)
            for i, f in enumerate(flags):
                k = int(pos[i]) // ratio
                if f:
                    pos[i] = k * ratio + ratio - 1
                elif ratio > 1:
                    pos[i] = k * ratio + int(torch.randint(0, ratio - 1, (1,), generator=g))
    else:
        pos = torch.tensor(list(positions), dtype=torch.int64)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(shape, generator=g)).to(device)

    out = dict(kv=rnd(batch, c), gate=rnd(batch, c), pos=pos.to(device),
               slot=((2 * torch.arange(batch) + 1) % slots).to(device),
               ring_kv=rnd(slots, ring_rows, c), ring_gate=rnd(slots, ring_rows, c),
               entries=torch.zeros((slots, table_rows, d), dtype=entry_dtype, device=device),
               ape=rnd(ratio, c, scale=0.5),
               norm=1.0 + rnd(d, scale=0.1), inv_freq=rope_inv_freq(rope_dim, 160000.0, None).to(device),
               ratio=ratio, overlap=overlap, eps=eps, finish=finish,
               nope_dim=d - rope_dim if nope_dim is None else nope_dim)
    return out


ARG_NAMES = ("kv", "gate", "pos", "slot", "ring_kv", "ring_gate", "entries", "ape", "norm", "inv_freq", "ratio",
             "overlap", "eps", "finish", "nope_dim")


def positional(inp: dict) -> tuple:
    """`compress_step`'s arguments in order (a @fused function needs its first argument positional)."""
    return tuple(inp[name] for name in ARG_NAMES)


def clone_inputs(inp: dict) -> dict:
    """A copy whose tensors the kernel / reference may mutate independently."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inp.items()}


# ----------------------------------------------------------------------------------------------- sm_90 build
def sass_report(kind: str = "csa", config: CompressConfig | None = None, precise: bool = True,
                batch: int = 16) -> dict:
    """Build `_compress_kernel` for sm_90 at a V4-Flash shape (`V4_SHAPES`) on any machine with Triton's NVIDIA
    backend (no GPU needed): registers, spill stack, and a few SASS counts (MUFU: exp/cos/sin/rsqrt on the
    special function unit; LDG / STG: global loads / stores; LDL / STL: local-memory traffic)."""
    import collections
    import re

    shp = V4_SHAPES[kind]
    d, ratio, overlap, finish = shp["d"], shp["ratio"], shp["overlap"], shp["finish"]
    cfg = pick_config(d, ratio, finish, config)
    fn = _compress_kernel
    names = fn.arg_names
    ptrs = dict(kv_ptr="fp32", gate_ptr="fp32", pos_ptr="i64", slot_ptr="i64", rkv_ptr="fp32", rgate_ptr="fp32",
                ent_ptr="bf16", ape_ptr="fp32", norm_ptr="bf16", freq_ptr="fp32", vis_ptr="u8")
    c = (2 if overlap else 1) * d
    size = (2 if overlap else 1) * ratio + 2
    ints = dict(B=batch, SIZE=size, N=shp["table_rows"], s_pos=1, s_slot=1, s_kv=c, s_gate=c, s_rks=size * c,
                s_rkr=c, s_rgs=size * c, s_rgr=c, s_es=shp["table_rows"] * d, s_er=d, s_ape=c, s_vis=shp["table_rows"])
    const = dict(D=d, D_PAD=_d_pad(d, finish), R=ratio, OVERLAP=overlap, HALF_RD=32, NOPE=d - 64 if finish == "kv"
                 else 0, FINISH=_FINISH[finish], LOG2D=d.bit_length() - 1 if finish == "index" else 0,
                 BR=cfg.block_rows, B_PAD=_batch_pad(batch), VB=cfg.vis_block, PRECISE=precise, PDL=False)
    sig = {a: "*" + ptrs[a] if a in ptrs else "fp32" if a in ("eps", "sqrt_d") else "i32" for a in names
           if a not in const}
    aligned = [a for a in names if a in ptrs or (a in ints and ints[a] % 16 == 0)]
    compiled = build_sm90(fn, sig, const, aligned, num_warps=cfg.num_warps, enable_fp_fusion=False)
    dump = cubin_dump(compiled.asm["cubin"])
    ops = collections.Counter(re.findall(r"\b(MUFU|LDG|STG|LDL|STL|BAR|FFMA)\b", dump[0]))
    return {"kind": kind, "config": cfg, "registers": int(re.search(r"REG:(\d+)", dump[1]).group(1)),
            "spills": int(re.search(r"STACK:(\d+)", dump[1]).group(1)), "shared": compiled.metadata.shared,
            "sass": dict(ops)}


# ----------------------------------------------------------------------------------------------- bench
def _entry_rows(inp: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots, rows) of the entries a step writes: row w of the sequences that close a window."""
    pos, r = inp["pos"], inp["ratio"]
    closes = (pos + 1) % r == 0
    return inp["slot"][closes], ((pos + 1) // r - 1)[closes]


def bench(device: str | torch.device = "cuda", batches: Sequence[int] = (1, 4, 16),
          kinds: Sequence[str] = ("csa", "index", "hca"), torch_ref: bool = True, l2_miss_bytes: int = 192 << 20,
          max_copies: int = 64, config: CompressConfig | None = None, quiet: bool = False) -> list[dict]:
    """compress_step at the V4-Flash shapes (`V4_SHAPES`, QAT finish, bf16 entries, rings of span + 2 rows):
    the kernel vs the compiled torch compress_step, each as a CUDA graph of `copies` back-to-back calls on
    distinct slots (ring bytes >= l2_miss_bytes in all, so rows come from DRAM as consecutive layers' would).
    Two batches of positions: every sequence closing a window ("close", the kernel's worst case) and none
    ("open"); torch does the same work for both. Prints a table; returns its rows."""
    from moebox.model.decode_attention import compress_step
    device = torch.device(device)
    rows = []
    if not quiet:
        print(f"compress_step, V4-Flash, CUDA-graph replay, rings cycled past L2\n"
              f"{'kind':6s} {'B':>3s} {'copies':>6s} | {'close us':>8s} {'open us':>8s} | {'torch us':>8s} | "
              f"{'speedup close/open':>18s} | max rel err", flush=True)
    for kind in kinds:
        shp = V4_SHAPES[kind]
        for b in batches:
            span = (2 if shp["overlap"] else 1) * shp["ratio"]
            ring_bytes = b * (span + 2) * (2 if shp["overlap"] else 1) * shp["d"] * 4 * 2
            copies = max(1, min(max_copies, -(-l2_miss_bytes // ring_bytes)))
            res: dict = dict(kind=kind, B=b, copies=copies)
            for mode in ("close", "open"):
                inp = random_inputs(b, **shp, slots=b * copies, close=mode == "close", device=device, seed=b)
                slots = [torch.arange(i * b, (i + 1) * b, device=device) for i in range(copies)]
                args = {k: v for k, v in inp.items() if k != "slot"}
                # correctness on the first copy: rings equal, the written entries close to the eager reference
                a, r_ = clone_inputs(inp), clone_inputs(inp)
                a["slot"] = r_["slot"] = slots[0]
                vis = compress_step_triton(**a, config=config)
                vis_ref = compress_step_reference(**r_)
                es, ew = _entry_rows(a)
                err = 0.0
                if es.numel():
                    got, ref = a["entries"][es, ew].float(), r_["entries"][es, ew].float()
                    err = float(((got - ref).norm(dim=-1) / ref.norm(dim=-1)).max())
                assert torch.equal(vis, vis_ref) and torch.equal(a["ring_kv"], r_["ring_kv"])
                res[f"{mode}_rel_err"] = err
                outs = [torch.empty((b, inp["entries"].shape[1]), dtype=torch.bool, device=device) for _ in range(2)]
                res[f"{mode}_us"] = graph_us([lambda s=s, o=outs[i % 2], kw=args: compress_step_triton(
                    slot=s, **kw, out=o, config=config) for i, s in enumerate(slots)])
                if torch_ref and mode == "close":
                    res["torch_us"] = graph_us([lambda s=s, kw=args: compress_step(*positional(dict(kw, slot=s)))
                                                 for s in slots])
                del inp, args, a, r_
            res.setdefault("torch_us", float("nan"))
            rows.append(res)
            if not quiet:
                print(f"{kind:6s} {b:3d} {copies:6d} | {res['close_us']:8.2f} {res['open_us']:8.2f} | "
                      f"{res['torch_us']:8.2f} | {res['torch_us'] / res['close_us']:8.1f}x "
                      f"{res['torch_us'] / res['open_us']:8.1f}x | "
                      f"{max(res['close_rel_err'], res['open_rel_err']):.1e}", flush=True)
            torch.cuda.empty_cache()
    return rows


def _parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m moebox.ops.triton.compress_decode",
                                description="Time the fused compressor decode step vs the compiled torch "
                                            "compress_step at the V4-Flash shapes (CUDA-graph replay).")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16], help="batch sizes (default 1 4 16)")
    p.add_argument("--kind", nargs="+", default=["csa", "index", "hca"], choices=sorted(V4_SHAPES),
                   help="compressors (default all): csa (main, d 512, r 4), index (d 128, r 4), hca (d 512, r 128)")
    p.add_argument("--no-torch", action="store_true", help="skip the torch reference timing")
    p.add_argument("--block-rows", type=int, default=0, help="window rows per tile (default automatic)")
    p.add_argument("--num-warps", type=int, default=0, help="warps per program (default automatic)")
    p.add_argument("--sass", action="store_true", help="only build the kernel for sm_90 and report registers, "
                                                       "spills and SASS counts per kind (no GPU needed)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse(argv)
    cfg = CompressConfig(block_rows=args.block_rows, num_warps=args.num_warps)
    if args.sass:
        for kind in args.kind:
            rep = sass_report(kind, cfg)
            print(f"{kind:6s} {rep['config']} regs {rep['registers']:3d} spill {rep['spills']:5d} "
                  f"smem {rep['shared']:6d} {rep['sass']}", flush=True)
        return
    bench_start()
    bench(batches=args.batch, kinds=args.kind, torch_ref=not args.no_torch, config=cfg)


if __name__ == "__main__":  # python -m moebox.ops.triton.compress_decode [--batch 1 4 16] [--kind ...] [--sass]
    main()
