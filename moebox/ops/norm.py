"""RMSNorm, computed in fp32 whatever the activation dtype (as the reference does).

`rms_norm` dispatches: CUDA decode-size inputs (up to 16 rows; outside autograd and torch.compile tracing) take
the one-launch Triton kernel (moebox/ops/triton/rms_norm.py; `MOEBOX_NORM_KERNEL=0` turns it off), everything
else the torch function `rms_norm_reference`, compiled on CUDA (`fused`).
"""

from __future__ import annotations

import torch

from moebox.ops.fuse import fused

KERNEL_MAX_ROWS = 16
Norm = tuple[torch.Tensor, float]   # (weight, eps) of an RMSNorm that a product applies to its x first


@fused
def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """weight * x / rms(x) over the last dim; `weight=None` is the unweighted variant (q heads, mHC input)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def _kernel_takes(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    from moebox.ops.triton.runtime import decode_kernel_takes
    return decode_kernel_takes(x, "MOEBOX_NORM_KERNEL", KERNEL_MAX_ROWS, weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """weight * x / rms(x) over the last dim; `weight=None` is the unweighted variant (q heads, mHC input)."""
    if _kernel_takes(x, weight):
        from moebox.ops.triton.rms_norm import rms_norm_triton
        return rms_norm_triton(x, weight, eps)
    return rms_norm_reference(x, weight, eps)
