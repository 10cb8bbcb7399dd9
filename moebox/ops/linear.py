"""y = x W^T for weights in any stored format (float, FP8 block-scaled, FP4): the torch reference.

The reference dequantizes the whole weight per call; CUDA kernels replace this where it matters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moebox.weights.formats import QuantTensor

Weight = torch.Tensor | QuantTensor


def dense_weight(w: Weight, dtype: torch.dtype) -> torch.Tensor:
    return w.dequantize(dtype) if isinstance(w, QuantTensor) else w.to(dtype)


def linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    return F.linear(x, dense_weight(w, x.dtype))
