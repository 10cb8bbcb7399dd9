"""Fused mHC (manifold-constrained hyper-connections, deepseek_v4.md §2.2) on the GPU: hc_pre in 2 Triton
kernels, hc_post in 1, hc_head in 2, where the torch references launch ~140, ~7 and ~17 kernels; at decode
(the "chain", below) a whole site is 2 launches on the main stream, the sub-block's RMSNorm included.

Why: a V4-Flash decode step calls hc_pre and hc_post twice per layer (43 layers: 86 of each). The torch
hc_pre is ~140 tiny kernels (each of the 20 Sinkhorn iterations is 2 x (sum, add, div)); at ~1.1 us per kernel
inside a CUDA graph that is ~150 us per call at any batch, more than a whole layer's weights take to stream.
The references are the torch functions of moebox.ops.mhc (`hc_pre_reference`, ... re-exported here);
`hc_pre_triton`, ... are the fused paths, which the dispatchers there take for CUDA tensors when triton imports.

hc_pre, X [N, hc, H] (fp32/bf16/fp16), fn [M, K] with K = hc*H, M = (2+hc)*hc (24 x 16384 fp32 = 1.57 MB):
  Kernel A, `_mix_logits_kernel` (split-K GEMV, grid (token tiles, SPLIT)): program (b, s) reads BLOCK_N
    tokens and all M rows of fn over its K range s and computes acc = X_tile @ fn_tile^T (tl.dot in fp32
    "ieee", i.e. FMA, never TF32) and the tokens' sum of squares there, since rms_norm(z) @ fn^T =
    rsqrt(mean(z^2) + eps) * (z @ fn^T). Both go to the fp32 scratch ws [N, SPLIT, M_PAD] (the sum of squares
    in column M; M_PAD = next power of 2 > M, >= 16 for the dot): each partial written once, no atomics, no
    zeroing. Decode (N <= 16, when MOEBOX_MHC_GEMV leaves it this kernel): one 16-token tile (rows past N
    re-read row N-1, from L1) and one 128-column K step per program, SPLIT = K / 128 = 128 programs, so all of
    fn is requested at once by ~one program per SM (fn is what a decode call must stream). Prefill: 128-token
    tiles, 32-column K steps, ~4 programs an SM, and the dot as "tf32x3" (three TF32 tensor-core products of
    split operands, fp32-level error: the same as "ieee" against the fp32 reference on the H200, where the
    "ieee" dot is an FMA loop): 515 -> 57 us an hc_pre's kernel A at N = 2048 (thirty-first session; X 67 MB,
    ~16 us at the copy rate; plain "tf32" was 8.8e-4 off, so not taken).
  Kernel A for N <= GEMV_MAX_N (16: all of decode), `_mix_logits_gemv_kernel`: the same partials on the CUDA
    cores, no tl.dot. A 16-token dot tile is mostly padding at small N (15/16 of it at N = 1) and the fp32
    "ieee" dot pays layout conversions besides (11.6 us an hc_pre at N = 1 on the H200, 7.1 with the gemv).
    Program (b, s) multiplies x [BLOCK_N, 1, BLOCK_K] (BLOCK_N = next_pow2(N), at most 4: a token tile's
    registers) by fn [1, M_PAD, BLOCK_K] in fp32 and sums over K; same grid, K steps and ws layout (M_PAD =
    next power of 2 > M, without the dot's minimum of 16); above 4 tokens the tiles re-read fn from L2.
    MOEBOX_MHC_GEMV=N takes the gemv up to N tokens (0: the dot kernel at every N, to A/B the two).
  Kernel B, `_mix_kernel` (grid (N, 1 + H / BLOCK_H)): every program sums its token's SPLIT partials in a fixed
    order (deterministic) and gets rs = rsqrt(sumsq / K + norm_eps) and the logits it needs. Program 0 of a
    token computes post = 2 sigmoid(.) and comb (softmax over k + eps, 1 column and iters-1 (row, column)
    normalisations, eps in every denominator) on the [hc, hc] tile in fp32 registers; the others compute
    pre = sigmoid(.) + eps and x = sum_j pre_j X[j] over their BLOCK_H columns (fp32, one cast to X's dtype),
    concurrently with it. BLOCK_H = one 16-byte vector per thread and stream (1024 bf16 / 512 fp32 columns
    with 4 warps): at that width Triton's coalesced [hc, BLOCK_H] layout keeps a column's hc streams in one
    thread, so the sum over streams needs no shared memory.
  hc_head: kernels A and B with M = hc and no post/comb (COEFFS off).
  At decode the model launches kernel B twice (`coeffs_branch`): the x programs on the main stream and the
  post/comb program on a side stream, joined before hc_post, so the sub-block starts without waiting for the
  Sinkhorn chain (twelfth session: -0.18 ms a step at batch 1 on the H200).
hc_post, `_post_kernel` (grid (N, H / BLOCK_H), elementwise, memory-bound): X_new[k] = post[k] out + sum_j
  comb[j, k] X[j] in fp32, with post and comb first rounded to X's dtype as the reference does (.to(dt)), then
  ONE rounding to X's dtype (the reference rounds 3 times in bf16: product, matmul, sum), so bf16 results
  differ from it by ~1 ulp on some elements; fp32 agrees to fp32 rounding.

The decode chain (N <= GEMV_MAX_N, `chain_takes`; the model's `Block` runs it): a decode step was ~4 mHC
launches a site on the main stream (kernel A, kernel B's x, the sub-block's RMSNorm, hc_post), each ~2-4 us
at batch 1 on the H200, 86 sites a step. In the chain:
  - `hc_post_chain_triton`: the `_post_kernel` program that writes X_new's columns hs (CHAIN_BLOCK_H = 32 of
    them: 128 programs a token, each reading a 12 KB slice of the next site's fn) also computes the NEXT
    site's kernel-A partials over those columns, from X_new as rounded: ws[n, s, :M] = X_new[:, hs] .
    fn[:, :, hs] and, instead of a sum of squares, the hc x hc Gram matrix G[j, k] = X_new[j, hs] .
    X_new[k, hs] (rows padded to `partials_width`). It also adds the shared expert's output to the routed one
    (`addend`, rounded to X's dtype as `out + shared` is): one launch fewer again.
  - `hc_pre_triton(..., norm=w, partials=ws)`: kernel B alone. Its sum of squares is trace(G), and the
    sub-block's RMSNorm of x = sum_j pre_j X[j] needs mean(x^2) = pre^T G pre / H: every x program has it
    from the partials, so x comes out normed (rounded to X's dtype first, then times rsqrt(. + eps) and the
    weight, as rms_norm(x) computes it; the mean square is from x before that rounding). The quadratic form
    cancels where the weighted streams nearly do (its fp32 error is ~1e-7 of sum_jk |pre_j G_jk pre_k| / H):
    below 1/256 of that sum the program sums the row's squares itself (`_row_mean_square`), so the mean
    square stays within ~1e-4 relative whatever the streams.
  - A step's first site, and the MTP block's, get their partials from `hc_partials_triton` (the same kernel
    without the post), the last one writes none (the head computes its own).
  Per site on the main stream: kernel B and hc_post, 2 launches where there were 4 (fifteenth session:
  batch 1 5.91 -> 5.59 ms with the other launch cuts of that session, docs/benchmarks.md).

Bounds: any hc (padded to a power of 2 with masks), H, N (N = 0 gives empty outputs), iters >= 0; X must be
[N, hc, H] fp32/bf16/fp16 and hc_post's out of X's dtype and shape [N, H], else the dispatchers run the
reference. Results differ from the reference only by fp32 rounding order (partial sums, tree reductions,
Triton's exp / rsqrt / division).

Bytes and time: an hc_pre call moves fn (1.57 MB) + X (N*K*2 bytes bf16: 32 KB a token) + x; X is read by both
kernels (B's read hits L2 at decode). At 4.3 TB/s that is ~0.4 us at N = 1..16, so decode is latency-bound:
two launches, kernel A one DRAM round trip per program (plus its FMAs: N x 128 x 24 a program in the gemv),
kernel B the longer of the x programs and the Sinkhorn program, a chain of 39 dependent [hc, hc]
normalisations (each 1-2 warp shuffles and a division; the sm_90 build has no shared memory and no barrier in
that loop; ~1.5 us by instruction latencies, not yet timed). hc_post moves 2*N*K*2 + N*H*2 bytes.
`bench` / `python -m moebox.ops.triton.mhc [--sweep]` times fused vs torch in CUDA-graph replay.

CUDA graphs: a call allocates its outputs (unless given `into`) and the scratch with torch.empty and launches
2 kernels (hc_pre, hc_head; 1 for hc_pre with partials) or 1 (hc_post); no host sync, no data-dependent shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch

from moebox.ops.mhc import hc_head_reference, hc_post_reference, hc_pre_reference
from moebox.ops.norm import rms_norm, rms_norm_reference
from moebox.ops.streams import Branch

from moebox.ops.triton.runtime import (HAVE_TRITON, bench_start, cdiv, each_copy, early_loads,  # noqa: F401
                                       env_count, graph_us, next_pow2, num_sms, pdl_args, pdl_start, rel_err,
                                       tl, triton)

__all__ = ["HcConfig", "PostConfig", "pick_config", "resolve_config", "fused_supported", "hc_pre_triton",
           "hc_post_triton", "hc_head_triton", "hc_pre_reference", "hc_post_reference", "hc_head_reference",
           "random_site", "bench", "sweep"]


@dataclass(frozen=True)
class HcConfig:
    """hc_pre / hc_head tiling. Kernel A: BLOCK_N tokens x BLOCK_K columns of the flattened streams per step,
    `split` programs along K (0 = automatic); logits_kernel "dot" (`_mix_logits_kernel`, tl.dot in `precision`:
    "ieee" (FMA) or "tf32x3") or "gemv" (`_mix_logits_gemv_kernel`, CUDA-core FMAs for a few tokens; num_stages
    and precision unused). Kernel B: mix_warps
    warps, BLOCK_H columns of H per program (0 = automatic: one 16-byte vector per thread, see `_block_h`)."""

    block_n: int = 16
    block_k: int = 128
    split: int = 0
    num_warps: int = 4
    num_stages: int = 3
    mix_warps: int = 4
    block_h: int = 0
    logits_kernel: str = "dot"
    precision: str = "ieee"


@dataclass(frozen=True)
class PostConfig:
    """hc_post tiling: num_warps warps and BLOCK_H columns of H per program (0 = automatic, see `_block_h`),
    all hc output streams of one token."""

    num_warps: int = 4
    block_h: int = 0


MAX_SPLIT = 256  # kernel B loads all partials of a token as one [next_pow2(split), ...] tile
# Decode batches up to this take the gemv logits kernel (MOEBOX_MHC_GEMV sets another bound, 0 none), in tiles of
# up to GEMV_TILE_N tokens (a tile's registers: 144 at 4 tokens in the sm_90 build, no spills).
GEMV_MAX_N = 16
GEMV_TILE_N = 4
# columns of a chain partials program: 128 a token at H = 4096, each reading 12 KB of fn (with PostConfig's 4
# warps the fastest at N = 1 and 4 of the sixteenth session's `--sweep-chain`; docs/benchmarks.md)
CHAIN_BLOCK_H = 32

def _block_h(block_h: int, num_warps: int, dtype: torch.dtype, hidden: int) -> int:
    """Columns of H per program of kernel B / hc_post. Automatic: exactly one 16-byte vector per thread and
    stream (1024 bf16 or 512 fp32 columns with 4 warps), the width at which Triton's coalesced [hc, BLOCK_H]
    layout keeps all hc streams of a column in one thread, so sums over streams need no shared memory (narrower
    tiles spread the streams over warps). Capped at H rounded up to a power of 2."""
    if not block_h:
        block_h = 16 // dtype.itemsize * 32 * num_warps
    return min(block_h, next_pow2(hidden))


def _gemv_max_n() -> int:
    """The largest batch that takes the gemv logits kernel: MOEBOX_MHC_GEMV (0: none), else GEMV_MAX_N."""
    return env_count("MOEBOX_MHC_GEMV", GEMV_MAX_N, "a token count (0: the dot kernel at every N)")


def pick_config(n: int, hc: int, hidden: int, sms: int = 132) -> HcConfig:
    """The default hc_pre/hc_head tiling (split resolved): N <= GEMV_MAX_N (or MOEBOX_MHC_GEMV) the gemv logits
    kernel, tiles of up to GEMV_TILE_N tokens; other decode (N <= 16) one 16-token dot tile; both one K step
    per program. Prefill 128-token tiles of 32-column K steps in "tf32x3", >= 8 K steps a program, ~4 programs an
    SM (split; the module doc has the times)."""
    if n <= _gemv_max_n():
        # BLOCK_K 128, 4 warps: a warp's lanes span the K step with one 16-byte fp32 vector each and the warps
        # split fn's rows, so a thread issues one 16-byte load per row it covers (M_PAD / 4), all at once, and
        # the sum over K stays inside a warp (shuffles, no shared memory); SPLIT 128 at V4's K = 16384
        cfg = HcConfig(block_n=min(GEMV_TILE_N, next_pow2(n)), block_k=128, num_warps=4, num_stages=1,
                       logits_kernel="gemv")
    elif n <= 16:
        cfg = HcConfig(block_n=16, block_k=128, num_warps=4, num_stages=3)
    else:
        cfg = HcConfig(block_n=128, block_k=32, num_warps=4, num_stages=4, precision="tf32x3")
    return resolve_config(cfg, n, hc, hidden, sms)


def resolve_config(cfg: HcConfig, n: int, hc: int, hidden: int, sms: int = 132) -> HcConfig:
    """cfg with split 0 replaced by the automatic choice, and clamped to 1..min(K steps, MAX_SPLIT) with every
    split the same number of K steps (the last may be shorter); the same for either logits kernel."""
    if cfg.logits_kernel not in ("dot", "gemv"):
        raise ValueError(f"HcConfig.logits_kernel must be 'dot' or 'gemv', got {cfg.logits_kernel!r}")
    if cfg.precision not in ("ieee", "tf32x3"):
        raise ValueError(f"HcConfig.precision must be 'ieee' or 'tf32x3', got {cfg.precision!r}")
    kb = cdiv(hc * hidden, cfg.block_k)
    split = cfg.split
    if not split:
        tiles = cdiv(n, cfg.block_n)
        split = min(kb, cdiv(2 * sms, tiles)) if n <= 16 else max(1, min(cdiv(4 * sms, tiles), kb // 8))
    split = max(1, min(split, kb, MAX_SPLIT))
    return replace(cfg, split=cdiv(kb, cdiv(kb, split)))


# ----------------------------------------------------------------------------------------------- kernels
if HAVE_TRITON:
    @triton.jit
    def _store_partials(ws_ptr, acc, sq, offs_n, offs_m, pid_s, N, M, SPLIT, M_PAD: tl.constexpr):
        """Kernel A's output, whichever computed it: token n's partial logits of split s at ws[n, s, :M] and its
        sum of squares sq [BN, 1] in column M; tokens past N are not stored."""
        acc = tl.where(offs_m[None, :] == M, sq, acc)
        ws = ws_ptr + (offs_n.to(tl.int64)[:, None] * SPLIT + pid_s) * M_PAD + offs_m[None, :]
        tl.store(ws, acc, mask=(offs_n < N)[:, None])

    @triton.jit
    def _mix_logits_kernel(x_ptr, fn_ptr, ws_ptr, N, K, M, K_PER_SPLIT, SPLIT, stride_xn, stride_fm,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, M_PAD: tl.constexpr,
                           PRECISION: tl.constexpr, PDL: tl.constexpr):
        """ws[n, s, :M] = X_flat[n, Ks] @ fn[:, Ks]^T, ws[n, s, M] = sum(X_flat[n, Ks]^2) for the K range Ks."""
        pdl_start(PDL)
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, M_PAD)
        offs_k = tl.arange(0, BLOCK_K)
        # rows past N / M are clamped (loaded, never stored / replaced), so only K needs a mask
        x_rows = x_ptr + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * stride_xn     # [BN, 1]
        fn_cols = fn_ptr + tl.minimum(offs_m, M - 1).to(tl.int64)[None, :] * stride_fm   # [1, MP]: fn^T tile
        k0 = pid_s * K_PER_SPLIT
        k1 = tl.minimum(k0 + K_PER_SPLIT, K)
        acc = tl.zeros((BLOCK_N, M_PAD), dtype=tl.float32)
        sq = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k in range(k0, k1, BLOCK_K):
            kk = k + offs_k
            mk = kk < k1
            x = tl.load(x_rows + kk[None, :], mask=mk[None, :], other=0.0).to(tl.float32)
            w = tl.load(fn_cols + kk[:, None], mask=mk[:, None], other=0.0).to(tl.float32)
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
            sq += tl.sum(x * x, axis=1)
        _store_partials(ws_ptr, acc, sq[:, None], offs_n, offs_m, pid_s, N, M, SPLIT, M_PAD)

    @triton.jit
    def _mix_logits_gemv_kernel(x_ptr, fn_ptr, ws_ptr, N, K, M, K_PER_SPLIT, SPLIT, stride_xn, stride_fm,
                                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, M_PAD: tl.constexpr,
                                PDL: tl.constexpr):
        """`_mix_logits_kernel`'s partials for a few tokens on the CUDA cores: a broadcast fp32 product summed
        over K, not a tl.dot whose 16-token tile would be mostly padding (the interpreter runs it exactly too)."""
        pdl_start(PDL)
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, M_PAD)
        # x [BN, 1, BK] and fn [1, MP, BK] tiles; rows past N / M are masked (not loaded; never stored / replaced)
        x_rows = x_ptr + offs_n.to(tl.int64)[:, None, None] * stride_xn
        fn_rows = fn_ptr + offs_m.to(tl.int64)[None, :, None] * stride_fm
        mn = (offs_n < N)[:, None, None]
        mm = (offs_m < M)[None, :, None]
        k0 = pid_s * K_PER_SPLIT
        k1 = tl.minimum(k0 + K_PER_SPLIT, K)
        acc = tl.zeros((BLOCK_N, M_PAD), dtype=tl.float32)
        sq = tl.zeros((BLOCK_N, 1), dtype=tl.float32)
        for k in range(k0, k1, BLOCK_K):
            kk = (k + tl.arange(0, BLOCK_K))[None, None, :]
            mk = kk < k1
            x = tl.load(x_rows + kk, mask=mn & mk, other=0.0).to(tl.float32)
            w = tl.load(fn_rows + kk, mask=mm & mk, other=0.0).to(tl.float32)
            acc += tl.sum(x * w, axis=2)
            sq += tl.sum(x * x, axis=2)
        _store_partials(ws_ptr, acc, sq, offs_n, offs_m, pid_s, N, M, SPLIT, M_PAD)

    @triton.jit
    def _row_mean_square(X_row, pre, offs_j, mj, H, BLOCK_H: tl.constexpr):
        """mean(x^2) over a token's row, x = sum_j pre_j X[j] rounded to X's dtype, summed directly."""
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            hh = h0 + tl.arange(0, BLOCK_H)
            Xt = tl.load(X_row + offs_j[:, None] * H + hh[None, :], mask=mj[:, None] & (hh < H)[None, :],
                         other=0.0).to(tl.float32)
            x = tl.sum(pre[:, None] * Xt, axis=0).to(X_row.dtype.element_ty).to(tl.float32)
            acc += x * x
        return tl.sum(acc, axis=0) / H

    @triton.jit
    def _mix_kernel(X_ptr, ws_ptr, base_ptr, scale_ptr, x_ptr, post_ptr, comb_ptr, norm_ptr,
                    H, K, SPLIT, iters, eps, norm_eps, stride_Xn, stride_xn,
                    HC: tl.constexpr, HC_PAD: tl.constexpr, M: tl.constexpr, M_PAD: tl.constexpr,
                    S_PAD: tl.constexpr, BLOCK_H: tl.constexpr, COEFFS: tl.constexpr, GRAM: tl.constexpr,
                    NORM: tl.constexpr, PDL: tl.constexpr):
        """Per token n: the logits from the partials (M of them; then the sum of squares in column M, or with
        GRAM the streams' Gram matrix G[j, k] = X[j] . X[k] in columns M + j * HC + k; M_PAD: a partial row's
        length). COEFFS: program 0 computes post and the Sinkhorn-normalised comb (first, so the longest
        dependency chain starts first); every other program computes x over its BLOCK_H columns (with COEFFS
        and one program a token, only post and comb). NORM (needs GRAM): x comes out RMS-normed with the weight
        at norm_ptr; its mean square is pre^T G pre / H, so no program needs the whole row.
        Loads: the weights (base, scale, the norm's columns) before the PDL wait, and after it the partials and
        X's columns together, so an x program waits for one L2 round trip where it waited for five in a row (the
        sm_90 build had each load after the reduction before it)."""
        n = tl.program_id(0)
        ph = tl.program_id(1) - (1 if COEFFS else 0)   # the H block of an x program; -1: post/comb
        xprog = ph >= 0
        offs_s = tl.arange(0, S_PAD)
        offs_j = tl.arange(0, HC_PAD)
        ms = offs_s < SPLIT
        mj = offs_j < HC
        hh = ph * BLOCK_H + tl.arange(0, BLOCK_H)
        mh = (hh >= 0) & (hh < H)                     # none in the post/comb program
        lin = tl.where(xprog, 0, HC)                    # the logits and base of pre (x programs) or post
        b_lin = tl.load(base_ptr + lin + offs_j, mask=mj, other=0.0).to(tl.float32)
        s_lin = tl.load(scale_ptr + tl.where(xprog, 0, 1)).to(tl.float32)
        if NORM:
            w = tl.load(norm_ptr + hh, mask=mh, other=0.0).to(tl.float32)
        pdl_start(PDL)
        # volatile: ptxas keeps these loads in order, all issued before the first reduction (plain loads of X
        # it sank below the partials' reductions: two round trips)
        X_n = X_ptr + n.to(tl.int64) * stride_Xn
        Xt = tl.load(X_n + offs_j[:, None] * H + hh[None, :], mask=mj[:, None] & mh[None, :], other=0.0,
                     volatile=True)
        ws_n = ws_ptr + (n.to(tl.int64) * SPLIT + offs_s) * M_PAD                       # [S_PAD]
        lin_w = tl.load(ws_n[:, None] + lin + offs_j[None, :], mask=ms[:, None] & mj[None, :], other=0.0,
                        volatile=True)
        if GRAM:
            jk = offs_j[:, None] * HC + offs_j[None, :]
            g_w = tl.load(ws_n[:, None, None] + M + jk[None, :, :],
                          mask=ms[:, None, None] & (mj[:, None] & mj[None, :])[None, :, :], other=0.0, volatile=True)
        else:
            sq_w = tl.load(ws_n + M, mask=ms, other=0.0, volatile=True)
        if GRAM:
            g = tl.sum(g_w, axis=0)
            sumsq = tl.sum(tl.sum(tl.where(offs_j[:, None] == offs_j[None, :], g, 0.0), axis=1), axis=0)
        else:
            sumsq = tl.sum(sq_w, axis=0)
        rs = 1.0 / tl.sqrt(sumsq / K + norm_eps)
        a_lin = tl.sum(lin_w, axis=0) * rs * s_lin + b_lin
        if xprog:
            pre = tl.sigmoid(a_lin) + eps
            x = tl.sum(pre[:, None] * Xt.to(tl.float32), axis=0)
            if NORM:   # rms_norm(x rounded to X's dtype, weight); the mean square from G, before that rounding
                pm = tl.where(mj, pre, 0.0)
                q = pm[:, None] * g * pm[None, :]
                ms_x = tl.sum(tl.sum(q, axis=1), axis=0) / H
                # its fp32 error is ~1e-7 of sum |q| / H: where the weighted streams cancel to under 1/256 of
                # that, the row's squares are summed directly instead (rare: 4 more loads of the token's X)
                if ms_x * 256.0 < tl.sum(tl.sum(tl.abs(q), axis=1), axis=0) / H:
                    ms_x = _row_mean_square(X_n, pre, offs_j, mj, H, BLOCK_H)
                x = x.to(X_ptr.dtype.element_ty).to(tl.float32) * (1.0 / tl.sqrt(ms_x + norm_eps)) * w
            tl.store(x_ptr + n.to(tl.int64) * stride_xn + hh, x.to(x_ptr.dtype.element_ty), mask=mh)
        elif COEFFS:
            post = 2.0 * tl.sigmoid(a_lin)
            tl.store(post_ptr + n.to(tl.int64) * HC + offs_j, post, mask=mj)
            jk = offs_j[:, None] * HC + offs_j[None, :]                                   # [HC_PAD, HC_PAD]
            valid = mj[:, None] & mj[None, :]
            comb_l = tl.sum(tl.load(ws_n[:, None, None] + 2 * HC + jk[None, :, :],
                                    mask=ms[:, None, None] & valid[None, :, :], other=0.0), axis=0)
            b_comb = tl.load(base_ptr + 2 * HC + jk, mask=valid, other=0.0).to(tl.float32)
            a = comb_l * rs * tl.load(scale_ptr + 2).to(tl.float32) + b_comb
            a = tl.where(mj[None, :], a, float("-inf"))       # padded columns; padded rows stay finite (0)
            e = tl.exp(a - tl.max(a, axis=1)[:, None])
            c = tl.where(valid, e / tl.sum(e, axis=1)[:, None] + eps, 0.0)
            c = c / (tl.sum(c, axis=0)[None, :] + eps)
            for _ in range(iters - 1):
                c = c / (tl.sum(c, axis=1)[:, None] + eps)
                c = c / (tl.sum(c, axis=0)[None, :] + eps)
            tl.store(comb_ptr + n.to(tl.int64) * (HC * HC) + jk, c, mask=valid)

    @triton.jit
    def _post_kernel(o_ptr, a_ptr, X_ptr, post_ptr, comb_ptr, y_ptr, fn_ptr, ws_ptr, H,
                     stride_on, stride_an, stride_Xn, stride_yn, stride_pn, stride_pk, stride_cn, stride_cj, stride_ck,
                     stride_fm, HC: tl.constexpr, HC_PAD: tl.constexpr, M: tl.constexpr, M_PAD: tl.constexpr,
                     W_PAD: tl.constexpr, BLOCK_H: tl.constexpr, POST: tl.constexpr, ADD: tl.constexpr,
                     PARTIALS: tl.constexpr, EARLY: tl.constexpr, PDL: tl.constexpr):
        """POST: y[n, k, h] = post[n, k] o[n, h] + sum_j comb[n, j, k] X[n, j, h] over BLOCK_H columns,
        coefficients rounded to X's dtype (ADD: o is the sum o + a, rounded to X's dtype, as the block adds
        the shared expert's output to the routed one). PARTIALS: then the next site's partials of y as
        rounded (without POST: of X itself): ws[n, s, :M] = y[:, hs] . fn[:, :, hs] for this program's columns
        hs, and ws[n, s, M + j * HC + k] = y[j, hs] . y[k, hs] (the Gram matrix, from which `_mix_kernel`
        gets both rms_norms). EARLY: the fn slice, a weight, is loaded before the PDL wait: its DRAM round trip
        overlaps the kernel before."""
        n = tl.program_id(0).to(tl.int64)
        s = tl.program_id(1)
        hh = s * BLOCK_H + tl.arange(0, BLOCK_H)
        offs_k = tl.arange(0, HC_PAD)
        mh = hh < H
        mk = offs_k < HC
        dt = X_ptr.dtype.element_ty
        if PARTIALS:
            offs_m = tl.arange(0, M_PAD)
            mm = offs_m < M
            f_ptrs = fn_ptr + offs_m.to(tl.int64)[:, None, None] * stride_fm + (offs_k[:, None] * H + hh[None, :]
                                                                             )[None, :, :]
            f_mask = mm[:, None, None] & (mk[:, None] & mh[None, :])[None, :, :]
            if EARLY:
                f = tl.load(f_ptrs, mask=f_mask, other=0.0)
        pdl_start(PDL)
        if PARTIALS:
            if EARLY == 0:
                f = tl.load(f_ptrs, mask=f_mask, other=0.0)
        if POST:
            p = tl.load(post_ptr + n * stride_pn + offs_k * stride_pk, mask=mk, other=0.0).to(dt).to(tl.float32)
            o = tl.load(o_ptr + n * stride_on + hh, mask=mh, other=0.0).to(tl.float32)
            if ADD:
                o = (o + tl.load(a_ptr + n * stride_an + hh, mask=mh, other=0.0).to(tl.float32)).to(dt)
                o = o.to(tl.float32)
            acc = p[:, None] * o[None, :]
            for j in tl.static_range(HC):
                c = tl.load(comb_ptr + n * stride_cn + j * stride_cj + offs_k * stride_ck, mask=mk, other=0.0)
                xj = tl.load(X_ptr + n * stride_Xn + j * H + hh, mask=mh, other=0.0).to(tl.float32)
                acc += c.to(dt).to(tl.float32)[:, None] * xj[None, :]
            y = acc.to(y_ptr.dtype.element_ty)
            tl.store(y_ptr + n * stride_yn + offs_k[:, None] * H + hh[None, :], y, mask=mk[:, None] & mh[None, :])
            v = tl.where(mk[:, None], y.to(tl.float32), 0.0)
        else:
            v = tl.load(X_ptr + n * stride_Xn + offs_k[:, None] * H + hh[None, :], mask=mk[:, None] & mh[None, :],
                        other=0.0).to(tl.float32)
        if PARTIALS:
            logits = tl.sum(tl.sum(f * v[None, :, :], axis=2), axis=1)
            gram = tl.sum(v[:, None, :] * v[None, :, :], axis=2)
            row = ws_ptr + (n * tl.num_programs(1) + s) * W_PAD
            tl.store(row + offs_m, logits, mask=mm)
            tl.store(row + M + offs_k[:, None] * HC + offs_k[None, :], gram, mask=mk[:, None] & mk[None, :])


# ---------------------------------------------------------------------------------------------- wrappers
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fused_supported(X: torch.Tensor, out: torch.Tensor | None = None) -> bool:
    """Whether the fused kernels take these streams (and sub-block output): X [N, hc, H] fp32/bf16/fp16, out of
    X's dtype and shape [N, H]."""
    if X.dim() != 3 or X.dtype not in _DTYPES:
        return False
    return out is None or (out.dtype == X.dtype and tuple(out.shape) == (X.shape[0], X.shape[2]))


def _streams(X: torch.Tensor) -> torch.Tensor:
    """X with each token's hc*H values contiguous (any token stride)."""
    if X.dim() != 3 or X.dtype not in _DTYPES:
        raise ValueError(f"X must be [N, hc, H] fp32/bf16/fp16, got {tuple(X.shape)} {X.dtype}")
    _, hc, hidden = X.shape
    if (hidden > 1 and X.stride(2) != 1) or (hc > 1 and X.stride(1) != hidden):
        X = X.contiguous()
    return X


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _filled(into: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
            name: str) -> torch.Tensor:
    if into is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(into.shape) != shape or into.dtype != dtype or into.device != device or not into.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {list(shape)} {dtype} on {device}, got "
                         f"{tuple(into.shape)} {into.dtype} on {into.device}")
    return into


def _mix_logits(X: torch.Tensor, fn: torch.Tensor, m: int, cfg: HcConfig) -> torch.Tensor:
    """Kernel A (cfg.logits_kernel's): the fp32 partials [N, split, M_PAD] (logits in columns < M, sum of
    squares in column M)."""
    n, hc, hidden = X.shape
    k = hc * hidden
    if tuple(fn.shape) != (m, k):
        raise ValueError(f"fn must be [{m}, {k}], got {tuple(fn.shape)}")
    gemv = cfg.logits_kernel == "gemv"
    m_pad = next_pow2(m + 1) if gemv else max(16, next_pow2(m + 1))   # a dot tile is >= 16 wide
    per = cdiv(cdiv(k, cfg.block_k), cfg.split) * cfg.block_k
    ws = torch.empty((n, cfg.split, m_pad), dtype=torch.float32, device=X.device)
    fn = _rows(fn)
    grid = (cdiv(n, cfg.block_n), cfg.split)
    args = (X, fn, ws, n, k, m, per, cfg.split, X.stride(0), fn.stride(0))
    tile = dict(BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, M_PAD=m_pad, num_warps=cfg.num_warps)
    if gemv:
        _mix_logits_gemv_kernel[grid](*args, **tile, **pdl_args(X, _mix_logits_gemv_kernel))
    else:
        _mix_logits_kernel[grid](*args, **tile, PRECISION=cfg.precision, num_stages=cfg.num_stages,
                                 **pdl_args(X, _mix_logits_kernel))
    return ws


def _mix(X: torch.Tensor, ws: torch.Tensor, m: int, base: torch.Tensor, scale: torch.Tensor,
         x: torch.Tensor | None, post: torch.Tensor | None, comb: torch.Tensor | None, cfg: HcConfig, iters: int,
         eps: float, norm_eps: float, norm: torch.Tensor | None = None, gram: bool = False) -> None:
    """Kernel B: x (unless None; RMS-normed with `norm` unless None, which needs `gram` partials) and post, comb
    (unless None: hc_head, or launched apart). ws: the partials [N, split, partial row length]."""
    n, hc, hidden = X.shape
    coeffs = post is not None
    block_h = _block_h(cfg.block_h, cfg.mix_warps, X.dtype, hidden)
    h_blocks = cdiv(hidden, block_h) if x is not None else 0
    some = x if x is not None else post
    split, m_pad = ws.shape[1:]
    _mix_kernel[(n, h_blocks + coeffs)](
        X, ws, _rows(base), _rows(scale), some, post if coeffs else some, comb if coeffs else some,
        some if norm is None else norm, hidden, hc * hidden, split, iters, eps, norm_eps, X.stride(0),
        some.stride(0), HC=hc, HC_PAD=next_pow2(hc), M=m, M_PAD=m_pad, S_PAD=next_pow2(split), BLOCK_H=block_h,
        COEFFS=coeffs, GRAM=gram, NORM=norm is not None, num_warps=cfg.mix_warps, **pdl_args(X, _mix_kernel))


def _config(config: HcConfig | None, X: torch.Tensor) -> HcConfig:
    n, hc, hidden = X.shape
    sms = num_sms(X.device)
    return pick_config(n, hc, hidden, sms) if config is None else resolve_config(config, n, hc, hidden, sms)


def hc_pre_triton(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, iters: int,
                  eps: float, norm_eps: float, into: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                  config: HcConfig | None = None, coeffs_branch: Branch | None = None,
                  norm: torch.Tensor | None = None, partials: torch.Tensor | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused hc_pre: X [N, hc, H] -> (x [N, H] in X's dtype, post [N, hc] fp32, comb [N, hc, hc] fp32), as
    `hc_pre_reference`. `into` = (x, post, comb) buffers to fill (every element written). Runs on CUDA, or on
    CPU tensors under TRITON_INTERPRET=1. `coeffs_branch`: post and comb, which only hc_post needs, are a
    launch of their own in that `Branch` (on its side stream when it is on): the Sinkhorn chain is the longest
    program of kernel B, so x, which the sub-block needs next, comes one program-length sooner. Use post and
    comb after the branch's join().
    `norm`: x comes out as rms_norm(x, norm, norm_eps). At decode sizes (`chain_takes`) kernel B does it from
    Gram partials, which `partials` (from `hc_post_chain_triton` with this site's fn) brings along, so hc_pre
    is then that one launch (else `hc_partials_triton` computes them first); larger N norm apart."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed")
    X = _streams(X)
    n, hc, hidden = X.shape
    m = (2 + hc) * hc
    if base.numel() != m or scale.numel() < 3:
        raise ValueError(f"base must have {m} elements and scale 3, got {base.numel()} and {scale.numel()}")
    bx, bp, bc = into if into is not None else (None, None, None)
    x = _filled(bx, (n, hidden), X.dtype, X.device, "x")
    post = _filled(bp, (n, hc), torch.float32, X.device, "post")
    comb = _filled(bc, (n, hc, hc), torch.float32, X.device, "comb")
    if n == 0:
        return x, post, comb
    cfg = _config(config, X)
    gram = norm is not None and (partials is not None or chain_takes(X))
    if gram:
        if norm.shape != (hidden,):
            raise ValueError(f"norm must be [{hidden}], got {tuple(norm.shape)}")
        ws = hc_partials_triton(X, fn) if partials is None else _check_partials(partials, n, m, hc)
    else:
        ws = _mix_logits(X, fn, m, cfg)
    mix = dict(norm=norm if gram else None, gram=gram)
    if coeffs_branch is None:
        _mix(X, ws, m, base, scale, x, post, comb, cfg, iters, eps, norm_eps, **mix)
    else:
        _mix(X, ws, m, base, scale, x, None, None, cfg, iters, eps, norm_eps, **mix)
        with coeffs_branch:
            _mix(X, ws, m, base, scale, None, post, comb, cfg, iters, eps, norm_eps, gram=gram)
        coeffs_branch.hold(ws)
    if norm is not None and not gram:   # past the chain's sizes: the norm apart
        x = rms_norm(x, norm, norm_eps) if bx is None else x.copy_(rms_norm(x, norm, norm_eps))
    return x, post, comb


def chain_takes(X: torch.Tensor) -> bool:
    """Whether mHC's decode chain takes these streams [N, hc, H]: N <= GEMV_MAX_N (decode sizes), where each
    site's hc_pre is one launch (logits and both rms_norms from partials that the previous hc_post wrote)."""
    return 0 < X.shape[0] <= GEMV_MAX_N


def partials_width(m: int, hc: int) -> int:
    """The length of a chain partial row: m logits and the hc x hc Gram matrix, padded to a power of 2."""
    return next_pow2(m + hc * hc)


def _check_partials(ws: torch.Tensor, n: int, m: int, hc: int) -> torch.Tensor:
    if ws.dim() != 3 or ws.shape[0] != n or ws.shape[2] != partials_width(m, hc) or ws.dtype != torch.float32:
        raise ValueError(f"partials must be [{n}, splits, {partials_width(m, hc)}] fp32 (hc_post_chain_triton's "
                         f"for a fn of {m} rows), got {tuple(ws.shape)} {ws.dtype}")
    return ws


def hc_partials_triton(X: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
    """The chain partials of streams X [N, hc, H] for fn [M, hc*H]: ws [N, H / CHAIN_BLOCK_H, partials_width]
    fp32, row s holding the M logits and the Gram matrix over columns s * CHAIN_BLOCK_H.. (a decode step's
    first site; the others get them from the hc_post before)."""
    return _post(None, None, X, None, None, fn)[1]


def hc_post_triton(out: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, *,
                   into: torch.Tensor | None = None, config: PostConfig | None = None) -> torch.Tensor:
    """Fused hc_post: X_new [N, hc, H] in X's dtype (out [N, H] of X's dtype, post [N, hc], comb [N, hc, hc]),
    as `hc_post_reference`. `into`: the X_new buffer to fill; it must not alias X."""
    return _post(out, None, X, post, comb, None, into, config)[0]


def hc_post_chain_triton(out: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, *,
                         addend: torch.Tensor | None = None, next_fn: torch.Tensor | None = None,
                         config: PostConfig | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hc_post_triton of out + addend (rounded to X's dtype, as `out + addend`) -> (X_new, the next site's
    chain partials for its fn `next_fn`, or None: no next_fn, or N past `chain_takes`), in one launch.
    `config`: its tiling (with partials, block_h 0 means CHAIN_BLOCK_H)."""
    return _post(out, addend, X, post, comb, next_fn if chain_takes(X) else None, config=config)


def _post(out: torch.Tensor | None, addend: torch.Tensor | None, X: torch.Tensor, post: torch.Tensor | None,
          comb: torch.Tensor | None, fn: torch.Tensor | None, into: torch.Tensor | None = None,
          config: PostConfig | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The `_post_kernel` launch: hc_post (unless out is None) and the chain partials for fn (unless None)."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed")
    X = _streams(X)
    n, hc, hidden = X.shape
    y = ws = None
    if out is not None:
        if not fused_supported(X, out) or tuple(post.shape) != (n, hc) or tuple(comb.shape) != (n, hc, hc) or (
                addend is not None and not fused_supported(X, addend)):
            raise ValueError(f"shapes/dtypes: out {tuple(out.shape)} {out.dtype}, X {tuple(X.shape)} {X.dtype}, "
                             f"post {tuple(post.shape)}, comb {tuple(comb.shape)}")
        y = _filled(into, (n, hc, hidden), X.dtype, X.device, "X_new")
    m = 0
    if fn is not None:
        fn = _rows(fn)
        m = fn.shape[0]
        if fn.shape[1] != hc * hidden:
            raise ValueError(f"fn must be [M, {hc * hidden}], got {tuple(fn.shape)}")
    if n == 0 or hidden == 0:
        return y, None if fn is None else torch.empty((n, 0, partials_width(m, hc)), device=X.device)
    cfg = config or PostConfig()
    block_h = (cfg.block_h or CHAIN_BLOCK_H) if fn is not None else _block_h(cfg.block_h, cfg.num_warps, X.dtype,
                                                                           hidden)
    blocks = cdiv(hidden, block_h)
    if fn is not None:
        ws = torch.empty((n, blocks, partials_width(m, hc)), dtype=torch.float32, device=X.device)
    o = _rows(out) if out is not None else X
    a = _rows(addend) if addend is not None else o
    p, c = (post, comb) if out is not None else (X, X)
    _post_kernel[(n, blocks)](
        o, a, X, p, c, y if y is not None else X, fn if fn is not None else X, ws if ws is not None else X, hidden,
        o.stride(0), a.stride(0), X.stride(0), y.stride(0) if y is not None else 0,
        *(p.stride(0), p.stride(1), c.stride(0), c.stride(1), c.stride(2)) if out is not None else (0,) * 5,
        fn.stride(0) if fn is not None else 0, HC=hc, HC_PAD=next_pow2(hc), M=m, M_PAD=next_pow2(max(m, 1)),
        W_PAD=partials_width(m, hc), BLOCK_H=block_h, POST=out is not None, ADD=addend is not None,
        PARTIALS=fn is not None, EARLY=early_loads(n), num_warps=cfg.num_warps, **pdl_args(X, _post_kernel))
    return y, ws


def hc_head_triton(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, eps: float,
                   norm_eps: float, into: torch.Tensor | None = None, config: HcConfig | None = None) -> torch.Tensor:
    """Fused hc_head: X [N, hc, H] -> y [N, H] in X's dtype, as `hc_head_reference`."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed")
    X = _streams(X)
    n, hc, hidden = X.shape
    if base.numel() != hc or scale.numel() < 1:
        raise ValueError(f"base must have {hc} elements and scale 1, got {base.numel()} and {scale.numel()}")
    y = _filled(into, (n, hidden), X.dtype, X.device, "y")
    if n == 0:
        return y
    cfg = _config(config, X)
    ws = _mix_logits(X, fn, hc, cfg)
    _mix(X, ws, hc, base, scale, y, None, None, cfg, 0, eps, norm_eps)
    return y


# ----------------------------------------------------------------------------------------------- bench
def random_site(n: int, hc: int = 4, hidden: int = 4096, dtype: torch.dtype = torch.bfloat16,
                device: torch.device | str = "cuda", seed: int = 0, head: bool = False) -> tuple[torch.Tensor, ...]:
    """(X, fn, base, scale) of one mHC site: X ~N(0, 1), fn ~N(0, 1.5^2 / K) so the logits are ~N(0, 1.5^2) at
    any size (a comb far from uniform), base ~N(0, 1), scale in [0.5, 1.5) (1 entry for the head, 3 otherwise)."""
    g = torch.Generator(device=device).manual_seed(seed)
    m = hc if head else (2 + hc) * hc
    X = torch.randn((n, hc, hidden), generator=g, device=device).to(dtype)
    fn = torch.randn((m, hc * hidden), generator=g, device=device) * (1.5 / (hc * hidden) ** 0.5)
    base = torch.randn((m,), generator=g, device=device)
    scale = 0.5 + torch.rand((1 if head else 3,), generator=g, device=device)
    return X, fn, base, scale


def _bench_n(n: int, device: torch.device, hc: int, hidden: int, iters: int, dtype: torch.dtype,
             config: HcConfig | None, ops: Sequence[str], torch_ref: bool, l2_miss_bytes: int,
             post_config: PostConfig | None = None) -> list[dict]:
    """The bench rows of one N (its inputs are freed on return)."""
    kw = dict(iters=iters, eps=1e-6, norm_eps=1e-6)
    esz = dtype.itemsize
    m, k = (2 + hc) * hc, hc * hidden
    nbytes = {"hc_pre": m * k * 4 + n * k * esz + n * hidden * esz + n * (hc + hc * hc) * 4,
              "hc_post": 2 * n * k * esz + n * hidden * esz + n * (hc + hc * hc) * 4}
    copies = max(1, min(64, cdiv(l2_miss_bytes, nbytes["hc_pre"])))
    sites = [random_site(n, hc, hidden, dtype, device, seed=i) for i in range(copies)]
    outs = [torch.randn((n, hidden), device=device).to(dtype) for _ in range(copies)]
    mixes = [hc_pre_reference(*site, **kw) for site in sites]
    norm = torch.ones(hidden, device=device, dtype=dtype)

    def chain(i: int) -> tuple[torch.Tensor, ...]:   # a decode site's mHC: hc_post writing the next partials
        X_new, ws = hc_post_chain_triton(outs[i], sites[i][0], mixes[i][1], mixes[i][2], next_fn=sites[i][1],
                                         config=post_config)
        return hc_pre_triton(X_new, *sites[i][1:], **kw, norm=norm, partials=ws)

    def chain_ref(i: int) -> tuple[torch.Tensor, ...]:
        x, post, comb = hc_pre_reference(hc_post_reference(outs[i], sites[i][0], mixes[i][1], mixes[i][2]),
                                         *sites[i][1:], **kw)
        return rms_norm_reference(x, norm, kw["norm_eps"]), post, comb

    calls = {"hc_pre": (lambda i: hc_pre_triton(*sites[i], **kw, config=config),
                        lambda i: hc_pre_reference(*sites[i], **kw)),
             "hc_post": (lambda i: hc_post_triton(outs[i], sites[i][0], mixes[i][1], mixes[i][2]),
                         lambda i: hc_post_reference(outs[i], sites[i][0], mixes[i][1], mixes[i][2])),
             "chain": (chain, chain_ref)}
    nbytes["chain"] = nbytes["hc_pre"] + nbytes["hc_post"]
    rows = []
    for op in ops:
        fused, ref = calls[op]
        got, want = fused(0), ref(0)
        err = rel_err(got, want) if op == "hc_post" else max(rel_err(a, b) for a, b in zip(got, want))
        us = graph_us(each_copy(fused, copies))
        us_ref = graph_us(each_copy(ref, copies)) if torch_ref else float("nan")
        rows.append(dict(op=op, N=n, bytes=nbytes[op], us=us, GB_s=nbytes[op] / us / 1e3, torch_us=us_ref,
                         torch_GB_s=nbytes[op] / us_ref / 1e3, rel_err=err, copies=copies))
    return rows


def bench(device: str | torch.device = "cuda", tokens: Sequence[int] = (1, 4, 16, 2048), hc: int = 4,
          hidden: int = 4096, iters: int = 20, dtype: torch.dtype = torch.bfloat16, config: HcConfig | None = None,
          ops: Sequence[str] = ("hc_pre", "hc_post", "chain"), torch_ref: bool = True,
          l2_miss_bytes: int = 192 << 20, quiet: bool = False, post_config: PostConfig | None = None) -> list[dict]:
    """hc_pre and hc_post, fused vs torch, each replayed from a CUDA graph of `copies` calls on distinct
    inputs (fn, X, out) totalling >= l2_miss_bytes, so each call reads its bytes from DRAM as consecutive
    layers do. GB/s = the bytes a call must move (fn + X read, x/post/comb written; X + out + post/comb read,
    X_new written) / time; rel err = the largest relative L2 error of the fused outputs vs torch. Prints one
    table (unless quiet); returns its rows."""
    device = torch.device(device)
    if not quiet:
        print(f"mHC hc={hc} H={hidden} iters={iters} X {str(dtype)[6:]}; CUDA-graph replay, inputs cycled past L2; "
              f"fused config {'auto' if config is None else config}")
        print(f"{'op':8s} {'N':>5s} {'bytes':>9s} | {'fused us':>9s} {'GB/s':>6s} | {'torch us':>9s} {'GB/s':>6s} | "
              f"{'speedup':>7s}  rel err")
    rows = []
    for n in tokens:
        if n > GEMV_MAX_N:
            ops = [op for op in ops if op != "chain"]   # decode sizes only
        for r in _bench_n(n, device, hc, hidden, iters, dtype, config, ops, torch_ref, l2_miss_bytes, post_config):
            rows.append(r)
            if not quiet:
                print(f"{r['op']:8s} {n:5d} {r['bytes'] / 1e6:7.2f}MB | {r['us']:9.2f} {r['GB_s']:6.0f} | "
                      f"{r['torch_us']:9.2f} {r['torch_GB_s']:6.0f} | {r['torch_us'] / r['us']:6.1f}x  "
                      f"{r['rel_err']:.1e}", flush=True)
        torch.cuda.empty_cache()
    if not quiet and "chain" in ops:
        for n in (t for t in tokens if t <= GEMV_MAX_N):
            chained = 86 * sum(r["us"] for r in rows if r["N"] == n and r["op"] == "chain")
            apart = 86 * sum(r["us"] for r in rows if r["N"] == n and r["op"] != "chain")
            print(f"per decode step at N={n} (43 layers x 2 sites): the chain {chained:6.0f} us, pre + post "
                  f"apart {apart:6.0f} us (without their rms_norm launch)")
    return rows


def _sweep_row(device: str | torch.device, cfg: HcConfig, tokens: Sequence[int]) -> None:
    """One line of `sweep`: cfg's hc_pre times at `tokens`, or why it failed (e.g. triton's OutOfResources)."""
    try:
        rows = bench(device, tokens=tokens, config=cfg, ops=("hc_pre",), torch_ref=False, quiet=True)
    except Exception as e:  # noqa: BLE001 - e.g. triton's OutOfResources: report, go on
        print(f"{cfg}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return
    print(f"{cfg}: " + "  ".join(f"N={r['N']} {r['us']:6.2f} us" for r in rows), flush=True)


def sweep(device: str | torch.device = "cuda", tokens: Sequence[int] = (1, 4, 16)) -> None:
    """hc_pre decode tilings around the default (fused only): which to make the default. The dot logits kernel
    at every N, then the gemv one at each N <= GEMV_MAX_N with BLOCK_N as pick_config sets it."""
    for block_k in (64, 128, 256):
        for warps in (2, 4, 8):
            for mix_warps in (2, 4, 8):
                _sweep_row(device, HcConfig(16, block_k, 0, warps, 3, mix_warps), tokens)
    for n in (t for t in tokens if t <= GEMV_MAX_N):
        for block_k in (64, 128, 256):
            for warps in (1, 2, 4, 8):
                _sweep_row(device, HcConfig(min(GEMV_TILE_N, next_pow2(n)), block_k, 0, warps, 1,
                                            logits_kernel="gemv"), (n,))


def sweep_chain(device: str | torch.device = "cuda", tokens: Sequence[int] = (1, 4, 16)) -> None:
    """The chain's hc_post tilings (columns a partials program and warps): which to make CHAIN_BLOCK_H."""
    for block_h, warps in ((16, 2), (32, 2), (32, 4), (64, 4), (64, 8), (128, 8)):
        rows = bench(device, tokens=tokens, ops=("chain",), torch_ref=False, quiet=True,
                     post_config=PostConfig(num_warps=warps, block_h=block_h))
        print(f"chain post block_h {block_h:4d} warps {warps}: " +
              "  ".join(f"N={r['N']} {r['us']:6.2f} us" for r in rows), flush=True)


if __name__ == "__main__":  # python -m moebox.ops.triton.mhc [--sweep] [--sweep-chain]
    import sys
    bench_start()
    bench()
    if "--sweep" in sys.argv:
        sweep()
    if "--sweep-chain" in sys.argv:
        sweep_chain()
