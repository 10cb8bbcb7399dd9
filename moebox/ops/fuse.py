"""`fused`: torch.compile for the small elementwise chains of a step, on CUDA tensors only.

A decode step at batch 1-16 is thousands of tiny kernels (an RMSNorm is ~7 torch ops, a RoPE ~20, the mHC
Sinkhorn ~100); each costs ~2-3 us even replayed from a CUDA graph, far more than the bytes it touches.
torch.compile (inductor) fuses such a chain into one or a few Triton kernels. Only weight-free functions of
tensors are compiled, so one compilation serves every layer (dynamo guards on shapes and dtypes, not on which
layer calls); the batch dimension becomes dynamic after the first new size. CPU tensors (the reference runs,
CI) always take the eager function. `MOEBOX_COMPILE=0` turns compilation off.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Callable, Iterator, TypeVar

import torch

F = TypeVar("F", bound=Callable)
RECOMPILE_LIMIT = 32


def compile_enabled() -> bool:
    return os.environ.get("MOEBOX_COMPILE", "1") != "0"


@contextlib.contextmanager
def eager() -> Iterator[None]:
    """MOEBOX_COMPILE=0 for the duration, restored after: every fused function (nested ones too) runs eagerly,
    as the torch references of the kernels want."""
    prev = os.environ.get("MOEBOX_COMPILE")
    os.environ["MOEBOX_COMPILE"] = "0"
    try:
        yield
    finally:
        if prev is None:
            del os.environ["MOEBOX_COMPILE"]
        else:
            os.environ["MOEBOX_COMPILE"] = prev


def _traceable(arg: object) -> bool:
    """Arguments a compiled function takes: tensors and plain values (not, e.g., FP8 cache row objects)."""
    return arg is None or isinstance(arg, (torch.Tensor, int, float, bool, str))


def _inductor_pdl() -> None:
    """Inductor's kernels launch with programmatic dependent launch as ours do (MOEBOX_PDL, default on), unless
    TORCHINDUCTOR_ENABLE_PDL says otherwise: ours alone gained nothing at batch 1, both together ~2% (seventh
    session)."""
    import torch._inductor.config as inductor_config

    from moebox.ops.triton.runtime import pdl_switched_on
    if "TORCHINDUCTOR_ENABLE_PDL" not in os.environ:
        inductor_config.triton.enable_pdl = pdl_switched_on()


def fused(fn: F) -> F:
    """fn, compiled on first use with a CUDA tensor as its first argument; eager otherwise."""
    compiled: Callable | None = None

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        nonlocal compiled
        if torch.compiler.is_compiling():       # called from another fused function: traced inline there
            return fn(*args, **kwargs)
        if args[0].is_cuda and compile_enabled() and all(map(_traceable, (*args, *kwargs.values()))):
            if compiled is None:
                torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
                _inductor_pdl()
                compiled = torch.compile(fn, fullgraph=True, dynamic=True)
            return compiled(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
