"""The FP8 gate-up (`moebox.ops.triton.w2_fp8`, e4m3 weights into Hopper's wgmma) against the mma gate-up
(`w2_moe._gate_up_mma`), alone and in its variants: how many K steps a load takes (one, or a pair: a row's whole
128-byte line), how far ahead, and codes stored tile by tile (`w2_moe.tile_codes`, the decode kernels' opt-in
layout, `moebox bench decode --tiled-codes`). The kernel's design and math are in its module doc; docs/benchmarks.md
(forty-ninth and fiftieth sessions) has the numbers.

    python -m bench.fp8_gate_up --sass          # build each variant for sm_90 on any machine, count the loop
    python -m bench.fp8_gate_up                 # on a GPU: check each variant and the FP8 down, then time them
    python -m bench.fp8_gate_up --down          # on a GPU: the FP8 down alone
"""

from __future__ import annotations

import argparse
from typing import Sequence

import torch

from moebox.ops.triton.w2_fp8 import Variant

VARIANTS = (Variant(), Variant(prefetch=2), Variant(pair=False), Variant(pair=False, prefetch=2),
            Variant(pair=False, prefetch=2, tiled=True), Variant(tiled=True), Variant(split=2),
            Variant(prefetch=2, split=2), Variant(tiled=True, split=2))


def _name(v: Variant) -> str:
    return f"{'pair' if v.pair else 'step'} p{v.prefetch}{' tiled' if v.tiled else ''}{' split' if v.split > 1 else ''}"


def _planes(experts: int, hidden: int, inter: int, device: torch.device):
    """Random stacked w13 planes split into w1 and w3 views (as the model's layer views are)."""
    from moebox.ops.triton import w2_moe
    return w2_moe._split_w13(*w2_moe.random_planes(experts, hidden, inter, device=device)[:2])


def _operands(planes, tiled: bool = False):
    """The planes as the gate-ups take them (int32 codes, uint8 scales), the codes tile by tile where asked."""
    from moebox.ops.triton import w2_moe
    w1c, w1s, w3c, w3s = planes
    if tiled:
        w1c, w3c = (w2_moe.tile_codes(c.contiguous()) for c in (w1c, w3c))
    return w2_moe.gate_up_operands(w1c, w1s, w3c, w3s)


def check(variant: Variant, hidden: int = 4096, inter: int = 2048, experts: int = 16, tokens: int = 2, k: int = 6,
          limit: float = 10.0) -> float:
    """Relative error (max |h - ref| / max |ref|) of the FP8 gate-up's h (the sum of its bf16 terms) against the
    planes' fp64 product (`bitplane_gate_up.gate_up_reference`), on random planes and routing; every element must
    be finite (the output is poisoned with NaN first), and a second call must give the same bits."""
    from bench.bitplane_gate_up import gate_up_reference
    from moebox.ops.triton import w2_fp8, w2_moe
    device = torch.device("cuda")
    planes = _planes(experts, hidden, inter, device)
    ids, rw = w2_moe.random_routing(tokens, experts, k, device=device)
    x = torch.randn((tokens, hidden), device=device).to(torch.bfloat16)
    ref = gate_up_reference(x.float(), ids, rw, *planes, limit, quantized=False).float()
    ops = _operands(planes, variant.tiled)
    hs = []
    # a second call into a new poisoned buffer, after one on other x: the same bits (a split's counters reset, its
    # scratch then holds the other call's sums)
    for xi in (x, -x, x):
        out = torch.full((tokens * k, 2, inter // 16, 8), -1, dtype=torch.int32, device=device)   # NaN bf16 terms
        hp = w2_fp8.gate_up(*w2_fp8.pack_x(xi), ids.reshape(-1), rw.reshape(-1).float(), *ops, limit, k, th=2,
                            variant=variant, out=out)
        hs.append(h_from_terms(hp, inter))
        assert torch.isfinite(hs[-1]).all(), f"{int((~torch.isfinite(hs[-1])).sum())} elements not written"
    assert torch.equal(hs[0], hs[2]), "a second call gave another h"
    return float((hs[0] - ref).abs().max() / ref.abs().max())


def odd_pairs_hidden(variant: Variant) -> int:
    """An H at which each of the variant's programs takes an odd count of pairs of K steps (3)."""
    return 1536 * variant.split


def h_from_terms(hp: torch.Tensor, inter: int) -> torch.Tensor:
    """h fp32 [N k, I] from its bf16 terms in the down kernel's pair layout (`pair_layout._column_slot`, in torch:
    in each tile of 16 words, word 4t + i, pair 4 rho + jj at slot 32 i + 16 rho + 4 t + jj; pair j of a word
    holds its columns (j & 3) + 8 (j >> 2) and that + 4)."""
    i = torch.arange(inter, device=hp.device)
    wd, c = i // 16, i % 16
    j = (c % 4) + 4 * (c // 8)
    wl = wd % 16
    slot = (wd // 16) * 128 + 32 * (wl % 4) + 4 * (wl // 4) + 16 * (j // 4) + j % 4
    bits = hp.view(torch.int16).flatten(2)[:, :, 2 * slot + (c // 4) % 2].to(torch.int32) << 16
    return bits.view(torch.float32).sum(dim=1)


def h_from_e4m3(hq: torch.Tensor, he: torch.Tensor) -> torch.Tensor:
    """h fp32 [N k, I] from the e4m3 terms and 64-column exponents the FP8 gate-up writes for the FP8 down
    (`w2_fp8.empty_h`), back in column order."""
    from moebox.ops.triton.w2_fp8 import STEP, x_permutation
    pairs, steps = hq.shape[:2]
    terms = hq.float().sum(3).reshape(pairs, steps, STEP)[:, :, torch.argsort(x_permutation()).to(hq.device)]
    return terms.reshape(pairs, -1) * torch.exp2(he.float()).repeat_interleave(64, dim=1)


def check_down(tokens: int = 3, hidden: int = 4096, inter: int = 2048, experts: int = 16, k: int = 6,
               limit: float = 10.0, ring: bool = False, tiled: bool = False, split: int = 1) -> tuple[float, float]:
    """(h's relative error: the FP8 gate-up's e4m3 h against the planes' fp64 product; out's: the FP8 down's output
    against the fp64 product of w2's planes and that h), on random planes and routing; both outputs are poisoned
    first (NaN terms, exponents of 2^1000, NaN out) and must come back finite. `ring`: the down's h ring; `tiled`:
    both kernels on the codes tile by tile (the references on the row-major ones); `split`: the down's programs a
    token and row block (run twice: the second run finds the arrival counters reset)."""
    from bench.bitplane_gate_up import gate_up_reference
    from moebox.ops.triton import w2_fp8, w2_fp8_down, w2_moe
    from moebox.quant.w2 import W2Tensor
    device = torch.device("cuda")
    w13c, w13s, w2c, w2s = w2_moe.random_planes(experts, hidden, inter, device=device)
    planes = w2_moe._split_w13(w13c, w13s)
    ids, rw = w2_moe.random_routing(tokens, experts, k, device=device)
    x = torch.randn((tokens, hidden), device=device).to(torch.bfloat16)
    hq, he = w2_fp8.empty_h(tokens * k, inter, device)
    hq.view(torch.uint8).fill_(0x7F)
    he.fill_(1000)
    flat = ids.reshape(-1).contiguous()
    w2_fp8.gate_up(*w2_fp8.pack_x(x), flat, rw.reshape(-1).float().contiguous(), *_operands(planes, tiled), limit, k,
                   th=2, variant=w2_fp8.variant_for(tokens, tiled, hidden), fp8_h=True, out=(hq, he))
    h = h_from_e4m3(hq, he)
    assert torch.isfinite(h).all(), f"{int((~torch.isfinite(h)).sum())} elements of h not written"
    ref_h = gate_up_reference(x.float(), ids, rw, *planes, limit, quantized=False)
    codes = w2_moe.tile_codes(w2c) if tiled else w2c
    outs = []
    for hi in (hq, (-hq.float()).to(hq.dtype), hq):    # the middle call on -h: other sums in a split's scratch
        out = torch.full((tokens, hidden), float("nan"), dtype=torch.bfloat16, device=device)
        w2_fp8_down.down(hi, he, flat, codes.view(torch.int32), w2s.view(torch.uint8), out, k, ring=ring, tiled=tiled,
                         split=split)
        assert torch.isfinite(out).all(), f"{int((~torch.isfinite(out)).sum())} elements of out not written"
        outs.append(out)
    assert torch.equal(outs[0], outs[2]), "a second call gave another output"
    ref = torch.zeros((tokens, hidden), dtype=torch.float64, device=device)
    for p, e in enumerate(flat.tolist()):
        ref[p // k] += W2Tensor(w2c[e], w2s[e]).dequantize(torch.float64) @ h[p].double()
    return (float((h.double() - ref_h).abs().max() / ref_h.abs().max()),
            float((out.double() - ref).abs().max() / ref.abs().max()))


def bench(tokens: Sequence[int], hidden: int = 4096, inter: int = 2048, experts: int = 256, k: int = 6,
          limit: float = 10.0, l2_miss_bytes: int = 256 << 20, rep: int = 100,
          variants: Sequence[Variant] = VARIANTS) -> list[dict]:
    """us a call: the mma gate-up (default tiling for N) against each FP8 variant, bf16 x packed beforehand for
    each (the kernels alone), CUDA-graph replay of back-to-back calls on routings whose planes miss L2."""
    from moebox.ops.triton import w2_fp8, w2_moe
    from moebox.ops.triton.runtime import graph_us
    device = torch.device("cuda")
    planes = _planes(experts, hidden, inter, device)
    ops = _operands(planes)
    tiled = _operands(planes, tiled=True) if any(v.tiled for v in variants) else None
    per_expert = 2 * w2_moe.expert_bytes(hidden, inter) // 3
    names = ["mma"] + [_name(v) for v in variants]
    print(" ".join(f"{c:>13s}" for c in ["N"] + names + ["best x mma"]), flush=True)
    rows = []
    for n in tokens:
        routes, nbytes = w2_moe.miss_routes(n, experts, k, per_expert, l2_miss_bytes, device)
        flat = [(ids.reshape(-1).contiguous(), w.reshape(-1).float().contiguous()) for ids, w in routes]
        x = torch.randn((n, hidden), device=device).to(torch.bfloat16)
        xp, xq = w2_moe._pack_x(x, w2_moe._empty_packed(x)), w2_fp8.pack_x(x)
        cfg = w2_moe.default_config(n)
        us = [graph_us([lambda f=f: w2_moe._gate_up_mma(x, xp, *f, *ops, limit, k, cfg) for f in flat], rep)]
        us += [graph_us([lambda f=f, v=v: w2_fp8.gate_up(*xq, *f, *(tiled if v.tiled else ops), limit, k, th=2,
                                                         variant=v) for f in flat], rep) for v in variants]
        rows.append({"tokens": n, "bytes": nbytes, **dict(zip(names, us))})
        print(" ".join(f"{c:>13s}" for c in [str(n)] + [f"{u:.1f}" for u in us] + [f"{us[0] / min(us[1:]):.2f}"]),
              flush=True)
    return rows


# (ring, tiled, split): h staged whole or by the ring, codes row-major or tile by tile, 1 or 2 programs a token
DOWN_FORMS = ((False, False, 1), (True, False, 1), (False, False, 2), (False, True, 1), (True, True, 1),
              (False, True, 2))


def _down_name(ring: bool, tiled: bool, split: int) -> str:
    return f"{'ring' if ring else 'split' if split > 1 else 'whole h'}{' tiled' if tiled else ''}"


def bench_down(tokens: Sequence[int], hidden: int = 4096, inter: int = 2048, experts: int = 256, k: int = 6,
               l2_miss_bytes: int = 256 << 20, rep: int = 100) -> list[dict]:
    """us a call of the FP8 down alone in each of `DOWN_FORMS` (h staged whole, by the two-expert ring, or whole
    for each half of the experts in programs of their own; w2's codes row-major or tile by tile), on h that the FP8
    gate-up wrote, CUDA-graph replay of back-to-back calls on routings whose planes miss L2."""
    from moebox.ops.triton import w2_fp8, w2_fp8_down, w2_moe
    from moebox.ops.triton.fp8_linear import copy_bandwidth
    from moebox.ops.triton.runtime import graph_us
    device = torch.device("cuda")
    w13c, w13s, w2c, w2s = w2_moe.random_planes(experts, hidden, inter, device=device)
    codes = {False: w2c.view(torch.int32), True: w2_moe.tile_codes(w2c).view(torch.int32)}
    w2s = w2s.view(torch.uint8)
    ops = _operands(w2_moe._split_w13(w13c, w13s))
    copy = copy_bandwidth(device) * 1e9
    names = [_down_name(*f) for f in DOWN_FORMS]
    print(" ".join(f"{c:>14s}" for c in ["N", "MB"] + names) + "   (us; % of copy)", flush=True)
    rows = []
    for n in tokens:
        routes, nbytes = w2_moe.miss_routes(n, experts, k, w2_moe.expert_bytes(hidden, inter) // 3, l2_miss_bytes,
                                            device)
        flat = [(ids.reshape(-1).contiguous(), w.reshape(-1).float().contiguous()) for ids, w in routes]
        x = torch.randn((n, hidden), device=device).to(torch.bfloat16)
        hs = [w2_fp8.gate_up(*w2_fp8.pack_x(x), f[0], f[1], *ops, 10.0, k, th=2, fp8_h=True) for f in flat]
        out = torch.empty((n, hidden), dtype=torch.bfloat16, device=device)
        us = [graph_us([lambda f=f, h=h: w2_fp8_down.down(*h, f[0], codes[tiled], w2s, out, k, ring=ring, tiled=tiled,
                                                           split=split) for f, h in zip(flat, hs)], rep)
              for ring, tiled, split in DOWN_FORMS]
        rows.append({"tokens": n, "bytes": nbytes, **dict(zip(names, us))})
        cells = [f"{u:.1f}; {100 * nbytes / (u * 1e-6) / copy:.0f}%" for u in us]
        print(" ".join(f"{c:>14s}" for c in [str(n), f"{nbytes / 1e6:.1f}"] + cells), flush=True)
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.fp8_gate_up", description=__doc__.splitlines()[0])
    p.add_argument("--sass", action="store_true", help="build for sm_90 and report the SASS (no GPU needed)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--down", action="store_true", help="time the FP8 down kernel alone instead")
    args = p.parse_args(argv)
    from moebox.ops.triton import w2_fp8
    if args.sass:
        for v in VARIANTS:
            print(w2_fp8.sass_report(v))
        return
    from moebox.ops.triton.fp8_linear import copy_bandwidth
    from moebox.ops.triton.runtime import bench_start
    bench_start()
    print(f"copy bandwidth {copy_bandwidth(torch.device('cuda')):.0f} GB/s")
    for v in VARIANTS:
        print(f"check {_name(v)}: rel. error of h against the planes' fp64 product {check(v):.2e}, at H = "
              f"{odd_pairs_hidden(v)} {check(v, hidden=odd_pairs_hidden(v)):.2e}", flush=True)
    for form in DOWN_FORMS:
        err_h, err_out = check_down(**dict(zip(("ring", "tiled", "split"), form)))
        print(f"check down {_down_name(*form)}: rel. error of e4m3 h {err_h:.2e}, of out against W2 h in fp64 "
              f"{err_out:.2e}", flush=True)
    if args.down:
        bench_down(args.tokens)
        return
    bench(args.tokens)


if __name__ == "__main__":
    main()
