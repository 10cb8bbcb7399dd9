"""Read weights into the GPU's L2 cache ahead of their product (experimental; the model uses it only with
MOEBOX_L2_PREFETCH set, see `moebox.ops.streams.prefetch`; not yet measured on a GPU).

Why: at batch 1 a V4-Flash decode step spends most of its time in kernels that leave DRAM idle (mHC's four
launches a site, the norms, the attention core: docs/benchmarks.md, eleventh session's timeline), while each
weight product waits for its bytes from DRAM. A copy-like kernel on another stream can pull the next
products' weights into L2 (50 MB on an H200) during such a span; the product then reads L2 instead.

Kernel: grid (programs,), program p reads words [p * per, (p + 1) * per) of the int32 view of a tensor, BLOCK
words a step (evict_last: Triton gives the loads an L2 evict_last cache policy, so the lines outlast normally
cached ones until the product reads them; sm_90 cannot combine it with .cg), XOR-folds them and
stores one int32 to `sink[p]`: the store keeps the loads alive, and the XOR of the sink is the XOR of every
word read once (`xor_reference`, what the tests check). One program an SM with 32 KB in flight (sm_90 build: 16
LDG.128 and 64 LOP3 a step, 142 registers) leaves room on every SM for the kernels it runs next to.
`python -m moebox.ops.triton.l2_prefetch` times it (CUDA graph, DRAM to L2) at several program counts.

CUDA graphs: one launch per tensor, the sink from torch.empty; no host sync.
"""

from __future__ import annotations

import torch

from moebox.ops.triton.runtime import HAVE_TRITON, cdiv, pdl_args, pdl_start, tl, triton

DEFAULT_PROGRAMS = 132    # one per H200 SM, 32 KB in flight each (16 16-byte loads a thread): ~4 MB
BLOCK_WORDS = 8192        # int32 words a program loads per step (64 per thread at 4 warps)

if HAVE_TRITON:
    @triton.jit
    def _l2_prefetch_kernel(src_ptr, sink_ptr, n_words, per_program, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_start(PDL)          # as every kernel (tests/test_triton_pdl.py), though the weights need no wait
        pid = tl.program_id(0)
        start = pid.to(tl.int64) * per_program
        count = tl.maximum(tl.minimum(per_program, n_words - start), 0).to(tl.int32)   # this program's words
        base = src_ptr + start
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        full = (count // BLOCK) * BLOCK
        for off in range(0, full, BLOCK):            # whole steps: no masks, 16-byte loads
            acc ^= tl.load(base + off + offs, eviction_policy="evict_last")
        if full < count:
            acc ^= tl.load(base + full + offs, mask=full + offs < count, other=0, eviction_policy="evict_last")
        tl.store(sink_ptr + pid, tl.xor_sum(acc, axis=0))


def words(t: torch.Tensor) -> torch.Tensor:
    """t's bytes as a flat int32 tensor (a view): t contiguous, its byte size a multiple of 4."""
    if not t.is_contiguous() or (t.numel() * t.element_size()) % 4:
        raise ValueError(f"an L2 prefetch needs a contiguous tensor of whole 4-byte words, got {tuple(t.shape)} "
                         f"{t.dtype} (contiguous: {t.is_contiguous()})")
    return t.reshape(-1).view(torch.uint8).view(torch.int32)


def l2_prefetch(t: torch.Tensor, programs: int = DEFAULT_PROGRAMS) -> torch.Tensor:
    """Launch the read of t's bytes into L2 on the current stream -> the sink [programs] int32 (see module)."""
    src = words(t)
    n = src.numel()
    per = cdiv(cdiv(n, max(1, programs)), BLOCK_WORDS) * BLOCK_WORDS      # whole steps a program
    programs = max(1, cdiv(n, per))
    sink = torch.empty(programs, dtype=torch.int32, device=t.device)
    _l2_prefetch_kernel[(programs,)](src, sink, n, per, BLOCK=BLOCK_WORDS, num_warps=4, **pdl_args(t))
    return sink


def xor_reference(t: torch.Tensor) -> int:
    """The XOR of all int32 words of t: what the XOR of `l2_prefetch`'s sink must be."""
    return xor_of(words(t))


def xor_of(w: torch.Tensor) -> int:
    """The XOR of an int32 tensor's elements, as an unsigned 32-bit int."""
    import numpy as np
    return int(np.bitwise_xor.reduce(w.cpu().numpy().view(np.uint32)))


def bench(nbytes: int = 40 << 20, programs: tuple[int, ...] = (33, 66, 132, 264)) -> None:
    """GB/s of prefetching `nbytes` from DRAM at each program count (copies cycled past L2)."""
    from moebox.ops.triton.runtime import bench_start, each_copy, graph_us
    bench_start()
    copies = max(2, (192 << 20) // nbytes + 1)
    srcs = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(copies)]
    for p in programs:
        us = graph_us(each_copy(lambda i, p=p: l2_prefetch(srcs[i], p), copies))
        print(f"L2 prefetch of {nbytes / 1e6:.1f} MB, {p:4d} programs: {us:7.2f} us, {nbytes / us / 1e3:6.0f} GB/s",
              flush=True)


if __name__ == "__main__":  # python -m moebox.ops.triton.l2_prefetch
    bench()
