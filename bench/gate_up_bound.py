"""What bounds the routed experts' mma gate-up from 4 tokens on: its loads or its math?

Why: in the forty-seventh session (H200) both the mma gate-up and the bit-plane one, whose loops share little but
their loads, stalled at ~2.0 TB/s from N = 4 (43% of the copy rate), and the bit-plane kernel's fewer integer ops a
weight bought nothing. This probe times the production gate-up (`w2_moe._gate_up_mma`, the default tiling for N)
four ways on the same random planes, each a CUDA-graph replay of back-to-back calls:
- "dram": every call on its own random routing, so its planes miss L2 (as consecutive layers do);
- "l2": every token routed to experts 0..k-1 in every call, so after the first call the planes come from L2;
- "loads": the same kernel with its unpack and mmas replaced by an xor of the same operands (`_xor_word_dot`:
  every load kept, 3 LOP3 an output instead of ~100 instructions), on the dram routings;
- "loads l2": that on the l2 routings;
- "tiled", "loads tiled": the kernel and its loads-only form with each program's 16 rows of codes read as if stored
  tile by tile (each warp's K step one contiguous KB instead of 16 pieces of 64 bytes, one a row 1 KB apart; the
  same bytes, wrong values), on the dram routings: what a device-side relayout of the planes could give.
If "loads" is about as slow as "dram", the loads (their pattern, the bytes a program keeps in flight) bound the
kernel and no cheaper unpack can help; if "l2" is about as slow as "dram", the math does, whatever the format.
Forty-eighth session, H100 (docs/benchmarks.md has the tables): from N = 4 each alone takes 0.84-0.91 of the full
time, and tile-by-tile addressing makes the loads 1.24-1.38x faster than the full kernel, the most any format that
keeps these loads could gain.

    python -m bench.gate_up_bound [--tokens 1 2 4 8 16] [--prefetch 2]
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Sequence

import torch

from moebox.ops.triton import w2_moe
from moebox.ops.triton.runtime import bench_start, graph_us, versions

MODES = ("dram", "l2", "loads", "loads l2", "tiled", "loads tiled")


def fixed_routing(tokens: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token routed to experts 0..k-1 (long [N, k]) with weights 1: k experts' planes, which fit L2."""
    ids = torch.arange(k, device=device).repeat(tokens, 1)
    return ids, torch.ones((tokens, k), device=device)


def bench(tokens: Sequence[int] = (1, 2, 4, 8, 16), hidden: int = 4096, intermediate: int = 2048,
          experts: int = 256, k: int = 6, limit: float = 10.0, l2_miss_bytes: int = 256 << 20, rep: int = 100,
          prefetch: int | None = None) -> list[dict]:
    """One row a (N, mode): us a call and the rate over the bytes each call reads (dram: its distinct experts'
    w1 + w3 planes; l2: the N k pairs' planes, which L2 serves). prefetch: K steps the code loads run ahead (the
    default tiling's for N if None)."""
    device = torch.device("cuda")
    w13c, w13s = w2_moe.random_planes(experts, hidden, intermediate, device=device)[:2]
    w1c, w1s, w3c, w3s = w2_moe.gate_up_operands(*w2_moe._split_w13(w13c, w13s))
    per_expert = 2 * w2_moe.expert_bytes(hidden, intermediate) // 3
    print(f"mma gate-up alone, H {hidden} I {intermediate} E {experts} k {k}, bf16 x, prefetch "
          f"{prefetch or 'default'}\n{'mode':11s} {'N':>3s} {'calls':>5s} {'us':>8s} {'GB/s':>7s} {'x dram':>7s}",
          flush=True)
    rows = []
    for n in tokens:
        dram, dram_bytes = w2_moe.miss_routes(n, experts, k, per_expert, l2_miss_bytes, device)
        calls = len(dram)
        flat = {where: [(ids.reshape(-1).contiguous(), w.reshape(-1).float().contiguous()) for ids, w in routes]
                for where, routes in (("dram", dram), ("l2", [fixed_routing(n, k, device)] * calls))}
        x = torch.randn((n, hidden), device=device).to(torch.bfloat16)
        xp = w2_moe._pack_x(x, w2_moe._empty_packed(x))
        cfg = w2_moe.default_config(n)
        cfg = replace(cfg, prefetch=prefetch or cfg.prefetch)
        base = None
        for mode in MODES:
            where = "l2" if mode.endswith("l2") else "dram"
            nbytes = n * k * per_expert if where == "l2" else dram_bytes
            fns = [lambda f=f: w2_moe._gate_up_mma(x, xp, f[0], f[1], w1c, w1s, w3c, w3s, limit, k, cfg,
                                                   loads_only=mode.startswith("loads"), tiled=mode.endswith("tiled"))
                   for f in flat[where]]
            us = graph_us(fns, rep)
            base = base or us
            rows.append({"mode": mode, "tokens": n, "us": us, "GB/s": nbytes / us / 1e3, "vs_dram": us / base})
            print(f"{mode:11s} {n:3d} {calls:5d} {us:8.1f} {nbytes / us / 1e3:7.0f} {us / base:7.2f}", flush=True)
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.gate_up_bound", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--prefetch", type=int, choices=(1, 2), help="K steps the code loads run ahead (default: the "
                                                                 "default tiling's, 1)")
    args = p.parse_args(argv)
    print(versions())
    bench_start()
    from moebox.ops.triton.fp8_linear import copy_bandwidth
    print(f"copy bandwidth {copy_bandwidth(torch.device('cuda')):.0f} GB/s")
    bench(tokens=args.tokens, prefetch=args.prefetch)


if __name__ == "__main__":
    main()
