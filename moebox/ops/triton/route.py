"""Expert routing from the router's logits in one Triton kernel (decode): scores, biased top-k, weights.

Why: after the router's GEMV, torch routes a decode step's tokens in three kernels: the scores plus the bias
(inductor), `torch.topk` (a block-wide radix select, ~10 us in a CUDA graph) and the gather and normalisation
(inductor). In the kernel profile of a batch-1 V4-Flash step (docs/benchmarks.md, sixth session) the top-k
launches alone are 6.7% of the step. Here one program per token holds all E scores in registers and takes the
top k in k rounds of (max, mask it out), one warp for E <= 1024 (its reductions are shuffles, no shared
memory and barriers): one launch. The max is over 64-bit keys (the selection value's order in the high word,
the complement of the index in the low one), one reduction a round where there were three (max, lowest index
at the max, its score: 4.5 us a launch at batch 1 in the fifteenth session's timeline); the k weights are
recomputed from their logits, gathered after the rounds.

Semantics: `moebox.ops.moe.route` for a non-hash layer (noaux_tc): scores = sqrt(softplus(logits)) or
sigmoid(logits) in fp32; the experts are picked by scores + bias; their weights are the unbiased scores,
divided by their sum (+ 1e-20) when normalised, times the scaling factor. Equal selection values pick the lower
expert index (torch's top-k leaves ties unspecified); the k experts come in selection order (the consumers sum
over them). softplus is torch's: x above 20, else log1p(exp(x)), with log1p(u) as u - u^2/2 below 1e-4 (the
plain log(1 + u) would lose those u in fp32). A NaN logit cannot send an id out of range: ids are clamped.
"""

from __future__ import annotations

import torch

from moebox.ops.triton.runtime import (HAVE_TRITON, early_loads, next_pow2, pdl_args, pdl_start,  # noqa: F401
                                       tl, triton)

SCORINGS = {"sqrtsoftplus": 0, "sigmoid": 1}   # softmax scores are not taken (the torch path routes them)
MAX_EXPERTS = 4096                             # one program's register tile

if HAVE_TRITON:
    @triton.jit
    def _scores(x, SCORING: tl.constexpr):
        """The routing scores of fp32 logits: sqrt(softplus(x)) (SCORING 0) or sigmoid(x)."""
        if SCORING == 0:
            u = tl.exp(tl.minimum(x, 20.0))
            log1p = tl.where(u < 1e-4, u - 0.5 * u * u, tl.log(1.0 + u))
            return tl.sqrt(tl.where(x > 20.0, x, log1p))
        return tl.sigmoid(x)

    @triton.jit
    def _route_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, E, stride_ln, scaling,
                      K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_E: tl.constexpr, SCORING: tl.constexpr,
                      HAS_BIAS: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr):
        bias = _bias(bias_ptr, E, BLOCK_E, HAS_BIAS)
        pdl_start(PDL)
        n = tl.program_id(0).to(tl.int64)
        _route_row(logits_ptr + n * stride_ln, bias, ids_ptr, w_ptr, n, E, scaling, K, K_PAD, BLOCK_E, SCORING, NORM,
                   "")

    @triton.jit
    def _bias(bias_ptr, E, BLOCK_E: tl.constexpr, HAS_BIAS: tl.constexpr):
        """The selection bias [BLOCK_E] fp32 (0 past E, or everywhere without one): a weight, which the kernels
        load before their PDL wait."""
        offs = tl.arange(0, BLOCK_E)
        if HAS_BIAS:
            return tl.load(bias_ptr + offs, mask=offs < E, other=0.0).to(tl.float32)
        return tl.zeros((BLOCK_E,), dtype=tl.float32)

    @triton.jit
    def _route_row(row, bias, ids_ptr, w_ptr, n, E, scaling, K: tl.constexpr, K_PAD: tl.constexpr,
                   BLOCK_E: tl.constexpr, SCORING: tl.constexpr, NORM: tl.constexpr, CACHE: tl.constexpr):
        """Token n's routing from its E logits at `row` (loaded with cache modifier CACHE) and the selection bias
        (`_bias`) into ids/w row n."""
        offs = tl.arange(0, BLOCK_E)
        me = offs < E
        sel = _scores(tl.load(row + offs, mask=me, other=0.0, cache_modifier=CACHE).to(tl.float32), SCORING) + bias
        sel = tl.where(me, sel, float("-inf"))
        # one max a round: the selection value as an int32 of the same order (negative floats' low 31 bits
        # flipped) in the high word, the complement of the index in the low one (ties: the lowest index)
        bits = sel.to(tl.int32, bitcast=True)
        key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64) * 4294967296 + (BLOCK_E - 1 - offs)
        kk = tl.arange(0, K_PAD)
        ids = tl.zeros((K_PAD,), dtype=tl.int32)
        for j in tl.static_range(K):
            e = BLOCK_E - 1 - (tl.max(key, axis=0) & 0xFFFFFFFF).to(tl.int32)
            ids = tl.where(kk == j, e, ids)
            key = tl.where(offs == e, -9223372036854775807 - 1, key)
        ids = tl.minimum(ids, E - 1)
        mk = kk < K
        ws = tl.where(mk, _scores(tl.load(row + ids, mask=mk, other=0.0, cache_modifier=CACHE).to(tl.float32),
                                  SCORING), 0.0)
        if NORM:
            ws = ws / (tl.sum(ws, axis=0) + 1e-20)
        tl.store(ids_ptr + n * K + kk, ids.to(tl.int64), mask=mk)
        tl.store(w_ptr + n * K + kk, ws * scaling, mask=mk)


    @triton.jit
    def _router_route_kernel(x_ptr, g_ptr, bias_ptr, logits_ptr, count_ptr, ids_ptr, w_ptr, E, H, stride_xn,
                             stride_ge, scaling, ROWS: tl.constexpr, BLOCK_H: tl.constexpr, K: tl.constexpr,
                             K_PAD: tl.constexpr, BLOCK_E: tl.constexpr, SCORING: tl.constexpr,
                             HAS_BIAS: tl.constexpr, NORM: tl.constexpr, EARLY: tl.constexpr, PDL: tl.constexpr):
        """Program (r, n): token n's logits of experts r*ROWS.. (fp32 products and sums) into
        logits[n]; the last of token n's E / ROWS programs to finish (its counter, which only ever grows, reaches
        a multiple of E / ROWS) routes the token from them. EARLY: the first BLOCK_H columns of the gate rows, a
        weight, are loaded before the PDL wait (all of them at V4's H <= BLOCK_H): their round trip overlaps the
        kernel before. The selection bias, which only the last program reads, always is (it was a DRAM round trip
        of that program's, after all the others')."""
        r = tl.program_id(0)
        n = tl.program_id(1).to(tl.int64)
        rows = r * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_H)
        g_rows = g_ptr + rows.to(tl.int64)[:, None] * stride_ge + cols[None, :]
        bias = _bias(bias_ptr, E, BLOCK_E, HAS_BIAS)
        if EARLY:
            g = tl.load(g_rows, mask=(cols < H)[None, :], other=0.0)
        pdl_start(PDL)
        if EARLY == 0:
            g = tl.load(g_rows, mask=(cols < H)[None, :], other=0.0)
        x = tl.load(x_ptr + n * stride_xn + cols, mask=cols < H, other=0.0).to(tl.float32)
        acc = g.to(tl.float32) * x[None, :]
        for h0 in range(BLOCK_H, H, BLOCK_H):
            mh = h0 + cols < H
            xh = tl.load(x_ptr + n * stride_xn + h0 + cols, mask=mh, other=0.0).to(tl.float32)
            gh = tl.load(g_rows + h0, mask=mh[None, :], other=0.0).to(tl.float32)
            acc += gh * xh[None, :]
        tl.store(logits_ptr + n * E + rows, tl.sum(acc, axis=1))
        # every thread's store before one thread's release of the count; the last program's loads after its
        # acquire (and from L2: the other programs' stores are not in this SM's L1)
        tl.debug_barrier()
        done = tl.atomic_add(count_ptr + n, 1, sem="acq_rel", scope="gpu")
        tl.debug_barrier()
        if done % (E // ROWS) == E // ROWS - 1:
            _route_row(logits_ptr + n * E, bias, ids_ptr, w_ptr, n, E, scaling, K, K_PAD, BLOCK_E, SCORING, NORM,
                       ".cg")


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _routable(experts: int, scoring_func: str, top_k: int) -> bool:
    return HAVE_TRITON and scoring_func in SCORINGS and 1 <= top_k <= experts <= MAX_EXPERTS


def _routing_constants(experts: int, bias: torch.Tensor | None, top_k: int, scoring_func: str,
                       norm_topk_prob: bool) -> dict:
    """The routing's constexprs (`_route_row`), as both kernels take them."""
    return dict(K=top_k, K_PAD=next_pow2(top_k), BLOCK_E=next_pow2(experts), SCORING=SCORINGS[scoring_func],
                HAS_BIAS=bias is not None, NORM=bool(norm_topk_prob))


def supported(logits: torch.Tensor, scoring_func: str, top_k: int) -> bool:
    """Whether `route_triton` takes these logits [N, E] (fp32/bf16/fp16, unit column stride)."""
    return (logits.dim() == 2 and logits.stride(1) == 1 and logits.dtype in _FLOATS
            and _routable(logits.shape[1], scoring_func, top_k))


def route_triton(logits: torch.Tensor, bias: torch.Tensor | None, *, top_k: int, scoring_func: str,
                 norm_topk_prob: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, E] -> (expert ids [N, k] int64, weights [N, k] fp32), as `moebox.ops.moe.route` does after its
    router product (non-hash layers)."""
    if not supported(logits, scoring_func, top_k):
        raise ValueError(f"route_triton takes [N, E <= {MAX_EXPERTS}] float logits with unit column stride and "
                         f"scoring {sorted(SCORINGS)}; got {tuple(logits.shape)} {logits.dtype} {scoring_func}")
    n, e = logits.shape
    ids = torch.empty((n, top_k), dtype=torch.int64, device=logits.device)
    w = torch.empty((n, top_k), dtype=torch.float32, device=logits.device)
    if n:
        _route_kernel[(n,)](
            logits, logits if bias is None else bias, ids, w, e, logits.stride(0), float(scaling),
            **_routing_constants(e, bias, top_k, scoring_func, norm_topk_prob), num_warps=1 if e <= 1024 else 4,
            **pdl_args(logits, _route_kernel))
    return ids, w


ROUTER_ROWS = 2           # experts a program of the fused router computes (V4-Flash: 128 programs a token)
ROUTER_MAX_TOKENS = 16
_counters: dict[tuple[torch.device, int], torch.Tensor] = {}   # per device and programs a token


def router_supported(x: torch.Tensor, gate: torch.Tensor, scoring_func: str, top_k: int) -> bool:
    """Whether `router_route_triton` takes x [N <= 16, H] and the gate weight [E, H] (float dtypes, unit column
    stride, E a multiple of ROUTER_ROWS)."""
    return (x.dim() == 2 and gate.dim() == 2 and x.shape[1] == gate.shape[1] and x.dtype in _FLOATS
            and gate.dtype in _FLOATS and x.stride(1) == 1 and gate.stride(1) == 1 and x.shape[0] <= ROUTER_MAX_TOKENS
            and gate.shape[0] % ROUTER_ROWS == 0 and _routable(gate.shape[0], scoring_func, top_k))


def router_route_triton(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None, *, top_k: int,
                        scoring_func: str, norm_topk_prob: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`route_triton(x @ gate.T in fp32, ...)` in one launch instead of two: each program computes a few experts'
    logits of one token, and the token's last program to finish routes it (a per-token counter on the device,
    one set per device and E / ROUTER_ROWS, never reset: it only grows, by E / ROUTER_ROWS a call, so it is a
    multiple of that between calls and a CUDA graph replays it; calls must not run at the same time on two
    streams). Why: at decode the routing kernel is one more
    dependent launch on the main stream of every MoE layer (the model takes it up to `ROUTER_KERNEL_TOKENS`)."""
    if not router_supported(x, gate, scoring_func, top_k):
        raise ValueError(f"router_route_triton takes float x [N <= {ROUTER_MAX_TOKENS}, H] and gate [E, H], "
                         f"E a multiple of {ROUTER_ROWS}, scoring {sorted(SCORINGS)}; got x {tuple(x.shape)} "
                         f"{x.dtype}, gate {tuple(gate.shape)} {gate.dtype}, {scoring_func}")
    (n, h), e = x.shape, gate.shape[0]
    ids = torch.empty((n, top_k), dtype=torch.int64, device=x.device)
    w = torch.empty((n, top_k), dtype=torch.float32, device=x.device)
    if n == 0:
        return ids, w
    key = (x.device, e // ROUTER_ROWS)
    if key not in _counters:
        _counters[key] = torch.zeros(ROUTER_MAX_TOKENS, dtype=torch.int64, device=x.device)
    logits = torch.empty((n, e), dtype=torch.float32, device=x.device)
    _router_route_kernel[(e // ROUTER_ROWS, n)](
        x, gate, gate if bias is None else bias, logits, _counters[key], ids, w, e, h, x.stride(0),
        gate.stride(0), float(scaling), ROWS=ROUTER_ROWS, BLOCK_H=min(next_pow2(h), 4096),
        **_routing_constants(e, bias, top_k, scoring_func, norm_topk_prob), EARLY=early_loads(n), num_warps=4,
        **pdl_args(x, _router_route_kernel))
    return ids, w
