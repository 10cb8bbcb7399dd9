"""What does one dependent kernel cost in a CUDA-graph decode step, before it does any work?

A batch-1 V4-Flash step is ~17 dependent kernels a layer on the main stream, and the FP8 products' times fit
~2.3 us a launch plus their bytes at ~3.55 TB/s (docs/benchmarks.md, fourteenth session). How much of that 2.3
us is the chain itself (a kernel's start after its predecessor's end, with PDL or without) and how much is the
first DRAM round trip or the spread of the last programs? Here chains of 200 kernels, each reading what the one
before wrote, replay in one CUDA graph, for kernels that do (a) nothing but the dependency (one program, one
value), (b) the same on 132 programs, (c) (b) plus one fresh 8 KB weight read a program (1 MB a kernel, DRAM
latency with little bandwidth), (d) (b) plus 16 MB a kernel (bandwidth). us a kernel, PDL off, on, and on with
the weights read before the wait.

    python -m bench.pdl_chain_probe          # CUDA only
"""

from __future__ import annotations

import torch

from moebox.ops.triton.runtime import bench_start, graph_us, pdl_start, tl, triton

CHAIN = 200


CHUNK = 4096   # bf16 weights a program reads at once (8 KB)


@triton.jit
def _weight_sum(w_row, CHUNKS: tl.constexpr, CH: tl.constexpr):
    """The sum of CHUNKS x CH bf16 weights from w_row, a chunk at a time (0 when CHUNKS is 0)."""
    offs = tl.arange(0, CH)
    acc = tl.zeros((CH,), dtype=tl.float32)
    for c in tl.range(0, CHUNKS):
        acc += tl.load(w_row + c * CH + offs).to(tl.float32)
    return tl.sum(acc, axis=0)


@triton.jit
def _link_kernel(src_ptr, dst_ptr, w_ptr, w_stride, CHUNKS: tl.constexpr, CH: tl.constexpr, EARLY: tl.constexpr,
                 PDL: tl.constexpr):
    """dst[pid] = src[pid] + 1 + the sum of this program's CHUNKS x CH weights, read before the PDL wait when
    EARLY (they do not depend on the kernel before), after it otherwise."""
    pid = tl.program_id(0)
    w_row = w_ptr + pid.to(tl.int64) * w_stride
    if EARLY:
        total = _weight_sum(w_row, CHUNKS, CH)
    pdl_start(PDL)
    if not EARLY:
        total = _weight_sum(w_row, CHUNKS, CH)
    tl.store(dst_ptr + pid, tl.load(src_ptr + pid) + 1.0 + total)


def chain_us(programs: int, chunks: int, pdl: bool, early: bool = False) -> float:
    """us a kernel of a CHAIN-kernel dependent chain of `programs` programs, each reading chunks x 8 KB of
    weights (a different slice of one big buffer for each kernel, so DRAM serves them)."""
    dev = torch.device("cuda")
    bufs = [torch.zeros(programs, device=dev) for _ in range(2)]
    w = torch.randn((CHAIN, programs, max(1, chunks) * CHUNK), device=dev, dtype=torch.bfloat16)
    launch = {"launch_pdl": True} if pdl else {}

    def link(i: int) -> None:
        _link_kernel[(programs,)](bufs[i % 2], bufs[(i + 1) % 2], w[i], w.stride(1), CHUNKS=chunks, CH=CHUNK,
                                  EARLY=early, PDL=pdl, num_warps=4, **launch)

    us = graph_us([lambda i=i: link(i) for i in range(CHAIN)], rep=50)
    assert torch.all(bufs[CHAIN % 2] != 0)   # every link ran
    return us


def main() -> None:
    bench_start()
    rows = [("1 program, no bytes", 1, 0), ("132 programs, no bytes", 132, 0),
            ("132 programs x 8 KB", 132, 1), ("132 programs x 128 KB", 132, 16), ("528 programs x 32 KB", 528, 4)]
    print(f"chains of {CHAIN} dependent kernels in one CUDA graph, us a kernel\n{'kernel':24s} {'MB':>6s} "
          f"{'PDL off':>8s} {'PDL on':>7s} {'on, early':>10s}", flush=True)
    for name, programs, chunks in rows:
        times = [chain_us(programs, chunks, pdl, early) for pdl, early in ((False, False), (True, False),
                                                                           (True, True))]
        mb = programs * chunks * CHUNK * 2 / 1e6
        print(f"{name:24s} {mb:6.2f} {times[0]:8.2f} {times[1]:7.2f} {times[2]:10.2f}", flush=True)


if __name__ == "__main__":
    main()
