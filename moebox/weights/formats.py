"""Number formats of the official DeepSeek-V4 checkpoint, and the tensors that keep them.

Dense linears are FP8 e4m3 with one power-of-two (E8M0) scale per 128x128 block; routed experts are
FP4 e2m1 packed two per byte along the input dimension with one E8M0 scale per 32 inputs of a row.
`QuantTensor` carries such a weight unexpanded, so nothing widens the model in memory until a kernel
(or the torch reference in `ops.linear`) needs the values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
FP4_BLOCK = 32


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (float8_e8m0fnu or uint8) -> float32 powers of two, 2^(byte-127)."""
    bits = scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale
    return torch.exp2(bits.to(torch.float32) - 127.0)


def pow2_exponent(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """Smallest power-of-two exponent e with amax / 2^e <= qmax (the ue8m0 rule), clamped to E8M0's range."""
    tiny = torch.finfo(torch.float32).tiny
    e = torch.ceil(torch.log2(amax.float().clamp(min=tiny) / qmax))
    return e.clamp(-127, 127)


def exponent_to_e8m0(e: torch.Tensor) -> torch.Tensor:
    return (e.to(torch.int32) + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def _expand_blocks(scale: torch.Tensor, rows: int, cols: int, br: int, bc: int) -> torch.Tensor:
    s = scale.repeat_interleave(br, dim=0)[:rows] if br > 1 else scale[:rows]
    return s.repeat_interleave(bc, dim=1)[:, :cols] if bc > 1 else s[:, :cols]


# ---------------------------------------------------------------- FP8 e4m3, 2-D blocks
def dequant_fp8_block(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128),
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    rows, cols = w.shape
    s = _expand_blocks(e8m0_to_float(scale), rows, cols, *block)
    return (w.to(torch.float32) * s).to(dtype)


def quant_fp8_block(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """float [O, I] -> (float8_e4m3fn [O, I], E8M0 scales [ceil(O/b0), ceil(I/b1)])."""
    rows, cols = w.shape
    br, bc = block
    nr, nc = -(-rows // br), -(-cols // bc)
    padded = torch.zeros(nr * br, nc * bc, dtype=torch.float32)
    padded[:rows, :cols] = w.float()
    amax = padded.view(nr, br, nc, bc).abs().amax(dim=(1, 3))
    e = pow2_exponent(amax, FP8_MAX)
    s = _expand_blocks(torch.exp2(e), rows, cols, br, bc)
    q = (w.float() / s).to(torch.float8_e4m3fn)
    return q, exponent_to_e8m0(e)


# ---------------------------------------------------------------- FP4 e2m1, 1x32 row blocks
def fp4_codes_from_values(x: torch.Tensor) -> torch.Tensor:
    """Round scaled values to the nearest e2m1 code (ties to the even code, as hardware rounding does).

    Magnitudes are clamped to 6 (NaN counts as 6, with a + sign); the sign bit is set for negative values
    and for -0.0, so a negative value that rounds to zero keeps its sign.

    The e2m1 grid has step 0.5 on [0, 2), 1 on [2, 4) and 2 on [4, 6]. Scaling each range to unit step (x2, x1,
    x0.5, all exact) makes the code (minus the range's first code, 0/2/4) the nearest integer, and torch's
    round-half-to-even picks the even code at every midpoint, because each range starts at an even code.
    """
    mag = x.abs().nan_to_num(nan=FP4_MAX).clamp_(max=FP4_MAX)   # no host tensor: CUDA graphs capture this
    ge2, ge4 = mag >= 2, mag >= 4
    scaled = mag * torch.where(ge2, torch.where(ge4, 0.5, 1.0), 2.0).to(x.dtype)
    code = scaled.round_().to(torch.uint8)
    code += (ge2.to(torch.uint8) + ge4.to(torch.uint8)) << 1
    sign = torch.signbit(x) & ~torch.isnan(x)
    return code | (sign.to(torch.uint8) << 3)


def fp4_values_from_codes(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 values of 4-bit codes (float32), computed from the bits rather than looked up in a table: a table would
    be a host constant inside compiled code, which a CUDA graph capture may not copy."""
    c = (codes & 7).to(torch.float32)
    e = torch.floor(c * 0.5)
    m = c - 2 * e
    mag = torch.where(e == 0, 0.5 * m, (1 + 0.5 * m) * torch.exp2(e - 1))
    return torch.where((codes & 8) != 0, -mag, mag)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes -> [..., K/2] int8; logical column 2c is the low nibble of byte c."""
    c = codes.to(torch.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).view(torch.int8)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    b = packed.view(torch.uint8)
    return torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)


def dequant_fp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    vals = fp4_values_from_codes(unpack_fp4(packed))
    s = e8m0_to_float(scale).repeat_interleave(FP4_BLOCK, dim=-1)
    return (vals * s).to(dtype)


def _fp4_block_codes(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [O, I] -> (e2m1 codes [O, I/32, 32], power-of-2 block exponents [O, I/32]): the rounding that
    `quant_fp4` packs and `fp4_round` evaluates."""
    rows, cols = w.shape
    blocks = w.float().view(rows, cols // FP4_BLOCK, FP4_BLOCK)
    e = pow2_exponent(blocks.abs().amax(dim=-1), FP4_MAX)
    return fp4_codes_from_values(blocks / torch.exp2(e)[..., None]), e


def fp4_round(w: torch.Tensor) -> torch.Tensor:
    """float [O, I] -> fp32 [O, I]: the values `dequant_fp4(*quant_fp4(w))` gives, without packing (a few fused
    elementwise ops: QAT applies it to every routed expert in every forward)."""
    codes, e = _fp4_block_codes(w)
    return (fp4_values_from_codes(codes) * torch.exp2(e)[..., None]).view(w.shape)


def quant_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [O, I] -> (packed int8 [O, I/2], E8M0 scales [O, I/32]); I must be a multiple of 32."""
    if w.shape[1] % FP4_BLOCK:
        raise ValueError(f"FP4 needs the input dim to be a multiple of {FP4_BLOCK}, got {w.shape[1]}")
    codes, e = _fp4_block_codes(w)
    return pack_fp4(codes.view(w.shape)), exponent_to_e8m0(e)


@dataclass
class QuantTensor:
    """A weight kept in its checkpoint format: `kind` is "fp8" (128x128 blocks) or "fp4" (1x32 row blocks)."""

    kind: str
    data: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int] = (128, 128)

    @property
    def shape(self) -> torch.Size:
        rows, cols = self.data.shape
        return torch.Size((rows, cols * 2 if self.kind == "fp4" else cols))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.kind == "fp8":
            return dequant_fp8_block(self.data, self.scale, self.block, dtype)
        if self.kind == "fp4":
            return dequant_fp4(self.data, self.scale, dtype)
        raise ValueError(f"unknown quantized kind {self.kind!r}")

    def to(self, device: torch.device | str) -> "QuantTensor":
        return QuantTensor(self.kind, self.data.to(device), self.scale.to(device), self.block)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()
