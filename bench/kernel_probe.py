"""Eager calls of the decode step's costliest kernels at the V4-Flash shapes, for Nsight Compute.

A CUDA-graph bench gives a kernel's time; it cannot say why the time is what it is. Under `ncu` (the
`ncu` phase of bench/gpu_session.sh) each launch here is replayed with the hardware counters on: achieved
DRAM bandwidth, warp stall reasons, occupancy. Each call runs twice (the first one compiles); ncu flushes the
caches before each profiled launch, so the weights come from DRAM as in a 43-layer step.

    MOEBOX_PDL=0 python -m bench.kernel_probe
"""

from __future__ import annotations

import torch

from moebox.ops.triton.fp8_linear import V4_FLASH_SHAPES, fp8_linear_triton, random_fp8_weight
from moebox.ops.triton.runtime import bench_start
from moebox.ops.triton.w2_moe import random_planes, random_routing, w2_moe_decode_triton


def main() -> None:
    bench_start()
    device = torch.device("cuda")
    planes = random_planes(256, 4096, 2048, device=device)
    for n in (1, 8):
        ids, w = random_routing(n, 256, 6, device=device, seed=n)
        x = torch.randn((n, 4096), device=device, dtype=torch.bfloat16)
        for _ in range(2):
            w2_moe_decode_triton(x, ids, w, *planes, 10.0)
    del planes
    for name, out_f, in_f in V4_FLASH_SHAPES:
        if name in ("wq_b", "wo_b", "wq_a"):
            w = random_fp8_weight(out_f, in_f, device=device)
            x = torch.randn((1, in_f), device=device, dtype=torch.bfloat16)
            for _ in range(2):
                fp8_linear_triton(x, w)
    torch.cuda.synchronize()
    print("probe done", flush=True)


if __name__ == "__main__":
    main()
