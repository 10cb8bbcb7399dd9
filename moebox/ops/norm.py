"""RMSNorm, computed in fp32 whatever the activation dtype (as the reference does).

`rms_norm` dispatches: CUDA decode-size inputs (up to 16 rows; outside autograd and torch.compile tracing) take
the one-launch Triton kernel (moebox/ops/triton/rms_norm.py; `MOEBOX_NORM_KERNEL=0` turns it off), everything
else the torch function `rms_norm_reference`, compiled on CUDA (`fused`).
"""

from __future__ import annotations

import torch

from moebox.ops.fuse import fused

KERNEL_MAX_ROWS = 16


@fused
def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """weight * x / rms(x) over the last dim; `weight=None` is the unweighted variant (q heads, mHC input)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def _kernel_takes(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    # tracing first: inside a compiled function the row count may be symbolic (no guard on it)
    if torch.compiler.is_compiling() or not x.is_cuda or x.numel() > KERNEL_MAX_ROWS * x.shape[-1]:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad)):
        return False
    from moebox.ops.triton.runtime import HAVE_TRITON, kernel_switched_on
    return HAVE_TRITON and kernel_switched_on(x, "MOEBOX_NORM_KERNEL")


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """weight * x / rms(x) over the last dim; `weight=None` is the unweighted variant (q heads, mHC input)."""
    if _kernel_takes(x, weight):
        from moebox.ops.triton.rms_norm import rms_norm_triton
        return rms_norm_triton(x, weight, eps)
    return rms_norm_reference(x, weight, eps)
