"""y = x W^T for weights in any stored format (float, FP8 block-scaled, FP4, 2-bit planes).

On CUDA an FP8 weight goes through the Triton FP8 kernel (the weight is never widened in memory); everything
else, and every CPU run, is the torch reference: dequantize the whole weight per call (slow, exact).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable, Sequence

import torch
import torch.nn.functional as F

from moebox.ops.norm import Norm, rms_norm
from moebox.quant.w2 import W2Tensor
from moebox.weights.formats import QuantTensor

Weight = torch.Tensor | QuantTensor | W2Tensor


def dense_weight(w: Weight, dtype: torch.dtype) -> torch.Tensor:
    return w.to(dtype) if isinstance(w, torch.Tensor) else w.dequantize(dtype)


# Decode-size products (N <= 4 rows) of bf16/fp16 weights up to this many elements go through the GEMV kernel
# (`dense_gemv`); larger ones (the ~1 GB output head, which cuBLAS streams at the copy rate) and more rows (the
# GEMV's work grows with them: at batch 8 and 16 it lost 0.3 and 1.0 ms a step on the H200) stay with torch.
DENSE_GEMV_MAX_N = 4
DENSE_GEMV_MAX_ELEMENTS = 1 << 26


def _dense_gemv_takes(x: torch.Tensor, w: Weight) -> bool:
    """Whether x @ w.T goes through `dense_gemv`: a CUDA decode-size product of a 16-bit float weight of x's
    dtype (see `decode_kernel_takes`; MOEBOX_DENSE_GEMV=0 turns it off)."""
    if not (isinstance(w, torch.Tensor) and w.dtype == x.dtype and w.dim() == 2
            and x.dtype in (torch.bfloat16, torch.float16) and w.numel() <= DENSE_GEMV_MAX_ELEMENTS):
        return False
    from moebox.ops.triton.runtime import decode_kernel_takes
    return decode_kernel_takes(x, "MOEBOX_DENSE_GEMV", DENSE_GEMV_MAX_N, w)


def _on_rows(x: torch.Tensor, product: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """product(x as rows [N, in]) -> [N, out], shaped back to x's leading dims."""
    y = product(x.reshape(-1, x.shape[-1]))
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _gemv(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    from moebox.ops.triton.fp8_linear import dense_gemv
    return _on_rows(x, lambda rows: dense_gemv(rows, w, out_dtype))


def linear(x: torch.Tensor, w: Weight, norm: Norm | None = None) -> torch.Tensor:
    """x W^T; with `norm` = (weight, eps), rms_norm(x, weight, eps) W^T. An FP8 weight on CUDA takes the norm
    into its kernel call, whose single-split decode GEMV fuses it (one launch fewer at batch 1); every other
    path norms x first."""
    if x.is_cuda and isinstance(w, QuantTensor) and w.kind == "fp8":
        from moebox.ops.triton.fp8_linear import fp8_linear
        return _on_rows(x, lambda rows: fp8_linear(rows, w, norm=norm))
    if norm is not None:
        x = rms_norm(x, *norm)
    if _dense_gemv_takes(x, w):
        return _gemv(x, w, x.dtype)
    return F.linear(x, dense_weight(w, x.dtype))


def _stack_key(w: Weight, i: int) -> Hashable:
    """Weights with equal keys stack into one (their rows concatenated); a unique key keeps w on its own:
    trainable parameters (the product must reach each one), FP4/planes, FP8 rows that end mid scale block; every
    weight when MOEBOX_STACK_LINEARS=0 (to measure what stacking gains)."""
    if os.environ.get("MOEBOX_STACK_LINEARS", "1") == "0":
        return "alone", i
    if isinstance(w, torch.Tensor) and not w.requires_grad:
        return "float", w.dtype, w.device, w.shape[1]
    if isinstance(w, QuantTensor) and w.kind == "fp8" and w.shape[0] % w.block[0] == 0:
        return "fp8", w.block, w.data.dtype, w.data.device, w.shape[1]
    return "alone", i


def _stack_rows(ws: Sequence[Weight]) -> Weight:
    if len(ws) == 1:
        return ws[0]
    if isinstance(ws[0], QuantTensor):
        return QuantTensor("fp8", torch.cat([w.data for w in ws]), torch.cat([w.scale for w in ws]), ws[0].block)
    return torch.cat(list(ws))


class SharedInputLinear:
    """Several linears of one input, as few products as their formats allow: weights that stack (same float
    dtype, or FP8 in whole scale blocks) run as one matmul over their concatenated rows whose output is split.
    On the GPU a decode step is bound by launches, and this is one launch and one pass over x instead of one
    per weight. Built from the separate weights, which a loader should not keep (the stacked copy replaces
    them)."""

    def __init__(self, *weights: Weight) -> None:
        groups: dict[Hashable, list[int]] = {}
        for i, w in enumerate(weights):
            groups.setdefault(_stack_key(w, i), []).append(i)
        self.rows = [w.shape[0] for w in weights]
        self.parts = [(idx, _stack_rows([weights[i] for i in idx])) for idx in groups.values()]

    def __call__(self, x: torch.Tensor, norm: Norm | None = None) -> list[torch.Tensor]:
        """x @ w.T for each weight, in the order given (column slices of a shared product are views); with `norm`
        = (weight, eps), of rms_norm(x, weight, eps): one product takes it along (see `linear`), several share
        x normed once."""
        if norm is not None and len(self.parts) > 1:
            x, norm = rms_norm(x, *norm), None
        out: list[torch.Tensor] = [x] * len(self.rows)
        for idx, w in self.parts:
            for i, y in zip(idx, linear(x, w, norm).split([self.rows[i] for i in idx], dim=-1)):
                out[i] = y
        return out


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
    """fp32 x W^T for the output heads and the router. On CUDA with a bf16/fp16 weight and x of the same dtype:
    one matmul with fp32 output (torch's mm out_dtype; bf16 products are exact in fp32, so only the summation
    order differs from the reference), and neither the ~1 GB head nor a router's gate is widened to fp32 per
    step (the router's widening copies were ~7 us a layer at batch 1 on the H200); a decode-size product of a
    weight below the head's size takes the GEMV kernel instead (see `linear`). Else x in fp32 against the
    weight widened (the CPU reference)."""
    if _dense_gemv_takes(x, w):
        return _gemv(x, w, torch.float32)
    if (x.is_cuda and isinstance(w, torch.Tensor) and w.dtype == x.dtype and x.dtype in (torch.bfloat16, torch.float16)
            and hasattr(torch.ops.aten.mm, "dtype")):
        return _on_rows(x, lambda rows: torch.mm(rows, w.t(), out_dtype=torch.float32))
    return linear(x.float(), w)
