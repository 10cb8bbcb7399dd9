"""Gated pooling of consecutive tokens into compressed KV entries (the CSA/HCA compressors).

Entry w of a rate-r compressor pools the tokens of window w = [w*r, (w+1)*r): per channel, a softmax over
the window of (gate + ape[pos mod r]) weights the projected values. CSA (`overlap`) emits two halves per
token and pools 2r slots: the first half of window w-1's tokens and the second half of window w's tokens.
"""

from __future__ import annotations

import torch

from moebox.ops.fuse import fused


@fused
def pool(kv: torch.Tensor, gate: torch.Tensor, has_prev: torch.Tensor, overlap: bool) -> torch.Tensor:
    """kv, gate [nw, span, C] fp32: each window's rows (gate already includes ape); with overlap the span is
    the r rows of window w-1 then the r rows of window w, C = 2d; `has_prev` [nw] says window w-1 exists.
    -> [nw, d]."""
    d = kv.shape[-1] // 2 if overlap else kv.shape[-1]
    r = kv.shape[1] // 2 if overlap else kv.shape[1]
    vals, gates = kv[:, -r:, -d:], gate[:, -r:, -d:]                                       # Cb (or all)
    if overlap:
        prev = has_prev[:, None, None]
        pv = torch.where(prev, kv[:, :r, :d], torch.zeros_like(vals))
        pg = torch.where(prev, gate[:, :r, :d], torch.full_like(gates, float("-inf")))
        vals, gates = torch.cat([pv, vals], dim=1), torch.cat([pg, gates], dim=1)
    return (vals * torch.softmax(gates, dim=1)).sum(dim=1)


def pool_windows(kv: torch.Tensor, gate: torch.Tensor, first_pos: int, windows: torch.Tensor, ratio: int,
                 overlap: bool) -> torch.Tensor:
    """kv, gate [P, C] fp32 rows for positions first_pos.. (gate already includes ape) -> [len(windows), d];
    or [B, P, C] for B sequences at the same positions -> [B, len(windows), d].

    C = 2d with overlap (halves [Ca | Cb]), else C = d. Rows a window needs must all be present.
    """
    rows = windows[:, None] * ratio + torch.arange(ratio, device=kv.device)[None, :] - first_pos   # [nw, r]
    if overlap:
        rows = torch.cat([(rows - ratio).clamp(min=0), rows], dim=1)
    if kv.dim() == 2:
        return pool(kv[rows], gate[rows], windows > 0, overlap)
    b, nw = kv.shape[0], rows.shape[0]
    pooled = pool(kv[:, rows].flatten(0, 1), gate[:, rows].flatten(0, 1), (windows > 0).repeat(b), overlap)
    return pooled.view(b, nw, pooled.shape[-1])
