"""Triton, when it can be imported: off Linux or without it the torch references run instead."""

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    HAVE_TRITON = False

import functools
import os

import torch


@functools.lru_cache(maxsize=None)
def _sms_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (the grid sizing unit); 132, an H200's count, for the
    interpreter's CPU tensors."""
    if device.type != "cuda":
        return 132
    return _sms_of(device.index if device.index is not None else torch.cuda.current_device())


def interpreting() -> bool:
    """Triton's CPU interpreter (TRITON_INTERPRET=1) runs the kernels."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


__all__ = ["HAVE_TRITON", "triton", "tl", "num_sms", "interpreting"]
