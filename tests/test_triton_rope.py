"""The query RoPE kernel (moebox/ops/triton/rope.py: q normed then rotated, qi rotated, one launch) against the
torch path (`norm_rope`, `apply_rope`): tiny shapes in Triton's interpreter on the CPU (with one value worked
out independently, and the tiny model's decode steps), the V4-Flash shapes on the GPU (outputs poisoned with NaN,
so nothing unwritten can pass), and the dispatch of `query_rope`."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

from moebox.config import YarnScaling
from moebox.ops import rope
from moebox.ops.rope import apply_rope, norm_rope, query_rope, rope_inv_freq

from tests.interpreter import check_in_interpreter
from tests.poison import poison_allocator

HAVE_TRITON = importlib.util.find_spec("triton") is not None
EPS = 1e-6


def case(n: int, hq: int, dq: int, hi: int, di: int, rd: int, dtype: torch.dtype, device: str = "cpu",
         seed: int = 0, weighted: bool = False) -> dict:
    """Inputs laid out as the model's: q [n, hq, dq] and qi [n, hi, di] column slices of one product's rows
    (row stride wider than either), head magnitudes over 10^-2..10^2 (a wrong per-head rms shows), positions up
    to 2^20, V4's compressed-layer inv_freq (theta 1.6e5, YaRN) at rope width rd."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-2, 2, hq + hi)
    cols = torch.cat([scale[:hq].repeat_interleave(dq), scale[hq:].repeat_interleave(di)])
    rows = (torch.randn(n, hq * dq + hi * di + 8, generator=g)[:, 8:] * cols).to(device=device, dtype=dtype)
    return dict(q=rows[:, :hq * dq].view(n, hq, dq), qi=rows[:, hq * dq:].view(n, hi, di),
                positions=torch.randint(1, 1 << 20, (n,), generator=g).to(device),
                inv_freq=rope_inv_freq(rd, 1.6e5, YarnScaling(16.0, 65536)).to(device),
                weight=(torch.rand(dq, generator=g) + 0.5).to(device) if weighted else None)


def reference(inp: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path: (norm_rope(q, weight), apply_rope(qi))."""
    pos, inv = inp["positions"], inp["inv_freq"]
    return norm_rope(inp["q"], inp["weight"], EPS, pos, inv), apply_rope(inp["qi"], pos, inv)


def head_rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest ||got - ref|| / ||ref|| over heads, in fp64."""
    return float(((got.double() - ref.double()).norm(dim=-1) / ref.double().norm(dim=-1)).max())


def ulps(got: torch.Tensor, ref: torch.Tensor, rd: int) -> torch.Tensor:
    """|got - ref| in units of the dtype's ulp at the scale of each channel (a rope channel: its pair's length,
    as a rotation mixes both)."""
    mag = ref.float().abs()
    pair = mag[..., -rd:].unflatten(-1, (rd // 2, 2)).norm(dim=-1, keepdim=True).expand(*mag.shape[:-1], rd // 2, 2)
    mag = torch.cat([mag[..., :-rd], pair.flatten(-2)], dim=-1)
    ulp = torch.finfo(ref.dtype).eps / 2 * torch.exp2(torch.frexp(mag).exponent.float())   # mag in [2^(E-1), 2^E)
    return (got.float() - ref.float()).abs() / ulp


def test_dispatch_keeps_the_torch_path_off_cuda() -> None:
    inp = case(3, 2, 24, 3, 16, 8, torch.float32)
    q, qi, pos, inv = inp["q"], inp["qi"], inp["positions"], inp["inv_freq"]
    assert not rope._kernel_takes(q, qi)
    got_q, got_qi = query_rope(q, qi, pos, inv, EPS)
    ref_q, ref_qi = reference(inp)
    assert torch.equal(got_q, ref_q) and torch.equal(got_qi, ref_qi)
    only_q, none = query_rope(q, None, pos, inv, EPS)
    assert none is None and torch.equal(only_q, ref_q)


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_the_wrapper_refuses_bad_shapes() -> None:
    from moebox.ops.triton.rope import query_rope_triton
    inp = case(2, 2, 24, 3, 16, 8, torch.float32)
    q, qi, pos, inv = inp["q"], inp["qi"], inp["positions"], inp["inv_freq"]
    for args, kw in [((q, qi, pos, inv, EPS), dict(weight=torch.ones(16))),       # weight not [Dq]
                     ((q, qi, pos[:1], inv, EPS), {}),                              # a position per token
                     ((q, qi, pos, torch.ones(10), EPS), {}),                       # rope wider than qi's heads
                     ((q.flatten(1), None, pos, inv, EPS), {}),                     # q not [N, H, D]
                     ((q, qi[:1], pos, inv, EPS), {})]:                             # qi of other tokens
        with pytest.raises(ValueError):
            query_rope_triton(*args, **kw)


_INTERPRETER_CHECK = textwrap.dedent("""
    import json, math, os, sys, torch
    sys.path.insert(0, sys.argv[1])
    import moebox.ops.triton.rope as kernel
    from moebox.ops.rope import apply_rope
    from tests.test_triton_rope import EPS, case, head_rel, reference
    results = []
    # (N, Hq, Dq, Hi, Di, dtype, weighted, with qi): head dims 16/24 with rope dim 8, head counts not a power of
    # two, two head blocks of q and of qi (36 x 24 and 70 x 16: 32 and 64 heads a program), fp16
    cases = [(1, 3, 24, 5, 16, torch.float32, False, True), (3, 3, 24, 5, 16, torch.float32, True, True),
             (3, 2, 16, 3, 24, torch.float32, True, False), (1, 4, 16, 2, 24, torch.float16, False, False),
             (3, 3, 24, 5, 16, torch.float16, True, True), (3, 36, 24, 70, 16, torch.float32, False, True)]
    for i, (n, hq, dq, hi, di, dt, weighted, with_qi) in enumerate(cases):
        inp = case(n, hq, dq, hi, di, 8, dt, seed=i, weighted=weighted)
        q, qi = kernel.query_rope_triton(inp["q"], inp["qi"] if with_qi else None, inp["positions"],
                                         inp["inv_freq"], EPS, inp["weight"])
        ref_q, ref_qi = reference(inp)
        tol = 1e-3 if dt == torch.float16 else 1e-6
        for name, got, ref in [("q", q, ref_q)] + ([("qi", qi, ref_qi)] if with_qi else []):
            results.append(dict(case=[name, n, hq, dq, hi, di, str(dt), weighted, with_qi], tol=tol,
                                same_buffer=got.shape == ref.shape and got.dtype == dt and got.is_contiguous(),
                                finite=bool(torch.isfinite(got).all()), rel=head_rel(got, ref),
                                ref_norm=float(ref.norm())))
        if not with_qi:
            assert qi is None

    # one value worked out by hand: token 2, q head 1, the rope pair 1 (channels 18, 19 of 24), weighted
    inp = case(3, 3, 24, 5, 16, 8, torch.float32, seed=1, weighted=True)
    q, _ = kernel.query_rope_triton(inp["q"], inp["qi"], inp["positions"], inp["inv_freq"], EPS, inp["weight"])
    x, w = inp["q"][2, 1].tolist(), inp["weight"].tolist()
    rstd = 1 / math.sqrt(sum(v * v for v in x) / len(x) + EPS)
    a, b = x[18] * rstd * w[18], x[19] * rstd * w[19]
    angle = float(inp["positions"][2].float() * inp["inv_freq"][1])      # fp32, as the reference
    want = a * math.cos(angle) - b * math.sin(angle)
    results.append(dict(case="by hand", same_buffer=True, finite=True, rel=abs(float(q[2, 1, 18]) - want) /
                        math.hypot(a, b), ref_norm=abs(want), tol=1e-5))

    # the inverse RoPE (an attention output rotated back): q's heads as the input (column slices of a wider
    # row: any row stride), head counts not a power of two, fp16, and one value by hand
    for i, (n, h, d, dt) in enumerate([(1, 3, 24, torch.float32), (3, 36, 24, torch.float32),
                                        (2, 5, 16, torch.float16)]):
        inp = case(n, h, d, 2, 16, 8, dt, seed=10 + i)
        got = kernel.inverse_rope_triton(inp["q"], inp["positions"], inp["inv_freq"])
        ref = apply_rope(inp["q"], inp["positions"], inp["inv_freq"], inverse=True)
        results.append(dict(case=["inverse", n, h, d, str(dt)], tol=1e-3 if dt == torch.float16 else 1e-6,
                            same_buffer=got.shape == ref.shape and got.dtype == dt and got.is_contiguous(),
                            finite=bool(torch.isfinite(got).all()), rel=head_rel(got, ref),
                            ref_norm=float(ref.norm())))
    inp = case(3, 3, 24, 2, 16, 8, torch.float32, seed=1)
    got = kernel.inverse_rope_triton(inp["q"], inp["positions"], inp["inv_freq"])
    a, b = inp["q"][2, 1, 18].item(), inp["q"][2, 1, 19].item()
    angle = float(inp["positions"][2].float() * inp["inv_freq"][1])
    want = a * math.cos(angle) + b * math.sin(angle)              # the conjugate rotation of the pair
    results.append(dict(case="inverse by hand", same_buffer=True, finite=True, tol=1e-5, ref_norm=abs(want),
                        rel=abs(float(got[2, 1, 18]) - want) / math.hypot(a, b)))
    unchanged = bool(torch.equal(got[..., :-8], inp["q"][..., :-8]))
    results.append(dict(case="inverse: channels before the rope ones copied", same_buffer=unchanged,
                        finite=True, rel=0.0, ref_norm=1.0, tol=1e-5))

    # the tiny model's decode steps with the kernels in place of the torch path (the dispatch takes them on CUDA
    # only: forced here), other kernels off (the attention kernel too: its torch path rotates its output back
    # with `inverse_rope`)
    from tests.interpreter import count_calls, switch_result, tiny_model
    import moebox.ops.rope as rope
    calls = count_calls(kernel, "query_rope_triton")
    inverse_calls = count_calls(kernel, "inverse_rope_triton")
    rope._kernel_takes = lambda q, qi=None: os.environ["MOEBOX_ROPE_KERNEL"] != "0"
    for switch in ("ATTENTION", "COMPRESS", "PREFILL_ATTENTION", "TOPK", "INDEX", "ROUTE", "W2_PREFILL"):
        os.environ[f"MOEBOX_{switch}_KERNEL"] = "0"
    cfg, model = tiny_model()
    results.append(switch_result(model, cfg, "MOEBOX_ROPE_KERNEL", 4))
    assert len(calls) == 5 * cfg.num_layers, (len(calls), cfg.num_layers)   # the prefill and 4 steps
    assert len(inverse_calls) == 5 * cfg.num_layers, (len(inverse_calls), cfg.num_layers)
    print("RESULT " + json.dumps(results))
""")


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install triton; Linux only)")
def test_kernel_in_triton_interpreter() -> None:
    check_in_interpreter(_INTERPRETER_CHECK, default_tol=1e-5)


def keys_case(b: int, d: int, r: int, rd: int, dtype: torch.dtype, ring_dtype: torch.dtype, device: str = "cpu",
              seed: int = 0) -> dict:
    """Arguments of `store_keys_triton` as a decode step has them: kv [b, d] a column slice of wider product
    rows, magnitudes over 10^-2..10^2 by token, positions below and past the ring length r (never-written rows,
    wrapped rings), sequence b in slot 2b + 1 of 2b + 2, a window shorter than the ring; the ring filled with
    random rows (what the step must not touch)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(b, d + 24, generator=g) * torch.logspace(-2, 2, b)[:, None]
    positions = torch.randint(0, 3 * r, (b,), generator=g)
    positions[0] = 1                                       # rows never written yet
    return dict(kv=rows[:, 24:].to(device=device, dtype=dtype), weight=(torch.rand(d, generator=g) + 0.5).to(device),
                eps=EPS, positions=positions.to(device), inv_freq=rope_inv_freq(rd, 1e4, None).to(device),
                slots=(2 * torch.arange(b) + 1).to(device),
                ring=torch.randn(2 * b + 2, r, d, generator=g).to(device=device, dtype=ring_dtype), window=r - 2)


def keys_reference(inp: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path on a copy of the ring: (the ring after the step, the visible rows)."""
    from moebox.model.decode_attention import window_mask
    ring = inp["ring"].clone()
    kv = norm_rope(inp["kv"], inp["weight"], inp["eps"], inp["positions"], inp["inv_freq"])
    return ring, window_mask(kv, inp["positions"], inp["slots"], ring, inp["window"])


_KEYS_CHECK = textwrap.dedent("""
    import json, os, sys, torch
    sys.path.insert(0, sys.argv[1])
    import moebox.ops.triton.rope as kernel
    from tests.test_triton_rope import keys_case, keys_reference
    results = []
    # (B, D, R, rope dim, kv dtype, ring dtype): D not a power of two, fp16 rows into an fp32 ring and back
    for i, (b, d, r, rd, dt, rt) in enumerate([(1, 32, 8, 8, torch.float32, torch.float32),
                                                (3, 24, 10, 8, torch.float32, torch.float16),
                                                (4, 48, 16, 16, torch.float16, torch.float32)]):
        inp = keys_case(b, d, r, rd, dt, rt, seed=i)
        ref_ring, ref_vis = keys_reference(inp)
        vis = kernel.store_keys_triton(**inp)
        ring = inp["ring"]
        new = ring[inp["slots"], inp["positions"] % r]
        untouched = torch.ones(ring.shape[:2], dtype=torch.bool)
        untouched[inp["slots"], inp["positions"] % r] = False
        results.append(dict(case=["keys", b, d, r, rd, str(dt), str(rt)],
                            same_buffer=bool(torch.equal(vis, ref_vis)) and bool(torch.equal(ring[untouched],
                                                                                             ref_ring[untouched])),
                            finite=bool(torch.isfinite(new).all()), ref_norm=float(ref_ring.norm()),
                            rel=float((ring.double() - ref_ring.double()).norm() / ref_ring.double().norm()),
                            tol=1e-3 if torch.float16 in (dt, rt) else 1e-6))

    # the tiny model's decode steps with the key store kernel against the torch path (the attention kernel on:
    # the model stores keys this way only there), other kernels off
    from tests.interpreter import count_calls, switch_result, tiny_model
    calls = count_calls(kernel, "store_keys_triton")
    for switch in ("COMPRESS", "PREFILL_ATTENTION", "TOPK", "INDEX", "ROUTE", "W2_PREFILL", "ROPE"):
        os.environ[f"MOEBOX_{switch}_KERNEL"] = "0"
    cfg, model = tiny_model()
    results.append(switch_result(model, cfg, "MOEBOX_KEYS_KERNEL", 3))
    assert len(calls) == 3 * cfg.num_layers, (len(calls), cfg.num_layers)   # each decode step's layers
    print("RESULT " + json.dumps(results))
""")


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install triton; Linux only)")
def test_key_store_kernel_in_triton_interpreter() -> None:
    check_in_interpreter(_KEYS_CHECK, default_tol=1e-5)


def test_key_store_off_cuda_is_the_torch_path() -> None:
    """Off CUDA (and outside the interpreter) `store_keys` takes the torch path: the reference's ring and mask."""
    from moebox.model.decode_attention import store_keys
    inp = keys_case(2, 24, 8, 8, torch.float32, torch.float32)
    ref_ring, ref_vis = keys_reference(inp)
    vis = store_keys(inp["kv"], inp["weight"], EPS, inp["positions"], inp["inv_freq"], inp["slots"], inp["ring"],
                     inp["window"])
    assert torch.equal(vis, ref_vis) and torch.equal(inp["ring"], ref_ring)


V4 = dict(hq=64, dq=512, hi=64, di=128, rd=64)   # V4-Flash: q heads, index heads, rope width


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("n", [1, 5, 16])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_matches_reference(n: int, dtype: torch.dtype) -> None:
    """Against the torch path on the CPU (eager, same roundings): bf16 bit for bit but where the sum order or
    the last bit of cos/sin moves a value across a rounding midpoint (at most a normed value's ulp, then the
    rotation's), fp32 within ~8 ulp a head."""
    from moebox.ops.triton.rope import query_rope_triton
    for weighted in (False, True):
        inp = case(n, *V4.values(), dtype, "cuda", seed=n, weighted=weighted)
        poison_allocator()   # an output the kernel fails to write shows as NaN
        q, qi = query_rope_triton(inp["q"], inp["qi"], inp["positions"], inp["inv_freq"], EPS, inp["weight"])
        torch.cuda.synchronize()
        ref_q, ref_qi = reference({k: None if v is None else v.cpu() for k, v in inp.items()})
        for got, ref in ((q, ref_q), (qi, ref_qi)):
            got = got.cpu()
            assert got.dtype == dtype and got.shape == ref.shape and torch.isfinite(got).all()
            if dtype == torch.bfloat16:
                err = ulps(got, ref, V4["rd"])
                assert err.max() <= 2 and (err == 0).float().mean() > 0.99, (err.max(), (err == 0).float().mean())
            else:
                assert head_rel(got, ref) < 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("n", [1, 3, 16])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_inverse_matches_reference(n: int, dtype: torch.dtype) -> None:
    """The attention output's inverse RoPE at the V4-Flash shape (64 heads of 512, a column slice of wider rows)
    against apply_rope(inverse) on the CPU: bf16 within an ulp of the rotation, fp32 within ~8 ulp a head; the
    dispatch (`inverse_rope`) takes the kernel there."""
    from moebox.ops.triton.rope import inverse_rope_triton
    inp = case(n, V4["hq"], V4["dq"], 1, 64, V4["rd"], dtype, "cuda", seed=20 + n)
    x, pos, inv = inp["q"], inp["positions"], inp["inv_freq"]
    poison_allocator()
    got = inverse_rope_triton(x, pos, inv)
    torch.cuda.synchronize()
    ref = apply_rope(x.cpu(), pos.cpu(), inv.cpu(), inverse=True)
    assert got.dtype == dtype and got.shape == ref.shape and torch.isfinite(got).all()
    if dtype == torch.bfloat16:
        err = ulps(got.cpu(), ref, V4["rd"])
        assert err.max() <= 1 and (err == 0).float().mean() > 0.99, (err.max(), (err == 0).float().mean())
    else:
        assert head_rel(got.cpu(), ref) < 1e-6
    assert rope._kernel_takes(x) and torch.equal(rope.inverse_rope(x, pos, inv), got)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode-size CUDA inputs take the kernel, 17 tokens, autograd and MOEBOX_ROPE_KERNEL=0 do not; qi None
    gives None; a captured graph replays it on new rows."""
    from moebox.ops.triton.rope import query_rope_triton
    inp = case(4, *V4.values(), torch.bfloat16, "cuda")
    q, qi, pos, inv = inp["q"], inp["qi"], inp["positions"], inp["inv_freq"]
    assert rope._kernel_takes(q, qi)
    got, want = query_rope(q, qi, pos, inv, EPS), query_rope_triton(q, qi, pos, inv, EPS)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert query_rope(q, None, pos, inv, EPS)[1] is None
    big = case(17, *V4.values(), torch.bfloat16, "cuda")
    assert not rope._kernel_takes(big["q"], big["qi"])
    assert not rope._kernel_takes(q, qi.clone().requires_grad_())
    monkeypatch.setenv("MOEBOX_ROPE_KERNEL", "0")
    assert not rope._kernel_takes(q, qi)
    monkeypatch.delenv("MOEBOX_ROPE_KERNEL")
    static = q.clone(), qi.clone(), pos.clone()
    query_rope_triton(*static, inv, EPS)   # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = query_rope_triton(*static, inv, EPS)
    new = case(4, *V4.values(), torch.bfloat16, "cuda", seed=9)
    for t, k in zip(static, ("q", "qi", "positions")):
        t.copy_(new[k])
    for t in out:
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    want = query_rope_triton(*static, inv, EPS)
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])


@pytest.mark.parametrize("n", [1, 5, 16])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_key_store_matches_reference(n: int) -> None:
    """The key store at the V4-Flash shape (512-wide bf16 rows of a wider product, a 130-row bf16 ring, window
    128) against the torch path on the CPU: the visible rows exactly, the new rows within an ulp of the
    rotation (bit for bit but where cos/sin's last bit moves a value across a rounding midpoint), every other
    ring row untouched; the dispatch takes it with MOEBOX_KEYS_KERNEL=1 only."""
    from moebox.model.decode_attention import store_keys
    from moebox.ops.triton.rope import store_keys_triton
    inp = keys_case(n, 512, 130, 64, torch.bfloat16, torch.bfloat16, "cuda", seed=30 + n)
    ref_ring, ref_vis = keys_reference({k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in inp.items()})
    vis = store_keys_triton(**inp)
    torch.cuda.synchronize()
    assert torch.equal(vis.cpu(), ref_vis)
    ring = inp["ring"].cpu()
    rows = inp["slots"].cpu(), inp["positions"].cpu() % 130
    err = ulps(ring[rows], ref_ring[rows], 64)
    assert err.max() <= 1 and (err == 0).float().mean() > 0.99, (err.max(), (err == 0).float().mean())
    untouched = torch.ones(ring.shape[:2], dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(ring[untouched], ref_ring[untouched])
    args = (inp["kv"], inp["weight"], EPS, inp["positions"], inp["inv_freq"], inp["slots"], inp["ring"], 128)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOEBOX_KEYS_KERNEL", "1")
        assert torch.equal(store_keys(*args), vis)
