"""Triton, when it can be imported: off Linux or without it the torch references run instead."""

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    HAVE_TRITON = False

__all__ = ["HAVE_TRITON", "triton", "tl"]
