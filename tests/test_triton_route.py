"""The routing kernel (moebox/ops/triton/route.py) against the torch routing (`route_from_logits`).

CPU: the kernel in Triton's interpreter on tiny shapes (E a power of two and not, k 1..6, both scorings, with and
without bias and normalisation, logits past softplus's threshold and far below zero, exact ties, NaN); what it
refuses. GPU (marker `gpu`): the V4-Flash router (E 256, k 6) at decode batches, outputs poisoned first, fp32 and
bf16 logits, replayed from a CUDA graph.
"""

from __future__ import annotations

import importlib.util
import re
import textwrap

import pytest
import torch

from moebox.ops.moe import route_from_logits
from tests.interpreter import check_in_interpreter, run_in_interpreter

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


_ROUTER_CASES = textwrap.dedent("""
    import json, os, sys, torch
    sys.path.insert(0, sys.argv[1])
    from moebox.ops.moe import route_from_logits
    import moebox.ops.triton.route as kernel
    from tests.test_triton_route import same_routing
    g = torch.Generator().manual_seed(1)
    # (N, E, H, k, scoring, bias, norm, scaling, dtype), one call after the other: each token's counter goes on
    # from where the calls before left it (N and E change)
    cases = [(3, 256, 96, 6, "sqrtsoftplus", True, True, 2.5, torch.float32),
             (1, 256, 96, 6, "sqrtsoftplus", True, True, 2.5, torch.float32),
             (5, 16, 4200, 2, "sigmoid", False, True, 1.0, torch.float32),     # H past one 4096 block
             (2, 10, 40, 3, "sqrtsoftplus", True, False, 1.5, torch.float16),
             (3, 256, 96, 6, "sqrtsoftplus", True, True, 2.5, torch.float32)]
    for n, e, h, k, scoring, has_bias, norm, scaling, dt in cases:
        x = (torch.randn(n, h, generator=g)).to(dt)
        gate = (torch.randn(e, h, generator=g) / h ** 0.5).to(dt)
        bias = torch.randn(e, generator=g) * 0.1 if has_bias else None
        kw = dict(top_k=k, scoring_func=scoring, norm_topk_prob=norm, scaling=scaling)
        ids, w = kernel.router_route_triton(x, gate, bias, **kw)
        logits = x.double() @ gate.double().T
        same_routing(ids, w, *route_from_logits(logits.float(), bias=bias, tid2eid=None, tokens=None, **kw))
    # between calls each token's counter is a whole number of calls (of E / 2 programs each)
    assert {p: c.tolist() for (_, p), c in kernel._counters.items()} == {
        128: [3 * 128, 2 * 128, 2 * 128] + [0] * 13, 8: [8] * 5 + [0] * 11, 5: [5] * 2 + [0] * 14}

    # the tiny model's decode steps with the fused router against the routing kernel after the torch product
    from tests.interpreter import count_calls, switch_result, tiny_model
    calls = count_calls(kernel, "router_route_triton")
    for switch in ("ATTENTION", "COMPRESS", "PREFILL_ATTENTION", "TOPK", "INDEX", "W2_PREFILL", "ROPE"):
        os.environ[f"MOEBOX_{switch}_KERNEL"] = "0"
    cfg, model = tiny_model()
    result = switch_result(model, cfg, "MOEBOX_ROUTER_KERNEL", 3)
    assert calls, "the model never took the fused router"
    print("RESULT " + json.dumps([result]))
""")


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install triton; Linux only)")
def test_fused_router_in_triton_interpreter():
    """The router's product and the routing in one launch (`router_route_triton`) against the routing of fp64
    logits: V4's E 256 and k 6, E not a power of two, H over one block, fp16, consecutive calls of different
    token counts (the per-token counters); then in the tiny model's decode steps."""
    check_in_interpreter(_ROUTER_CASES, default_tol=1e-5)


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("hidden", [4096, 7168])
def test_fused_router_builds_for_sm90(hidden):
    """The fused router as V4 launches it (bf16 x and gate, E 256, k 6) compiles for sm_90 on any machine, with
    its H loop run (7168 > one 4096 block) and not: the interpreter does not type-check what the GPU build does
    (a loop-carried value whose dtype changed in the loop), and loads its weights before its PDL wait."""
    from moebox.ops.triton import route
    from moebox.ops.triton.runtime import build_sm90
    fn = route._router_route_kernel
    before = {}
    for early in (True, False):   # the gate rows' loads before the PDL wait, or after it
        const = dict(ROWS=route.ROUTER_ROWS, BLOCK_H=min(hidden, 4096), EARLY=early, PDL=True,
                     **route._routing_constants(256, torch.zeros(256), 6, "sqrtsoftplus", True))
        types = {"x_ptr": "*bf16", "g_ptr": "*bf16", "count_ptr": "*i64", "ids_ptr": "*i64", "scaling": "fp32"}
        sig = {a: types.get(a, "*fp32" if a.endswith("_ptr") else "i32") for a in fn.arg_names if a not in const}
        ptx = build_sm90(fn, sig, const, [a for a in sig if a.endswith("_ptr")], num_warps=4).asm["ptx"]
        wait = ptx.find("griddepcontrol.wait")
        assert wait >= 0
        before[early] = len(re.findall(r"\bld\.global", ptx[:wait]))
    assert 1 <= before[False] <= 2 < before[True]     # the bias (2 a thread) always, the gate rows when early


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_what_it_refuses():
    from moebox.ops.triton.route import route_triton, supported
    assert not supported(torch.zeros(2, 8), "softmax", 2)              # softmax scores: the torch path
    assert not supported(torch.zeros(2, 8)[:, ::2], "sigmoid", 2)      # strided columns
    assert not supported(torch.zeros(2, 8), "sigmoid", 9)              # k > E
    with pytest.raises(ValueError, match="route_triton takes"):
        route_triton(torch.zeros(2, 8), None, top_k=2, scoring_func="softmax", norm_topk_prob=True, scaling=1.0)
    from moebox.ops.triton.route import router_route_triton, router_supported
    x, gate = torch.zeros(2, 8), torch.zeros(6, 8)
    assert router_supported(x, gate, "sigmoid", 2)
    assert not router_supported(x, torch.zeros(7, 8), "sigmoid", 2)             # E not a multiple of 2
    assert not router_supported(torch.zeros(17, 8), gate, "sigmoid", 2)         # more than 16 tokens
    assert not router_supported(x, gate.int(), "sigmoid", 2)                    # not a float weight
    with pytest.raises(ValueError, match="router_route_triton takes"):
        router_route_triton(x, torch.zeros(6, 9), None, top_k=2, scoring_func="sigmoid", norm_topk_prob=True,
                            scaling=1.0)


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_the_model_fuses_the_router_up_to_8_tokens(monkeypatch):
    """A scored MoE layer takes the one-launch router up to `ROUTER_KERNEL_TOKENS` (8) tokens, where the H200
    gained, and not at 9-16 (batch 16 lost); MOEBOX_ROUTER_KERNEL=0 / 1: never / up to the kernel's 16. The
    decision only (the interpreter flag lets CPU tensors pass the dispatch; no kernel runs here)."""
    from moebox.ops.triton import route as kernel
    from tests.interpreter import tiny_model
    cfg, model = tiny_model()
    moe = next(layer.ffn for layer in model.layers if layer.ffn.tid2eid is None)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("MOEBOX_ROUTER_KERNEL", raising=False)

    def fused(n: int) -> bool:
        return moe._fused_router_takes(torch.zeros(n, cfg.hidden_size), kernel)
    assert [fused(n) for n in (1, 8, 9, 16)] == [True, True, False, False]
    monkeypatch.setenv("MOEBOX_ROUTER_KERNEL", "1")
    assert [fused(n) for n in (1, 16, 17)] == [True, True, False]
    monkeypatch.setenv("MOEBOX_ROUTER_KERNEL", "0")
    assert not fused(1)


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n", [1, 4, 16])
def test_gpu_fused_v4_router(n: int):
    """The fused router at the V4-Flash shape (E 256, H 4096, bf16, k 6) against the routing of the same
    product in fp64, eagerly and replayed from a CUDA graph on new inputs (the counters carry over)."""
    from moebox.ops.cuda_graphs import capture
    from moebox.ops.triton.route import router_route_triton
    g = torch.Generator(device="cuda").manual_seed(10 + n)
    x = torch.randn(n, 4096, generator=g, device="cuda").bfloat16()
    gate = (torch.randn(256, 4096, generator=g, device="cuda") / 64).bfloat16()
    bias = torch.randn(256, generator=g, device="cuda") * 0.05
    kw = dict(top_k=6, scoring_func="sqrtsoftplus", norm_topk_prob=True, scaling=2.5)

    def ref():
        logits = (x.double() @ gate.double().T).float()
        return route_from_logits(logits, bias=bias, tid2eid=None, tokens=None, **kw)
    torch.empty(64 << 20, dtype=torch.uint8, device="cuda").fill_(0xFF)     # poison what the allocator hands out
    for _ in range(3):
        same_routing(*router_route_triton(x, gate, bias, **kw), *ref())
    graph, out = capture(lambda: router_route_triton(x, gate, bias, **kw))
    for seed in range(3):
        x.copy_(torch.randn(n, 4096, generator=g, device="cuda").bfloat16())
        out[0].fill_(-1)
        out[1].fill_(float("nan"))
        graph.replay()
        same_routing(*out, *ref())
