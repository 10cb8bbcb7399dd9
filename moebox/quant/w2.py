"""The w2 codec: routed-expert weights as sign-symmetric 2-bit planes, exactly 2.25 bits per weight.

Levels {-4, -1, +1, +4} in units of the FP4 grid, code order 0:-4, 1:-1, 2:+1, 3:+4 (high bit = sign,
low bit = "small" for negative / "big" for positive), and one E8M0 scale byte per 32 inputs of an output row:
value = LEVEL[code] * 2^(scale-127). Symmetric levels are the point: the error-optimal 4-level codebook is
lopsided and its per-expert sign bias compounds over 43 layers (field_notes.md §3).

Memory layout (what the kernels read):
- `codes`: uint8 [rows, cols/4], row-major; byte j of a row holds columns 4j..4j+3, column 4j+c in bits 2c..2c+1.
  A 32-column scale block is therefore 8 consecutive bytes.
- `scales`: E8M0 bytes (float8_e8m0fnu) [rows, cols/32], row-major.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moebox.weights.formats import (FP4_BLOCK, FP4_MAX, e8m0_to_float, exponent_to_e8m0, fp4_codes_from_values,
                                    unpack_fp4)

LEVELS = torch.tensor([-4.0, -1.0, 1.0, 4.0])
BITS_PER_WEIGHT = 2 + 8 / FP4_BLOCK          # 2.25
SAME_SIGN_ZERO_SHARE = 0.95                  # above this, zeros get alternating signs by position


@dataclass
class W2Tensor:
    codes: torch.Tensor     # uint8 [rows, cols/4]
    scales: torch.Tensor    # float8_e8m0fnu [rows, cols/32]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.codes.shape[0], self.codes.shape[1] * 4))

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel()

    def level_codes(self) -> torch.Tensor:
        """Unpacked 2-bit codes [rows, cols] (uint8 in 0..3)."""
        b = self.codes
        return torch.stack([(b >> (2 * c)) & 3 for c in range(4)], dim=-1).flatten(-2)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        vals = LEVELS.to(self.codes.device)[self.level_codes().long()]
        s = e8m0_to_float(self.scales).repeat_interleave(FP4_BLOCK, dim=-1)
        return (vals * s).to(dtype)

    def to(self, device: torch.device | str) -> "W2Tensor":
        return W2Tensor(self.codes.to(device), self.scales.to(device))


def pack_levels(levels: torch.Tensor) -> torch.Tensor:
    """[rows, cols] codes 0..3 -> uint8 [rows, cols/4] in the layout above."""
    c = levels.to(torch.uint8).reshape(*levels.shape[:-1], -1, 4)
    return c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)


def _codes_from_fp4_nibbles(nibbles: torch.Tensor) -> torch.Tensor:
    """FP4 e2m1 nibbles [rows, cols] -> 2-bit codes; magnitudes {0,.5,1,1.5,2} -> 1, {3,4,6} -> 4, sign kept.

    A signed zero goes to -1/+1 by its sign bit, unless more than 95% of the tensor's zeros share one sign
    (a checkpoint that normalised -0 away): then zeros alternate + / - by flat position (even: +1).
    """
    negative = (nibbles & 8) != 0
    big = (nibbles & 7) >= 5
    zero = (nibbles & 7) == 0
    n_zero = int(zero.sum())
    if n_zero:
        n_neg_zero = int((zero & negative).sum())
        if max(n_neg_zero, n_zero - n_neg_zero) > SAME_SIGN_ZERO_SHARE * n_zero:
            odd = (torch.arange(nibbles.numel(), device=nibbles.device).view(nibbles.shape) % 2) == 1
            negative = torch.where(zero, odd, negative)
    # code: negative big 0, negative small 1, positive small 2, positive big 3
    return torch.where(negative, 1 - big.to(torch.uint8), 2 + big.to(torch.uint8))


def _byte_tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Lookup tables over FP4 bytes: for each uint16 pair of bytes (4 nibbles, little-endian) the plane byte
    of their four 2-bit codes; for each byte its count of +0 and of -0 nibbles."""
    nib = torch.arange(256, dtype=torch.uint8)
    pair = torch.stack([nib & 0xF, nib >> 4], dim=-1)                    # [256, 2]
    neg, big = (pair & 8) != 0, (pair & 7) >= 5
    codes = torch.where(neg, 1 - big.to(torch.uint8), 2 + big.to(torch.uint8))
    byte_codes = (codes[:, 0] | (codes[:, 1] << 2)).numpy()             # one FP4 byte -> 4 bits
    v = np.arange(65536, dtype=np.uint32)
    pair_codes = (byte_codes[v & 0xFF] | (byte_codes[v >> 8] << 4)).astype(np.uint8)
    zero = (pair & 7) == 0
    return pair_codes, (zero & ~neg).sum(-1).numpy(), (zero & neg).sum(-1).numpy()


_PAIR_CODES, _BYTE_POS_ZEROS, _BYTE_NEG_ZEROS = _byte_tables()


def from_fp4(packed: torch.Tensor, scales: torch.Tensor) -> W2Tensor:
    """Official FP4 expert bytes (int8 [rows, cols/2], low nibble = even column) + E8M0 scales [rows, cols/32]
    -> planes. The scale bytes are kept unchanged.

    Lookup tables do the work (a V4-Flash layer is 768 such matrices): every two FP4 bytes become one plane
    byte. Only a tensor whose zeros are (almost) all of one sign takes the per-element path of the zero rule."""
    b = packed.detach().cpu().contiguous().view(torch.uint8).numpy()
    counts = np.bincount(b.ravel(), minlength=256)
    pos, neg = int(counts @ _BYTE_POS_ZEROS), int(counts @ _BYTE_NEG_ZEROS)
    kept_scales = scales.view(torch.uint8).clone().view(torch.float8_e8m0fnu)
    if pos + neg and max(pos, neg) > SAME_SIGN_ZERO_SHARE * (pos + neg):
        return W2Tensor(pack_levels(_codes_from_fp4_nibbles(unpack_fp4(packed))), kept_scales)
    return W2Tensor(torch.from_numpy(_PAIR_CODES[b.view(np.uint16)]), kept_scales)


def from_float(w: torch.Tensor) -> W2Tensor:
    """FP8/BF16/FP32 expert [rows, cols] -> planes: per 32-block scale exponent round(log2(amax/6)), values
    rounded to the FP4 grid at that scale (saturating at 6), then the FP4 bucketing of `from_fp4`."""
    rows, cols = w.shape
    if cols % FP4_BLOCK:
        raise ValueError(f"w2 needs the input dim to be a multiple of {FP4_BLOCK}, got {cols}")
    blocks = w.float().reshape(rows, cols // FP4_BLOCK, FP4_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    tiny = torch.finfo(torch.float32).tiny
    e = torch.round(torch.log2(amax.clamp(min=tiny) / FP4_MAX)).clamp(-127, 127)
    nibbles = fp4_codes_from_values(blocks / torch.exp2(e)[..., None]).reshape(rows, cols)
    return W2Tensor(pack_levels(_codes_from_fp4_nibbles(nibbles)), exponent_to_e8m0(e))


@dataclass(frozen=True)
class ErrorStats:
    """Reconstruction error of one tensor: relative RMS error, max abs error, cosine similarity."""

    rel_rmse: float
    max_abs: float
    cosine: float


def error_stats(reference: torch.Tensor, approx: torch.Tensor) -> ErrorStats:
    r, a = reference.float().flatten(), approx.float().flatten()
    err = a - r
    denom = r.square().mean().sqrt().clamp(min=1e-30)
    cos = torch.nn.functional.cosine_similarity(r, a, dim=0)
    return ErrorStats(float(err.square().mean().sqrt() / denom), float(err.abs().max()), float(cos))
