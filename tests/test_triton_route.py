"""The routing kernel (moebox/ops/triton/route.py) against the torch routing (`route_from_logits`).

CPU: the kernel in Triton's interpreter on tiny shapes (E a power of two and not, k 1..6, both scorings, with and
without bias and normalisation, logits past softplus's threshold and far below zero, exact ties, NaN); what it
refuses. GPU (marker `gpu`): the V4-Flash router (E 256, k 6) at decode batches, outputs poisoned first, fp32 and
bf16 logits, replayed from a CUDA graph.
"""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

from moebox.ops.moe import route_from_logits
from tests.interpreter import run_in_interpreter

HAVE_TRITON = importlib.util.find_spec("triton") is not None


def same_routing(ids: torch.Tensor, w: torch.Tensor, ref_ids: torch.Tensor, ref_w: torch.Tensor) -> None:
    """Equal expert sets per token and, expert by expert, equal weights (the order of the k is free)."""
    a, ia = ids.cpu().sort(dim=1)
    b, ib = ref_ids.cpu().sort(dim=1)
    assert torch.equal(a, b)
    torch.testing.assert_close(w.cpu().gather(1, ia), ref_w.cpu().float().gather(1, ib), rtol=2e-6, atol=1e-7)


_CASES = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, sys.argv[1])
    from moebox.ops.moe import route_from_logits
    from moebox.ops.triton.route import route_triton
    from tests.test_triton_route import same_routing
    g = torch.Generator().manual_seed(0)
    cases = [(5, 256, 6, "sqrtsoftplus", True, True, 1.5), (3, 16, 2, "sqrtsoftplus", False, True, 1.0),
             (4, 6, 3, "sigmoid", True, False, 2.5), (2, 33, 1, "sigmoid", False, False, 1.0)]
    for n, e, k, scoring, has_bias, norm, scaling in cases:
        logits = torch.randn(n, e, generator=g) * 4
        logits[0, :3] = torch.tensor([25.0, -30.0, -12.0])    # past the threshold, far below zero
        bias = torch.randn(e, generator=g) * 0.1 if has_bias else None
        kw = dict(top_k=k, scoring_func=scoring, norm_topk_prob=norm, scaling=scaling)
        ids, w = route_triton(logits, bias, **kw)
        same_routing(ids, w, *route_from_logits(logits, bias=bias, tid2eid=None, tokens=None, **kw))
    # exact ties pick the lowest expert ids
    ids, _ = route_triton(torch.zeros(1, 8), None, top_k=3, scoring_func="sigmoid", norm_topk_prob=True,
                          scaling=1.0)
    assert ids.tolist() == [[0, 1, 2]], ids
    # a NaN logit cannot send an id out of range
    ids, _ = route_triton(torch.full((2, 8), float("nan")), None, top_k=2, scoring_func="sqrtsoftplus",
                          norm_topk_prob=True, scaling=1.0)
    assert ((ids >= 0) & (ids < 8)).all(), ids
    print("OK")
""")


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install triton; Linux only)")
def test_kernel_in_triton_interpreter():
    assert "OK" in run_in_interpreter(_CASES)


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_what_it_refuses():
    from moebox.ops.triton.route import route_triton, supported
    assert not supported(torch.zeros(2, 8), "softmax", 2)              # softmax scores: the torch path
    assert not supported(torch.zeros(2, 8)[:, ::2], "sigmoid", 2)      # strided columns
    assert not supported(torch.zeros(2, 8), "sigmoid", 9)              # k > E
    with pytest.raises(ValueError, match="route_triton takes"):
        route_triton(torch.zeros(2, 8), None, top_k=2, scoring_func="softmax", norm_topk_prob=True, scaling=1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 4, 16])
def test_gpu_v4_router(n: int, dtype: torch.dtype):
    from moebox.ops.cuda_graphs import capture
    from moebox.ops.triton.route import route_triton
    g = torch.Generator(device="cuda").manual_seed(n)
    logits = (torch.randn(n, 256, generator=g, device="cuda") * 3).to(dtype)
    bias = torch.randn(256, generator=g, device="cuda") * 0.05
    kw = dict(top_k=6, scoring_func="sqrtsoftplus", norm_topk_prob=True, scaling=2.5)
    ref = route_from_logits(logits.float(), bias=bias, tid2eid=None, tokens=None, **kw)
    torch.empty(64 << 20, dtype=torch.uint8, device="cuda").fill_(0xFF)     # poison what the allocator hands out
    same_routing(*route_triton(logits, bias, **kw), *ref)
    graph, out = capture(lambda: route_triton(logits, bias, **kw))
    out[0].fill_(-1)
    out[1].fill_(float("nan"))
    graph.replay()
    same_routing(*out, *ref)
