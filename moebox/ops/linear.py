"""y = x W^T for weights in any stored format (float, FP8 block-scaled, FP4, 2-bit planes).

On CUDA an FP8 weight goes through the Triton FP8 kernel (the weight is never widened in memory); everything
else, and every CPU run, is the torch reference: dequantize the whole weight per call (slow, exact).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moebox.quant.w2 import W2Tensor
from moebox.weights.formats import QuantTensor

Weight = torch.Tensor | QuantTensor | W2Tensor


def dense_weight(w: Weight, dtype: torch.dtype) -> torch.Tensor:
    return w.to(dtype) if isinstance(w, torch.Tensor) else w.dequantize(dtype)


def linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    if x.is_cuda and isinstance(w, QuantTensor) and w.kind == "fp8":
        from moebox.ops.triton.fp8_linear import fp8_linear
        y = fp8_linear(x.reshape(-1, x.shape[-1]), w)
        return y.reshape(*x.shape[:-1], y.shape[-1])
    return F.linear(x, dense_weight(w, x.dtype))
