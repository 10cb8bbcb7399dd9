"""RMSNorm of decode-size rows in one Triton launch: one program a row, the whole row in registers.

Why: a V4-Flash decode step runs ~130 RMSNorms over 4096- or 1024-wide rows (the sub-block input after each of
the 86 mHC sites, attention's q latent). Inductor compiles `moebox.ops.norm.rms_norm_reference` into a looped
reduction ("triton_red_...": the row read twice, in chunks), ~4 us a launch at batch 1 on the H200 (twelfth
session's timeline), for 8 KB. Here a program loads its row once (one 16-byte vector a thread and chunk), sums
the squares in fp32, and writes weight * x * rsqrt(mean + eps) in x's dtype: the arithmetic of the reference
(fp32 throughout, one rounding at the end), only the order of the sum differs.

Bounds: rows of any width D (padded to a power of 2 with a mask), unit column stride, any row stride; weight
None or [D]. `moebox.ops.norm.rms_norm` takes this path for CUDA decode-size inputs (up to 16 rows) outside
autograd and torch.compile tracing; `MOEBOX_NORM_KERNEL=0` keeps the compiled torch function.
CUDA graphs: a call allocates its output with torch.empty and launches one kernel; no host sync.
"""

from __future__ import annotations

import torch

from moebox.ops.triton.runtime import HAVE_TRITON, next_pow2, pdl_args, pdl_start, tl, triton

if HAVE_TRITON:
    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, D, stride_x, stride_y, eps, BLOCK: tl.constexpr,
                         HAS_WEIGHT: tl.constexpr, PDL: tl.constexpr):
        pdl_start(PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        m = offs < D
        x = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0).to(tl.float32)
        y = x * (1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps))
        if HAS_WEIGHT:
            y = y * tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_y + offs, y.to(y_ptr.dtype.element_ty), mask=m)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """weight * x / rms(x) over the last dim of x [..., D] (fp32/bf16/fp16, unit column stride), in x's dtype,
    as `moebox.ops.norm.rms_norm_reference`. Runs on CUDA, or on CPU tensors under TRITON_INTERPRET=1."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed")
    d = x.shape[-1]
    if weight is not None and tuple(weight.shape) != (d,):
        raise ValueError(f"weight must be [{d}], got {tuple(weight.shape)}")
    rows = x.reshape(-1, d) if x.stride(-1) == 1 else x.contiguous().reshape(-1, d)
    y = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.numel():
        block = next_pow2(d)
        _rms_norm_kernel[(rows.shape[0],)](
            rows, rows if weight is None else weight, y, d, rows.stride(0), y.stride(0), eps, BLOCK=block,
            HAS_WEIGHT=weight is not None, num_warps=4 if block <= 4096 else 8, **pdl_args(x, _rms_norm_kernel))
    return y.reshape(x.shape)
