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


def grouped_linear(x: torch.Tensor, w: Weight, groups: int) -> torch.Tensor:
    """Block-diagonal linear: x [N, g, in/g] -> [N, g, out/g], group i times the i-th block of out/g weight rows
    (DeepSeek-V4's grouped output projection wo_a). An FP8 weight on CUDA whose groups are whole 128-row scale
    blocks runs one grouped kernel launch for all groups (fp8_grouped_linear), so it is never dequantized in
    memory."""
    rows = w.shape[0] // groups
    if x.is_cuda and isinstance(w, QuantTensor) and w.kind == "fp8" and rows % w.block[0] == 0:
        from moebox.ops.triton.fp8_linear import fp8_grouped_linear
        return fp8_grouped_linear(x, w, groups)
    return torch.einsum("ngd,grd->ngr", x, dense_weight(w, x.dtype).view(groups, rows, -1))


def logits_linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """fp32 x W^T for the output heads. On CUDA with a bf16/fp16 head and x of the same dtype: one matmul with
    fp32 output (torch's mm out_dtype), so the ~1 GB head is never widened to fp32 per step. Else x in fp32
    against the head widened (the CPU reference)."""
    if (x.is_cuda and isinstance(w, torch.Tensor) and w.dtype == x.dtype and x.dtype in (torch.bfloat16, torch.float16)
            and hasattr(torch.ops.aten.mm, "dtype")):
        y = torch.mm(x.reshape(-1, x.shape[-1]), w.t(), out_dtype=torch.float32)
        return y.reshape(*x.shape[:-1], w.shape[0])
    return linear(x.float(), w)
