"""The decode step's attention read (`attend` of moebox/model/decode_attention.py) as one fused Triton kernel
plus a small combine kernel: flash-decoding for DeepSeek-V4's MQA (one shared K=V head), reading the keys
through their indices straight from the window ring and the compressed-entry table.

What it computes (`attend_triton`, = `attend_reference`): per sequence b of a decode batch (one query token
each), q [B, nh, d] attends over its keys, which are also the values:
  - the window: ring rows ring[slot[b], 0..R) (R = window + speculative slack), those with window_visible[b, r];
  - in compressed layers, entry rows entries[slot[b], rows[b, j]] with valid[b, j] (CSA: the indexer's top-k
    rows [B, k]; HCA: rows None (or [1, E] = arange) and valid [B, E]: the whole table).
  s = (q . k) * scale in fp32 (keys rounded to q's dtype first, as the reference's `.to(q.dtype)`), masked keys
  -> -inf; o = sum_j exp(s_j - M) k_j / (sum_j exp(s_j - M) + exp(sink_h - M)), cast to q's dtype. The sink
  only enlarges the denominator; a sequence whose keys are all masked gets o = 0, as in the reference.

Why: the compiled torch `attend` gathers the selected entry rows into a new [B, k, d] tensor, concatenates it
with the window keys (which `window_step` already copied out of the ring) and runs both einsums on fp32
operands: at V4-Flash (nh 64, d 512, R 128 + slack, k 512) and B = 16 that is ~10.5 MB of bf16 keys per CSA
layer, read, copied and widened several times over. Here each key row is read once, from where it is stored.

Kernel 1, `_attend_kernel`, grid (B, SPLIT, head groups): program (b, s, g) takes sequence b, the heads
  [g*HB, (g+1)*HB) and the s-th contiguous range of key tiles of BLOCK_K keys (window tiles first, then entry
  tiles; a tile never mixes the two, so ring and table may have different storage dtypes). Per tile it loads
  the key rows [BLOCK_K, d] through slot / rows (masked keys are not loaded: zeros, so garbage or -1 padding
  in unwritten or invalid rows cannot leak), scores them against the q block [HB, d] with ONE tl.dot over the
  whole d (d = 512 is a fine K dimension for the MMA: no d loop for the scores), updates the running max m and
  sum l per head (online softmax; m starts at the sink logit, so it is always finite and exp(-inf - m) = 0
  needs no special case) and accumulates acc [HB, d] += p @ K with the same key tile (K = V).
  Pipelining: a tile's masks (and entry rows) are loaded one iteration ahead and carried, so the key load
  depends on no load of its own iteration and Triton's pipeliner issues it num_stages - 1 tiles ahead with
  cp.async (with the masks loaded in-iteration it is not pipelined at all: no LDGSTS in the SASS).
  Precision: q and the keys enter the MMA in q's dtype (bf16/fp16 products are exact in fp32, accumulated in
  fp32: the reference's fp32 einsum up to summation order); p [HB, BLOCK_K] fp32 is split as p_hi + p_lo, both
  in the 16-bit dtype, and multiplied in two MMAs (a relative error ~2^-17 instead of bf16's 2^-9); fp32 q
  uses fp32 "ieee" dots (a correctness path: at d = 512 it spills heavily). With `query` the program loads
  the raw query product and norms and rotates its q block itself (`rope_tile` of ops/triton/rope.py: the
  `query_rope` launch before the kernel goes). With SPLIT = 1 the program
  normalises and writes the output itself (one launch); otherwise it writes (acc, m, l) to fp32 partials
  [B, SPLIT, nh, d] / [B, SPLIT, nh].
Kernel 2, `_combine_kernel`, grid (B, head blocks, d blocks): M = max_s m_s (>= the sink), L = sum_s l_s
  exp(m_s - M) + exp(sink - M), o = sum_s acc_s exp(m_s - M) / L, splits summed in a fixed order
  (deterministic, no atomics, nothing to zero). `combine_unroll` issues a program's split loads together,
  unrolled over S_PAD with masks, instead of one split after the other; batch 1 (`DECODE_CONFIG_1`) takes it
  with 4-head x 64-column programs (128 where there were 16) and 8 warps in kernel 1: CSA 14.41 -> 13.54-13.62
  us, HCA 11.83-11.94 -> 11.60 on the H200 (twentieth session). With `rope` the combine also rotates the
  output back (the model does so where `rope_in_combine` says).

The [nh, d] accumulator: with all 64 heads of a V4-Flash sequence in one program it is 64 x 512 fp32 = 128 KB,
more than a program's registers can hold beside the q block (64 KB bf16) and a key tile: built for sm_90 it
spills ~7.6 KB a thread (`sass_report(AttendConfig(heads=64, ...))`). Two ways to split it: by d columns
(every program must still compute the full-d scores of its keys, so the QK^T work and the key-tile reads
repeat per column chunk) or by heads (each score is computed once; only the key tile is re-read, from L2,
once per head group). This kernel splits by heads: `AttendConfig.heads` heads per program (HB, a power of two
>= 16, the mma.sync M), acc [HB, d] in registers. Split-K over keys (SPLIT key ranges per sequence) then fills
the GPU: the automatic SPLIT aims at `waves` x SMs programs with every split the same number of tiles; more
splits cost partial traffic (SPLIT x nh x d x 4 bytes per sequence, written and read back, mostly in L2), so a
split keeps at least `min_tiles` tiles.
Default (V4-Flash, bf16): 16 heads x 32 keys a tile, 4 warps, 3 stages (built for sm_90 with Triton 3.9: 240
registers, 2 programs an SM, no spills, 82 KB shared memory, HMMA for all three dots, cp.async key tiles);
decode batches (`DECODE_CONFIG`) take 2 stages: the thirteenth session's `--sweep` on the H200 (batch 1 and 4,
docs/benchmarks.md) found 2 stages faster than 3 for every kind (CSA 15.84 -> 14.44 us, HCA 13.23 -> 11.84 at
batch 1) and no other tiling faster on CSA and HCA; batches of 5-8 also take twice the programs
(`DECODE_CONFIG_8`, the fourteenth session's sweep at batch 8), batch 1 splits of one tile (`DECODE_CONFIG_1`). At
B = 1 / 4 / 16 (CSA: 5 + 16 tiles) that is 21 / 7 / 3 splits = 84 / 112 / 192 programs.

Bounds (`supported`): q [B, nh, d] fp32/bf16/fp16 with d % 16 == 0 and 16 <= d <= 1024 (padded to a power of
two in registers), any nh (padded to a multiple of HB with masks), ring [S, R, d] and entries [S, E, d] plain
tensors (not the FP8/FP4 row objects of model/cache.py) of fp32/bf16/fp16 with unit stride on d, slot [B]
int32/int64, window_visible bool [B, R], rows int32/int64 [B, k] or [1, k] (or None: all E rows), valid bool
[B, k], sink [nh]; CUDA tensors, or CPU tensors under TRITON_INTERPRET=1 (fp32/fp16 q only: the interpreter's
bf16 dot is wrong). Anything else: callers take the torch path (`attend_decode` does that).

Wiring: `Attention._decode` (moebox/model/attention.py) calls `attend_decode` on CUDA with plain caches
(`attention_kernel_takes`; MOEBOX_ATTENTION_KERNEL=0 turns it off), after `window_mask` stored the new row.
`attend_decode` is exactly the dispatch: `attend_triton` where `supported` says so, else the torch path as
today (`attend(q, cache.window[slot].to(q.dtype), ...)` with rows = arange for HCA). FP8-layout caches
(kv_cache_dtype="fp8": FP8Rows objects) and CPU tensors take the torch path. The ring store must precede the
kernel's read (same stream: it does).

CUDA graphs: a call allocates its output (unless given `out`) and the partials with torch.empty and launches
1 or 2 kernels; no host sync, no data-dependent shapes (the split is chosen from shapes alone).
`python -m moebox.ops.triton.decode_attention [--batch 1 4 16] [--kind csa hca sliding] [--sweep]` times it
against the compiled torch `attend` at the V4-Flash shape in CUDA-graph replay (`--sass`: the sm_90 build
report per tiling, no GPU needed).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from typing import Sequence

import torch

from moebox.ops.triton.rope import rope_pair_angles, rope_tile, rope_tile_angles, rope_tile_by, rope_tile_fits
from moebox.ops.triton.runtime import (HAVE_TRITON, bench_start, build_sm90, cdiv, cubin_dump,  # noqa: F401
                                       default_hold, env_count, graph_us, interpreting, kernel_or_fallback,
                                       kernel_switched_on, next_pow2, num_sms, pdl_args, pdl_start, plain_tensor,
                                       rel_err, tl, triton)

__all__ = ["AttendConfig", "pick_config", "resolve_config", "supported", "attend_triton", "attend_reference",
           "attend_decode", "random_inputs", "replay_inputs", "sass_report", "bench", "sweep"]


@dataclass(frozen=True)
class AttendConfig:
    """Tiling of `_attend_kernel`: `heads` heads per program (0 = all; rounded up to a power of two >= 16),
    BLOCK_K = `block_k` keys per tile, `split` key ranges per sequence (0 = automatic: about `waves` x SMs
    programs, at least `min_tiles` tiles per split), num_warps / num_stages of the main kernel; the combine
    kernel takes `combine_heads` heads x `combine_block_d` columns per program, and with up to
    `combine_unroll` splits (0: never) issues every split's loads at once (one L2 round trip) instead of one
    split after the other."""

    heads: int = 16
    block_k: int = 32
    split: int = 0
    num_warps: int = 4
    num_stages: int = 3
    waves: float = 1.0
    min_tiles: int = 2
    combine_heads: int = 16
    combine_block_d: int = 128
    combine_unroll: int = 0


DEFAULT_CONFIG = AttendConfig()
# decode batches (<= 16 sequences): 2 stages, the sweep's pick for batch 1 and 4 (see the module doc); prefill
# (one "sequence" a token, 2K-16K of them) keeps 3, which its benches were taken with
DECODE_CONFIG = replace(DEFAULT_CONFIG, num_stages=2)
# batch 5-8: twice the programs, splits down to one tile (the fourteenth session's sweep at batch 8: CSA 23.9 ->
# 19.9 us, HCA 20.9 -> 17.7; at batch 16 it lost on CSA, 30.3 -> 33.7)
DECODE_CONFIG_8 = replace(DECODE_CONFIG, waves=2.0, min_tiles=1)
# batch 1: 8 warps a program; the combine's splits loaded at once by 4-head x 64-column programs (the
# nineteenth/twentieth sessions' batch-1 sweep); splits of one tile (twenty-eighth session: decode at 4K 4.91-4.92
# -> 4.85 ms; a CSA layer's 21 tiles 11 -> 21 splits, 13.76 -> 12.91 us; HCA's 6 at 4K, 9.50 -> 7.91)
DECODE_CONFIG_1 = replace(DECODE_CONFIG, num_warps=8, min_tiles=1, combine_heads=4, combine_block_d=64,
                          combine_unroll=32)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INDEX_DTYPES = (torch.int32, torch.int64)


def _head_block(heads: int, nh: int) -> int:
    """Heads per program: a power of two >= 16 (the MMA's smallest M), no more than nh rounded up."""
    return max(16, min(next_pow2(heads or nh), next_pow2(nh)))


def resolve_config(cfg: AttendConfig, batch: int, nh: int, tiles: int, sms: int = 132) -> AttendConfig:
    """cfg with heads resolved (`_head_block`) and split 0 replaced by the automatic choice: about
    cfg.waves x sms programs over (batch x head groups x split) with at least cfg.min_tiles tiles per split.
    Either way every split gets the same number of tiles (the last may have fewer, none has 0)."""
    hb = _head_block(cfg.heads, nh)
    tiles = max(1, tiles)
    if cfg.split:
        per = cdiv(tiles, min(cfg.split, tiles))
    else:
        target = cdiv(max(1, int(cfg.waves * sms)), max(1, batch) * cdiv(nh, hb))
        per = max(cfg.min_tiles, cdiv(tiles, target), 1)
    return replace(cfg, heads=hb, split=cdiv(tiles, per))


def default_config(batch: int) -> AttendConfig:
    """The tiling a call of `batch` sequences takes by default: `DECODE_CONFIG` up to 16 (`DECODE_CONFIG_1` at 1,
    `DECODE_CONFIG_8` from 5 to 8), else `DEFAULT_CONFIG`; MOEBOX_ATTEND_MIN_TILES=n sets their least tiles a
    split (an A/B switch)."""
    if batch == 1:
        cfg = DECODE_CONFIG_1
    elif 4 < batch <= 8:
        cfg = DECODE_CONFIG_8
    else:
        cfg = DECODE_CONFIG if batch <= 16 else DEFAULT_CONFIG
    return replace(cfg, min_tiles=env_count("MOEBOX_ATTEND_MIN_TILES", cfg.min_tiles, "a tile count >= 1",
                                            least=1))


def pick_config(batch: int, nh: int, tiles: int, sms: int = 132) -> AttendConfig:
    """The default tiling for a call (`default_config` resolved)."""
    return resolve_config(default_config(batch), batch, nh, tiles, sms)


# ----------------------------------------------------------------------------------------------- kernels
if HAVE_TRITON:
    @triton.jit
    def _tile(q, acc, m, l, k_ptrs, kmask, dmask, scale, SPLIT_P: tl.constexpr):
        """One key tile [BLOCK_K, D] into the running (acc, m, l) of the q block [HB, D]."""
        k = tl.load(k_ptrs, mask=kmask[:, None] & dmask[None, :], other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision="ieee", out_dtype=tl.float32) * scale         # [HB, BK]
        s = tl.where(kmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))          # m starts at the sink: always finite
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if SPLIT_P:   # p = hi + lo in the 16-bit dtype: two exact-product MMAs, ~2^-17 relative error
            hi = p.to(k.dtype)
            lo = (p - hi.to(tl.float32)).to(k.dtype)
            acc = tl.dot(hi, k, acc, out_dtype=tl.float32)
            acc = tl.dot(lo, k, acc, out_dtype=tl.float32)
        else:
            acc = tl.dot(p, k, acc, input_precision="ieee", out_dtype=tl.float32)
        return acc, m_new, l

    @triton.jit
    def _q_block(rows, mh, qpos, qinv_ptr, q_eps, D: tl.constexpr, D_PAD: tl.constexpr, Q_RD: tl.constexpr,
                 PRECISE: tl.constexpr):
        """The q block [HB, D_PAD] of the heads at rows ([HB, 1] pointers; mh: which exist): as stored, or with
        Q_RD > 0 normed and rotated from the raw product at position *qpos."""
        if Q_RD:
            return rope_tile(rows, mh, qinv_ptr, tl.load(qpos).to(tl.float32), q_eps, D, D_PAD, Q_RD, True, PRECISE)
        cols = tl.arange(0, D_PAD)
        return tl.load(rows + cols[None, :], mask=mh[:, None] & (cols < D)[None, :], other=0.0)

    @triton.jit
    def _attend_kernel(q_ptr, ring_ptr, slot_ptr, wvis_ptr, ent_ptr, rows_ptr, valid_ptr, sink_ptr,
                       out_ptr, po_ptr, pm_ptr, pl_ptr, qpos_ptr, qinv_ptr,
                       NH, R, KE, NW, NT, TILES_PER_SPLIT, NSPLIT, scale, q_eps,
                       s_qb, s_qh, s_rs, s_rr, s_wb, s_es, s_er, s_rowb, s_vb, s_ob, s_oh,
                       D: tl.constexpr, HB: tl.constexpr, BLOCK_K: tl.constexpr, D_PAD: tl.constexpr,
                       HAS_ENT: tl.constexpr, ALL_ROWS: tl.constexpr, SPLIT_P: tl.constexpr, FINAL: tl.constexpr,
                       Q_RD: tl.constexpr, Q_EARLY: tl.constexpr, PRECISE: tl.constexpr, PDL: tl.constexpr):
        """Program (b, s, g): sequence b, heads [g*HB, (g+1)*HB), key tiles [s*TPS, (s+1)*TPS) of the NT tiles
        (NW window tiles, then the entry tiles). FINAL: write the normalised output; else the partials. Q_RD > 0:
        q is the raw product, normed and its trailing Q_RD channels rotated here (`rope_tile`; read after the wait,
        its cos/sin are taken before it). Q_EARLY: q is read before the PDL wait (the caller's word that its
        producer ran two launches back or more)."""
        b = tl.program_id(0).to(tl.int64)
        offs_h = tl.program_id(2) * HB + tl.arange(0, HB)
        mh = offs_h < NH
        q_rows = q_ptr + b * s_qb + offs_h[:, None] * s_qh
        if Q_EARLY:
            q = _q_block(q_rows, mh, qpos_ptr + b, qinv_ptr, q_eps, D, D_PAD, Q_RD, PRECISE)
        elif Q_RD:   # q after the wait: its rotation's cos/sin (libdevice, ~hundreds of instructions) before it
            qcos, qsin, qrot = rope_tile_angles(qinv_ptr, tl.load(qpos_ptr + b).to(tl.float32), D, D_PAD, Q_RD,
                                                PRECISE)
        pdl_start(PDL)
        if not Q_EARLY:
            if Q_RD:
                q = rope_tile_by(q_rows, mh, qcos, qsin, qrot, q_eps, D, D_PAD, True)
            else:
                q = _q_block(q_rows, mh, qpos_ptr + b, qinv_ptr, q_eps, D, D_PAD, Q_RD, PRECISE)
        sp = tl.program_id(1)
        offs_d = tl.arange(0, D_PAD)
        offs_k = tl.arange(0, BLOCK_K)
        md = offs_d < D
        sink = tl.load(sink_ptr + offs_h, mask=mh, other=0.0).to(tl.float32)
        m = sink
        l = tl.zeros([HB], dtype=tl.float32)
        acc = tl.zeros([HB, D_PAD], dtype=tl.float32)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        t0 = sp * TILES_PER_SPLIT
        t1 = tl.minimum(t0 + TILES_PER_SPLIT, NT)
        # The masks (and entry rows) of tile t+1 are loaded in iteration t and carried: a tile's key load then
        # depends on no load of its own iteration, so Triton's pipeliner issues it num_stages - 1 iterations
        # ahead (cp.async into shared memory); with them loaded in-iteration it is not pipelined at all.
        ring_b = ring_ptr + slot * s_rs + offs_d[None, :]
        kk = t0 * BLOCK_K + offs_k
        vis = (kk < R) & (tl.load(wvis_ptr + b * s_wb + kk, mask=kk < R, other=0) != 0)
        for t in range(t0, tl.minimum(t1, NW)):
            kk = t * BLOCK_K + offs_k
            kn = kk + BLOCK_K
            vis_n = (kn < R) & (tl.load(wvis_ptr + b * s_wb + kn, mask=kn < R, other=0) != 0)
            acc, m, l = _tile(q, acc, m, l, ring_b + kk.to(tl.int64)[:, None] * s_rr, vis, md, scale, SPLIT_P)
            vis = vis_n
        if HAS_ENT:
            ent_b = ent_ptr + slot * s_es + offs_d[None, :]
            e0 = tl.maximum(t0, NW)
            e = (e0 - NW) * BLOCK_K + offs_k
            ok = (e < KE) & (tl.load(valid_ptr + b * s_vb + e, mask=e < KE, other=0) != 0)
            if ALL_ROWS:
                row = e.to(tl.int64)
            else:   # the rows of invalid keys are not read (e.g. -1 padding)
                row = tl.load(rows_ptr + b * s_rowb + e, mask=ok, other=0).to(tl.int64)
            for t in range(e0, t1):
                en = (t + 1 - NW) * BLOCK_K + offs_k
                ok_n = (en < KE) & (tl.load(valid_ptr + b * s_vb + en, mask=en < KE, other=0) != 0)
                if ALL_ROWS:
                    row_n = en.to(tl.int64)
                else:
                    row_n = tl.load(rows_ptr + b * s_rowb + en, mask=ok_n, other=0).to(tl.int64)
                acc, m, l = _tile(q, acc, m, l, ent_b + row[:, None] * s_er, ok, md, scale, SPLIT_P)
                ok = ok_n
                row = row_n
        mhd = mh[:, None] & md[None, :]
        if FINAL:
            o = acc / (l + tl.exp(sink - m))[:, None]
            tl.store(out_ptr + b * s_ob + offs_h[:, None] * s_oh + offs_d[None, :], o.to(out_ptr.dtype.element_ty),
                     mask=mhd)
        else:
            row_p = (b * NSPLIT + sp) * NH + offs_h                                  # [HB] of [B, SPLIT, nh]
            tl.store(pm_ptr + row_p, m, mask=mh)
            tl.store(pl_ptr + row_p, l, mask=mh)
            tl.store(po_ptr + row_p.to(tl.int64)[:, None] * D + offs_d[None, :], acc, mask=mhd)

    @triton.jit
    def _unrope(o, cos, sin):
        """o [H, BD] fp32 rotated back by the cos / sin [BD / 2] of its column pairs' angles (`rope_pair_angles`:
        0, so cos 1 and sin 0, for the pairs not rotated), as `apply_rope(..., inverse=True)`."""
        H: tl.constexpr = o.shape[0]
        BD: tl.constexpr = o.shape[1]
        a, b = tl.split(tl.reshape(o, (H, BD // 2, 2)))
        cos, sin = cos[None, :], sin[None, :]
        return tl.reshape(tl.join(a * cos + b * sin, b * cos - a * sin), (H, BD))

    @triton.jit
    def _add_split(acc, po_ptr, pm_ptr, rows, offs_d, big, mh, md, D: tl.constexpr):
        """acc + one split's partial o of the heads at `rows` ([HB] rows of its [.., nh] partials), weighted by
        exp(m - big); heads masked off (mh: past nh, or a padding split) add 0."""
        w = tl.exp(tl.load(pm_ptr + rows, mask=mh, other=float("-inf")) - big)
        o = tl.load(po_ptr + rows.to(tl.int64)[:, None] * D + offs_d[None, :], mask=mh[:, None] & md[None, :],
                    other=0.0)
        return acc + o * w[:, None]

    @triton.jit
    def _combine_kernel(po_ptr, pm_ptr, pl_ptr, sink_ptr, pos_ptr, inv_ptr, out_ptr, NH, NSPLIT, s_ob, s_oh,
                        D: tl.constexpr, HB: tl.constexpr, BD: tl.constexpr, S_PAD: tl.constexpr, RD: tl.constexpr,
                        UNROLL: tl.constexpr, PDL: tl.constexpr):
        """out[b, heads, cols] from the SPLIT partials of sequence b, summed in split order; RD > 0: the
        trailing RD columns of each head rotated back by position pos[b] (`_unrope`). UNROLL: the S_PAD splits
        unrolled with masks (their loads issued together; a masked split adds 0), else a loop over NSPLIT.
        Before the PDL wait: the sinks (a weight) and the rotation's angles (the positions are the step's input,
        written launches back), so after it the program waits only for the partials."""
        b = tl.program_id(0).to(tl.int64)
        offs_h = tl.program_id(1) * HB + tl.arange(0, HB)
        offs_d = tl.program_id(2) * BD + tl.arange(0, BD)
        offs_s = tl.arange(0, S_PAD)
        mh = offs_h < NH
        md = offs_d < D
        ms = offs_s < NSPLIT
        sink = tl.load(sink_ptr + offs_h, mask=mh, other=0.0).to(tl.float32)
        if RD:
            f, _ = rope_pair_angles(tl.program_id(2) * BD, tl.load(pos_ptr + b).to(tl.float32), inv_ptr, BD, D, RD)
            cos, sin = tl.cos(f), tl.sin(f)
        pdl_start(PDL)
        rows = (b * NSPLIT + offs_s[:, None]) * NH + offs_h[None, :]                     # [S_PAD, HB]
        msh = ms[:, None] & mh[None, :]
        pm = tl.load(pm_ptr + rows, mask=msh, other=float("-inf"))
        pl = tl.load(pl_ptr + rows, mask=msh, other=0.0)
        big = tl.maximum(tl.max(pm, axis=0), sink)          # = max_s m_s (each m_s >= sink); finite
        den = tl.sum(pl * tl.exp(pm - big[None, :]), axis=0) + tl.exp(sink - big)
        acc = tl.zeros([HB, BD], dtype=tl.float32)
        if UNROLL:
            for s in tl.static_range(S_PAD):
                acc = _add_split(acc, po_ptr, pm_ptr, (b * NSPLIT + s) * NH + offs_h, offs_d, big,
                                 mh & (offs_h * 0 + s < NSPLIT), md, D)
        else:
            for s in range(0, NSPLIT):
                acc = _add_split(acc, po_ptr, pm_ptr, (b * NSPLIT + s) * NH + offs_h, offs_d, big, mh, md, D)
        out = acc / den[:, None]
        if RD:
            out = _unrope(out, cos, sin)
        tl.store(out_ptr + b * s_ob + offs_h[:, None] * s_oh + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=mh[:, None] & md[None, :])


# ---------------------------------------------------------------------------------------------- wrappers
def supported(q: torch.Tensor, ring: object, slot: torch.Tensor, window_visible: torch.Tensor,
              sink: torch.Tensor, entries: object = None, rows: torch.Tensor | None = None,
              valid: torch.Tensor | None = None) -> bool:
    """Whether `attend_triton` takes these arguments (see the module docstring's Bounds); callers fall back to
    the torch path (`attend_reference`) otherwise."""
    if not HAVE_TRITON or not plain_tensor(q, 3) or q.dtype not in _DTYPES:
        return False
    if q.device.type == "cuda":
        pass
    elif not (interpreting() and q.device.type == "cpu" and q.dtype != torch.bfloat16):
        return False
    b, nh, d = q.shape
    if d % 16 or not 16 <= d <= 1024 or nh < 1:
        return False
    dev = q.device

    def table(t: object) -> bool:
        return (plain_tensor(t, 3) and t.dtype in _DTYPES and t.shape[2] == d and t.stride(2) == 1
                and t.device == dev)

    if not table(ring) or ring.shape[1] < 1:
        return False
    if not (plain_tensor(slot, 1) and slot.dtype in _INDEX_DTYPES and slot.shape[0] == b and slot.device == dev):
        return False
    if not (plain_tensor(window_visible, 2) and window_visible.dtype == torch.bool
            and tuple(window_visible.shape) == (b, ring.shape[1]) and window_visible.device == dev):
        return False
    if not isinstance(sink, torch.Tensor) or sink.numel() != nh or sink.dtype not in _DTYPES or sink.device != dev:
        return False
    if entries is None:
        return rows is None and valid is None
    if not table(entries) or not (plain_tensor(valid, 2) and valid.dtype == torch.bool and valid.device == dev):
        return False
    k = valid.shape[1]
    if valid.shape[0] != b:
        return False
    if rows is None:
        return k == entries.shape[1]
    return (plain_tensor(rows, 2) and rows.dtype in _INDEX_DTYPES and rows.shape[0] in (1, b) and rows.shape[1] == k
            and rows.device == dev)


def _contig_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def attend_triton(q: torch.Tensor, ring: torch.Tensor, slot: torch.Tensor, window_visible: torch.Tensor,
                  sink: torch.Tensor, scale: float, entries: torch.Tensor | None = None,
                  rows: torch.Tensor | None = None, valid: torch.Tensor | None = None, *,
                  out: torch.Tensor | None = None, config: AttendConfig | None = None,
                  rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                  query: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                  query_early: bool = False) -> torch.Tensor:
    """Sink attention of q [B, nh, d] over each sequence's window ring rows ring[slot] (masked by
    window_visible [B, R]) plus, when `entries` is given, the rows `rows` [B, k] / [1, k] (None: all E rows) of
    entries[slot] masked by `valid` [B, k]: what `attend_reference` computes, without materialising the keys.
    -> [B, nh, d] in q's dtype (into `out` when given: contiguous on the last dim). `rope` = (positions [B],
    inv_freq [rd / 2] fp32, on q's device): the output's trailing rd columns rotated back as
    `apply_rope(out, positions, inv_freq, inverse=True)` does, in the combine kernel's store (with one split:
    by `inverse_rope` after). A combine that rotates lets the kernel after it launch only at its end
    (`PDL_HOLD`; MOEBOX_COMBINE_HOLD=0: at its start, as every other kernel): with the rotation in the combine
    and an early launch a batch-1 V4-Flash step lost 0.4 ms, the two output products after it slower by 2-6 us a
    layer, as their programs, launched at the combine's start, waited beside it; held, the step gained 0.05 ms
    at batch 1 and 0.1 at 8 (docs/benchmarks.md, twenty-first and twenty-second sessions). `query` = (positions
    [B], inv_freq [rq / 2], eps): q is the raw query product and the kernel takes `norm_rope(q, None, eps,
    positions, inv_freq)` itself (`query_rope`'s q, one launch fewer before it; d - rq even). `query_early`: the
    kernel reads q (and its positions) before its PDL wait, over the kernel before it: only where q's producer
    ran two launches back or more on the stream (CSA: the indexer's score and top-k kernels between). Runs on
    CUDA, or on CPU tensors under TRITON_INTERPRET=1; raises ValueError where `supported` is False."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed")
    if not supported(q, ring, slot, window_visible, sink, entries, rows, valid):
        raise ValueError(f"unsupported arguments: q {tuple(q.shape)} {q.dtype} on {q.device}, ring "
                         f"{getattr(ring, 'shape', type(ring))}, entries {getattr(entries, 'shape', type(entries))}"
                         f" rows {None if rows is None else tuple(rows.shape)} (see `supported`)")
    b, nh, d = q.shape
    if rope is not None and (tuple(rope[0].shape) != (b,) or 2 * rope[1].numel() > d):
        raise ValueError(f"rope: positions must be [{b}] and inv_freq at most {d // 2} long")
    q_rd = 0 if query is None else 2 * query[1].numel()
    if query is not None and not rope_tile_fits(q, query[0], query[1]):
        raise ValueError(f"query: positions must be [{b}] and inv_freq at most {d // 2} long with {d} - its "
                         f"double even, got {tuple(query[0].shape)} and {query[1].numel()}")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    elif tuple(out.shape) != (b, nh, d) or out.dtype != q.dtype or out.device != q.device or out.stride(2) != 1:
        raise ValueError(f"out must be [{b}, {nh}, {d}] {q.dtype} on {q.device} with unit stride on d, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if b == 0:
        return out
    q = _contig_last(q)
    r = ring.shape[1]
    has_ent = entries is not None
    ke = valid.shape[1] if has_ent else 0
    cfg0 = config or default_config(b)
    nw, ne = cdiv(r, cfg0.block_k), cdiv(ke, cfg0.block_k)
    cfg = resolve_config(cfg0, b, nh, nw + ne, num_sms(q.device))
    tps = cdiv(nw + ne, cfg.split)          # tiles per split (resolve_config: none empty)
    hb, d_pad = cfg.heads, max(16, next_pow2(d))
    wvis = _contig_last(window_visible).view(torch.uint8)
    sink = sink.reshape(nh)
    sink = _contig_last(sink)
    if has_ent:
        vmask = _contig_last(valid).view(torch.uint8)
        all_rows = rows is None
        rws = vmask if all_rows else _contig_last(rows)
        s_rowb = 0 if all_rows or rws.shape[0] == 1 else rws.stride(0)
        ent, s_es, s_er, s_vb = entries, entries.stride(0), entries.stride(1), vmask.stride(0)
    else:
        ent, rws, vmask, all_rows, s_rowb, s_es, s_er, s_vb = ring, wvis, wvis, True, 0, 0, 0, 0
    final = cfg.split == 1
    rd = 0 if rope is None else 2 * rope[1].numel()
    if final:
        po = pm = pl = out     # unused
    else:
        po = torch.empty((b, cfg.split, nh, d), dtype=torch.float32, device=q.device)
        pm = torch.empty((b, cfg.split, nh), dtype=torch.float32, device=q.device)
        pl = torch.empty_like(pm)
    qpos, qinv, q_eps = (slot, sink, 0.0) if query is None else (query[0].contiguous(),
                                                                  query[1].float().contiguous(), float(query[2]))
    _attend_kernel[(b, cfg.split, cdiv(nh, hb))](
        q, ring, slot, wvis, ent, rws, vmask, sink, out, po, pm, pl, qpos, qinv,
        nh, r, ke, nw, nw + ne, tps, cfg.split, float(scale), q_eps,
        q.stride(0), q.stride(1), ring.stride(0), ring.stride(1), wvis.stride(0), s_es, s_er, s_rowb, s_vb,
        out.stride(0), out.stride(1),
        D=d, HB=hb, BLOCK_K=cfg.block_k, D_PAD=d_pad, HAS_ENT=has_ent, ALL_ROWS=all_rows,
        SPLIT_P=q.dtype != torch.float32, FINAL=final, Q_RD=q_rd, Q_EARLY=query_early, PRECISE=q.is_cuda,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl_args(q, _attend_kernel))
    if not final:
        chb = max(1, min(next_pow2(cfg.combine_heads), next_pow2(nh)))
        cbd = min(next_pow2(cfg.combine_block_d), d_pad)
        pos, inv = rope if rope is not None else (slot, sink)   # not read without rope
        s_pad = next_pow2(cfg.split)
        _combine_kernel[(b, cdiv(nh, chb), cdiv(d, cbd))](
            po, pm, pl, sink, _contig_last(pos), _contig_last(inv), out, nh, cfg.split, out.stride(0),
            out.stride(1), D=d, HB=chb, BD=cbd, S_PAD=s_pad, RD=rd, UNROLL=s_pad <= cfg.combine_unroll, num_warps=4,
            **pdl_args(q, _combine_kernel, hold=default_hold(rd > 0, "MOEBOX_COMBINE_HOLD")))
    elif rope is not None:
        from moebox.ops.rope import inverse_rope
        out.copy_(inverse_rope(out, rope[0], rope[1]))
    return out


def attend_reference(q: torch.Tensor, ring, slot: torch.Tensor, window_visible: torch.Tensor, sink: torch.Tensor,
                     scale: float, entries=None, rows: torch.Tensor | None = None,
                     valid: torch.Tensor | None = None) -> torch.Tensor:
    """The torch path: `attend(q, ring[slot].to(q.dtype), window_visible, sink, scale, entries, slot, rows,
    valid)` (rows None: all rows of the table)."""
    from moebox.model.decode_attention import attend
    keys = ring[slot].to(q.dtype)
    if entries is None:
        return attend(q, keys, window_visible, sink, scale)
    if rows is None:
        rows = torch.arange(valid.shape[1], device=q.device)[None, :]
    return attend(q, keys, window_visible, sink, scale, entries, slot, rows, valid)


def rope_in_combine(batch: int) -> bool:
    """Whether a decode step of `batch` sequences rotates the attention output back in the combine (saving a
    launch) rather than after it: at batch 1 and from 4. On the H200 (V4-Flash, 4K context, twenty-second
    session), with the combine's dependent held (`attend_triton`), against rotating after it at batch 1 and in an
    unheld combine from 4: batch 1 5.07 -> 5.02 ms, batch 8 12.13 -> 12.04, batch 4 and 16 tied; at batch 2 the
    rotation in the combine lost 0.04 ms (batch 3 not measured)."""
    return batch == 1 or batch >= 4


def attend_decode(q: torch.Tensor, ring, slot: torch.Tensor, window_visible: torch.Tensor, sink: torch.Tensor,
                  scale: float, entries=None, rows: torch.Tensor | None = None,
                  valid: torch.Tensor | None = None, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                  query: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                  query_early: bool = False) -> torch.Tensor:
    """The dispatch the model uses: `attend_triton` where `supported` (and where it builds), else
    `attend_reference`; with `rope` the output rotated back (`apply_rope(..., inverse=True)`): inside the
    kernel's combine where `rope_in_combine` says (MOEBOX_ATTENTION_ROPE=0 / 1: never / always), else after
    it. `query` (positions, inv_freq, eps): q is the raw query product, normed and rotated (`norm_rope` without
    weight) by the kernel where it fits (`rope_tile_fits`), else first; `query_early`: `attend_triton`'s, unless
    MOEBOX_QUERY_EARLY=0."""
    def unrope(out: torch.Tensor) -> torch.Tensor:
        from moebox.ops.rope import inverse_rope
        return out if rope is None else inverse_rope(out, rope[0], rope[1])

    def queries() -> torch.Tensor:
        from moebox.ops.rope import norm_rope
        return q if query is None else norm_rope(q, None, query[2], query[0], query[1])

    def torch_path() -> torch.Tensor:
        return unrope(attend_reference(queries(), ring, slot, window_visible, sink, scale, entries, rows, valid))

    def kernel() -> torch.Tensor:
        fits = query is not None and rope_tile_fits(q, query[0], query[1])
        qk, fused = (q, query) if fits else (queries(), None)
        args = (qk, ring, slot, window_visible, sink, scale, entries, rows, valid)
        early = query_early and kernel_switched_on(q, "MOEBOX_QUERY_EARLY")
        if rope is not None and kernel_switched_on(q, "MOEBOX_ATTENTION_ROPE",
                                                   default=rope_in_combine(q.shape[0])):
            return attend_triton(*args, rope=rope, query=fused, query_early=early)
        return unrope(attend_triton(*args, query=fused, query_early=early))
    if supported(q, ring, slot, window_visible, sink, entries, rows, valid):
        return kernel_or_fallback("decode attention", "MOEBOX_ATTENTION_KERNEL", kernel, torch_path)
    return torch_path()


# ----------------------------------------------------------------------------------------------- inputs
def random_inputs(batch: int, nh: int = 64, d: int = 512, ring_rows: int = 130, window: int = 128,
                  table_rows: int = 4097, k: int | None = 512, kind: str = "csa", slots: int | None = None,
                  dtype: torch.dtype = torch.bfloat16, q_dtype: torch.dtype | None = None,
                  device: torch.device | str = "cuda", seed: int = 0, masked: Sequence[int] = (),
                  fill: float = 1.0) -> dict:
    """Keyword arguments of `attend_triton` (minus config/out) for one decode step, V4-Flash-shaped by default:
    kind "sliding" (window only), "csa" (k distinct random rows of a table_rows-row table, a random prefix of
    them valid: the kernel masks row by row, so where the valid rows sit does not matter) or "hca" (rows None: all
    table_rows rows, a random prefix valid). Sequence b uses slot 2b + 1 of `slots` (default 2B + 1).
    Keys ~N(0, 1) (RMS-normed rows) stored in `dtype`, q ~N(0, 1.5^2) in q_dtype (default dtype) so the
    scaled scores spread over several units, sinks ~N(0, 1) with one large one (+6), window positions at random
    (`fill` = the fraction of the window that is visible, the newest first). Sequences listed in `masked`
    see no key at all (output 0). Tensors on `device`."""
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    q_dtype = q_dtype or dtype
    slots = slots or 2 * batch + 1
    kw = dict(generator=g, device=device)
    q = (1.5 * torch.randn((batch, nh, d), **kw)).to(q_dtype)
    ring = torch.randn((slots, ring_rows, d), **kw).to(dtype)
    slot = (2 * torch.arange(batch, device=device) + 1) % slots
    pos = torch.randint(0, 4 * window, (batch,), **kw)
    kpos = pos[:, None] - (pos[:, None] - torch.arange(ring_rows, device=device)[None, :]) % ring_rows
    lim = max(1, int(round(fill * window)))
    vis = (kpos > pos[:, None] - lim) & (kpos >= 0)
    sink = torch.randn((nh,), **kw)
    sink[nh // 2] += 6.0
    out: dict = dict(q=q, ring=ring, slot=slot, window_visible=vis, sink=sink, scale=d ** -0.5)
    valid = None
    if kind != "sliding":
        out["entries"] = torch.randn((slots, table_rows, d), **kw).to(dtype)
        kk = (k if k is not None else table_rows) if kind == "csa" else table_rows
        nvalid = torch.randint(1, kk + 1, (batch,), **kw)
        nvalid[0] = kk
        valid = torch.arange(kk, device=device)[None, :] < nvalid[:, None]
        rows = None
        if kind == "csa":
            rows = torch.stack([torch.randperm(table_rows, **kw)[:kk] for _ in range(batch)])
        out.update(rows=rows, valid=valid)
    for i in masked:
        vis[i] = False
        if valid is not None:
            valid[i] = False
    return out


# ----------------------------------------------------------------------------------------------- sm_90 build
def sass_report(config: AttendConfig = DEFAULT_CONFIG, batch: int = 16, kind: str = "csa",
                dtype: torch.dtype = torch.bfloat16, query_rd: int = 0) -> dict:
    """Build `_attend_kernel` for sm_90 at the V4-Flash shape (nh 64, d 512, R 130, k 512 of 4097 rows, or
    HCA / sliding) on any machine with Triton's NVIDIA backend (no GPU needed), specialised as a real launch
    would be (integers divisible by 16 marked so), and report registers, spill stack, shared memory, and the
    SASS counts that matter: HMMA/HGMMA (tensor cores), LDGSTS (cp.async: the key tiles pipelined),
    16-byte vs 2-byte global loads, local-memory traffic. `query_rd`: q normed and rotated in the kernel
    (`attend_triton`'s `query`, V4's 64 rope channels)."""
    import collections
    import re

    ring_rows, table_rows, k = V4_SHAPES[kind]
    nh, d = 64, 512
    ke = 0 if kind == "sliding" else (k or table_rows)
    nw, ne = cdiv(ring_rows, config.block_k), cdiv(ke, config.block_k)
    cfg = resolve_config(config, batch, nh, nw + ne)
    ty = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    ptrs = dict(q_ptr=ty, ring_ptr=ty, slot_ptr="i64", wvis_ptr="u8", ent_ptr=ty, rows_ptr="i64", valid_ptr="u8",
                sink_ptr="fp32", out_ptr=ty, po_ptr="fp32", pm_ptr="fp32", pl_ptr="fp32", qpos_ptr="i64",
                qinv_ptr="fp32")
    ints = dict(NH=nh, R=ring_rows, KE=ke, NW=nw, NT=nw + ne, TILES_PER_SPLIT=cdiv(nw + ne, cfg.split),
                NSPLIT=cfg.split, s_qb=nh * d, s_qh=d, s_rs=ring_rows * d, s_rr=d, s_wb=ring_rows,
                s_es=max(table_rows, 1) * d, s_er=d, s_rowb=ke, s_vb=ke, s_ob=nh * d, s_oh=d)
    const = dict(D=d, HB=cfg.heads, BLOCK_K=cfg.block_k, D_PAD=next_pow2(d), HAS_ENT=kind != "sliding",
                 ALL_ROWS=kind != "csa", SPLIT_P=dtype != torch.float32, FINAL=cfg.split == 1, Q_RD=query_rd,
                 Q_EARLY=False, PRECISE=True, PDL=False)
    names = _attend_kernel.arg_names
    sig = {a: "*" + ptrs[a] if a in ptrs else "fp32" if a in ("scale", "q_eps") else "i32" for a in names
           if a not in const}
    aligned = [a for a in names if a in ptrs or (a in ints and ints[a] % 16 == 0)]
    compiled = build_sm90(_attend_kernel, sig, const, aligned, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    dump = cubin_dump(compiled.asm["cubin"])
    ops = collections.Counter(re.findall(r"\b(HGMMA|HMMA|LDGSTS|LDL|STL|LDG\.E\.128|LDG\.E\.U16|LDG\.E\.64|"
                                         r"LDG\.E(?=[ .]))", dump[0]))
    ptx = compiled.asm["ptx"]
    return {"config": cfg, "registers": int(re.search(r"REG:(\d+)", dump[1]).group(1)),
            "spills": int(re.search(r"STACK:(\d+)", dump[1]).group(1)), "shared": compiled.metadata.shared,
            "sass": dict(ops), "ptx_ld_v4": ptx.count("ld.global.v4"), "ptx_ld_b16": ptx.count("ld.global.b16"),
            "ptx_cp_async": len(re.findall(r"cp\.async\.c[ag]\.shared\.global", ptx))}


# ----------------------------------------------------------------------------------------------- bench
V4_SHAPES = {   # kind -> (ring rows, table rows, k): V4-Flash, window 128 + 2 speculative rows
    "csa": (130, 4097, 512),     # 16K context / ratio 4 (+ the scratch row), the indexer's top-512
    "hca": (130, 513, None),     # 64K context / ratio 128 (+ scratch): all rows
    "sliding": (130, 0, None),
    "hca4k": (130, 33, None),    # 4K context (the decode bench's): 32 entries + scratch
}


def replay_inputs(kind: str, b: int, device: torch.device, l2_miss_bytes: int = 192 << 20,
                  max_copies: int = 256) -> tuple[dict, list[torch.Tensor]]:
    """What a CUDA-graph replay bench of `kind` at batch b calls the attention on: (the arguments of
    `attend_triton` but `slot`, every key visible; the slots of `copies` back-to-back calls, enough that their
    keys (>= l2_miss_bytes in all, up to max_copies calls) come from DRAM as consecutive layers' would)."""
    ring_rows, table_rows, k = V4_SHAPES[kind]
    kb = b * (ring_rows + (0 if kind == "sliding" else k or table_rows)) * 512 * 2
    copies = max(1, min(max_copies, cdiv(l2_miss_bytes, kb)))
    inp = random_inputs(b, ring_rows=ring_rows, table_rows=max(table_rows, 1), k=k, kind=kind, slots=b * copies,
                        device=device, seed=b)
    for name in ("window_visible", "valid"):
        if inp.get(name) is not None:
            inp[name].fill_(True)
    assert key_bytes(inp) == kb
    return ({n: v for n, v in inp.items() if n != "slot"},
            [torch.arange(i * b, (i + 1) * b, device=device) for i in range(copies)])


def key_bytes(inp: dict) -> int:
    """Bytes of key rows a call reads (every window row and selected/all entry row, masked or not)."""
    b = inp["q"].shape[0]
    n = inp["ring"].shape[1] * inp["ring"].element_size() * b
    if inp.get("entries") is not None:
        n += inp["valid"].shape[1] * inp["entries"].element_size() * b
    return n * inp["q"].shape[2]


def bench(device: str | torch.device = "cuda", batches: Sequence[int] = (1, 4, 16),
          kinds: Sequence[str] = ("csa", "hca", "sliding"), configs: Sequence[tuple[str, AttendConfig | None]] = (
              ("default", None),), torch_ref: bool = True, l2_miss_bytes: int = 192 << 20,
          max_copies: int = 256, quiet: bool = False) -> list[dict]:
    """The V4-Flash decode attention read (nh 64, d 512, bf16 storage, everything visible) per kind and batch:
    fused kernel(s) vs the compiled torch path (the ring gather `ring[slot]` of window_step + `attend`), each
    as a CUDA graph of `copies` back-to-back calls on distinct slots (key bytes >= l2_miss_bytes in all, so the
    keys come from DRAM as consecutive layers' would). GB/s = key bytes read / time. Prints a table."""
    from moebox.model.decode_attention import attend
    device = torch.device(device)
    rows_out = []
    if not quiet:
        print(f"decode attention, V4-Flash nh=64 d=512 bf16; CUDA-graph replay, keys cycled past L2\n"
              f"{'kind':8s} {'B':>3s} {'config':16s} {'key MB':>7s} {'copies':>6s} | {'fused us':>8s} {'GB/s':>6s} | "
              f"{'torch us':>8s} {'GB/s':>6s} | {'speedup':>7s} rel err", flush=True)
    for kind in kinds:
        for b in batches:
            args, slots = replay_inputs(kind, b, device, l2_miss_bytes, max_copies)
            kb, copies = key_bytes(dict(args, slot=slots[0])), len(slots)
            ref = attend_reference(slot=slots[0], **args).float()
            if torch_ref:
                def torch_call(s, a=args):
                    keys = a["ring"][s]
                    if a.get("entries") is None:
                        return attend(a["q"], keys, a["window_visible"], a["sink"], a["scale"])
                    rws = a["rows"] if a["rows"] is not None else torch.arange(a["valid"].shape[1],
                                                                              device=device)[None, :]
                    return attend(a["q"], keys, a["window_visible"], a["sink"], a["scale"], a["entries"], s, rws,
                                  a["valid"])
                us_ref = graph_us([lambda s=s: torch_call(s) for s in slots])
            else:
                us_ref = float("nan")
            for cname, cfg in configs:
                outs = [torch.empty_like(args["q"]) for _ in range(min(copies, 4))]
                got = attend_triton(slot=slots[0], **args, config=cfg, out=outs[0])
                err = rel_err(got, ref)
                fns = [lambda s=s, o=outs[i % len(outs)], a=args, c=cfg: attend_triton(slot=s, **a, config=c, out=o)
                       for i, s in enumerate(slots)]
                us = graph_us(fns)
                row = dict(kind=kind, B=b, config=cname, key_bytes=kb, copies=copies, us=us, GB_s=kb / us / 1e3,
                           torch_us=us_ref, torch_GB_s=kb / us_ref / 1e3, rel_err=err)
                rows_out.append(row)
                if not quiet:
                    print(f"{kind:8s} {b:3d} {cname:16s} {kb / 1e6:7.2f} {copies:6d} | {us:8.2f} {row['GB_s']:6.0f} | "
                          f"{us_ref:8.2f} {row['torch_GB_s']:6.0f} | {us_ref / us:6.1f}x {err:.1e}", flush=True)
            del args, slots
            torch.cuda.empty_cache()
    return rows_out


def _sweep_name(c: AttendConfig) -> str:
    d = DEFAULT_CONFIG
    combine = (c.combine_heads, c.combine_block_d, c.combine_unroll)
    return (f"h{c.heads}k{c.block_k}w{c.num_warps}s{c.num_stages}" + (f"x{c.waves:g}" if c.waves != d.waves else "")
            + (f"t{c.min_tiles}" if c.min_tiles != d.min_tiles else "")
            + ("c{}x{}u{}".format(*combine) if combine != (d.combine_heads, d.combine_block_d, d.combine_unroll)
               else ""))


SWEEP: tuple[tuple[str, AttendConfig], ...] = tuple((_sweep_name(c), c) for c in (
    AttendConfig(heads=16, block_k=32, num_warps=4, num_stages=3),
    AttendConfig(heads=16, block_k=16, num_warps=4, num_stages=3),
    AttendConfig(heads=16, block_k=16, num_warps=4, num_stages=4),
    AttendConfig(heads=16, block_k=32, num_warps=8, num_stages=3),
    AttendConfig(heads=32, block_k=32, num_warps=8, num_stages=3),
    AttendConfig(heads=32, block_k=16, num_warps=8, num_stages=4),
    AttendConfig(heads=64, block_k=16, num_warps=8, num_stages=3),
    AttendConfig(waves=2.0), AttendConfig(waves=2.0, min_tiles=1), AttendConfig(waves=0.5, min_tiles=4),
    # batch 1: more, shorter programs (the default gave a CSA layer 44 programs of 2 tiles until the
    # twenty-eighth session)
    AttendConfig(heads=16, block_k=16, waves=2.0, min_tiles=1), AttendConfig(heads=16, block_k=16, waves=4.0,
                                                                            min_tiles=1),
    AttendConfig(heads=16, block_k=32, num_stages=2, waves=2.0, min_tiles=1),
    # batch 1's combine (4.1 us a CSA layer: 16 programs, each walking 11 splits one after the other): smaller
    # tiles (more programs) and the splits' loads issued together
    AttendConfig(num_stages=2, combine_block_d=32), AttendConfig(num_stages=2, combine_block_d=32, combine_unroll=16),
    AttendConfig(num_stages=2, combine_heads=8, combine_block_d=64, combine_unroll=16),
    AttendConfig(num_stages=2, combine_heads=4, combine_block_d=64, combine_unroll=32),
    # batch 8-16 (not yet swept there): longer tiles, fewer loop trips; more warps a program
    AttendConfig(heads=16, block_k=64, num_warps=8, num_stages=2),
    AttendConfig(heads=16, block_k=32, num_warps=8, num_stages=2),
    # batch 1 (`DECODE_CONFIG_1`) with splits of two tiles, its default before the twenty-eighth session; then
    # around its one-tile splits: shorter tiles (twice the splits), 4 warps, 3 stages, 32 heads a program, and
    # the combine's programs (21 splits each)
    replace(DECODE_CONFIG_1, min_tiles=2), replace(DECODE_CONFIG_1, block_k=16), replace(DECODE_CONFIG_1, num_warps=4),
    replace(DECODE_CONFIG_1, num_stages=3), replace(DECODE_CONFIG_1, heads=32),
    replace(DECODE_CONFIG_1, combine_heads=8), replace(DECODE_CONFIG_1, combine_heads=16, combine_block_d=128),
    replace(DECODE_CONFIG_1, combine_block_d=32)))


def sweep(device: str | torch.device = "cuda", batches: Sequence[int] = (1, 4, 16),
          kinds: Sequence[str] = ("csa",)) -> None:
    """Tilings around the default (fused only): which to make the default."""
    for name, cfg in (("default", None), *SWEEP):
        try:
            rows = bench(device, batches=batches, kinds=kinds, configs=((name, cfg),), torch_ref=False,
                         quiet=True)
        except Exception as e:  # noqa: BLE001 - e.g. triton's OutOfResources: report, go on
            print(f"{name}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        print(f"{name:14s} " + "  ".join(f"{r['kind']} B={r['B']} {r['us']:7.2f} us" for r in rows),
              flush=True)


def _parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m moebox.ops.triton.decode_attention",
                                description="Time the fused decode attention read vs the compiled torch attend "
                                            "at the V4-Flash shape (CUDA-graph replay).")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16], help="batch sizes (default 1 4 16)")
    p.add_argument("--kind", nargs="+", default=["csa", "hca", "sliding"], choices=sorted(V4_SHAPES),
                   help="layer kinds (default all)")
    p.add_argument("--no-torch", action="store_true", help="skip the torch reference timing")
    p.add_argument("--sweep", action="store_true", help="also time the tilings of SWEEP (the --kind layers, fused "
                                                        "only)")
    p.add_argument("--sass", action="store_true", help="only build the kernel for sm_90 and report registers, "
                                                       "spills and SASS counts per SWEEP tiling (no GPU needed)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse(argv)
    if args.sass:
        for name, cfg in (("default", DEFAULT_CONFIG), *SWEEP):
            rep = sass_report(cfg)
            print(f"{name:14s} regs {rep['registers']:3d} spill {rep['spills']:5d} smem {rep['shared']:6d} "
                  f"cp.async {rep['ptx_cp_async']:3d} {rep['sass']}", flush=True)
        return
    bench_start()
    bench(batches=args.batch, kinds=args.kind, torch_ref=not args.no_torch)
    if args.sweep:
        sweep(batches=args.batch, kinds=args.kind)


if __name__ == "__main__":  # python -m moebox.ops.triton.decode_attention [--batch 1 4 16] [--sweep] [--sass]
    main()
