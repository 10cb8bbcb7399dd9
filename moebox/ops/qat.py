"""Simulated activation quantization that DeepSeek-V4 was trained with (its QAT), as the reference runs it.

- KV and compressed entries: the non-rope channels are rounded to FP8 e4m3 in blocks of 64 with a
  power-of-two scale.
- Indexer queries and keys: a Hadamard rotation over the index head dim, then FP4 e2m1 rounding in blocks of
  32 with a power-of-two scale. The rotation is orthogonal, so without rounding it cancels in q.k.
"""

from __future__ import annotations

import math

import torch

from moebox.ops.fuse import fused
from moebox.weights.formats import FP4_MAX, FP8_MAX, fp4_codes_from_values, fp4_values_from_codes, pow2_exponent


def _blockwise_round(x: torch.Tensor, block: int, qmax: float, round_fn) -> torch.Tensor:
    """Round x in blocks of `block` along the last dim with one power-of-two scale per block. A last partial
    block (tiny test models: dims that are not multiples of the block) is zero-padded, which leaves its
    scale and values as if it stood alone."""
    d = x.shape[-1]
    pad = -d % block
    xb = torch.nn.functional.pad(x.float(), (0, pad)).reshape(*x.shape[:-1], (d + pad) // block, block)
    s = torch.exp2(pow2_exponent(xb.abs().amax(-1, keepdim=True), qmax))
    q = round_fn(xb / s) * s
    return q.reshape(*x.shape[:-1], d + pad)[..., :d].to(x.dtype)


def fp8_round(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    return _blockwise_round(x, block, FP8_MAX, lambda v: v.to(torch.float8_e4m3fn).float())


def fp4_round(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    return _blockwise_round(x, block, FP4_MAX, lambda v: fp4_values_from_codes(fp4_codes_from_values(v)))


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform over the last dim (a power of two)."""
    n = x.shape[-1]
    y = x.float()
    h = 1
    while h < n:
        y = y.reshape(*x.shape[:-1], n // (2 * h), 2, h)
        y = torch.stack((y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]), dim=-2)
        h *= 2
    return (y.reshape(x.shape) / math.sqrt(n)).to(x.dtype)


@fused
def round_kv_nope(kv: torch.Tensor, nope_dim: int) -> torch.Tensor:
    return torch.cat([fp8_round(kv[..., :nope_dim]), kv[..., nope_dim:]], dim=-1)


@fused
def round_index_vectors(x: torch.Tensor) -> torch.Tensor:
    return fp4_round(hadamard(x))
