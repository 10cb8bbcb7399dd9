"""Why does the inverse RoPE in the attention's combine lose at batch 1 when the kernels say it should win?

At batch 4-16 a V4-Flash decode step gains from rotating the attention output back inside the combine kernel
(one launch fewer a layer: batch 8 12.28 -> 12.13 ms on the H200), and the kernels agree at batch 1: CSA
attention + combine + a separate inverse RoPE 15.91 us against 13.83 with the RoPE in the combine (HCA 14.01
against 11.73). Yet the whole batch-1 step goes from 5.54 to 5.86 ms with it (~7 us a layer; twentieth
session, docs/benchmarks.md). This times, per kind, batch (1, 8) and tiling, the attention call alone, with
`apply_rope(inverse)` after it (what the model did), and with the RoPE in its combine, each as a CUDA-graph
replay of calls on distinct slots (keys past L2, every key visible: `replay_inputs`, as the attention bench);
then the kernels of one eager batch-1 call under the profiler. `bash bench/gpu_session.sh ropeprobe` runs it
with the batch-1 step's timelines beside it.

    python -m bench.rope_combine_probe       # CUDA only
"""

from __future__ import annotations

from dataclasses import replace

import torch

from moebox.ops.rope import apply_rope, rope_inv_freq
from moebox.ops.triton import decode_attention as da
from moebox.ops.triton.runtime import graph_us, versions

CONFIGS = (("pick", None), ("batch 1", da.DECODE_CONFIG_1), ("decode", da.DECODE_CONFIG),
           ("decode w8", replace(da.DECODE_CONFIG, num_warps=8)))


def graph_table(device: torch.device) -> None:
    for kind in ("csa", "hca"):
        for b in (1, 8):
            args, slots = da.replay_inputs(kind, b, device)
            rope = (torch.randint(0, 4096, (b,), device=device), rope_inv_freq(64, 10000.0, None).to(device))
            for name, cfg in CONFIGS:
                plain = [lambda s=s, c=cfg, a=args: da.attend_triton(slot=s, **a, config=c) for s in slots]
                after = [lambda s=s, c=cfg, a=args, r=rope: apply_rope(da.attend_triton(slot=s, **a, config=c), *r,
                                                                       inverse=True) for s in slots]
                inside = [lambda s=s, c=cfg, a=args, r=rope: da.attend_triton(slot=s, **a, config=c, rope=r)
                          for s in slots]
                us = [graph_us(f) for f in (plain, after, inside)]
                print(f"{kind} B={b} {name:10s} attention {us[0]:6.2f} | + apply_rope {us[1]:6.2f} | RoPE in the "
                      f"combine {us[2]:6.2f} us", flush=True)
            del args, slots
            torch.cuda.empty_cache()


def profiled_kernels(device: torch.device, calls: int = 20) -> None:
    from torch.profiler import ProfilerActivity, profile
    ring_rows, table_rows, k = da.V4_SHAPES["csa"]
    inp = da.random_inputs(1, ring_rows=ring_rows, table_rows=table_rows, k=k, kind="csa", device=device, seed=3)
    rope = (torch.tensor([4000], device=device), rope_inv_freq(64, 10000.0, None).to(device))
    for name, fn in (("after", lambda: apply_rope(da.attend_triton(**inp), *rope, inverse=True)),
                     ("inside", lambda: da.attend_triton(**inp, rope=rope))):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        for e in prof.key_averages():
            if e.device_type.name == "CUDA" and e.count >= calls:
                print(f"  {name:6s} {e.key[:60]:60s} {e.count:3d} x {e.device_time_total / e.count:6.2f} us")


if __name__ == "__main__":
    print(versions())
    graph_table(torch.device("cuda"))
    print("CSA batch 1, one eager call's kernels (profiler):")
    profiled_kernels(torch.device("cuda"))
