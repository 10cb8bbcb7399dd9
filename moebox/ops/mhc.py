"""Manifold-constrained hyper-connections (mHC): mixing the 4 residual streams around each sub-block.

All mixing math runs in fp32 (as the reference does); see deepseek_v4.md §2.2 for the formulas.
`hc_pre` / `hc_post` / `hc_head` dispatch: CUDA tensors go to the fused Triton kernels (moebox/ops/triton/mhc.py)
when triton imports, everything else to the torch references below (`*_reference`). Under autograd (training
on CUDA) the references run compiled (`fused`): the Sinkhorn loop is ~100 tiny ops forward and more backward.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from moebox.ops.fuse import fused
from moebox.ops.norm import rms_norm, rms_norm_reference
from moebox.ops.streams import Branch


def _fused(X: torch.Tensor, out: torch.Tensor | None = None) -> ModuleType | None:
    """The fused-kernel module for these CUDA tensors, or None (CPU, no triton, a case it does not take, or
    autograd recording: the kernels have no backward, training takes the torch code)."""
    if not X.is_cuda or (torch.is_grad_enabled() and X.requires_grad):
        return None
    from moebox.ops.triton.runtime import HAVE_TRITON
    if not HAVE_TRITON:
        return None
    from moebox.ops.triton import mhc
    return mhc if mhc.fused_supported(X, out) else None


def hc_pre(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, iters: int, eps: float,
           norm_eps: float, coeffs_branch: Branch | None = None, norm: torch.Tensor | None = None,
           partials: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """X [N, hc, H] -> (sub-block input [N, H], post [N, hc] fp32, comb [N, hc, hc] fp32). The fused path
    computes post and comb on `coeffs_branch`'s side stream when it is on: use them after its join().
    `norm`: the sub-block's RMSNorm weight; the input comes back normed, rms_norm(x, norm, norm_eps) (at
    decode the fused path does it in the same launch). `partials`: what `hc_post_chain` returned for this
    site's fn (the fused path's; None: computed here)."""
    if (f := _fused(X)) is not None:
        return f.hc_pre_triton(X, fn, base, scale, iters=iters, eps=eps, norm_eps=norm_eps,
                               coeffs_branch=coeffs_branch, norm=norm, partials=partials)
    x, post, comb = hc_pre_reference(X, fn, base, scale, iters=iters, eps=eps, norm_eps=norm_eps)
    return (x if norm is None else rms_norm(x, norm, norm_eps)), post, comb


def hc_post(out: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """X_new[k] = post[k] * out + sum_j comb[j, k] X[j]  (comb is applied transposed)."""
    return hc_post_chain(out, X, post, comb)[0]


def hc_post_chain(out: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, *,
                  addend: torch.Tensor | None = None, next_fn: torch.Tensor | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hc_post of out + addend (None: out alone) -> (X_new, partials for the next site's hc_pre, whose fn is
    `next_fn`, or None). The fused decode path writes both in one launch (moebox/ops/triton/mhc.py: the
    decode chain); elsewhere the partials are None and hc_pre computes its logits itself."""
    if (f := _fused(X, out)) is not None and (addend is None or f.fused_supported(X, addend)):
        return f.hc_post_chain_triton(out, X, post, comb, addend=addend, next_fn=next_fn)
    return hc_post_reference(out if addend is None else out + addend, X, post, comb), None


def hc_head(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, eps: float,
            norm_eps: float) -> torch.Tensor:
    """Collapse the streams for the output head: y = sum_j (sigmoid(.) + eps)_j X[j]."""
    if (f := _fused(X)) is not None:
        return f.hc_head_triton(X, fn, base, scale, eps=eps, norm_eps=norm_eps)
    return hc_head_reference(X, fn, base, scale, eps=eps, norm_eps=norm_eps)


@fused
def hc_pre_reference(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, iters: int,
                     eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """X [N, hc, H] -> (sub-block input [N, H], post [N, hc] fp32, comb [N, hc, hc] fp32)."""
    n, hc, _ = X.shape
    flat = rms_norm_reference(X.flatten(1).float(), None, norm_eps)
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


@fused
def hc_post_reference(out: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """X_new[k] = post[k] * out + sum_j comb[j, k] X[j]  (comb is applied transposed)."""
    dt = X.dtype
    return post.to(dt).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dt).transpose(-1, -2), X)


@fused
def hc_head_reference(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, eps: float,
                      norm_eps: float) -> torch.Tensor:
    """Collapse the streams for the output head: y = sum_j (sigmoid(.) + eps)_j X[j]."""
    flat = rms_norm_reference(X.flatten(1).float(), None, norm_eps)
    pre = torch.sigmoid(F.linear(flat, fn.float()) * scale.float() + base.float()) + eps
    return (pre.unsqueeze(-1) * X).sum(dim=1).to(X.dtype)
