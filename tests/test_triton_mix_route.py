"""An FFN site's x and routing in one launch (moebox/ops/triton/mix_route.py) against the torch composition it
replaces: hc_pre's x, rms_norm, the router's product and the routing (`mix_route_reference`), and the packing.

CPU: both kernels (rows, columns) in Triton's interpreter (bf16 streams with packing, fp32 with no bias, fp16 at an
H that is not a power of two with sigmoid scores, volatile and plain loads, consecutive calls of 1 and 2 tokens:
the per-token counters); their sm_90 builds (no spills, the weights' loads before the PDL wait); what it refuses;
when the model asks for it.
GPU (marker `gpu`): the V4-Flash shape (H 4096, E 256, k 6, bf16) at 1 and 2 tokens, outputs poisoned, eagerly
and replayed from a CUDA graph on new streams.
"""

from __future__ import annotations

import importlib.util
import re
import textwrap

import pytest
import torch

from tests.interpreter import check_in_interpreter

HAVE_TRITON = importlib.util.find_spec("triton") is not None

_CASES = textwrap.dedent("""
    import json, sys, torch
    sys.path.insert(0, sys.argv[1])
    from moebox.ops.moe import route_from_logits
    from moebox.ops.triton import mix_route as kernel
    from moebox.ops.triton.mhc import hc_partials_triton
    from moebox.ops.triton.route import _counters
    from moebox.ops.triton.w2_moe import _empty_packed, _pack_x
    from tests.test_triton_route import same_routing
    g = torch.Generator().manual_seed(0)
    results = []
    # (N, H, E, k, scoring, bias, norm_topk, dtype, pack, x tolerance against the reference, (warps, volatile,
    # columns[, early]): the row kernel, then the column kernel)
    cases = [(1, 256, 16, 2, "sqrtsoftplus", True, True, torch.bfloat16, True, 1e-2, (8, True, 0)),
             (2, 512, 32, 6, "sqrtsoftplus", False, True, torch.float32, True, 1e-5, (4, False, 0)),
             (2, 96, 10, 3, "sigmoid", True, False, torch.float16, False, 2e-3, (4, True, 0)),
             (1, 256, 16, 2, "sqrtsoftplus", True, True, torch.bfloat16, True, 1e-2, (8, True, 0)),
             (2, 512, 32, 6, "sqrtsoftplus", False, True, torch.float32, True, 1e-5, (8, True, 64)),
             (2, 96, 10, 3, "sigmoid", True, False, torch.float16, False, 2e-3, (4, False, 64)),
             (1, 256, 16, 2, "sqrtsoftplus", True, True, torch.bfloat16, True, 1e-2, (8, False, 32, False))]
    for n, h, e, k, scoring, has_bias, norm_topk, dt, pack, tol, variant in cases:
        hc = 4
        m = (2 + hc) * hc
        X = torch.randn(n, hc, h, generator=g).to(dt)
        fn = torch.randn(m, hc * h, generator=g) / (hc * h) ** 0.5
        base, scale = torch.randn(m, generator=g) * 0.3, torch.rand(3, generator=g) + 0.5
        norm = (1 + 0.2 * torch.randn(h, generator=g)).to(dt)
        router = kernel.Router((torch.randn(e, h, generator=g) / h ** 0.5).to(dt),
                               torch.randn(e, generator=g) * 0.1 if has_bias else None, k, scoring, norm_topk, 2.5)
        into = torch.full((n, h), float("nan"), dtype=dt)
        config = kernel.MixRouteConfig(*variant)
        x, ids, w, xp = kernel.mix_route_triton(X, hc_partials_triton(X, fn), base, scale, norm, router, eps=1e-6,
                                                norm_eps=1e-6, pack=pack, into=into, config=config)
        assert x is into and (xp is not None) == pack
        ref_x, ref_ids, ref_w = kernel.mix_route_reference(X, fn, base, scale, norm, router, iters=20, eps=1e-6,
                                                           norm_eps=1e-6)
        # the routing of the kernel's own x, as the router routes it (fp64 product), exactly; the reference's
        # routing too where x is fp32 (no rounding of x can flip a close pick)
        logits = (x.double() @ router.gate.double().T).float()
        same_routing(ids, w, *route_from_logits(logits, bias=router.bias, tid2eid=None, tokens=None,
                                                **router.routing()))
        if dt == torch.float32:
            same_routing(ids, w, ref_ids, ref_w)
        if pack:   # the packed x is the packing kernel's of the kernel's x, bit for bit
            assert torch.equal(xp, _pack_x(x, _empty_packed(x)))
        results.append(dict(case=f"N{n} H{h} E{e} {dt} {config}", same_buffer=True, finite=bool(x.isfinite().all()),
                            rel=float((x.float() - ref_x.float()).norm() / ref_x.float().norm()),
                            ref_norm=float(ref_x.float().norm()), tol=tol))
    # between calls each token's counter is a whole number of calls (the row kernel: E / 2 programs a token, the
    # column kernel: H / columns; kernels of one quantum share a set)
    counts = {p: c.tolist() for (_, p), c in _counters.items()}
    assert counts == {8: [4 * 8, 8] + [0] * 14, 16: [16, 16] + [0] * 14, 5: [5, 5] + [0] * 14,
                      2: [2, 2] + [0] * 14}, counts
    print("RESULT " + json.dumps(results))
""")


_SITE = textwrap.dedent("""
    import json, sys, torch
    sys.path.insert(0, sys.argv[1])
    from moebox.ops.triton import mix_route as kernel
    from moebox.ops.triton.mhc import hc_partials_triton, hc_pre_triton, random_site
    from moebox.ops.triton.route import router_route_triton
    from tests.test_triton_route import same_routing
    results = []
    for n, columns in ((1, 0), (2, 64)):
        X, fn, base, scale = random_site(n, hidden=256, dtype=torch.float32, device="cpu", seed=n)
        g = torch.Generator().manual_seed(n)
        norm = 1 + 0.2 * torch.randn(256, generator=g)
        router = kernel.Router(torch.randn(16, 256, generator=g) / 16, torch.randn(16, generator=g) * 0.1, 2,
                               "sqrtsoftplus", True, 2.5)
        kw = dict(iters=20, eps=1e-6, norm_eps=1e-6, norm=norm, partials=hc_partials_triton(X, fn))
        want = hc_pre_triton(X, fn, base, scale, **kw)
        ahead = kernel.RouteAhead(router, pack=False, config=kernel.MixRouteConfig(columns=columns))
        got = hc_pre_triton(X, fn, base, scale, **kw, router=ahead)
        same_routing(ahead.ids, ahead.weights, *router_route_triton(want[0], router.gate, router.bias,
                                                                     **router.routing()))
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])      # post and comb: the same launch
        results.append(dict(case=f"N{n} columns {columns}", same_buffer=True, finite=bool(got[0].isfinite().all()),
                            rel=float((got[0] - want[0]).norm() / want[0].norm()), ref_norm=float(want[0].norm())))
    print("RESULT " + json.dumps(results))
""")


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install triton; Linux only)")
def test_hc_pre_routes_when_asked_in_the_interpreter():
    """hc_pre_triton with a `RouteAhead` (its coefficients in the same stream: no side branch) gives kernel B's x
    (to fp32 rounding), the same post and comb, and the routing that the fused router gives that x; both
    kernels of the launch."""
    check_in_interpreter(_SITE, default_tol=1e-5)


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install triton; Linux only)")
def test_kernel_in_triton_interpreter():
    """x within its dtype's rounding of the reference (fp32: 1e-5), every element of it written (the buffer
    starts NaN), the routing of that x exact, the packed x bit for bit the packing kernel's."""
    check_in_interpreter(_CASES)


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("kernel", ["rows", "columns"])
def test_builds_for_sm90_with_its_weights_before_the_wait(kernel: str):
    """As a V4-Flash FFN site launches them (bf16 streams, H 4096, E 256, k 6, 8 warps; the column kernel at 64
    columns a program): no spills, and the loads before the PDL wait are the weights' (gate rows or columns, pre's
    base and scale, the norm weight, the bias)."""
    from moebox.ops.triton import mix_route
    from moebox.ops.triton.route import _routing_constants
    from moebox.ops.triton.runtime import build_sm90, cubin_dump
    fn, grid = ((mix_route._mix_router_kernel, dict(BLOCK_H=4096, ROWS=mix_route.ROWS)) if kernel == "rows" else
                (mix_route._mix_router_cols_kernel, dict(BLOCK_C=64, P_PAD=64)))
    before = {}
    for early in (True, False):
        const = dict(HC=4, HC_PAD=4, M=24, W_PAD=64, S_PAD=128, **grid, TERMS=1, VOLATILE=True, EARLY=early,
                     PDL=True, **_routing_constants(256, torch.zeros(256), 6, "sqrtsoftplus", True))
        types = {"X_ptr": "*bf16", "g_ptr": "*bf16", "norm_ptr": "*bf16", "x_ptr": "*bf16", "xp_ptr": "*i16",
                 "count_ptr": "*i64", "ids_ptr": "*i64", "eps": "fp32", "norm_eps": "fp32", "scaling": "fp32"}
        sig = {a: types.get(a, "*fp32" if a.endswith("_ptr") else "i32") for a in fn.arg_names if a not in const}
        aligned = [a for a in sig if a.endswith("_ptr")] + ["H", "stride_Xn", "stride_xn", "stride_ge"]
        compiled = build_sm90(fn, sig, const, aligned, num_warps=8)
        _, usage = cubin_dump(compiled.asm["cubin"])
        assert re.findall(r"STACK:(\d+)", usage) == ["0"], usage
        ptx = compiled.asm["ptx"]
        wait = ptx.find("griddepcontrol.wait")
        assert wait >= 0
        before[early] = len(re.findall(r"\bld\.global", ptx[:wait]))
    assert before[False] >= 4 and before[True] > before[False]     # the gate rows too when early


_BENCH = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    from moebox.ops.triton import mix_route as kernel
    ran = []
    rows = kernel.bench("cpu", tokens=(1, 2), configs=(kernel.MixRouteConfig(), kernel.MixRouteConfig(8, False, 64)),
                        copies=2, hidden=256, experts=16, timer=lambda calls: [c() for c in calls] and ran.append(1) or 0)
    assert len(rows) == 2 * 5 and len(ran) == 10, rows
    assert [r["same_routing"] for r in rows] == [None, None, True, True, True] * 2, rows
    print("OK")
""")


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_site_bench_runs_every_variant_to_the_routers_routing():
    """`bench`'s chains in the interpreter at a small shape, a clock that only runs them: each variant routes
    the first site as kernel B + the fused router do (what its printed check says on the GPU)."""
    from tests.interpreter import run_in_interpreter
    assert "OK" in run_in_interpreter(_BENCH)


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_what_it_refuses():
    from moebox.ops.triton.mix_route import Router, mix_route_supported, mix_route_triton
    gate = torch.zeros(8, 64)
    router = Router(gate, None, 2, "sqrtsoftplus", True, 1.0)
    X = torch.zeros(1, 4, 64)
    assert mix_route_supported(X, router)
    assert not mix_route_supported(torch.zeros(1, 4, 8192), Router(torch.zeros(8, 8192), None, 2, "sigmoid", True,
                                                                    1.0))          # more than one program's row
    assert not mix_route_supported(X, Router(torch.zeros(7, 64), None, 2, "sigmoid", True, 1.0))   # odd E
    assert not mix_route_supported(X, Router(gate, None, 2, "softmax", True, 1.0))
    assert not mix_route_supported(X.transpose(1, 2).contiguous().transpose(1, 2), router)
    with pytest.raises(ValueError, match="mix_route_triton takes"):
        mix_route_triton(X, torch.zeros(1, 2, 64), torch.zeros(24), torch.ones(3), torch.ones(64),
                         Router(gate, None, 2, "softmax", True, 1.0), eps=1e-6, norm_eps=1e-6, pack=False)


def test_the_model_asks_for_it_only_where_switched_on(monkeypatch):
    """`MoE.route_ahead`: never by default (`MIX_ROUTE_TOKENS` 0: it lost on the H200); with MOEBOX_MIX_ROUTE=N
    the kernel's streams (CUDA, or the interpreter's CPU) of a scored layer up to N tokens; hash layers and CPU
    streams never (the decision only: no kernel runs here)."""
    from tests.interpreter import tiny_model
    cfg, model = tiny_model()
    scored = next(layer.ffn for layer in model.layers if layer.ffn.tid2eid is None)
    hashed = next(layer.ffn for layer in model.layers if layer.ffn.tid2eid is not None)
    monkeypatch.delenv("MOEBOX_MIX_ROUTE", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    def asks(ffn, n: int) -> bool:
        return ffn.route_ahead(torch.zeros(n, cfg.hc_mult, cfg.hidden_size)) is not None
    monkeypatch.setenv("MOEBOX_MIX_ROUTE", "2")
    assert not asks(scored, 1)                                         # CPU streams
    if not HAVE_TRITON:
        return
    monkeypatch.setenv("TRITON_INTERPRET", "1")     # the interpreter's CPU streams pass as the kernel's
    assert [asks(scored, n) for n in (1, 2, 3)] == [True, True, False]
    assert not asks(hashed, 1)
    monkeypatch.delenv("MOEBOX_MIX_ROUTE")
    assert not asks(scored, 1)
    monkeypatch.setenv("MOEBOX_MIX_ROUTE", "4")
    assert [asks(scored, n) for n in (3, 4, 5)] == [True, True, False]
    monkeypatch.setenv("MOEBOX_MIX_ROUTE", "0")
    assert not asks(scored, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variant", [(8, True, 0), (8, False, 0), (8, True, 64), (8, False, 128)])
@pytest.mark.parametrize("n", [1, 2])
def test_gpu_v4_ffn_site(n: int, variant: tuple):
    """The V4-Flash FFN site (bf16 streams [n, 4, 4096], E 256, k 6, packing on; the row kernel and the column
    kernel, volatile and plain loads) against the reference: x within bf16 rounding, the routing of that x exact,
    the packed x the packing kernel's; eagerly over poisoned memory, then replayed from a CUDA graph on new
    streams (the counters carry over)."""
    from moebox.ops.cuda_graphs import capture
    from moebox.ops.moe import route_from_logits
    from moebox.ops.triton.mhc import hc_partials_triton
    from moebox.ops.triton.mix_route import MixRouteConfig, Router, mix_route_reference, mix_route_triton
    from moebox.ops.triton.w2_moe import _empty_packed, _pack_x
    from tests.test_triton_route import same_routing
    g = torch.Generator(device="cuda").manual_seed(20 + n)
    hc, h, m = 4, 4096, 24
    X = torch.randn(n, hc, h, generator=g, device="cuda").bfloat16()
    fn = torch.randn(m, hc * h, generator=g, device="cuda") / 128
    base, scale = torch.randn(m, generator=g, device="cuda") * 0.3, torch.rand(3, generator=g, device="cuda") + 0.5
    norm = (1 + 0.2 * torch.randn(h, generator=g, device="cuda")).bfloat16()
    router = Router((torch.randn(256, h, generator=g, device="cuda") / 64).bfloat16(),
                    torch.randn(256, generator=g, device="cuda") * 0.05, 6, "sqrtsoftplus", True, 2.5)
    kw = dict(eps=1e-6, norm_eps=1e-6)
    launch = dict(kw, pack=True, config=MixRouteConfig(*variant))

    def check(x, ids, w, xp):
        ref_x = mix_route_reference(X, fn, base, scale, norm, router, iters=20, **kw)[0]
        assert x.isfinite().all()
        assert float((x.float() - ref_x.float()).norm() / ref_x.float().norm()) < 1e-2
        logits = (x.double() @ router.gate.double().T).float()
        same_routing(ids, w, *route_from_logits(logits, bias=router.bias, tid2eid=None, tokens=None,
                                                **router.routing()))
        assert torch.equal(xp, _pack_x(x, _empty_packed(x)))

    torch.empty(64 << 20, dtype=torch.uint8, device="cuda").fill_(0xFF)     # poison what the allocator hands out
    for _ in range(2):
        check(*mix_route_triton(X, hc_partials_triton(X, fn), base, scale, norm, router, **launch))
    ws = hc_partials_triton(X, fn)
    graph, out = capture(lambda: mix_route_triton(X, ws, base, scale, norm, router, **launch))
    for _ in range(2):
        X.copy_(torch.randn(n, hc, h, generator=g, device="cuda").bfloat16())
        ws.copy_(hc_partials_triton(X, fn))
        for t, v in zip(out, (float("nan"), -1, float("nan"), -1)):
            t.fill_(v)
        graph.replay()
        check(*out)
