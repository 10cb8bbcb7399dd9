"""How many bits of x a bit-plane expert kernel needs: the accuracy side of a dequant-free design, on the CPU.

The expert kernels are bound by their dequant (PRMT/LOP3/SHF on the integer ALU pipe, ~0.95 of their 1.7 SASS
instructions a weight). A 2-bit code's level is linear in its bits: with c = 2 b1 + b0 (w2 codec order -4, -1, +1,
+4), level = 3 b0 + 5 b1 - 4. So the tensor cores can take the weights as two bit planes with no dequant at all:
one b1 AND-popc mma (m16n8k256, a native BMMA on sm_90) whose A row holds one 32-column scale group's b0 bits in 3
of its 8 chunks of 32 and its b1 bits in the other 5, and whose 8 B columns hold 8 bit planes of x over that group,
gives 3 popc(b0 & x_j) + 5 popc(b1 & x_j) for 16 rows and 8 planes j. x enters as `bits`-bit two's-complement
integers with one exponent per group of 32 (the sign plane weighs -2^(bits-1)), so the products are exact and x's
rounding to those integers is the only error. `plane_dot` computes the result that way, plane by plane, as the
kernel would; `integer_dot` is the same sum as a plain integer dot (the identity the planes rest on); `main`
prints the relative error against the fp64 product for several `bits` and activation shapes, beside the error of
rounding the output to bf16 (what the bf16 kernels' tolerance is).

    python -m bench.bitplane_probe      # CPU; V4-Flash's gate-up shape (2048 x 4096) by default
"""

from __future__ import annotations

import argparse

import torch

from moebox.ops.triton.runtime import rel_err
from moebox.ops.triton.w2_moe import random_planes
from moebox.quant.w2 import LEVELS, W2Tensor
from moebox.weights.formats import e8m0_to_float

GROUP = 32


def quantize_groups(x: torch.Tensor, bits: int, min_exponent: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., cols] -> (int64 [..., cols] two's-complement values in [-2^(bits-1), 2^(bits-1)), the int64
    [..., cols / 32] exponent of each group): x ~ q * 2^(e - bits + 1) with e the group's largest exponent
    (|x| < 2^e), raised to `min_exponent` where given (smaller groups then round towards zero)."""
    g = x.double().reshape(*x.shape[:-1], -1, GROUP)
    _, e = torch.frexp(g.abs().amax(dim=-1))
    e = e.long() if min_exponent is None else e.long().clamp(min=min_exponent)
    top = 1 << (bits - 1)
    q = torch.round(g * torch.exp2((bits - 1 - e).double())[..., None]).clamp(-top, top - 1).long()
    return q.reshape(x.shape), e


def _group_scales(w: W2Tensor, e: torch.Tensor, bits: int) -> torch.Tensor:
    """[rows, groups] fp64: each group's E8M0 weight scale times x's group factor 2^(e - bits + 1)."""
    return e8m0_to_float(w.scales).double() * torch.exp2((e - bits + 1).double())[None, :]


def plane_dot(w: W2Tensor, x: torch.Tensor, bits: int) -> torch.Tensor:
    """W x (fp64 [rows]) the way the bit-plane kernel would get it: popcounts of weight bit planes against x bit
    planes, weighted 3 / 5 (b0 / b1) and 2^j (x plane j; -2^(bits-1) for the sign plane), minus 4 times the group's
    sum of x, times the group's scales."""
    q, e = quantize_groups(x, bits)
    c = w.level_codes().long()
    b0, b1 = (c & 1).reshape(c.shape[0], -1, GROUP), (c >> 1).reshape(c.shape[0], -1, GROUP)
    u = q & ((1 << bits) - 1)                                   # the bits of the two's complement
    acc = torch.zeros(b0.shape[:2], dtype=torch.long)
    for j in range(bits):
        plane = ((u >> j) & 1).reshape(1, -1, GROUP)
        weight = -(1 << j) if j == bits - 1 else 1 << j
        acc += weight * (3 * (b0 & plane).sum(-1) + 5 * (b1 & plane).sum(-1))   # one BMMA column j
    acc -= 4 * q.reshape(1, -1, GROUP).sum(-1)
    return (acc.double() * _group_scales(w, e, bits)).sum(-1)


def integer_dot(w: W2Tensor, x: torch.Tensor, bits: int) -> torch.Tensor:
    """The same sum as a plain integer dot of the levels and the quantized x, group by group."""
    q, e = quantize_groups(x, bits)
    lv = LEVELS.long()[w.level_codes().long()].reshape(w.shape[0], -1, GROUP)
    return ((lv * q.reshape(1, -1, GROUP)).sum(-1).double() * _group_scales(w, e, bits)).sum(-1)


def random_w2(rows: int, cols: int) -> W2Tensor:
    """One expert's w1/w3 rows of the benches' random planes (uniform codes, scale bytes 118..123)."""
    codes, scales = random_planes(1, cols, rows // 2)[:2]
    return W2Tensor(codes[0], scales[0])


def activations(cols: int, seed: int = 1) -> dict[str, torch.Tensor]:
    """x shapes to try: gaussian; per-channel log-normal gains (sigma 1: channels spread ~50x); those gains with 8
    channels 100x larger (LLM outlier channels); the product of two gaussians (like h = silu(g) u)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(cols, generator=g, dtype=torch.float64)
    gains = torch.exp(torch.randn(cols, generator=g, dtype=torch.float64))
    outliers = gains.clone()
    outliers[torch.randperm(cols, generator=g)[:8]] *= 100
    silu_u = torch.nn.functional.silu(torch.randn(cols, generator=g, dtype=torch.float64)) * z
    return {"gaussian": z, "channel gains": z * gains, "gains + outliers": z * outliers, "silu(g) * u": silu_u}


def table(rows: int, cols: int, bit_counts: list[int]) -> list[dict]:
    """Relative error of `integer_dot` against the fp64 product, per activation shape and bit count, with x in bf16 (the
    kernels' input) and the bf16 output rounding beside it."""
    w = random_w2(rows, cols)
    wf = w.dequantize(torch.float64)
    out = []
    for name, x in activations(cols).items():
        xb = x.to(torch.bfloat16).double()
        ref = wf @ xb
        row = {"x": name, "bf16 output": rel_err(ref.to(torch.bfloat16).double(), ref)}
        row.update({bits: rel_err(integer_dot(w, xb, bits), ref) for bits in bit_counts})
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.bitplane_probe", description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--cols", type=int, default=4096)
    p.add_argument("--bits", type=int, nargs="+", default=[8, 10, 12, 14, 16])
    args = p.parse_args(argv)
    rows = table(args.rows, args.cols, args.bits)
    print(f"relative error of W x against fp64, W {args.rows} x {args.cols} random 2-bit, x in bf16, x as integers "
          f"with one exponent per {GROUP}\n| x | bf16 output | " + " | ".join(f"{b} bits" for b in args.bits)
          + " |\n|---|---|" + "---|" * len(args.bits))
    for r in rows:
        print(f"| {r['x']} | {r['bf16 output']:.1e} | " + " | ".join(f"{r[b]:.1e}" for b in args.bits) + " |")


if __name__ == "__main__":
    main()
