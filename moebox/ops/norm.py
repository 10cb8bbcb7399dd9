"""RMSNorm, computed in fp32 whatever the activation dtype (as the reference does)."""

from __future__ import annotations

import torch

from moebox.ops.fuse import fused


@fused
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """weight * x / rms(x) over the last dim; `weight=None` is the unweighted variant (q heads, mHC input)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)
