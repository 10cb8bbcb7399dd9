"""The shape-static decode step of attention (`DecodeBatch`: one token per sequence), as free functions of
tensors.

Free functions, not methods, so that `fused` compiles each once for all layers (a method would be guarded on
its layer): per CSA layer about 90 small torch ops become a handful of fused kernels. Every shape is static:
whole window rings and entry tables are read and masked by position (a CUDA graph can replay the step for any
positions), the entry pooled at a token that closes no window goes to the table's scratch last row, and the
indexer's top-k runs over the whole table. Caches in the FP8 layout (`model/cache.py` row objects) take the
same functions eagerly.
"""

from __future__ import annotations

import torch

from moebox.ops.attention import sink_attention
from moebox.ops.compress import pool
from moebox.ops.fuse import fused
from moebox.ops.qat import round_index_vectors, round_kv_nope
from moebox.ops.rope import apply_rope, norm_rope
from moebox.ops.triton.runtime import kernel_or_fallback, kernel_switched_on


@fused
def window_mask(kv: torch.Tensor, pos: torch.Tensor, slot: torch.Tensor, ring: torch.Tensor,
                window: int) -> torch.Tensor:
    """Store each sequence's new K=V row in its window ring; which ring rows are inside the window [B, R]."""
    size = ring.shape[1]
    ring[slot, pos % size] = kv.to(ring.dtype)
    # ring row i holds the newest position <= pos that is i mod size (negative: never written)
    kpos = pos[:, None] - (pos[:, None] - torch.arange(size, device=pos.device)[None, :]) % size
    return (kpos > pos[:, None] - window) & (kpos >= 0)


def rope_keys(kv: torch.Tensor, weight: torch.Tensor, eps: float, pos: torch.Tensor, inv_freq: torch.Tensor,
              qat_nope_dim: int | None = None) -> torch.Tensor:
    """The K=V rows of kv's product: normed and rotated (`norm_rope`), QAT-rounded when `qat_nope_dim` is given."""
    keys = norm_rope(kv, weight, eps, pos, inv_freq)
    return keys if qat_nope_dim is None else round_kv_nope(keys, qat_nope_dim)


def store_keys(kv: torch.Tensor, weight: torch.Tensor, eps: float, pos: torch.Tensor, inv_freq: torch.Tensor,
               slot: torch.Tensor, ring: torch.Tensor, window: int, qat_nope_dim: int | None = None) -> torch.Tensor:
    """`window_mask` of `rope_keys(kv)`: the new K=V rows normed, rotated and stored in their rings -> which
    ring rows are inside the window [B, R]. On CUDA (a plain tensor ring, no QAT rounding) one Triton launch
    (ops/triton/rope.py: `store_keys_triton`) where the compiled functions take six on a batch-1 step (H200, 4K
    context: batch 1 / 16 -0.24 / -0.20 ms a step); MOEBOX_KEYS_KERNEL=0 takes the torch path."""
    def torch_path() -> torch.Tensor:
        return window_mask(rope_keys(kv, weight, eps, pos, inv_freq, qat_nope_dim), pos, slot, ring, window)
    if (qat_nope_dim is None and isinstance(ring, torch.Tensor)
            and kernel_switched_on(kv, "MOEBOX_KEYS_KERNEL")):
        from moebox.ops.triton.rope import store_keys_triton
        return kernel_or_fallback("key store", "MOEBOX_KEYS_KERNEL", lambda: store_keys_triton(
            kv, weight, eps, pos, inv_freq, slot, ring, window), torch_path)
    return torch_path()


@fused
def window_step(kv: torch.Tensor, pos: torch.Tensor, slot: torch.Tensor, ring: torch.Tensor,
                window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`window_mask`, and the ring read out: keys [B, R, d] and which of them are inside the window [B, R]."""
    visible = window_mask(kv, pos, slot, ring, window)
    return ring[slot].to(kv.dtype), visible


@fused
def compress_step(kv: torch.Tensor, gate: torch.Tensor, pos: torch.Tensor, slot: torch.Tensor,
                  ring_kv: torch.Tensor, ring_gate: torch.Tensor, entries: torch.Tensor, ape: torch.Tensor,
                  norm: torch.Tensor, inv_freq: torch.Tensor, ratio: int, overlap: bool, eps: float,
                  finish: str | None, nope_dim: int) -> torch.Tensor:
    """One compressor (main or indexer) at one token per sequence: store the raw rows kv/gate [B, C] (as fp32), pool
    the window that ends at this token, store the entry (row w, or the scratch row when no window closes), and
    return which entries are visible now [B, E]. `finish`: the QAT rounding of the entry ("kv", "index")."""
    kv, gate = kv.float(), gate.float()
    size = ring_kv.shape[1]
    ring_kv[slot, pos % size] = kv
    ring_gate[slot, pos % size] = gate
    w = (pos + 1) // ratio - 1
    span = (2 if overlap else 1) * ratio
    p = (w[:, None] + 1) * ratio - span + torch.arange(span, device=pos.device)[None, :]      # [B, span]
    rows = slot[:, None], p % size
    e = pool(ring_kv[rows], ring_gate[rows] + ape.float()[p % ratio], w > 0, overlap)
    e = norm_rope(e, norm, eps, w * ratio, inv_freq)
    if finish == "kv":
        e = round_kv_nope(e, nope_dim)
    elif finish == "index":
        e = round_index_vectors(e)
    n = entries.shape[1]
    entries[slot, torch.where((pos + 1) % ratio == 0, w, n - 1)] = e.to(entries.dtype)
    return torch.arange(n, device=pos.device)[None, :] < ((pos + 1) // ratio)[:, None]


@fused
def index_scores(qi: torch.Tensor, wi: torch.Tensor, scale: float, index_keys: torch.Tensor, slot: torch.Tensor,
                 valid: torch.Tensor) -> torch.Tensor:
    """The lightning indexer's scores [B, E] fp32 over each sequence's whole key table, -inf where not `valid`;
    the head weights `wi` are the raw projection, scaled here."""
    keys = index_keys[slot]                                                                 # [B, E, dI]
    scores = torch.relu(torch.einsum("bhd,bkd->bhk", qi.float(), keys.float()))
    return (scores * (wi.float() * scale).unsqueeze(-1)).sum(dim=1).masked_fill(~valid, float("-inf"))


@fused
def _top_rows(scores: torch.Tensor, valid: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    # unsorted: attention does not care about the order, and sorting the k rows was 4.8% of a batch-1 step
    top = scores.topk(k, dim=-1, sorted=False).indices
    return top, valid.gather(1, top)


def index_select(qi: torch.Tensor, wi: torch.Tensor, scale: float, index_keys: torch.Tensor, slot: torch.Tensor,
                 valid: torch.Tensor, topk: int, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The lightning indexer: (entry rows [B, k], valid [B, k]) of the top-k scores. The top-k and the gather
    of `valid` are one Triton kernel (ops/triton/topk.py) for rows up to 16385 entries (64K tokens of context;
    6.4 against torch's 16.4 us a call at 4K on the H200, 29 against 78 at 64K), torch.topk for longer ones
    (not measured end to end there); MOEBOX_TOPK_KERNEL=0 / 1 takes torch / the kernel at any length. The
    scores are one Triton kernel (ops/triton/index_scores.py: 2.7-4.0 against torch's 10.9-22.3 us a call at
    batch 1, 4K-64K, on the H200); MOEBOX_INDEX_KERNEL=0 takes the compiled torch function. `rope` (positions,
    inv_freq): qi is the raw product, rotated (`apply_rope`) by the score kernel where it fits, else first."""
    from moebox.ops.triton import index_scores as scorer
    from moebox.ops.triton.rope import rope_tile_fits

    def torch_scores() -> torch.Tensor:
        q = qi if rope is None else apply_rope(qi, rope[0], rope[1])
        return index_scores(q, wi, scale, index_keys, slot, valid)
    if (kernel_switched_on(qi, "MOEBOX_INDEX_KERNEL") and scorer.supported(qi, wi, index_keys, slot, valid)
            and (rope is None or rope_tile_fits(qi, *rope))):
        scores = kernel_or_fallback("indexer scores", "MOEBOX_INDEX_KERNEL",
                                    lambda: scorer.index_scores_triton(qi, wi, scale, index_keys, slot, valid,
                                                                       rope=rope), torch_scores)
    else:
        scores = torch_scores()
    k = min(topk, scores.shape[1])
    from moebox.ops.triton import topk as kernel
    if kernel_switched_on(scores, "MOEBOX_TOPK_KERNEL", default=scores.shape[1] <= kernel.DEFAULT_MAX_ENTRIES):
        if kernel.supported(scores, valid, k):
            return kernel_or_fallback("indexer top-k", "MOEBOX_TOPK_KERNEL",
                                      lambda: kernel.index_topk_triton(scores, valid, k),
                                      lambda: _top_rows(scores, valid, k))
    return _top_rows(scores, valid, k)


@fused
def attend(q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, sink: torch.Tensor, scale: float,
           entries: torch.Tensor | None = None, slot: torch.Tensor | None = None, rows: torch.Tensor | None = None,
           valid: torch.Tensor | None = None) -> torch.Tensor:
    """Sink attention of q [B, nh, d] over the window keys plus, in compressed layers, the entry rows `rows`
    [B, k] (or [1, E]: all) of each sequence's table, masked by `valid`."""
    if entries is not None:
        ent = entries[slot[:, None], rows.expand(slot.shape[0], -1)]
        keys = torch.cat([keys, ent.to(keys.dtype)], dim=1)
        visible = torch.cat([visible, valid], dim=1)
    return sink_attention(q, keys, visible, sink, scale)
