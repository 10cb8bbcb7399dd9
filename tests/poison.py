"""NaN in the CUDA caching allocator's free blocks: a GPU test's proof that a kernel wrote every element of the
scratch and outputs that torch.empty hands out (an unwritten one shows up as NaN)."""

import torch


def poison_allocator() -> None:
    """Fill free blocks of the caching allocator (small and large pool) with NaN."""
    for numel in (1 << 18, 1 << 24):
        torch.full((numel,), float("nan"), device="cuda")
    torch.cuda.synchronize()
