"""An FFN site's sub-block input and its routing in one launch at decode: mHC kernel B's x programs, the router's
product, the routing and the experts' packed x, which were three launches on a step's main stream.

Why: at a decode FFN site of the mHC chain (moebox/ops/triton/mhc.py) the main stream ran hc_post, then kernel
B's x programs (pre from the chain partials, x = sum_j pre_j X[j], RMS-normed), then the fused router (product,
last-arriver routing), then the routed experts' gate-up after `_pack_x_kernel`'s join. Each dependent launch
costs ~1.7 us however little it does (thirty-third session), and on the H200 at batch 1 a step without kernel
B's x launch at the 43 FFN sites and without the router ran 0.17 ms faster (thirty-fourth session's drop probe).

`_mix_router_kernel`, grid (E / ROWS, N): program (r, n) is the fused router's program for experts r*ROWS.. of
token n (`_router_route_kernel` in route.py), except that it computes x itself where that kernel loads it:
  - before its PDL wait (weights): its gate rows, the pre logits' base and scale, the norm weight, the bias;
  - after it, one burst of loads: token n's streams X [hc, H] (from L2; 32 KB for V4-Flash in bf16) and the
    chain partials' pre logits and Gram diagonal (hc + hc floats of each of the SPLIT rows);
  - pre = sigmoid(sum of the partial logits * rs * scale + base) + eps with rs = rsqrt(trace(G) / (hc H) + eps),
    as kernel B; x = sum_j pre_j X[j] rounded to X's dtype, then rms_norm(x) * weight rounded again (kernel B
    takes the mean square from G's quadratic form because its programs hold a slice of the row; a program here
    holds the whole row, so it sums the squares as rms_norm does);
  - its ROWS logits of x (fp32 products, as the router), the token's last program routing (`_route_row`);
  - its 1 / (E / ROWS) slice of x (for the shared expert) and of x packed as the w2 mma kernels read it
    (`_pack_x_kernel`'s pair layout and terms), so no packing launch or join comes before gate-up.
Every program of a token reads the whole X row and the partials (E / ROWS = 128 programs: ~5 MB of L2 reads a
token), so the launch is meant for a few tokens; the rest takes the three launches.

`_mix_router_cols_kernel` (`MixRouteConfig.columns` > 0), grid (H / columns, N): the other way to cut the work.
Program (p, n) is kernel B's x program for columns p*columns.. (its mean square from the partials' Gram matrix,
pre^T G pre / H, or the row's squares where that cancels: `_row_mean_square`), and computes every expert's logit
over its columns (the gate's columns loaded before the wait) into part[n, p]; the token's last program sums the
parts and routes. X and the partials are ~11 KB a program instead of 36, for 32-128 programs a token instead of
128, at the cost of a larger last step (the parts: 64 KB at 64 columns a program).

Off by default (`MIX_ROUTE_TOKENS` 0; MOEBOX_MIX_ROUTE=N takes it up to N tokens): on the H200 (thirty-fourth
session, docs/benchmarks.md) the decode step at batch 1 went 4.81 -> 5.02 ms and at batch 2 6.15 -> 6.38 with
it, ~5 us a FFN site slower where the drop probe said up to 4 us could go, and not understood yet. `bench`
(`python -m moebox.ops.triton.mix_route`) times a decode FFN site's main-stream chain both ways (hc_post, then
kernel B's x and the router; or hc_post, then this launch) in CUDA-graph replay, with the variants
`MixRouteConfig` sets (rows or columns; warps; X and the partials as volatile loads, which the sm_90 build makes
LDG.E.128.STRONG.SYS, or plain ones), to find where the launch loses before it is tried in the step again.

`mix_route_reference` is the torch composition it replaces (hc_pre's x, rms_norm, the router and routing,
the packing); the tests check the kernel against it in Triton's interpreter and on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from moebox.ops.triton.route import _counter, _routable, _routing_constants
from moebox.ops.triton.runtime import (HAVE_TRITON, early_loads, env_count, next_pow2, pdl_args,  # noqa: F401
                                       pdl_start, tl, triton)

MIX_ROUTE_TOKENS = 0      # up to this many tokens a decode FFN site takes the one launch (MOEBOX_MIX_ROUTE=N)
ROWS = 2                  # experts a program computes, as the fused router's ROUTER_ROWS


@dataclass(frozen=True)
class MixRouteConfig:
    """The launch's variants: warps a program; whether X and the partials are volatile loads (one burst in
    order, as kernel B's) or plain ones (which ptxas may reorder and cache); and the grid: the row kernel (a
    program = 2 experts over the whole row, as the fused router) or the column kernel (a program = every expert's
    partial logit over `columns` columns, the token's last program summing them); whether the gate is loaded
    before the wait (its programs then load 2 MB of gate during hc_post, which the router did during kernel B)."""

    num_warps: int = 8
    volatile: bool = True
    columns: int = 0          # 0: the row kernel; else the column kernel with this many columns a program
    early: bool = True        # the gate's loads before the PDL wait (where `early_loads` allows), else after

if HAVE_TRITON:
    from moebox.ops.triton.mhc import _normed_mix, _trace
    from moebox.ops.triton.route import _bias, _route_if_last, _route_row
    from moebox.ops.triton.w2_moe import _store_packed

    @triton.jit
    def _after_wait(ptrs, mask, VOLATILE: tl.constexpr):
        """A load of what the kernel before wrote: volatile (kept in order with the others, one burst) or plain."""
        if VOLATILE:
            return tl.load(ptrs, mask=mask, other=0.0, volatile=True)
        return tl.load(ptrs, mask=mask, other=0.0)

    @triton.jit
    def _site_weights(base_ptr, scale_ptr, norm_ptr, offs_j, mj, cols, mh):
        """The site's weights a program reads before its PDL wait, fp32: pre's base [HC_PAD] and scale, and the
        norm weight's columns `cols`."""
        return (tl.load(base_ptr + offs_j, mask=mj, other=0.0).to(tl.float32), tl.load(scale_ptr).to(tl.float32),
                tl.load(norm_ptr + cols, mask=mh, other=0.0).to(tl.float32))

    @triton.jit
    def _pre(lin_w, sumsq, s_pre, b_pre, K, eps, norm_eps):
        """pre [HC_PAD] from the partials' pre logits lin_w [S_PAD, HC_PAD] and the streams' sum of squares over
        their K values, as kernel B: sigmoid(sum of the logits * rsqrt(sumsq / K + eps) * scale + base) + eps."""
        rs = 1.0 / tl.sqrt(sumsq / K + norm_eps)
        return tl.sigmoid(tl.sum(lin_w, axis=0) * rs * s_pre + b_pre) + eps

    @triton.jit
    def _store_x(x_row, xp_row, cols, x, mask, H, TERMS: tl.constexpr):
        """x's columns `cols` (where mask) into its row, and (TERMS > 0) into its packed row as `_pack_x_kernel`
        lays it out."""
        tl.store(x_row + cols, x, mask=mask)
        if TERMS:
            _store_packed(xp_row, cols, x.to(tl.float32), TERMS, H, mask)

    @triton.jit
    def _mix_router_cols_kernel(X_ptr, ws_ptr, base_ptr, scale_ptr, norm_ptr, g_ptr, bias_ptr, x_ptr, xp_ptr,
                                part_ptr, logits_ptr, count_ptr, ids_ptr, w_ptr, E, H, SPLIT, eps, norm_eps,
                                scaling, stride_Xn, stride_xn, stride_ge,
                                HC: tl.constexpr, HC_PAD: tl.constexpr, M: tl.constexpr, W_PAD: tl.constexpr,
                                S_PAD: tl.constexpr, BLOCK_C: tl.constexpr, P_PAD: tl.constexpr, K: tl.constexpr,
                                K_PAD: tl.constexpr, BLOCK_E: tl.constexpr, SCORING: tl.constexpr,
                                HAS_BIAS: tl.constexpr, NORM: tl.constexpr, TERMS: tl.constexpr,
                                VOLATILE: tl.constexpr, EARLY: tl.constexpr, PDL: tl.constexpr):
        """Program (p, n): token n's x over columns p*BLOCK_C.. (kernel B's x program: its mean square from the
        partials' Gram matrix, pre^T G pre / H, or the row's squares where that cancels) and every expert's
        logit over those columns into part[n, p]; the token's last program sums the parts and routes."""
        p = tl.program_id(0)
        n = tl.program_id(1).to(tl.int64)
        P = tl.num_programs(0)
        cols = p * BLOCK_C + tl.arange(0, BLOCK_C)
        mh = cols < H
        offs_e = tl.arange(0, BLOCK_E)
        me = offs_e < E
        offs_j = tl.arange(0, HC_PAD)
        mj = offs_j < HC
        offs_s = tl.arange(0, S_PAD)
        ms = offs_s < SPLIT
        g_cols = g_ptr + offs_e.to(tl.int64)[:, None] * stride_ge + cols[None, :]
        mg = me[:, None] & mh[None, :]
        bias = _bias(bias_ptr, E, BLOCK_E, HAS_BIAS)
        b_pre, s_pre, wn = _site_weights(base_ptr, scale_ptr, norm_ptr, offs_j, mj, cols, mh)
        if EARLY:
            g = tl.load(g_cols, mask=mg, other=0.0)
        pdl_start(PDL)
        if EARLY == 0:
            g = tl.load(g_cols, mask=mg, other=0.0)
        X_n = X_ptr + n * stride_Xn
        Xt = _after_wait(X_n + offs_j[:, None] * H + cols[None, :], mj[:, None] & mh[None, :], VOLATILE)
        ws_n = ws_ptr + (n * SPLIT + offs_s) * W_PAD
        lin_w = _after_wait(ws_n[:, None] + offs_j[None, :], ms[:, None] & mj[None, :], VOLATILE)
        jk = offs_j[:, None] * HC + offs_j[None, :]
        valid = mj[:, None] & mj[None, :]
        g_w = _after_wait(ws_n[:, None, None] + M + jk[None, :, :], ms[:, None, None] & valid[None, :, :], VOLATILE)
        G = tl.sum(g_w, axis=0)
        pre = _pre(lin_w, _trace(G, offs_j), s_pre, b_pre, HC * H, eps, norm_eps)
        x = _normed_mix(Xt, pre, G, wn, X_n, offs_j, mj, H, norm_eps, BLOCK_C).to(x_ptr.dtype.element_ty)
        _store_x(x_ptr + n * stride_xn, xp_ptr + n * (TERMS * H), cols, x, mh, H, TERMS)
        part = tl.sum(g.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        tl.store(part_ptr + (n * P + p) * E + offs_e, part, mask=me)
        tl.debug_barrier()
        done = tl.atomic_add(count_ptr + n, 1, sem="acq_rel", scope="gpu")
        tl.debug_barrier()
        if done % P == P - 1:   # the parts from L2 (the others' stores are not in this SM's L1)
            pp = tl.arange(0, P_PAD)
            parts = tl.load(part_ptr + (n * P + pp)[:, None] * E + offs_e[None, :],
                            mask=(pp < P)[:, None] & me[None, :], other=0.0, cache_modifier=".cg")
            tl.store(logits_ptr + n * E + offs_e, tl.sum(parts, axis=0), mask=me)
            tl.debug_barrier()
            _route_row(logits_ptr + n * E, bias, ids_ptr, w_ptr, n, E, scaling, K, K_PAD, BLOCK_E, SCORING, NORM,
                       ".cg")

    @triton.jit
    def _mix_router_kernel(X_ptr, ws_ptr, base_ptr, scale_ptr, norm_ptr, g_ptr, bias_ptr, x_ptr, xp_ptr,
                           logits_ptr, count_ptr, ids_ptr, w_ptr, E, H, SPLIT, SLICE, eps, norm_eps, scaling,
                           stride_Xn, stride_xn, stride_ge,
                           HC: tl.constexpr, HC_PAD: tl.constexpr, M: tl.constexpr, W_PAD: tl.constexpr,
                           S_PAD: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr, K: tl.constexpr,
                           K_PAD: tl.constexpr, BLOCK_E: tl.constexpr, SCORING: tl.constexpr, HAS_BIAS: tl.constexpr,
                           NORM: tl.constexpr, TERMS: tl.constexpr, VOLATILE: tl.constexpr, EARLY: tl.constexpr,
                           PDL: tl.constexpr):
        r = tl.program_id(0)
        n = tl.program_id(1).to(tl.int64)
        rows = r * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_H)
        mh = cols < H
        offs_j = tl.arange(0, HC_PAD)
        mj = offs_j < HC
        offs_s = tl.arange(0, S_PAD)
        ms = offs_s < SPLIT
        g_rows = g_ptr + rows.to(tl.int64)[:, None] * stride_ge + cols[None, :]
        bias = _bias(bias_ptr, E, BLOCK_E, HAS_BIAS)
        b_pre, s_pre, wn = _site_weights(base_ptr, scale_ptr, norm_ptr, offs_j, mj, cols, mh)
        if EARLY:
            g = tl.load(g_rows, mask=mh[None, :], other=0.0)
        pdl_start(PDL)
        if EARLY == 0:
            g = tl.load(g_rows, mask=mh[None, :], other=0.0)
        # VOLATILE: one burst, in order (as kernel B's loads after its wait)
        X_n = X_ptr + n * stride_Xn
        Xt = _after_wait(X_n + offs_j[:, None] * H + cols[None, :], mj[:, None] & mh[None, :], VOLATILE)
        ws_n = ws_ptr + (n * SPLIT + offs_s) * W_PAD
        m2 = ms[:, None] & mj[None, :]
        lin_w = _after_wait(ws_n[:, None] + offs_j[None, :], m2, VOLATILE)
        diag_w = _after_wait(ws_n[:, None] + M + offs_j[None, :] * (HC + 1), m2, VOLATILE)
        pre = _pre(lin_w, tl.sum(tl.sum(diag_w, axis=1), axis=0), s_pre, b_pre, HC * H, eps, norm_eps)
        x = tl.sum(pre[:, None] * Xt.to(tl.float32), axis=0).to(X_ptr.dtype.element_ty).to(tl.float32)
        x = x * (1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + norm_eps)) * wn
        x = x.to(x_ptr.dtype.element_ty)
        _store_x(x_ptr + n * stride_xn, xp_ptr + n * (TERMS * H), cols, x, mh & (cols >= r * SLICE) &
                 (cols < (r + 1) * SLICE), H, TERMS)
        tl.store(logits_ptr + n * E + rows, tl.sum(g.to(tl.float32) * x.to(tl.float32)[None, :], axis=1))
        _route_if_last(logits_ptr + n * E, count_ptr + n, E // ROWS, bias, ids_ptr, w_ptr, n, E, scaling, K, K_PAD,
                       BLOCK_E, SCORING, NORM)


@dataclass(frozen=True)
class Router:
    """A scored MoE layer's router as the one launch takes it: gate [E, H] weight, selection bias [E] or None,
    and the routing's settings (`moebox.ops.moe.route`'s keywords)."""

    gate: torch.Tensor
    bias: torch.Tensor | None
    top_k: int
    scoring_func: str
    norm_topk_prob: bool
    scaling: float

    def routing(self) -> dict:
        return dict(top_k=self.top_k, scoring_func=self.scoring_func, norm_topk_prob=self.norm_topk_prob,
                    scaling=self.scaling)


def mix_route_supported(X: torch.Tensor, router: Router) -> bool:
    """Whether the one launch takes streams X [N, hc, H] (contiguous rows of a float dtype) and this router (a
    float gate [E, H] with unit column stride, E a multiple of ROWS, H up to 4096: one program's row)."""
    gate = router.gate
    return (HAVE_TRITON and X.dim() == 3 and X.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and X.stride(2) == 1 and X.stride(1) == X.shape[2] and gate.dim() == 2 and gate.shape[1] == X.shape[2]
            and gate.dtype in (torch.float32, torch.bfloat16, torch.float16) and gate.stride(1) == 1
            and gate.shape[0] % ROWS == 0 and X.shape[2] <= 4096 and X.shape[2] % 16 == 0
            and _routable(gate.shape[0], router.scoring_func, router.top_k))


def mix_route_triton(X: torch.Tensor, partials: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                     norm: torch.Tensor, router: Router, *, eps: float, norm_eps: float, pack: bool,
                     into: torch.Tensor | None = None, config: MixRouteConfig = MixRouteConfig()
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(x [N, H] in X's dtype, expert ids [N, k] int64, weights [N, k] fp32, x packed for the w2 mma kernels or
    None): `mix_route_reference` in one launch. X [N, hc, H]; partials: the chain's [N, splits, width] from the
    hc_post before (`hc_post_chain_triton` with this site's fn); base, scale: the site's; norm: the FFN's RMSNorm
    weight [H]; pack: also write x in the mma kernels' layout (`w2_moe._empty_packed`); into: x's buffer
    ([N, H] contiguous, X's dtype) or None; config: the variant."""
    from moebox.ops.triton.mhc import _check_partials
    from moebox.ops.triton.w2_moe import _TERMS, _empty_packed
    if not mix_route_supported(X, router):
        raise ValueError(f"mix_route_triton takes streams [N, hc, H <= 4096] with contiguous rows and a float gate "
                         f"[E, H], E a multiple of {ROWS}; got X {tuple(X.shape)} {X.dtype}, gate "
                         f"{tuple(router.gate.shape)} {router.gate.dtype}")
    n, hc, hidden = X.shape
    m = (2 + hc) * hc
    ws = _check_partials(partials, n, m, hc)
    e = router.gate.shape[0]
    x = torch.empty((n, hidden), dtype=X.dtype, device=X.device) if into is None else into
    if x.shape != (n, hidden) or x.dtype != X.dtype or x.stride(1) != 1:
        raise ValueError(f"into must be [{n}, {hidden}] {X.dtype} with contiguous rows, got {tuple(x.shape)} {x.dtype}")
    ids = torch.empty((n, router.top_k), dtype=torch.int64, device=X.device)
    w = torch.empty((n, router.top_k), dtype=torch.float32, device=X.device)
    xp = _empty_packed(x) if pack else None
    if n == 0:
        return x, ids, w, xp
    logits = torch.empty((n, e), dtype=torch.float32, device=X.device)
    common = dict(HC=hc, HC_PAD=next_pow2(hc), M=m, W_PAD=ws.shape[2], S_PAD=next_pow2(ws.shape[1]),
                  **_routing_constants(e, router.bias, router.top_k, router.scoring_func, router.norm_topk_prob),
                  TERMS=_TERMS[X.dtype] if pack else 0, VOLATILE=config.volatile,
                  EARLY=config.early and early_loads(n), num_warps=config.num_warps)
    bias = x if router.bias is None else router.bias
    packed = x if xp is None else xp.view(torch.int16)
    if config.columns:
        programs = -(-hidden // config.columns)
        parts = torch.empty((n, programs, e), dtype=torch.float32, device=X.device)
        _mix_router_cols_kernel[(programs, n)](
            X, ws, base.reshape(-1), scale.reshape(-1), norm, router.gate, bias, x, packed, parts, logits,
            _counter(X.device, programs, n), ids, w, e, hidden, ws.shape[1], float(eps), float(norm_eps),
            float(router.scaling), X.stride(0), x.stride(0), router.gate.stride(0), BLOCK_C=config.columns,
            P_PAD=next_pow2(programs), **common, **pdl_args(X, _mix_router_cols_kernel))
        return x, ids, w, xp
    programs = e // ROWS
    _mix_router_kernel[(programs, n)](
        X, ws, base.reshape(-1), scale.reshape(-1), norm, router.gate, bias, x, packed, logits,
        _counter(X.device, programs, n), ids, w, e, hidden, ws.shape[1], -(-hidden // programs), float(eps),
        float(norm_eps), float(router.scaling), X.stride(0), x.stride(0), router.gate.stride(0),
        BLOCK_H=next_pow2(hidden), ROWS=ROWS, **common, **pdl_args(X, _mix_router_kernel))
    return x, ids, w, xp


@dataclass
class RouteAhead:
    """An FFN site's request that its hc_pre route too (`hc_pre_triton(..., router=)`): the MoE layer's router,
    whether to pack x for the w2 mma kernels, and, once the one launch ran, what it wrote (else they stay None
    and the layer routes and packs by itself)."""

    router: Router
    pack: bool
    config: MixRouteConfig = MixRouteConfig()
    ids: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    packed: torch.Tensor | None = None

    def fill(self, X: torch.Tensor, partials: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
             norm: torch.Tensor, x: torch.Tensor, *, eps: float, norm_eps: float) -> bool:
        """Run the one launch into x if it takes these streams: True if it ran (x, the routing and the packed x
        written)."""
        if not (X.shape[0] > 0 and mix_route_supported(X, self.router)):
            return False
        _, self.ids, self.weights, self.packed = mix_route_triton(X, partials, base, scale, norm, self.router,
                                                                  eps=eps, norm_eps=norm_eps, pack=self.pack,
                                                                  into=x, config=self.config)
        return True


def mix_route_tokens() -> int:
    """The most tokens a decode FFN site takes the one launch at: MIX_ROUTE_TOKENS, or MOEBOX_MIX_ROUTE (0: never)."""
    return env_count("MOEBOX_MIX_ROUTE", MIX_ROUTE_TOKENS, "a token count (0: never)")


def mix_route_reference(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                        norm: torch.Tensor, router: Router, *, iters: int, eps: float, norm_eps: float
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch path it replaces: (rms_norm(hc_pre's x, norm), then `moebox.ops.moe.route` of it: ids, weights)."""
    from moebox.ops.mhc import hc_pre_reference
    from moebox.ops.moe import route
    from moebox.ops.norm import rms_norm
    x = rms_norm(hc_pre_reference(X, fn, base, scale, iters=iters, eps=eps, norm_eps=norm_eps)[0], norm, norm_eps)
    ids, w = route(x, router.gate, bias=router.bias, tid2eid=None, tokens=None, **router.routing())
    return x, ids, w


# ----------------------------------------------------------------------------------------------- bench
BENCH_CONFIGS = (MixRouteConfig(), MixRouteConfig(volatile=False), MixRouteConfig(4), MixRouteConfig(16),
                 MixRouteConfig(16, False), MixRouteConfig(8, True, 64), MixRouteConfig(8, False, 64),
                 MixRouteConfig(4, True, 64), MixRouteConfig(8, True, 128), MixRouteConfig(16, True, 128),
                 MixRouteConfig(8, True, 32), MixRouteConfig(early=False), MixRouteConfig(8, True, 64, early=False))


def bench(device: str | torch.device = "cuda", tokens: Sequence[int] = (1, 2),
          configs: Sequence[MixRouteConfig] = BENCH_CONFIGS, copies: int = 48, hidden: int = 4096,
          experts: int = 256, timer: Callable[[list], float] | None = None) -> list[dict]:
    """A decode FFN site's main-stream chain at V4-Flash size (bf16 streams [N, 4, 4096], E 256, k 6), us a site:
    hc_post writing the partials, then either kernel B's x (its coefficients on their side stream, as the model
    runs them) and the fused router, or this launch with each config; and two bounds: hc_post alone, and hc_post
    then the router on an x computed before (what the drop probe's `mixffn` leaves). `copies` sites on distinct
    inputs captured back to back in one CUDA graph (fn, the gate and X past L2, as consecutive layers). Prints a
    table (with whether each variant's routing equals the router's on the first site); returns its rows.
    hidden, experts, timer (`graph_us` by default): smaller shapes and another clock, for a check on the CPU."""
    from moebox.ops.streams import Branch
    from moebox.ops.triton.mhc import hc_post_chain_triton, hc_pre_triton, random_site
    from moebox.ops.triton.route import router_route_triton
    from moebox.ops.triton.runtime import each_copy, graph_us
    device = torch.device(device)
    kw = dict(iters=20, eps=1e-6, norm_eps=1e-6)
    timer = timer or graph_us
    print(f"FFN site chain, H {hidden}, E {experts}, {copies} sites a graph; us a site", flush=True)
    rows = []
    for n in tokens:
        sites = [random_site(n, hidden=hidden, device=device, seed=i) for i in range(copies)]
        g = torch.Generator(device=device).manual_seed(1000 + n)
        outs = [torch.randn((n, hidden), generator=g, device=device).bfloat16() for _ in range(copies)]
        post = torch.rand((n, 4), generator=g, device=device) * 2
        comb = torch.softmax(torch.randn((n, 4, 4), generator=g, device=device), dim=-1)
        norm = (1 + 0.1 * torch.randn(hidden, generator=g, device=device)).bfloat16()
        routers = [Router((torch.randn((experts, hidden), generator=g, device=device) / hidden ** 0.5).bfloat16(),
                          torch.randn(experts, generator=g, device=device) * 0.05, 6, "sqrtsoftplus", True, 2.5)
                   for _ in range(copies)]

        xs = [torch.randn((n, hidden), generator=g, device=device).bfloat16() for _ in range(copies)]

        def site(i: int, config: MixRouteConfig | str | None) -> tuple[torch.Tensor, torch.Tensor] | None:
            X, fn, base, scale = sites[i]
            X_new, ws = hc_post_chain_triton(outs[i], X, post, comb, next_fn=fn)
            if config == "post":
                return None
            if config == "router":
                return router_route_triton(xs[i], routers[i].gate, routers[i].bias, **routers[i].routing())
            coeffs = Branch(X_new, "mhc", purpose="mhc")
            ahead = None if config is None else RouteAhead(routers[i], pack=True, config=config)
            x, _, _ = hc_pre_triton(X_new, fn, base, scale, **kw, coeffs_branch=coeffs if coeffs.on else None,
                                    norm=norm, partials=ws, router=ahead)
            if ahead is None:
                ids, w = router_route_triton(x, routers[i].gate, routers[i].bias, **routers[i].routing())
            else:
                ids, w = ahead.ids, ahead.weights
            coeffs.join()
            return ids, w

        bounds = {"post": "bound: hc_post alone", "router": "bound: hc_post, router on a given x"}
        want = site(0, None)[0].sort(dim=1)[0]
        for config in ("post", "router", None, *configs):
            got = site(0, config)
            same = None if config in bounds else torch.equal(got[0].sort(dim=1)[0], want)
            us = timer(each_copy(lambda i, c=config: site(i, c), copies))
            name = bounds.get(config) if isinstance(config, str) else "kernel B + router" if config is None else (
                f"one launch, {f'{config.columns} columns' if config.columns else 'rows'}, {config.num_warps} warps, "
                + ("volatile" if config.volatile else "plain loads") + ("" if config.early else ", gate late"))
            rows.append(dict(N=n, variant=name, us=us, same_routing=same))
            check = "" if same is None else f"   routing {'same' if same else 'DIFFERS'}"
            print(f"N={n} {name:50s} {us:7.2f} us{check}", flush=True)
        del sites, outs, routers, xs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":  # python -m moebox.ops.triton.mix_route
    from moebox.ops.triton.runtime import bench_start
    bench_start()
    bench()
