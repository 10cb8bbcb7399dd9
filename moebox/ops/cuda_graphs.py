"""Capture a CUDA graph of a function: the one warm-up-then-capture recipe the engine and the benches share.

The function runs `warmup` times on a side stream first (Triton compiles, torch.compile traces, the caching
allocator settles), then once under capture; replaying the graph re-runs its kernels with one CPU call.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


def capture(fn: Callable[[], Any], pool: Any = None, warmup: int = 1) -> tuple[torch.cuda.CUDAGraph, Any]:
    """(graph, what fn returned during capture: tensors that every replay refills)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out
