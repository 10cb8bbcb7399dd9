"""The indexer's top-k at decode in one Triton kernel: a radix select on the fp32 bits, held in registers.

Why: every decode step each CSA layer's lightning indexer picks `index_topk` (512) of a sequence's compressed
entries. torch.topk (`gatherTopK`, a radix select that re-reads its input from memory on each of its passes)
took 393 us of a batch-1 V4-Flash step at 4K context: 21 launches of ~18.7 us (docs/benchmarks.md, seventh
session), for 1025 scores a row (1024 entries + the scratch row). One program per row finds the k-th largest
key 4 bits a round, then writes the chosen rows and their `valid` flags (the gather the caller did after
torch.topk) in the same launch.

How: a score's fp32 bits map to a uint32 key with the same order (sign bit flipped for positive scores, all bits
for negative ones; NaN of either sign -> the largest key, past the row's end -> 0, below any real key). The
search keeps t, the k-th largest key's high bits found so far, with n_ge = #keys >= t (>= k) and n_above =
#keys >= t + 2^s (< k), s the bits still unknown. A round (s -= 4) counts, for the 15 candidates t + d 2^s,
the keys at or above each: a key with digit x (min(15, (key - t) >> s), 0 below t) adds 1 to the first x
nibbles of a uint64 (one 64-bit shift), summed over <= 8 keys in-thread (a nibble stays <= 15), spread to
16-bit fields: [8, NT] words a thread, summed over the block in one reduction (REDUX in-warp, one shared
memory pass across warps). The next digit d* is how many counts are >= k (counts fall with d); n_ge and
n_above are the counts at d* and d* + 1. The rounds stop at s = 0 or as soon as n_ge == k: the keys >= t are
then exactly the top k (relu'd Gaussian rows, emulated in numpy: 4.7 to 5.4 rounds on average at 1025 to
16385 entries; all 8 when fewer than k are finite, the k-th being a tied -inf; k = E: none). Taken: keys
>= t + 2^s at their rank among those, then keys in [t, t + 2^s) (all equal when s = 0) until there are k:
exactly k distinct rows, none left out scoring above one taken. Ranks: one scan across the threads (ties are
taken in thread-major order, not lowest index first).

Tiling (`config`): NT = 32 x 8 threads. A row of up to 8 NT (2048) entries is held in registers, padded to a
power of two ([1, HK, NT]); a longer one holds its largest power-of-two head, up to 64 keys a thread ([NCH,
8, NT]), and re-reads the rest from L1/L2 each round in [1, TK, NT] chunks, TK as small as the tail allows:
4097 = 4096 held + one 256-lane chunk of 1 row; 16385 = 16384 held (227 registers, no spill) + one. Rows of
>= 65536 entries count and rank in 32-bit fields (WIDE). E up to MAX_ENTRIES works (slowly, streamed).

What changed (tenth session) and why: the ninth session's kernel (31.7 us at 1025 entries on the H200 against
gatherTopK's 18.7) re-read 1024-score chunks from memory on each of 8 rounds (its second chunk held 1 real
entry), compared them with 16 candidates as [16, 1024] tiles (layout conversions through shared memory) on 4
warps, one warp a scheduler, nothing to hide latency. Here the keys stay in registers, a key costs ~11
instructions a round instead of 16 compares, a round is one block reduction of 8 words, and rounds stop early.
sm_90 builds (offline, `--sass`; k 512, 8 warps): at 1025 entries 64 registers, no spill in the loops, the
round loop ~280 instructions a warp (8 keys a thread + the 8-word reduction: 16 REDUX, 4 barriers) and the
final take ~470 once; at 4097 96 registers, ~390 a round + a 51-instruction tail chunk; at 16385 227
registers, ~1000 a round. `python -m moebox.ops.triton.topk` times it against torch.topk + the gather
(`--sweep`: 4/8/16 warps, 32/64 held keys). Measured (H200, tenth session, docs/benchmarks.md): the GPU tests
pass, and the batch-1 V4-Flash step at 4K context (1025 entries) went from 9.85 to 9.57 ms with it (batch 16:
27.25 -> 27.02); at 64K context (16385 entries) 9.44 -> 8.79 ms (batch 16: 34.88 -> 34.09, eleventh
session), so the indexer takes it by default up to that length (`DEFAULT_MAX_ENTRIES`); longer rows keep
torch.topk until a bench shows the kernel ahead there too.
tl.histogram is avoided: on sm_90 it lowers to shared-memory atomics (one per key and round).

The rank kernel (small calls: batch x E^2 <= RANK_MAX_WORK, `rank_takes`; MOEBOX_TOPK_RANK=0 turns it off):
the radix select is one program a row, ~5 rounds of block reductions one after the other: 6.4 us a call at
batch 1 and 1025 entries, all of it on a CSA layer's critical path (21 a step). `_rank_topk_kernel` spreads a
row over E / RANK_BLOCK programs instead: each ranks its RANK_BLOCK entries among the whole row (rank = the
entries with a larger key, or an equal key at a lower index: a permutation of 0..E-1) from E comparisons each,
counted in a [RANK_BLOCK, RANK_CHUNK] tile and summed once at the end, and writes the entries of rank < k to
their rank's slot. No block reduction a round, no loop-carried search: one pass over the row (from L2) per
program. Work grows as E^2 a row, hence the bound: on the H200 (twenty-sixth session, `python -m
moebox.ops.triton.topk`) at 1025 entries 5.44 against the radix select's 6.46 us at batch 1, but 8.72 against
7.20 at batch 8 and 12.94 against 7.32 at 16, and 12.88 against 10.62 at batch 1 and 4097 entries; so it takes
batch <= 2 at 4K context and nothing longer. Ties go lowest index first.

Semantics: `torch.topk(scores, k, sorted=False)` up to ties (torch leaves those unspecified) and the order of
the k rows (callers do not depend on it); -inf rows (masked entries) are taken only when fewer than k rows are
finite, as there. -0.0 ranks just below +0.0, and NaN (either sign) above +inf (torch also ranks NaN first).

Bounds: scores [B, E] fp32 with unit column stride, valid [B, E] bool, 1 <= k <= E <= MAX_ENTRIES; other
calls raise ValueError (`supported` says which). CUDA graphs: outputs from torch.empty, one launch, no host sync.
"""

from __future__ import annotations

import argparse
import functools
import os
from collections.abc import Sequence
from typing import NamedTuple

import torch

from moebox.ops.triton.runtime import (HAVE_TRITON, bench_start, cdiv, graph_us, next_pow2, pdl_args,
                                       pdl_start, tl, triton)

MAX_ENTRIES = 1 << 20   # rows of up to 4M tokens of context at ratio 4
NUM_WARPS = 8           # a row's program: NT = 32 x warps threads
HELD_KEYS = 64          # keys a thread holds in registers at most (at 8 warps: 227 registers, no spill, sm_90)
WIDE_FROM = 1 << 16     # rows from this many entries count in 32-bit fields (16-bit ones could overflow)
DEFAULT_MAX_ENTRIES = 16385   # the model takes the kernel by default up to 64K tokens of context (measured there)
RANK_BLOCK = 16         # entries a rank program ranks (1025 entries: 65 programs a row)
RANK_CHUNK = 256        # entries it compares them with per step
RANK_MAX_WORK = 2 * 1025 ** 2    # batch x E^2 comparisons up to which the rank kernel runs (4K context: batch 2)


class Config(NamedTuple):
    """One launch's tiling: the row's first NCH x HK x NT entries held in registers as [NCH, HK, NT] (entry
    (c HK + r) NT + t at [c, r, t]: a thread holds NCH x HK keys), the rest re-read from memory each round in
    [1, TK, NT] chunks (TK <= HK); WIDE: 32-bit count fields."""
    nch: int
    hk: int
    tk: int
    nt: int
    num_warps: int
    wide: bool


def config(e: int, num_warps: int | None = None, held_keys: int | None = None) -> Config:
    """The tiling of a row of e entries: all held (padded to a power of two) unless holding the largest
    power-of-two head and streaming the rest takes fewer lanes, or they would be more than `held_keys` a thread."""
    warps = num_warps or NUM_WARPS
    nt = 32 * warps
    most = max(1, (held_keys or HELD_KEYS) // 8)                  # [8, NT] chunks held
    if e <= 8 * nt:
        hk = min(8, next_pow2(cdiv(e, nt)))
        return Config(1, hk, hk, nt, warps, False)
    chunk = 8 * nt
    pad = next_pow2(cdiv(e, chunk))
    head = min(most, 1 << ((e // chunk).bit_length() - 1))
    if pad <= most and pad * chunk <= head * chunk + next_pow2(cdiv(e - head * chunk, nt)) * nt:
        return Config(pad, 8, 8, nt, warps, e >= WIDE_FROM)
    return Config(head, 8, min(8, next_pow2(cdiv(e - head * chunk, nt))), nt, warps, e >= WIDE_FROM)


if HAVE_TRITON:
    @triton.jit
    def _keys(row_ptr, offs, E):
        """Unsigned keys in the scores' order for the entries at offs: the fp32 bits with the sign bit flipped
        (positive scores) or all bits flipped (negative ones); NaN of either sign -> the largest key; 0 past the
        row's end (below every real entry: -inf's key is 0x007FFFFF)."""
        real = offs < E
        x = tl.load(row_ptr + offs, mask=real, other=0.0)
        bits = x.to(tl.uint32, bitcast=True)
        key = bits ^ tl.where(bits >= 0x80000000, 0xFFFFFFFF, 0x80000000).to(tl.uint32)
        key = tl.where(x != x, 0xFFFFFFFF, key).to(tl.uint32)                 # noqa: PLR0124 - NaN
        return tl.where(real, key, 0).to(tl.uint32)

    @triton.jit
    def _words(u, t, s):
        """Keys [C, R, NT] (R <= 15) -> this thread's counts of keys at or above the 15 candidates t + d 2^s
        (d = 1..15): [8, NT] uint32 words of two 16-bit fields, row m holding d = m+1 and m+5 (m < 4), m+5 and
        m+9 (m >= 4; row 7's high field, d = 16, is 0). A key adds 1 to the first x nibbles of a uint64 (x its
        digit, 15 above t's class, 0 below it); summed over R a nibble stays <= R; then the nibbles are spread to
        16-bit fields and summed over C. The rows of a word are in-thread: the block reduces them in one pass."""
        x = tl.where(u >= t, tl.minimum((u - t) >> s, 15), 0).to(tl.uint64)
        nib = tl.sum(tl.full(u.shape, 0x111111111111111, tl.uint64) >> (60 - 4 * x), axis=1)       # [C, NT]
        m = tl.arange(0, 8)[None, :, None]
        half = tl.where(m < 4, nib.to(tl.uint32)[:, None, :], (nib >> 32).to(tl.uint32)[:, None, :])
        return tl.sum((half >> (4 * (m % 4)).to(tl.uint32)) & 0x000F000F, axis=0)                # [8, NT]

    @triton.jit
    def _pick(w, K, n_ge, n_above, FB: tl.constexpr):
        """The block's counts w ([8] words of two FB-bit fields) -> (the next digit d*: how many candidates have
        >= K keys at or above them, the count at t + d* 2^s, the count at t + (d* + 1) 2^s). Counts fall with
        d, so those are the smallest count >= K (or n_ge for d* = 0) and the largest < K (or n_above)."""
        lo = (w & ((1 << FB) - 1)).to(tl.int32)
        hi = (w >> FB).to(tl.int32)
        ge_lo = lo >= K
        ge_hi = hi >= K
        dstar = tl.sum(ge_lo.to(tl.int32), axis=0) + tl.sum(ge_hi.to(tl.int32), axis=0)
        n_ge = tl.minimum(tl.min(tl.where(ge_lo, lo, n_ge), axis=0), tl.min(tl.where(ge_hi, hi, n_ge), axis=0))
        n_above = tl.maximum(tl.max(tl.where(ge_lo, n_above, lo), axis=0),
                             tl.max(tl.where(ge_hi, n_above, hi), axis=0))
        return dstar, n_ge, n_above

    @triton.jit
    def _take(u, offs, E, t, s, K, n_above, carry, v_row, rows_out, valid_out, FB: tl.constexpr):
        """Write the rows of keys [C, R, NT] at offs that are taken: those above t's class (keys >= t + 2^s) at
        their rank among those, those in it at n_above + their rank there while that is < K. Ranks run thread
        by thread (then c, then r within a thread: one scan across threads), from `carry` (earlier chunks' counts,
        packed like `flag`); returns the new carry."""
        inside = (offs < E) & (u >= t)
        high = (u - t).to(tl.uint64) >> s.to(tl.uint64)
        above = inside & (high != 0)
        equal = inside & (high == 0)
        if FB == 32:
            flag = above.to(tl.uint64) | (equal.to(tl.uint64) << 32)
        else:
            flag = above.to(tl.uint32) | (equal.to(tl.uint32) << 16)
        per_c = tl.sum(flag, axis=1)                                    # [C, NT]
        per_t = tl.sum(per_c, axis=0)                                   # [NT]
        rank = (tl.cumsum(flag, axis=1) + (tl.cumsum(per_c, axis=0) - per_c)[:, None, :]
                + (tl.cumsum(per_t, axis=0) - per_t)[None, None, :] + carry)    # inclusive
        r_above = (rank & ((1 << FB) - 1)).to(tl.int32)
        r_equal = (rank >> FB).to(tl.int32)
        take = above | (equal & (r_equal <= K - n_above))
        pos = tl.where(above, r_above - 1, n_above + r_equal - 1)
        tl.store(rows_out + pos, offs.to(tl.int64), mask=take)
        tl.store(valid_out + pos, tl.load(v_row + offs, mask=take, other=0), mask=take)
        return carry + tl.sum(per_t, axis=0)

    @triton.jit
    def _topk_kernel(s_ptr, v_ptr, rows_ptr, rv_ptr, E, stride_s, stride_v, K: tl.constexpr,
                     NCH: tl.constexpr, HK: tl.constexpr, TK: tl.constexpr, NT: tl.constexpr, WIDE: tl.constexpr,
                     PDL: tl.constexpr):
        pdl_start(PDL)
        b = tl.program_id(0).to(tl.int64)
        s_row = s_ptr + b * stride_s
        lane = tl.arange(0, NT)[None, None, :]
        head = (tl.arange(0, NCH)[:, None, None] * HK + tl.arange(0, HK)[None, :, None]) * NT + lane  # [NCH, HK, NT]
        lane = tl.arange(0, TK)[None, :, None] * NT + lane                               # a streamed [1, TK, NT]
        u = _keys(s_row, head, E)                                        # held across the rounds
        t = tl.full((), 0, tl.uint32)                                    # the k-th largest key's digits so far
        s = E * 0 + 32                                                   # their class: keys in [t, t + 2^s)
        n_ge = E                                                         # keys >= t
        n_above = E * 0                                                  # keys >= t + 2^s: < K
        while (s > 0) & (n_ge > K):                                      # n_ge == K: the class is all taken
            s -= 4
            su = s.to(tl.uint32)
            w = _words(u, t, su)                                         # [8, NT] per thread
            for c0 in tl.range(NCH * HK * NT, E, TK * NT):
                w += _words(_keys(s_row, c0 + lane, E), t, su)
            if WIDE:                                                     # 32-bit fields for the block's sums
                w64 = (w & 0xFFFF).to(tl.uint64) | ((w >> 16).to(tl.uint64) << 32)
                dstar, n_ge, n_above = _pick(tl.sum(w64, axis=1), K, n_ge, n_above, 32)
            else:
                dstar, n_ge, n_above = _pick(tl.sum(w, axis=1), K, n_ge, n_above, 16)
            t += dstar.to(tl.uint32) << su
        v_row = v_ptr + b * stride_v
        rows_out = rows_ptr + b * K
        valid_out = rv_ptr + b * K
        FB: tl.constexpr = 32 if WIDE else 16
        carry = _take(u, head, E, t, s, K, n_above, 0, v_row, rows_out, valid_out, FB)
        for c0 in tl.range(NCH * HK * NT, E, TK * NT):
            offs = c0 + lane
            carry = _take(_keys(s_row, offs, E), offs, E, t, s, K, n_above, carry, v_row, rows_out, valid_out, FB)

    @triton.jit
    def _rank_topk_kernel(s_ptr, v_ptr, rows_ptr, rv_ptr, E, stride_s, stride_v, K: tl.constexpr,
                          BLOCK: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
        """Program (c, b): the ranks of row b's entries c*BLOCK.. (keys larger, or equal at a lower index) by
        comparing them with every entry of the row; those of rank < K go to their rank's slot. Chunks wholly
        before or after the program's own entries need no index comparison (entries past E have key 0, below
        every real key, and a higher index)."""
        pdl_start(PDL)
        c = tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)
        s_row = s_ptr + b * stride_s
        own = c * BLOCK + tl.arange(0, BLOCK)
        ki = _keys(s_row, own, E)[:, None]                                           # [BLOCK, 1]
        cols = tl.arange(0, CHUNK)
        lo = c * BLOCK
        count = tl.zeros((BLOCK, CHUNK), dtype=tl.int32)
        for j0 in range(0, E, CHUNK):
            oj = j0 + cols
            kj = _keys(s_row, oj, E)[None, :]                                        # [1, CHUNK]
            if j0 + CHUNK <= lo:
                count += (kj >= ki).to(tl.int32)
            elif j0 >= lo + BLOCK:
                count += (kj > ki).to(tl.int32)
            else:
                count += ((kj > ki) | ((kj == ki) & (oj[None, :] < own[:, None]))).to(tl.int32)
        rank = tl.sum(count, axis=1)
        take = (rank < K) & (own < E)
        tl.store(rows_ptr + b * K + rank, own.to(tl.int64), mask=take)
        tl.store(rv_ptr + b * K + rank, tl.load(v_ptr + b * stride_v + own, mask=take, other=0), mask=take)


def rank_takes(batch: int, entries: int) -> bool:
    """Whether a call of `batch` rows of `entries` takes the rank kernel (see the module doc): batch x E^2 <=
    RANK_MAX_WORK, unless MOEBOX_TOPK_RANK=0."""
    return batch * entries * entries <= RANK_MAX_WORK and os.environ.get("MOEBOX_TOPK_RANK", "1") != "0"


def supported(scores: torch.Tensor, valid: torch.Tensor, k: int) -> bool:
    """Whether `index_topk_triton` takes these arguments (see the module doc's Bounds)."""
    return (HAVE_TRITON and scores.dim() == 2 and scores.dtype == torch.float32 and scores.stride(1) == 1
            and valid.dtype == torch.bool and tuple(valid.shape) == tuple(scores.shape) and valid.stride(1) == 1
            and valid.device == scores.device and 1 <= k <= scores.shape[1] <= MAX_ENTRIES)


def index_topk_triton(scores: torch.Tensor, valid: torch.Tensor, k: int, cfg: Config | None = None,
                      rank: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [B, E] fp32 (masked entries -inf), valid [B, E] bool -> (rows [B, k] int64, valid at those rows
    [B, k] bool): what `rows = scores.topk(k, sorted=False).indices; valid.gather(1, rows)` gives, up to ties
    and order. `rank`: the rank kernel (True) or the radix select (False; `cfg` its tiling); None: `rank_takes`
    decides, unless a cfg is given."""
    if not supported(scores, valid, k):
        raise ValueError(f"index_topk_triton takes fp32 scores [B, E <= {MAX_ENTRIES}] with unit column stride, "
                         f"a bool valid of their shape and 1 <= k <= E; got {tuple(scores.shape)} {scores.dtype}, "
                         f"{tuple(valid.shape)} {valid.dtype}, k {k}")
    b, e = scores.shape
    ranked = rank or (rank is None and cfg is None and rank_takes(b, e))
    if not ranked:
        cfg = cfg or config(e)
        if max(cfg.hk, cfg.tk) > 8 or cfg.wide < (e >= WIDE_FROM) or cdiv(e, cfg.nt) + 8 >= 1 << 16:
            raise ValueError(f"{cfg} cannot count a row of {e} entries")   # nibbles <= 15, 16-bit fields
    rows = torch.empty((b, k), dtype=torch.int64, device=scores.device)
    rvalid = torch.empty((b, k), dtype=torch.bool, device=scores.device)
    if b:
        args = (scores, valid.view(torch.uint8), rows, rvalid.view(torch.uint8), e, scores.stride(0),
                valid.stride(0))
        if ranked:
            _rank_topk(args, b, e, k)
        else:
            _topk_kernel[(b,)](*args, K=k, NCH=cfg.nch, HK=cfg.hk, TK=cfg.tk, NT=cfg.nt, WIDE=cfg.wide,
                               num_warps=cfg.num_warps, **pdl_args(scores, _topk_kernel))
    return rows, rvalid


def _rank_topk(args: tuple, b: int, e: int, k: int) -> None:
    """The `_rank_topk_kernel` launch (its arguments as `_topk_kernel`'s): grid (E / RANK_BLOCK, B)."""
    _rank_topk_kernel[(cdiv(e, RANK_BLOCK), b)](*args, K=k, BLOCK=RANK_BLOCK, CHUNK=RANK_CHUNK, num_warps=4,
                                                **pdl_args(args[0], _rank_topk_kernel))


# ----------------------------------------------------------------------------------------------- bench
def _reference(scores: torch.Tensor, valid: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the model does without the kernel (moebox/model/decode_attention.py `_top_rows`)."""
    top = scores.topk(k, dim=-1, sorted=False).indices
    return top, valid.gather(1, top)


def random_scores(batch: int, entries: int, device: torch.device | str = "cuda", seed: int = 0,
                  masked: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, valid) of an indexer step: relu'd sums like `index_scores` (>= 0, many exact zeros), the last
    entry (the scratch row) and a `masked` fraction of the others -inf."""
    g = torch.Generator(device=device).manual_seed(seed)
    scores = torch.relu(torch.randn(batch, entries, device=device, generator=g) + 0.5)
    valid = torch.rand(batch, entries, device=device, generator=g) >= masked
    valid[:, -1] = False
    return scores.masked_fill(~valid, float("-inf")), valid


def check(scores: torch.Tensor, valid: torch.Tensor, k: int, rows: torch.Tensor, rvalid: torch.Tensor) -> bool:
    """Whether (rows, rvalid) is a top-k of scores (no NaN): k distinct in-range rows a row, their values those
    of torch.topk, their valid flags gathered."""
    if rows.min() < 0 or rows.max() >= scores.shape[1]:
        return False
    distinct = bool((rows.sort(dim=1).values.diff(dim=1) > 0).all())
    same = torch.equal(scores.gather(1, rows).sort(dim=1).values, scores.topk(k, dim=1).values.sort(dim=1).values)
    return distinct and same and torch.equal(rvalid, valid.gather(1, rows))


def bench(entries: Sequence[int] = (1025, 4097, 16385), batches: Sequence[int] = (1, 8, 16), k: int = 512,
          configs: Sequence[Config | None] = (None,), torch_ref: bool = True, copies: int = 8,
          masked: float = 0.0) -> list[dict]:
    """us a call, replayed from a CUDA graph of `copies` calls on distinct inputs (triton's do_bench flushes
    L2 before each replay): the kernel (per config; None: `config`'s) vs torch.topk(sorted=False) + the valid
    gather, the model's torch path; and the rank kernel (config "rank") up to 16 x its bound. Each kernel
    result is checked first. Prints a table; returns its rows."""
    print(f"indexer top-k, k {k}, CUDA-graph replay of {copies} calls on distinct inputs, {masked:.0%} masked")
    print(f"{'E':>6s} {'B':>3s} {'config':44s} | {'triton us':>9s} | {'torch us':>8s} | speedup  ok")
    rows_out = []
    for e in entries:
        for b in batches:
            inputs = [random_scores(b, e, "cuda", seed=i, masked=masked) for i in range(copies)]
            kk = min(k, e)
            ref_us = (graph_us([functools.partial(_reference, s, v, kk) for s, v in inputs])
                      if torch_ref else float("nan"))
            ranked = b * e * e <= 16 * RANK_MAX_WORK      # its times around its bound
            for cfg in [c or config(e) for c in configs] + (["rank"] if ranked else []):
                kw = dict(rank=True) if cfg == "rank" else dict(cfg=cfg, rank=False)
                name = cfg if cfg == "rank" else str(cfg)[7:-1]
                try:
                    ok = check(*inputs[0], kk, *index_topk_triton(*inputs[0], kk, **kw))
                    us = graph_us([functools.partial(index_topk_triton, s, v, kk, **kw) for s, v in inputs])
                except Exception as err:  # noqa: BLE001 - e.g. triton's OutOfResources: report, go on
                    print(f"{e:6d} {b:3d} {name:44s} | failed: {type(err).__name__}: {str(err)[:120]}")
                    continue
                rows_out.append({"E": e, "B": b, "config": cfg, "us": us, "torch_us": ref_us, "ok": ok})
                print(f"{e:6d} {b:3d} {name:44s} | {us:9.2f} | {ref_us:8.2f} | {ref_us / us:6.2f}x  "
                      f"{'ok' if ok else 'WRONG'}", flush=True)
    return rows_out


def sweep_configs(e: int) -> list[Config]:
    """Tilings to try at e entries: `config`'s at 4, 8 and 16 warps, holding up to 32 or 64 keys a thread."""
    out = []
    for warps in (4, 8, 16):
        for held in (32, 64):
            cfg = config(e, num_warps=warps, held_keys=held)
            if cfg not in out:
                out.append(cfg)
    return out


def sass_report(e: int, k: int = 512, cfg: Config | None = None) -> dict:
    """Build `_topk_kernel` for sm_90 as a launch at e entries would be (no GPU needed: Triton's NVIDIA
    backend compiles offline): registers, spill stack, shared memory, and the SASS op counts of its loops."""
    import re

    from moebox.ops.triton.runtime import build_sm90, cubin_dump
    cfg = cfg or config(e)
    sig = dict(zip(_topk_kernel.arg_names, ["*fp32", "*u8", "*i64", "*u8", "i32", "i32", "i32"]))
    const = {"K": k, "NCH": cfg.nch, "HK": cfg.hk, "TK": cfg.tk, "NT": cfg.nt, "WIDE": cfg.wide, "PDL": True}
    compiled = build_sm90(_topk_kernel, sig, const, [a for a, ty in sig.items() if ty.startswith("*")],
                          num_warps=cfg.num_warps)
    sass, usage = cubin_dump(compiled.asm["cubin"])
    line = r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?"
    ins = [(int(a, 16), op.split(".")[0]) for a, op in re.findall(line + r"([A-Z][\w.]*)", sass)]
    loops = sorted((int(t, 16), int(a, 16)) for a, t in re.findall(line + r"BRA[^;]*?0x([0-9a-f]+)", sass)
                   if int(t, 16) < int(a, 16))
    return {"config": cfg, "registers": int(re.search(r"REG:(\d+)", usage).group(1)),
            "spill_stack": int(re.search(r"STACK:(\d+)", usage).group(1)), "shared": compiled.metadata.shared,
            "instructions": len(ins), "loops": [sum(lo <= a <= hi for a, _ in ins) for lo, hi in loops],
            "barriers": sum(op == "BAR" for _, op in ins)}


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="the indexer top-k kernel vs torch.topk: time (CUDA) or --sass")
    p.add_argument("--entries", type=int, nargs="+", default=[1025, 4097, 16385])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("-k", type=int, default=512)
    p.add_argument("--masked", type=float, default=0.0, help="fraction of -inf entries (short contexts: most)")
    p.add_argument("--sweep", action="store_true", help="also time other warp counts / held keys")
    p.add_argument("--sass", action="store_true", help="no GPU needed: registers, spills, loop sizes for sm_90")
    args = p.parse_args(argv)
    if args.sass:
        for e in args.entries:
            for cfg in sweep_configs(e) if args.sweep else [config(e)]:
                print(f"E {e:6d}: {sass_report(e, args.k, cfg)}", flush=True)
        return
    bench_start()
    for e in args.entries:
        bench([e], args.batch, args.k, configs=sweep_configs(e) if args.sweep else (None,), masked=args.masked)


if __name__ == "__main__":  # python -m moebox.ops.triton.topk [--entries ...] [--batch ...] [--sweep] [--sass]
    main()
