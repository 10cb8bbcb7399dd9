"""Partial, interleaved rotary embedding with optional YaRN, as DeepSeek-V4 uses it.

RoPE covers the *trailing* `rope_dim` channels of a vector; channels (2i, 2i+1) form one complex pair.
Sliding layers use plain RoPE (theta 1e4); compressed layers use theta 1.6e5 with YaRN and no mscale.

`query_rope` (an attention layer's queries: q normed then rotated, the indexer's qi rotated) and `inverse_rope`
(its output rotated back) dispatch: CUDA decode-size inputs (up to 16 tokens; outside autograd and
torch.compile tracing) take the one-launch Triton kernels (moebox/ops/triton/rope.py; `MOEBOX_ROPE_KERNEL=0`
turns them off), everything else `norm_rope` and `apply_rope`.
"""

from __future__ import annotations

import math

import torch

from moebox.config import YarnScaling
from moebox.ops.fuse import fused
from moebox.ops.norm import rms_norm

KERNEL_MAX_ROWS = 16   # tokens


def rope_inv_freq(rope_dim: int, theta: float, yarn: YarnScaling | None) -> torch.Tensor:
    """[rope_dim/2] fp32 inverse frequencies (YaRN: ramp between extrapolated and /factor-interpolated)."""
    exps = torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim
    extrap = 1.0 / (theta ** exps)
    if yarn is None:
        return extrap
    interp = extrap / yarn.factor

    def correction_dim(rotations: float) -> float:
        return rope_dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(theta))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return interp * ramp + extrap * (1 - ramp)


@fused
def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing 2*len(inv_freq) channels of x [..., D] at `positions` (broadcast over x's
    leading dims: positions has x.shape[0] entries). `inverse` applies the conjugate rotation."""
    rd = inv_freq.numel() * 2
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(x.device)[None, :]     # [N, rd/2]
    shape = (positions.shape[0],) + (1,) * (x.dim() - 2) + (rd // 2,)
    cos, sin = freqs.cos().view(shape), freqs.sin().view(shape)
    if inverse:
        sin = -sin
    rope = x[..., -rd:].float()
    a, b = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat([x[..., :-rd], rotated], dim=-1)


@fused
def norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, positions: torch.Tensor,
              inv_freq: torch.Tensor) -> torch.Tensor:
    """RMSNorm then RoPE, as one compiled function (one kernel on the GPU rather than two): every key, query and
    compressed entry of V4 is normed then rotated."""
    return apply_rope(rms_norm(x, weight, eps), positions, inv_freq)


def _kernel_takes(q: torch.Tensor, qi: torch.Tensor | None = None) -> bool:
    from moebox.ops.triton.runtime import decode_kernel_takes
    return decode_kernel_takes(q, "MOEBOX_ROPE_KERNEL", KERNEL_MAX_ROWS * q.shape[-2], qi)   # q [N, H, D]


def inverse_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """apply_rope(x, positions, inv_freq, inverse=True) for x [N, H, D] (an attention output), one Triton launch
    at decode sizes on CUDA."""
    if _kernel_takes(x):
        from moebox.ops.triton.rope import inverse_rope_triton
        return inverse_rope_triton(x, positions, inv_freq)
    return apply_rope(x, positions, inv_freq, inverse=True)


def query_rope(q: torch.Tensor, qi: torch.Tensor | None, positions: torch.Tensor, inv_freq: torch.Tensor,
               eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(norm_rope(q) without weight, apply_rope(qi)) for q [N, Hq, Dq] and qi [N, Hi, Di] or None (no indexer):
    the queries of an attention layer, in one launch at decode sizes on CUDA."""
    if _kernel_takes(q, qi):
        from moebox.ops.triton.rope import query_rope_triton
        return query_rope_triton(q, qi, positions, inv_freq, eps)
    return (norm_rope(q, None, eps, positions, inv_freq),
            None if qi is None else apply_rope(qi, positions, inv_freq))
