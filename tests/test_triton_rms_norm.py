"""The decode RMSNorm kernel (moebox/ops/triton/rms_norm.py) against the torch reference
(`moebox.ops.norm.rms_norm_reference`): tiny odd widths in Triton's interpreter on the CPU, the V4-Flash widths on
the GPU (outputs of a fresh allocation, so nothing stale can pass), and the dispatch of `rms_norm`."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

from moebox.ops import norm
from moebox.ops.norm import rms_norm, rms_norm_reference

from tests.interpreter import check_in_interpreter

HAVE_TRITON = importlib.util.find_spec("triton") is not None


def rows(n: int, d: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0) -> torch.Tensor:
    """n rows of width d with magnitudes spread over 10^-2..10^2 (a wrong per-row rms shows)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, d, generator=g) * torch.logspace(-2, 2, n)[:, None]).to(device=device, dtype=dtype)


def test_dispatch_keeps_the_reference_off_cuda() -> None:
    x, w = rows(3, 64, torch.float32), torch.rand(64) + 0.5
    assert not norm._kernel_takes(x, w)
    assert torch.equal(rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6))


_INTERPRETER_CHECK = textwrap.dedent("""
    import json, sys, torch
    sys.path.insert(0, sys.argv[1])
    from moebox.ops.norm import rms_norm_reference
    from moebox.ops.triton.rms_norm import rms_norm_triton
    from tests.test_triton_rms_norm import rows
    results = []
    # (N, D, dtype, weighted, layout): a power-of-2 width, odd widths (masked), fp16, no weight, a 3-d input,
    # rows with a stride (a column slice of a wider tensor)
    for n, d, dt, weighted, layout in [(1, 64, torch.float32, True, "rows"), (5, 100, torch.float32, True, "rows"),
                                       (3, 33, torch.float16, True, "rows"), (4, 96, torch.float32, False, "rows"),
                                       (6, 80, torch.float32, True, "3d"), (6, 80, torch.float32, True, "strided")]:
        x = rows(n, d, dt, seed=d)
        if layout == "3d":
            x = x.reshape(2, 3, d)
        elif layout == "strided":
            x = rows(n, d + 7, dt)[:, 3:3 + d]
        w = torch.rand(d) + 0.5 if weighted else None
        y = rms_norm_triton(x, w, 1e-6)
        ref = rms_norm_reference(x, w, 1e-6)
        err = ((y.double() - ref.double()).norm(dim=-1) / ref.double().norm(dim=-1)).max()
        results.append(dict(case=[n, d, str(dt), weighted, layout], same_buffer=y.shape == x.shape and y.dtype == dt,
                            finite=bool(torch.isfinite(y).all()), rel=float(err), ref_norm=float(ref.norm()),
                            tol=1e-3 if dt == torch.float16 else 1e-6))
    print("RESULT " + json.dumps(results))
""")


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install triton; Linux only)")
def test_kernel_in_triton_interpreter() -> None:
    check_in_interpreter(_INTERPRETER_CHECK)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("n", [1, 3, 16])
@pytest.mark.parametrize("d", [4096, 1024, 7168 + 3])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_matches_reference(d: int, n: int, dtype: torch.dtype) -> None:
    from moebox.ops.triton.rms_norm import rms_norm_triton
    x = rows(n, d, dtype, "cuda", seed=n)
    w = torch.rand(d, device="cuda") + 0.5
    for weight in (w, None):   # against the reference in fp32 on the CPU
        y = rms_norm_triton(x, weight, 1e-6)
        want = rms_norm_reference(x.cpu().float(), None if weight is None else weight.cpu(), 1e-6)
        assert y.dtype == dtype and torch.isfinite(y).all()
        err = ((y.cpu().double() - want.double()).norm(dim=-1) / want.double().norm(dim=-1)).max()
        assert err < (4e-3 if dtype == torch.bfloat16 else 1e-6), err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode-size CUDA inputs take the kernel, 17 rows, autograd and MOEBOX_NORM_KERNEL=0 do not; a captured
    graph replays it on new rows."""
    from moebox.ops.triton.rms_norm import rms_norm_triton
    x, w = rows(4, 4096, torch.bfloat16, "cuda"), torch.rand(4096, device="cuda") + 0.5
    assert norm._kernel_takes(x, w) and torch.equal(rms_norm(x, w, 1e-6), rms_norm_triton(x, w, 1e-6))
    assert not norm._kernel_takes(rows(17, 4096, torch.bfloat16, "cuda"), w)
    assert not norm._kernel_takes(x, w.clone().requires_grad_())
    monkeypatch.setenv("MOEBOX_NORM_KERNEL", "0")
    assert not norm._kernel_takes(x, w)
    monkeypatch.delenv("MOEBOX_NORM_KERNEL")
    static = x.clone()
    rms_norm_triton(static, w, 1e-6)   # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rms_norm_triton(static, w, 1e-6)
    static.copy_(rows(4, 4096, torch.bfloat16, "cuda", seed=9))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, rms_norm_triton(static, w, 1e-6))
