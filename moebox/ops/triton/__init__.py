"""Triton kernels for the GPU fast path (issue D). Importing this package never needs Triton: each module
imports it lazily or guards on it, and falls back to the torch reference off CUDA."""

from moebox.ops.triton.w2_moe import (HAVE_TRITON, stack_planes, w2_moe_decode, w2_moe_decode_reference,
                                      w2_moe_decode_triton)

__all__ = ["HAVE_TRITON", "stack_planes", "w2_moe_decode", "w2_moe_decode_reference", "w2_moe_decode_triton"]
