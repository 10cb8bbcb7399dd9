"""The fused mHC kernels (moebox/ops/triton/mhc.py) against the torch references (moebox/ops/mhc.py).

- CPU: the dispatchers run the references off CUDA; the tiling choice (the gemv logits kernel for N <= 16, the
  dot above, or with MOEBOX_MHC_GEMV set lower); argument checks; the kernels themselves in Triton's interpreter
  (TRITON_INTERPRET=1 is read when triton is imported, so that check runs in a subprocess), fp32 and fp16, tiny
  shapes: hc 2, 3 (padded), 4; H 64, 80, 96, 256; both logits kernels (hc_pre and hc_head, the gemv at N 1 and 3,
  the dot at prefill sizes and forced at N 2); splits that do not divide K, several H blocks with a partial last one,
  several token tiles, strided X, iters 1 and 20.
- GPU (marker `gpu`, skipped without CUDA): the V4-Flash shape (hc 4, H 4096) and tiny/odd ones, N in
  {1, 3, 16, 300}, fp32 and bf16, outputs poisoned with NaN (and the caching allocator's free blocks, which the
  scratch reuses) before each run, determinism, forced tilings of both logits kernels, N = 2048, the dispatch,
  a CUDA-graph replay.
"""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

from moebox.ops import mhc
from moebox.ops.attention import matmul_tf32
from moebox.ops.mhc import (hc_head, hc_head_reference, hc_post, hc_post_chain, hc_post_reference, hc_pre,
                            hc_pre_reference)
from moebox.ops.norm import rms_norm_reference

from tests.interpreter import check_in_interpreter
from tests.poison import poison_allocator

HAVE_TRITON = importlib.util.find_spec("triton") is not None
KW = dict(iters=20, eps=1e-6, norm_eps=1e-6)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30))


def site(n: int, hc: int, hidden: int, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0,
         head: bool = False) -> tuple[torch.Tensor, ...]:
    """(X, fn, base, scale) with logits ~N(0, 1.5^2) (a comb far from uniform) and token magnitudes spread over
    10^-2..10^2 (so a wrong per-token rms shows)."""
    g = torch.Generator().manual_seed(seed)
    m = hc if head else (2 + hc) * hc
    X = torch.randn(n, hc, hidden, generator=g) * torch.logspace(-2, 2, n)[:, None, None]
    fn = torch.randn(m, hc * hidden, generator=g) * (1.5 / (hc * hidden) ** 0.5)
    base = torch.randn(m, generator=g)
    scale = 0.5 + torch.rand(1 if head else 3, generator=g)
    return tuple(t.to(device) for t in (X.to(dtype), fn, base, scale))


def post_inputs(n: int, hc: int, hidden: int, dtype: torch.dtype = torch.float32, device: str = "cpu",
                seed: int = 0) -> tuple[torch.Tensor, ...]:
    """(out, X, post, comb) for hc_post, out and X ~N(0, 1); post and comb from a real hc_pre (comb doubly
    stochastic, not symmetric for hc > 2)."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, hc, hidden, generator=g)
    out = torch.randn(n, hidden, generator=g)
    _, post, comb = hc_pre_reference(X, *site(n, hc, hidden, seed=seed)[1:], **KW)
    return tuple(t.to(device) for t in (out.to(dtype), X.to(dtype), post, comb))


# ---------------------------------------------------------------------------------------------- CPU
def test_dispatchers_run_the_references_on_cpu() -> None:
    X, fn, base, scale = site(3, 4, 16, seed=1)
    for a, b in zip(hc_pre(X, fn, base, scale, **KW), hc_pre_reference(X, fn, base, scale, **KW)):
        assert torch.equal(a, b)
    out, Xp, post, comb = post_inputs(3, 4, 16, seed=2)
    assert torch.equal(hc_post(out, Xp, post, comb), hc_post_reference(out, Xp, post, comb))
    Xh, fnh, bh, sh = site(3, 4, 16, seed=3, head=True)
    assert torch.equal(hc_head(Xh, fnh, bh, sh, eps=1e-6, norm_eps=1e-6),
                       hc_head_reference(Xh, fnh, bh, sh, eps=1e-6, norm_eps=1e-6))


def test_chain_dispatchers_run_the_references_on_cpu() -> None:
    """hc_pre with the sub-block's norm and hc_post_chain off CUDA: the references, no partials."""
    X, fn, base, scale = site(3, 4, 16, seed=1)
    w = torch.rand(16) + 0.5
    x, post, comb = hc_pre(X, fn, base, scale, **KW, norm=w)
    ref = hc_pre_reference(X, fn, base, scale, **KW)
    assert torch.equal(x, rms_norm_reference(ref[0], w, 1e-6)) and torch.equal(post, ref[1])
    out, Xp, post, comb = post_inputs(3, 4, 16, seed=2)
    addend = torch.randn(3, 16)
    Y, partials = hc_post_chain(out, Xp, post, comb, addend=addend, next_fn=fn)
    assert partials is None and torch.equal(Y, hc_post_reference(out + addend, Xp, post, comb))


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_pick_config_and_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    from moebox.ops.triton.mhc import MAX_SPLIT, HcConfig, _block_h, fused_supported, hc_pre_triton, pick_config
    from moebox.ops.triton.mhc import resolve_config
    monkeypatch.delenv("MOEBOX_MHC_GEMV", raising=False)
    for hc, hidden in ((4, 4096), (2, 64), (3, 96), (4, 7168)):
        for n in (1, 2, 3, 4, 5, 16, 17, 300, 2048):
            cfg = pick_config(n, hc, hidden, sms=132)
            kb = -(-hc * hidden // cfg.block_k)
            assert 1 <= cfg.split <= min(kb, MAX_SPLIT)
            per = -(-kb // cfg.split)
            assert -(-kb // per) == cfg.split            # every split has K steps
            want = ("gemv", {1: 1, 2: 2}.get(n, 4)) if n <= 16 else ("dot", 128)
            assert (cfg.logits_kernel, cfg.block_n) == want
    for n in (1, 4, 8, 16):   # decode: all of fn requested at once by >= 128 programs (4 token tiles at N = 16)
        v4 = pick_config(n, 4, 4096, sms=132)
        assert v4.block_k == 128 and v4.split * -(-n // v4.block_n) >= 128 and v4.split == (64 if n == 16 else 128)
    prefill = pick_config(2048, 4, 4096, sms=132)   # ~4 programs an SM, fp32-level tensor-core products
    assert prefill.split * -(-2048 // prefill.block_n) >= 3 * 132 and prefill.precision == "tf32x3"
    assert resolve_config(HcConfig(split=1000), 1, 4, 4096).split == 128
    assert resolve_config(HcConfig(split=1000, logits_kernel="gemv"), 1, 4, 4096).split == 128
    with pytest.raises(ValueError):
        resolve_config(HcConfig(logits_kernel="tc"), 1, 4, 4096)
    with pytest.raises(ValueError, match="precision"):
        resolve_config(HcConfig(precision="tf32"), 1, 4, 4096)
    monkeypatch.setenv("MOEBOX_MHC_GEMV", "4")                # the A/B switch: the gemv up to 4 tokens
    assert [pick_config(n, 4, 4096).logits_kernel for n in (4, 5, 16)] == ["gemv", "dot", "dot"]
    monkeypatch.setenv("MOEBOX_MHC_GEMV", "four")
    with pytest.raises(ValueError, match="MOEBOX_MHC_GEMV"):
        pick_config(1, 4, 4096)
    monkeypatch.setenv("MOEBOX_MHC_GEMV", "0")                # the dot kernel at every N
    assert all(pick_config(n, 4, 4096).logits_kernel == "dot" for n in (1, 3, 4))
    assert pick_config(1, 4, 4096) == pick_config(16, 4, 4096)
    assert _block_h(0, 4, torch.bfloat16, 4096) == 1024 and _block_h(0, 4, torch.float32, 4096) == 512
    assert _block_h(0, 4, torch.bfloat16, 96) == 128 and _block_h(32, 4, torch.float32, 4096) == 32
    X, fn, base, scale = site(3, 4, 16)
    assert fused_supported(X) and fused_supported(X, torch.empty(3, 16))
    assert not fused_supported(X, torch.empty(3, 16, dtype=torch.float64))
    assert not fused_supported(X[0]) and not fused_supported(X.double())
    with pytest.raises(ValueError):
        hc_pre_triton(X, fn[:, :-1], base, scale, **KW)
    with pytest.raises(ValueError):
        hc_pre_triton(X, fn, base[:-1], scale, **KW)
    with pytest.raises(ValueError):
        hc_pre_triton(X, fn, base, scale, **KW, into=(torch.empty(3, 15), torch.empty(3, 4), torch.empty(3, 4, 4)))


_INTERPRETER_CHECK = textwrap.dedent("""
    import json, os, sys, torch
    assert os.environ.get("TRITON_INTERPRET") == "1"
    os.environ.pop("MOEBOX_MHC_GEMV", None)   # the default choice of logits kernel
    sys.path.insert(0, sys.argv[1])
    from moebox.ops.triton.mhc import (HcConfig, PostConfig, _config, hc_head_reference, hc_head_triton,
                                       hc_post_reference, hc_post_triton, hc_pre_reference, hc_pre_triton)
    from moebox.ops.streams import Branch
    from tests.test_triton_mhc import post_inputs, site
    nan = float("nan")
    results = []
    covered = set()   # (op, logits kernel, N), the kernel as the call picks it

    def add(case, got, ref, buf, tol):
        # rel: the largest error of a token relative to its own norm (token magnitudes differ 10^4x)
        err = (got.double() - ref.double()).flatten(1).norm(dim=1)
        norm = ref.double().flatten(1).norm(dim=1)
        results.append(dict(case=case, same_buffer=got.data_ptr() == buf.data_ptr(),
                            finite=bool(torch.isfinite(got).all()), rel=float((err / norm).max()),
                            ref_norm=float(norm.min()), tol=tol))

    # (hc, H, N, X dtype, iters, config): default decode (N 1 and 3: the gemv logits kernel, split 2 and 1) and
    # prefill tilings, then forced ones: hc 3 padded to 4 with a split that leaves a partial K step (K 288, steps
    # of 64) and 3 H blocks of 32; 2 token tiles x 4 splits (the last 1 step long); the dot at N 2 with 9 splits
    # padded to 16 in kernel B and iters 1; the gemv with a masked token row, M + 1 = M_PAD (hc 3) and 3 + 2 K
    # steps, the last partial; the gemv with 3 token tiles, the last partial
    gemv = dict(logits_kernel="gemv", num_stages=1)
    cases = [(4, 64, 1, torch.float32, 20, None), (2, 64, 3, torch.float32, 20, None),
             (4, 80, 20, torch.float32, 20, None),
             (3, 96, 5, torch.float32, 20, HcConfig(block_k=64, split=3, block_h=32)),
             (4, 80, 20, torch.float32, 20, HcConfig(block_n=16, block_k=32, split=4, block_h=64)),
             (3, 96, 2, torch.float32, 1, HcConfig(block_k=32, split=9, block_h=32)),
             (4, 256, 3, torch.float16, 20, None), (2, 64, 17, torch.float16, 20, HcConfig(16, 32, 3, block_h=16)),
             (3, 96, 3, torch.float32, 20, HcConfig(block_n=4, block_k=64, split=2, block_h=32, **gemv)),
             (2, 64, 5, torch.float16, 20, HcConfig(block_n=2, block_k=32, split=2, **gemv))]
    for i, (hc, H, n, dt, iters, cfg) in enumerate(cases):
        X, fn, base, scale = site(n, hc, H, dt, seed=i)
        if i == 2:   # tokens with a row stride: every other row of a wider batch
            X = site(2 * n, hc, H, dt, seed=i)[0][::2]
        kw = dict(iters=iters, eps=1e-6, norm_eps=1e-6)
        into = (torch.full((n, H), nan, dtype=dt), torch.full((n, hc), nan), torch.full((n, hc, hc), nan))
        # cases 1 and 4: post and comb as a launch of their own (a Branch, in place off CUDA)
        branch = Branch(X, "mhc") if i in (1, 4) else None
        got = hc_pre_triton(X, fn, base, scale, **kw, into=into, config=cfg, coeffs_branch=branch)
        ref = hc_pre_reference(X, fn, base, scale, **kw)
        kernel = _config(cfg, X).logits_kernel
        covered.add(("hc_pre", kernel, n))
        name = f"hc_pre hc={hc} H={H} N={n} {dt} iters={iters} {kernel} {cfg} apart={branch is not None}"
        for out, g, r, b, tol in zip(("x", "post", "comb"), got, ref, into,
                                     (1e-3 if dt == torch.float16 else 1e-6, 4e-6, 4e-6)):
            add(f"{name}: {out}", g, r, b, tol)
        if i in (0, 3, 6, 8):
            Xh, fnh, bh, sh = site(n, hc, H, dt, seed=10 + i, head=True)
            y = torch.full((n, H), nan, dtype=dt)
            got = hc_head_triton(Xh, fnh, bh, sh, eps=1e-6, norm_eps=1e-6, into=y, config=cfg)
            ref = hc_head_reference(Xh, fnh, bh, sh, eps=1e-6, norm_eps=1e-6)
            kernel = _config(cfg, Xh).logits_kernel
            covered.add(("hc_head", kernel, n))
            add(f"hc_head hc={hc} H={H} N={n} {dt} {kernel}", got, ref, y, 1e-3 if dt == torch.float16 else 1e-6)
    for op in ("hc_pre", "hc_head"):   # both logits kernels: the gemv at N 1 and 3, the dot at a prefill size
        assert {(op, "gemv", 1), (op, "gemv", 3)} <= covered, covered
        assert any(c[:2] == (op, "dot") and c[2] > 4 for c in covered), covered

    # hc_post: (hc, H, N, dtype, config); the fp16 reference rounds 3 times, the kernel once
    for i, (hc, H, n, dt, cfg) in enumerate([(4, 64, 3, torch.float32, None), (2, 256, 1, torch.float32, None),
                                             (3, 96, 20, torch.float16, PostConfig(block_h=32)),
                                             (4, 80, 5, torch.float16, PostConfig(num_warps=2, block_h=64))]):
        out, X, post, comb = post_inputs(n, hc, H, dt, seed=20 + i)
        y = torch.full((n, hc, H), nan, dtype=dt)
        got = hc_post_triton(out, X, post.t().contiguous().t() if i == 0 else post, comb, into=y, config=cfg)
        ref = hc_post_reference(out, X, post, comb)
        add(f"hc_post hc={hc} H={H} N={n} {dt} {cfg}", got, ref, y, 1e-3 if dt == torch.float16 else 1e-6)

    # the decode chain: hc_pre with the sub-block's norm (its partials computed first), hc_post with an addend
    # writing the next site's partials, the next hc_pre from them; H 96: 3 partial blocks, 80: a partial last
    # one; hc 3 padded; case 1 with post/comb as a launch of their own; N 17: past the chain (no partials, the
    # norm apart)
    from moebox.ops.norm import rms_norm_reference
    from moebox.ops.triton.mhc import hc_post_chain_triton
    for i, (hc, H, n, dt) in enumerate([(4, 96, 1, torch.float32), (3, 64, 3, torch.float32),
                                        (4, 80, 2, torch.float16), (2, 64, 17, torch.float32)]):
        X, fn, base, scale = site(n, hc, H, dt, seed=30 + i)
        _, fn2, base2, scale2 = site(n, hc, H, dt, seed=40 + i)
        if i == 0:   # streams that nearly cancel in x: the Gram form's mean square would be off by 3-2000%
            g = torch.Generator().manual_seed(9)
            v = torch.randn(H, generator=g) * 100
            X = torch.stack([v, -v + 1e-3 * torch.randn(H, generator=g), v, -v]).to(dt)[None]
            fn, base = fn * 0, torch.cat([torch.zeros(hc), base[hc:]])   # equal pre weights
        w = (torch.rand(H, generator=torch.Generator().manual_seed(i)) + 0.5).to(dt)
        kw = dict(iters=20, eps=1e-6, norm_eps=1e-6)
        tol = 1e-3 if dt == torch.float16 else 1e-6
        tol_x = 1e-3 if dt == torch.float16 else 1e-5   # the mean square from G: fp32 error ~1e-7 of sum |q|
        name = f"chain hc={hc} H={H} N={n} {dt}"
        into = (torch.full((n, H), nan, dtype=dt), torch.full((n, hc), nan), torch.full((n, hc, hc), nan))
        got = hc_pre_triton(X, fn, base, scale, **kw, into=into, norm=w,
                            coeffs_branch=Branch(X, "mhc") if i == 1 else None)
        ref = hc_pre_reference(X, fn, base, scale, **kw)
        ref = (rms_norm_reference(ref[0], w, 1e-6), *ref[1:])
        for out, g, r, b, t in zip(("x normed", "post", "comb"), got, ref, into, (tol_x, 4e-6, 4e-6)):
            add(f"{name}: pre {out}", g, r, b, t)
        out, addend = torch.randn(n, H).to(dt), torch.randn(n, H).to(dt)
        Y, ws = hc_post_chain_triton(out, X, got[1], got[2], addend=addend, next_fn=fn2)
        assert (ws is None) == (n > 16)
        add(f"{name}: post + addend", Y, hc_post_reference(out + addend, X, got[1], got[2]), Y, tol)
        into = (torch.full((n, H), nan, dtype=dt), torch.full((n, hc), nan), torch.full((n, hc, hc), nan))
        got = hc_pre_triton(Y, fn2, base2, scale2, **kw, into=into, norm=w, partials=ws)
        ref = hc_pre_reference(Y, fn2, base2, scale2, **kw)
        ref = (rms_norm_reference(ref[0], w, 1e-6), *ref[1:])
        for out, g, r, b, t in zip(("x normed", "post", "comb"), got, ref, into, (tol_x, 4e-6, 4e-6)):
            add(f"{name}: pre from partials {out}", g, r, b, t)
    print("RESULT " + json.dumps(results))
""")


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_chain_kernels_build_for_sm90() -> None:
    """The decode chain's kernels as the V4 decode step launches them (kernel B with the Gram partials and the
    norm, x programs and the coefficients' program; hc_post with the shared expert's add and the partials; the
    partials alone) compile for sm_90 on any machine: the interpreter does not type-check what the GPU build
    does (the cancellation fallback's branch, the 3-D fn tile)."""
    from moebox.ops.triton import mhc as kernels
    from moebox.ops.triton.runtime import build_sm90
    dims = dict(HC=4, HC_PAD=4, M=24)
    fp32 = ("ws_ptr", "base_ptr", "scale_ptr", "post_ptr", "comb_ptr", "fn_ptr")
    for fn, const in [(kernels._mix_kernel, dict(M_PAD=64, S_PAD=128, BLOCK_H=1024, COEFFS=coeffs, GRAM=True,
                                                 NORM=not coeffs, PDL=True)) for coeffs in (False, True)] + [
            (kernels._post_kernel, dict(M_PAD=32, W_PAD=64, BLOCK_H=32, POST=post, ADD=post, PARTIALS=True,
                                        EARLY=early, PDL=True)) for post in (True, False) for early in (True, False)]:
        sig = {a: "*fp32" if a in fp32 else "*bf16" if a.endswith("_ptr") else "fp32" if "eps" in a else "i32"
               for a in fn.arg_names if a not in {**dims, **const}}
        compiled = build_sm90(fn, sig, {**dims, **const}, [a for a in sig if a.endswith("_ptr")], num_warps=4)
        assert "griddepcontrol.wait" in compiled.asm["ptx"], fn


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install triton; Linux only)")
def test_kernels_in_triton_interpreter() -> None:
    """Tiny shapes through the real kernels in Triton's CPU interpreter, vs the references."""
    check_in_interpreter(_INTERPRETER_CHECK)


# ---------------------------------------------------------------------------------------------- GPU
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SHAPES = [("v4", 4, 4096), ("hc2_H64", 2, 64), ("hc4_H256", 4, 256), ("hc3_H96", 3, 96)]
DTYPES = [torch.float32, torch.bfloat16]


def _assert_x_close(x: torch.Tensor, ref: torch.Tensor, X: torch.Tensor) -> None:
    """x = sum_j pre_j X[j] in X's dtype: elementwise within one ulp of X's dtype of the reference (both round
    fp32 sums that differ by fp32 rounding, so the cast may pick neighbours) plus that fp32 rounding, bounded by
    2^-18 sum_j |X[j]| (pre_j < 1.01; cancelling sums)."""
    assert x.dtype == ref.dtype and torch.isfinite(x).all()
    ulp = 2.0 ** -7 if x.dtype == torch.bfloat16 else 2.0 ** -20
    d = (x.double() - ref.double()).abs()
    bound = ulp * ref.double().abs() + 2.0 ** -18 * X.double().abs().sum(dim=1)
    assert bool((d <= bound).all()), float((d / bound).max())
    assert rel_err(x, ref) < (4e-3 if x.dtype == torch.bfloat16 else 1e-5)


def _check_pre(n: int, hc: int, hidden: int, dtype: torch.dtype, config=None, X: torch.Tensor | None = None,
               seed: int = 0) -> None:
    from moebox.ops.triton.mhc import hc_pre_triton
    X0, fn, base, scale = site(n, hc, hidden, dtype, "cuda", seed)
    X = X0 if X is None else X
    with matmul_tf32(False):
        ref = hc_pre_reference(X, fn, base, scale, **KW)
    first = None
    for _ in range(2):  # the second run into re-poisoned buffers: nothing stale, and bit-identical (deterministic)
        into = (torch.full((n, hidden), float("nan"), device="cuda", dtype=dtype),
                torch.full((n, hc), float("nan"), device="cuda"), torch.full((n, hc, hc), float("nan"), device="cuda"))
        poison_allocator()
        got = hc_pre_triton(X, fn, base, scale, **KW, into=into, config=config)
        torch.cuda.synchronize()
        assert all(g.data_ptr() == b.data_ptr() for g, b in zip(got, into))
        x, post, comb = got
        _assert_x_close(x, ref[0], X)
        assert torch.isfinite(post).all() and torch.isfinite(comb).all()
        assert float((post - ref[1]).abs().max()) < 2e-5, float((post - ref[1]).abs().max())
        assert float((comb - ref[2]).abs().max()) < 2e-5, float((comb - ref[2]).abs().max())
        if first is not None:
            assert all(torch.equal(a, b) for a, b in zip(first, got))
        first = tuple(t.clone() for t in got)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("n", [1, 3, 16, 300])
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.gpu
@needs_cuda
def test_gpu_hc_pre(shape: tuple, n: int, dtype: torch.dtype) -> None:
    _, hc, hidden = shape
    _check_pre(n, hc, hidden, dtype, seed=n)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("n", [1, 3, 16, 300])
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.gpu
@needs_cuda
def test_gpu_hc_post(shape: tuple, n: int, dtype: torch.dtype) -> None:
    """vs the reference, and elementwise within half an ulp of the exact value with the coefficients rounded
    to X's dtype (the kernel rounds once)."""
    from moebox.ops.triton.mhc import hc_post_triton
    _, hc, hidden = shape
    out, X, post, comb = post_inputs(n, hc, hidden, dtype, "cuda", seed=n)
    y = torch.full((n, hc, hidden), float("nan"), device="cuda", dtype=dtype)
    got = hc_post_triton(out, X, post, comb, into=y)
    torch.cuda.synchronize()
    assert got.data_ptr() == y.data_ptr() and torch.isfinite(got).all()
    p, c = post.to(dtype).double(), comb.to(dtype).double()
    exact = p[:, :, None] * out.double()[:, None, :] + torch.einsum("njk,njh->nkh", c, X.double())
    mag = p.abs()[:, :, None] * out.double().abs()[:, None, :] + torch.einsum("njk,njh->nkh", c.abs(), X.double().abs())
    half_ulp = 2.0 ** -24 if dtype == torch.float32 else 2.0 ** -8   # of the one final rounding, relative
    bound = half_ulp * exact.abs() + 2.0 ** -21 * mag + torch.finfo(dtype).tiny   # (+ fp16 subnormals)
    assert bool(((got.double() - exact).abs() <= bound).all()), float(((got.double() - exact).abs() / bound).max())
    with matmul_tf32(False):
        assert rel_err(got, hc_post_reference(out, X, post, comb)) < (1e-6 if dtype == torch.float32 else 1e-2)
    if hc > 2:  # (a 2 x 2 doubly stochastic matrix is symmetric)
        wrong = p[:, :, None] * out.double()[:, None, :] + torch.einsum("nkj,njh->nkh", c, X.double())
        assert rel_err(got, wrong) > 1e-2  # the orientation of comb shows at these inputs


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("n", [1, 3, 16, 300])
@pytest.mark.parametrize("shape", SHAPES[:2], ids=[s[0] for s in SHAPES[:2]])
@pytest.mark.gpu
@needs_cuda
def test_gpu_hc_head(shape: tuple, n: int, dtype: torch.dtype) -> None:
    from moebox.ops.triton.mhc import hc_head_triton
    _, hc, hidden = shape
    X, fn, base, scale = site(n, hc, hidden, dtype, "cuda", seed=n, head=True)
    with matmul_tf32(False):
        ref = hc_head_reference(X, fn, base, scale, eps=1e-6, norm_eps=1e-6)
    y = torch.full((n, hidden), float("nan"), device="cuda", dtype=dtype)
    poison_allocator()
    got = hc_head_triton(X, fn, base, scale, eps=1e-6, norm_eps=1e-6, into=y)
    torch.cuda.synchronize()
    assert got.data_ptr() == y.data_ptr()
    _assert_x_close(got, ref, X)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("n", [1, 3, 16, 17])
@pytest.mark.gpu
@needs_cuda
def test_gpu_decode_chain(n: int, dtype: torch.dtype) -> None:
    """Two mHC sites of the V4 shape as a decode step runs them: hc_pre with the norm (post/comb on a side
    stream), hc_post_chain with the shared expert's addend writing the next site's partials, hc_pre from
    them; outputs poisoned. N = 17 is past the chain: no partials, the norm apart, same results."""
    from moebox.ops.streams import Branch
    from moebox.ops.triton.mhc import hc_post_chain_triton, hc_pre_triton
    hc, hidden = 4, 4096
    X, fn, base, scale = site(n, hc, hidden, dtype, "cuda", seed=n)
    _, fn2, base2, scale2 = site(n, hc, hidden, dtype, "cuda", seed=n + 1)
    w = (torch.rand(hidden, device="cuda") + 0.5).to(dtype)
    out, addend = (torch.randn(n, hidden, device="cuda").to(dtype) for _ in range(2))

    def pre(X: torch.Tensor, fn, base, scale, partials) -> tuple[torch.Tensor, ...]:
        poison_allocator()
        branch = Branch(X, "mhc", purpose="mhc")
        got = hc_pre_triton(X, fn, base, scale, **KW, norm=w, partials=partials, coeffs_branch=branch)
        branch.join()
        torch.cuda.synchronize()
        with matmul_tf32(False):
            ref = hc_pre_reference(X, fn, base, scale, **KW)
        ref_x = rms_norm_reference(ref[0], w, 1e-6)
        assert torch.isfinite(got[0]).all() and rel_err(got[0], ref_x) < (4e-3 if dtype == torch.bfloat16 else 1e-5)
        assert float((got[1] - ref[1]).abs().max()) < 2e-5 and float((got[2] - ref[2]).abs().max()) < 2e-5
        return got

    _, post, comb = pre(X, fn, base, scale, None)
    Y, partials = hc_post_chain_triton(out, X, post, comb, addend=addend, next_fn=fn2)
    torch.cuda.synchronize()
    assert (partials is None) == (n > 16)
    with matmul_tf32(False):
        assert rel_err(Y, hc_post_reference(out + addend, X, post, comb)) < (1e-2 if dtype == torch.bfloat16 else 1e-6)
    pre(Y, fn2, base2, scale2, partials)


@pytest.mark.gpu
@needs_cuda
def test_gpu_prefill_forced_tilings_and_strides() -> None:
    from moebox.ops.triton.mhc import HcConfig
    _check_pre(2048, 4, 4096, torch.bfloat16)
    for cfg in (HcConfig(split=1), HcConfig(block_k=64, split=256), HcConfig(block_n=64, block_k=64, split=7),
                HcConfig(block_n=128, block_k=32, split=9, num_stages=4, precision="tf32x3"),
                HcConfig(block_n=16, block_k=256, num_warps=8, mix_warps=8),
                HcConfig(block_k=32, split=100, mix_warps=2, block_h=128),
                HcConfig(block_n=4, logits_kernel="gemv"),
                HcConfig(block_n=2, block_k=256, split=7, num_warps=8, logits_kernel="gemv")):
        for n in (1, 17, 300):
            _check_pre(n, 4, 4096, torch.bfloat16, config=cfg)
        _check_pre(5, 3, 96, torch.float32, config=cfg)
    wide = site(32, 4, 4096, torch.bfloat16, "cuda", seed=5)[0]
    _check_pre(16, 4, 4096, torch.bfloat16, X=wide[::2])                       # token stride 2 * hc * H
    _check_pre(16, 4, 4096, torch.bfloat16, X=wide[:16].transpose(0, 1).contiguous().transpose(0, 1))


@pytest.mark.gpu
@needs_cuda
def test_gpu_dispatch_takes_the_fused_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from moebox.ops.triton import mhc as fused
    calls = []
    for name in ("hc_pre_triton", "hc_post_chain_triton", "hc_head_triton"):
        real = getattr(fused, name)
        monkeypatch.setattr(fused, name, lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k))
    X, fn, base, scale = site(3, 4, 256, torch.bfloat16, "cuda")
    x, post, comb = mhc.hc_pre(X, fn, base, scale, **KW)
    mhc.hc_post(x, X, post, comb)
    mhc.hc_head(X, fn[:4], base[:4], scale[:1], eps=1e-6, norm_eps=1e-6)
    assert calls == ["hc_pre_triton", "hc_post_chain_triton", "hc_head_triton"]
    mhc.hc_post(x.float(), X, post, comb)  # out of another dtype: the reference
    assert len(calls) == 3


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("coeffs_apart", [False, True])
def test_gpu_cuda_graph_replay(coeffs_apart: bool) -> None:
    """A block's mHC calls (pre, post, pre, post) and the head captured in one CUDA graph; replays follow new
    streams written into the static input, with all outputs poisoned before each replay. coeffs_apart: each
    hc_pre's post and comb on a side stream (as the decode step runs them), joined before its hc_post, with
    work on the main stream in between (the sub-block)."""
    from moebox.ops.streams import Branch
    from moebox.ops.triton.mhc import hc_head_triton, hc_post_triton, hc_pre_triton
    n, hc, hidden = 4, 4, 4096
    X, fn1, b1, s1 = site(n, hc, hidden, torch.bfloat16, "cuda", seed=1)
    _, fn2, b2, s2 = site(n, hc, hidden, torch.bfloat16, "cuda", seed=2)
    _, fnh, bh, sh = site(n, hc, hidden, torch.bfloat16, "cuda", seed=3, head=True)

    def pre_post(X: torch.Tensor, fn, b, s, sub_block):
        branch = Branch(X, "mhc", purpose="mhc") if coeffs_apart else None
        assert branch is None or branch.on
        x, p, c = hc_pre_triton(X, fn, b, s, **KW, coeffs_branch=branch)
        out = sub_block(x)
        if branch is not None:
            branch.join()
        return x, hc_post_triton(out, X, p, c)

    def step(X: torch.Tensor):
        x1, X1 = pre_post(X, fn1, b1, s1, torch.tanh)
        _, X2 = pre_post(X1, fn2, b2, s2, lambda x: x * 0.5)
        return x1, X1, X2, hc_head_triton(X2, fnh, bh, sh, eps=1e-6, norm_eps=1e-6)

    def ref_step(X: torch.Tensor):
        x1, p1, c1 = hc_pre_reference(X, fn1, b1, s1, **KW)
        X1 = hc_post_reference(torch.tanh(x1), X, p1, c1)
        x2, p2, c2 = hc_pre_reference(X1, fn2, b2, s2, **KW)
        X2 = hc_post_reference(x2 * 0.5, X1, p2, c2)
        return x1, X1, X2, hc_head_reference(X2, fnh, bh, sh, eps=1e-6, norm_eps=1e-6)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step(X)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step(X)
    for seed in (7, 8):
        X.copy_(site(n, hc, hidden, torch.bfloat16, "cuda", seed=seed)[0])
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        with matmul_tf32(False):
            refs = ref_step(X)
        for o, r in zip(outs, refs):
            assert torch.isfinite(o).all() and rel_err(o, r) < 1e-2, rel_err(o, r)
        assert rel_err(outs[0], refs[0]) < 4e-3  # x1 depends on X alone: within bf16 rounding
