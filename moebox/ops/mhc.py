"""Manifold-constrained hyper-connections (mHC): mixing the 4 residual streams around each sub-block.

All mixing math runs in fp32 (as the reference does); see deepseek_v4.md §2.2 for the formulas.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moebox.ops.norm import rms_norm


def hc_pre(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, iters: int, eps: float,
           norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """X [N, hc, H] -> (sub-block input [N, H], post [N, hc] fp32, comb [N, hc, hc] fp32)."""
    n, hc, _ = X.shape
    flat = rms_norm(X.flatten(1).float(), None, norm_eps)
    m = F.linear(flat, fn.float())                                       # [N, (2+hc)*hc]
    pre_m, post_m, comb_m = m.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.float().split([hc, hc, hc * hc])
    s = scale.float()
    pre = torch.sigmoid(pre_m * s[0] + pre_b) + eps
    post = 2 * torch.sigmoid(post_m * s[1] + post_b)
    comb = torch.softmax(comb_m.view(n, hc, hc) * s[2] + comb_b.view(hc, hc), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    x = (pre.unsqueeze(-1) * X).sum(dim=1).to(X.dtype)
    return x, post, comb


def hc_post(out: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """X_new[k] = post[k] * out + sum_j comb[j, k] X[j]  (comb is applied transposed)."""
    dt = X.dtype
    return post.to(dt).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dt).transpose(-1, -2), X)


def hc_head(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, eps: float,
            norm_eps: float) -> torch.Tensor:
    """Collapse the streams for the output head: y = sum_j (sigmoid(.) + eps)_j X[j]."""
    flat = rms_norm(X.flatten(1).float(), None, norm_eps)
    pre = torch.sigmoid(F.linear(flat, fn.float()) * scale.float() + base.float()) + eps
    return (pre.unsqueeze(-1) * X).sum(dim=1).to(X.dtype)
