"""The indexer's top-k at decode in one Triton kernel: a radix select on the fp32 bits, held in registers.

Why: every decode step each CSA layer's lightning indexer picks `index_topk` (512) of a sequence's compressed
entries. torch.topk (`gatherTopK`, a radix select that re-reads its input from memory on each of its passes)
took 393 us of a batch-1 V4-Flash step at 4K context: 21 launches of ~18.7 us (docs/benchmarks.md, seventh
session), for 1024 scores a row. Here one program per row finds the k-th largest in 8 rounds over the row,
each one block-wide reduction per 1024 scores (the row stays in L1 after the first), then writes the chosen rows
and their `valid` flags (the gather the caller did after torch.topk) in the same launch.

How: a score's fp32 bits map to an int32 key with the same order (negative floats get their 31 low bits
flipped). The search keeps the k-th largest key's high bits found so far, T, and in each round counts, for
the 16 candidates T + d 2^s (d = 0..15, s = 28, 24, ..., 0), how many keys are at least that: the largest d
whose count is >= k is the next digit. The rows taken are those with keys above T, then rows equal to T, lowest
index first, until there are k: exactly k distinct rows, none left out scoring above one taken. Their order: the
rows above T by index, then the equal ones (callers do not depend on the order, as with sorted=False).

Semantics: `torch.topk(scores, k, sorted=False)` up to ties (torch leaves those unspecified) and the order of
the k rows; -inf rows (masked entries) are taken only when fewer than k rows are finite, as there. -0.0 ranks
just below +0.0, and NaN above +inf (torch also ranks NaN first).

Measured (H200, ninth session, docs/benchmarks.md): the GPU tests pass, but a call takes 31.7 us at 4K context
(1 025 entries: two 1024-score chunks, 8 rounds of [16, 1024] compares on one SM's 4 warps) against
gatherTopK's 18.7 us, and the batch-1 step went from 8.89 to 9.14 ms. Off by default. Next: keep rows of up
to 2 048 entries in registers across the rounds (8 warps), and count the 16 digits of the keys that match the
prefix so far. Not with tl.histogram as is: on sm_90 it lowers to shared-memory atomics (one per key and
round), so keys sent to a spare bin would all contend on one address.

Bounds: scores [B, E] fp32 with unit column stride, valid [B, E] bool, 1 <= k <= E <= MAX_ENTRIES; other
calls raise ValueError (`supported` says which). CUDA graphs: outputs from torch.empty, one launch, no host sync.
"""

from __future__ import annotations

import torch

from moebox.ops.triton.runtime import HAVE_TRITON, next_pow2, pdl_args, pdl_start, tl, triton  # noqa: F401

MAX_ENTRIES = 1 << 20   # rows of up to 4M tokens of context at ratio 4
CHUNK = 1024            # scores a program holds at once (4 warps: [16, 1024] compares without spills)


if HAVE_TRITON:
    @triton.jit
    def _keys(s_ptr, v_ptr, row, offs, E, stride_s, stride_v):
        """Order-preserving int32 keys of the scores at offs (negative floats: 31 low bits flipped), the mask
        of real entries, and their valid flags."""
        me = offs < E
        x = tl.load(s_ptr + row * stride_s + offs, mask=me, other=float("-inf"))
        bits = x.to(tl.int32, bitcast=True)
        return bits ^ ((bits >> 31) & 0x7FFFFFFF), me, tl.load(v_ptr + row * stride_v + offs, mask=me, other=0)

    @triton.jit
    def _signed(u):
        """int64 in [0, 2^32), the unsigned image of a key -> the int32 key."""
        k = u ^ 0x80000000
        return tl.where(k >= 0x80000000, k - 0x100000000, k).to(tl.int32)

    @triton.jit
    def _topk_kernel(s_ptr, v_ptr, rows_ptr, rv_ptr, E, stride_s, stride_v,
                     K: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
        pdl_start(PDL)
        b = tl.program_id(0).to(tl.int64)
        lane = tl.arange(0, CHUNK)
        digit = tl.arange(0, 16)
        t = b * 0                                              # the k-th largest key + 2^31, digit by digit
        for r in tl.static_range(8):
            shift = 28 - 4 * r
            cand = _signed(t + (digit.to(tl.int64) << shift))
            count = tl.zeros((16,), dtype=tl.int32)
            for c0 in tl.range(0, E, CHUNK):
                key, me, _ = _keys(s_ptr, v_ptr, b, c0 + lane, E, stride_s, stride_v)
                count += tl.sum(((key[None, :] >= cand[:, None]) & me[None, :]).to(tl.int32), axis=1)
            t += tl.sum(((count >= K) & (digit >= 1)).to(tl.int64), axis=0) << shift   # count falls with d
        kth = _signed(t)
        n_above = 0
        for c0 in tl.range(0, E, CHUNK):
            key, me, _ = _keys(s_ptr, v_ptr, b, c0 + lane, E, stride_s, stride_v)
            n_above += tl.sum(((key > kth) & me).to(tl.int32), axis=0)
        above_before = 0                                       # rows written so far: above kth, equal to it
        equal_before = 0
        for c0 in tl.range(0, E, CHUNK):
            offs = c0 + lane
            key, me, valid = _keys(s_ptr, v_ptr, b, offs, E, stride_s, stride_v)
            above = (key > kth) & me
            equal = (key == kth) & me
            rank_eq = equal_before + tl.cumsum(equal.to(tl.int32), axis=0)      # 1-based among equal rows
            take = above | (equal & (rank_eq <= K - n_above))
            pos = tl.where(above, above_before + tl.cumsum(above.to(tl.int32), axis=0) - 1, n_above + rank_eq - 1)
            tl.store(rows_ptr + b * K + pos, offs.to(tl.int64), mask=take)
            tl.store(rv_ptr + b * K + pos, valid, mask=take)
            above_before += tl.sum(above.to(tl.int32), axis=0)
            equal_before += tl.sum(equal.to(tl.int32), axis=0)


def supported(scores: torch.Tensor, valid: torch.Tensor, k: int) -> bool:
    """Whether `index_topk_triton` takes these arguments (see the module doc's Bounds)."""
    return (HAVE_TRITON and scores.dim() == 2 and scores.dtype == torch.float32 and scores.stride(1) == 1
            and valid.dtype == torch.bool and tuple(valid.shape) == tuple(scores.shape) and valid.stride(1) == 1
            and valid.device == scores.device and 1 <= k <= scores.shape[1] <= MAX_ENTRIES)


def index_topk_triton(scores: torch.Tensor, valid: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [B, E] fp32 (masked entries -inf), valid [B, E] bool -> (rows [B, k] int64, valid at those rows
    [B, k] bool): what `rows = scores.topk(k, sorted=False).indices; valid.gather(1, rows)` gives, up to ties
    and order."""
    if not supported(scores, valid, k):
        raise ValueError(f"index_topk_triton takes fp32 scores [B, E <= {MAX_ENTRIES}] with unit column stride, "
                         f"a bool valid of their shape and 1 <= k <= E; got {tuple(scores.shape)} {scores.dtype}, "
                         f"{tuple(valid.shape)} {valid.dtype}, k {k}")
    b, e = scores.shape
    rows = torch.empty((b, k), dtype=torch.int64, device=scores.device)
    rvalid = torch.empty((b, k), dtype=torch.bool, device=scores.device)
    if b:
        _topk_kernel[(b,)](scores, valid.view(torch.uint8), rows, rvalid.view(torch.uint8), e, scores.stride(0),
                           valid.stride(0), K=k, CHUNK=min(CHUNK, next_pow2(e)), num_warps=4, **pdl_args(scores))
    return rows, rvalid
