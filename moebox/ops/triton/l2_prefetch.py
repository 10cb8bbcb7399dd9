"""Ask the GPU's L2 for a weight's first bytes ahead of the product that reads them (Hopper's bulk L2 prefetch).

Why: a batch-1 V4-Flash decode step reads ~9.6 GB in ~4.9 ms where the copy rate would take 2.27 ms; for long
stretches DRAM is idle while latency-bound kernels run, most of all the attention core of each layer (the
indexer's scores and top-k, attend, combine: ~17 us a layer, ~0 bytes; docs/benchmarks.md, twenty-fifth
session's drop table). The product after it, wo_a (33.5 MB of FP8), then streams its weights from DRAM. A
prefetch issued when the core starts, on a side stream, can pull the first tens of MB of wo_a into L2 (50 MB on
an H200) while DRAM would otherwise idle, so the product reads them at L2's rate. This is not the prefetch that
the tenth session dropped (a kernel asking for its own weights right before reading them, while the kernel
before it was still streaming its own: the two competed for the same DRAM time).

How: one thread issues `cp.async.bulk.prefetch.L2.global [addr], size` per CHUNK bytes (a hint: no registers,
no shared memory, no completion to wait for; the kernel ends as soon as its requests are issued). One warp a
program, 32 chunks a program, each thread one chunk. Not run by Triton's interpreter (inline PTX): `l2_prefetch`
does nothing on CPU tensors.

Switch: MOEBOX_L2_PREFETCH = "target:MB[,target:MB]" (default empty: off), the MB of each target's FP8 weight
prefetched at each decode step (`prefetch_branch`): `wo_a` when the attention core starts; `wq_b` (the query
product's stacked weight) when a block starts, so that it streams in beside the attention site's mHC kernel and
the wq_a product. Not yet measured on the GPU.
"""

from __future__ import annotations

import os

import torch

from moebox.ops.linear import Weight
from moebox.ops.streams import Branch
from moebox.ops.triton.runtime import HAVE_TRITON, cdiv, pdl_args, pdl_start, tl, triton  # noqa: F401
from moebox.weights.formats import QuantTensor

CHUNK = 64 << 10      # bytes one thread asks for (a multiple of 16, as the instruction needs)

if HAVE_TRITON:
    @triton.jit
    def _l2_prefetch_kernel(ptr, nbytes, CHUNK: tl.constexpr, PDL: tl.constexpr):
        """Thread t of program p: bytes [(32 p + t) CHUNK, +CHUNK) of the nbytes at ptr (a byte pointer,
        16-byte aligned; nbytes a multiple of 16), if any."""
        pdl_start(PDL)
        offs = (tl.program_id(0) * 32 + tl.arange(0, 32)).to(tl.int64) * CHUNK
        size = tl.minimum(nbytes - offs, CHUNK).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [ptr + offs, size], dtype=tl.int32, is_pure=False, pack=1)


TARGETS = ("wo_a", "wq_b")


def prefetch_bytes(target: str) -> int:
    """The bytes MOEBOX_L2_PREFETCH asks for `target` (0: none)."""
    value = os.environ.get("MOEBOX_L2_PREFETCH", "")
    sizes = {}
    for item in filter(None, value.split(",")):
        name, _, mb = item.partition(":")
        try:
            if name not in TARGETS:
                raise ValueError
            sizes[name] = int(float(mb) * (1 << 20))
        except ValueError:
            raise ValueError(f"MOEBOX_L2_PREFETCH must be target:MB items (targets {', '.join(TARGETS)}), e.g. "
                             f"'wo_a:24,wq_b:16'; got {value!r}") from None
    return sizes.get(target, 0)


def prefetch_branch(ref: torch.Tensor, weight: Weight, target: str) -> Branch | None:
    """Launch the prefetch of `target`'s bytes (`prefetch_bytes`) of an FP8 weight on a side stream (forked from
    ref's stream now); the branch, to join after the product that reads the weight has been launched, or None
    (nothing asked, not CUDA, not an FP8 weight)."""
    nbytes = prefetch_bytes(target)
    if not nbytes or not ref.is_cuda or not (isinstance(weight, QuantTensor) and weight.kind == "fp8"):
        return None
    branch = Branch(ref, "prefetch", purpose="prefetch")
    with branch:
        l2_prefetch(weight.data, nbytes)
    return branch


def l2_prefetch(t: torch.Tensor, nbytes: int) -> None:
    """Ask L2 for the first nbytes (at most all, rounded down to 16) of the contiguous CUDA tensor t, on the
    current stream; nothing for CPU tensors, without triton or before Hopper (the instruction is sm_90's)."""
    if not (HAVE_TRITON and t.is_cuda and torch.cuda.get_device_capability(t.device)[0] >= 9):
        return
    if not t.is_contiguous():
        raise ValueError("l2_prefetch takes a contiguous tensor")
    nbytes = min(nbytes, t.numel() * t.element_size()) // 16 * 16
    if nbytes <= 0:
        return
    flat = t.view(-1).view(torch.uint8)
    _l2_prefetch_kernel[(cdiv(nbytes, 32 * CHUNK),)](flat, nbytes, CHUNK=CHUNK, num_warps=1,
                                                     **pdl_args(flat, _l2_prefetch_kernel))
