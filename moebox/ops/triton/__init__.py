"""Triton kernels for the GPU fast path (issue D). Importing this package never needs Triton: each module
imports it lazily or guards on it, and falls back to the torch reference off CUDA."""

# not the dispatcher `fp8_linear` itself: that name would shadow the submodule moebox.ops.triton.fp8_linear
from moebox.ops.triton.fp8_linear import Fp8Config, fp8_linear_reference, fp8_linear_triton
from moebox.ops.triton.w2_moe import (HAVE_TRITON, stack_planes, w2_moe_decode, w2_moe_decode_reference,
                                      w2_moe_decode_triton)

__all__ = ["HAVE_TRITON", "stack_planes", "w2_moe_decode", "w2_moe_decode_reference", "w2_moe_decode_triton",
           "Fp8Config", "fp8_linear_reference", "fp8_linear_triton"]
