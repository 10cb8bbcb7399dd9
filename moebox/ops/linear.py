"""y = x W^T for weights in any stored format (float, FP8 block-scaled, FP4, 2-bit planes): the torch reference.

The reference dequantizes the whole weight per call; CUDA kernels replace this where it matters.
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
    return F.linear(x, dense_weight(w, x.dtype))
