"""Gated pooling of consecutive tokens into compressed KV entries (the CSA/HCA compressors).

Entry w of a rate-r compressor pools the tokens of window w = [w*r, (w+1)*r): per channel, a softmax over
the window of (gate + ape[pos mod r]) weights the projected values. CSA (`overlap`) emits two halves per
token and pools 2r slots: the first half of window w-1's tokens and the second half of window w's tokens.
"""

from __future__ import annotations

import torch


def pool_windows(kv: torch.Tensor, gate: torch.Tensor, first_pos: int, windows: torch.Tensor, ratio: int,
                 overlap: bool) -> torch.Tensor:
    """kv, gate [P, C] fp32 rows for positions first_pos.. (gate already includes ape) -> [len(windows), d].

    C = 2d with overlap (halves [Ca | Cb]), else C = d. Rows a window needs must all be present.
    """
    d = kv.shape[-1] // 2 if overlap else kv.shape[-1]
    cur = windows[:, None] * ratio + torch.arange(ratio, device=kv.device)[None, :] - first_pos   # [nw, r]
    vals, gates = kv[cur][..., -d:], gate[cur][..., -d:]                                    # Cb (or all) [nw, r, d]
    if overlap:
        prev = cur - ratio
        has_prev = (windows > 0)[:, None, None]
        pv = kv[prev.clamp(min=0)][..., :d]
        pg = torch.where(has_prev, gate[prev.clamp(min=0)][..., :d], torch.full_like(pv, float("-inf")))
        pv = torch.where(has_prev, pv, torch.zeros_like(pv))
        vals, gates = torch.cat([pv, vals], dim=1), torch.cat([pg, gates], dim=1)
    return (vals * torch.softmax(gates, dim=1)).sum(dim=1)
