"""Attention with a learnable per-head sink, where keys double as values (DeepSeek-V4's single K=V head)."""

from __future__ import annotations

import torch

from moebox.ops.fuse import fused


@fused
def sink_attention(q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, sinks: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """q [L, nh, d], keys [K, d] shared by the L queries or [L, K, d] per query, visible [L, K] bool,
    sinks [nh] -> [L, nh, d].

    softmax over (scores of visible keys, sink logit); the sink only enlarges the denominator.
    """
    k = "lkd" if keys.dim() == 3 else "kd"
    s = torch.einsum(f"lhd,{k}->lhk", q.float(), keys.float()) * scale
    s = s.masked_fill(~visible[:, None, :], float("-inf"))
    sink = sinks.float().view(1, -1, 1).expand(s.shape[0], -1, 1)
    logits = torch.cat([s, sink], dim=-1)
    p = torch.softmax(logits - logits.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
    return torch.einsum(f"lhk,{k}->lhd", p, keys.float()).to(q.dtype)
