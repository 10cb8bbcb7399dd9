"""Fused mHC (manifold-constrained hyper-connections, deepseek_v4.md §2.2) on the GPU: hc_pre in 2 Triton
kernels, hc_post in 1, hc_head in 2, where the torch references launch ~140, ~7 and ~17 kernels; in a decode
chain (post, then the next site's pre) 2 launches a site, the sub-block's RMSNorm included.

Why: a V4-Flash decode step calls hc_pre and hc_post twice per layer (43 layers: 86 of each). The torch
hc_pre is ~140 tiny kernels (each of the 20 Sinkhorn iterations is 2 x (sum, add, div)); at ~1.1 us per kernel
inside a CUDA graph that is ~150 us per call at any batch, more than a whole layer's weights take to stream.
Fused, a site was still 4 latency-bound launches (logits 6.6 us, mix 5.7 us, the norm 3 us, post 2 us at batch
1: 1.5 ms a step, docs/benchmarks.md ninth session); the logits now ride on the post before them, and the norm
on the mix. The references are the torch functions of moebox.ops.mhc (`hc_pre_reference`, ... re-exported
here); `hc_pre_triton`, ... are the fused paths, which the dispatchers there take for CUDA tensors.

X [N, hc, H] (fp32/bf16/fp16), fn [M, K] with K = hc*H, M = (2+hc)*hc (24 x 16384 fp32 = 1.57 MB) or hc (head):
  Kernel A, `_post_logits_kernel` (grid (token tiles, SPLIT)): the work is hc * cdiv(H, BLOCK_K) steps (stream
    k, BLOCK_K columns of H), SPLIT programs along them; a step loads BLOCK_N tokens' columns of all hc streams
    (Z[0..hc-1], each in its own registers: hc <= 4) and works on stream k. With POST it
    first makes Z the new streams of hc_post, Z[k] = post[k] out + sum_j comb[j, k] X[j] in fp32 with post
    and comb rounded to X's dtype as the reference does (.to(dt)), and stores them with ONE rounding to X's
    dtype (the reference rounds 3 times in bf16: product, matmul, sum; bf16 results differ from it by ~1 ulp
    on some elements). With LOGITS it writes the partials of the next site's hc_pre / hc_head over its
    columns Hs to the fp32 scratch ws [N, SPLIT, W]: the logits Z_flat[Hs] @ fn[:, Hs]^T (tl.dot in fp32
    "ieee", i.e. FMA, never TF32; rms_norm(z) @ fn^T = rsqrt(mean(z^2) + eps) * (z @ fn^T)) in columns < M and
    the streams' Gram matrix G[k, j] = sum_h Z[k, h] Z[j, h] at column M + 4 k + j after them (W =
    `partial_width`). Each partial is written once: no atomics, no zeroing. hc_pre / hc_head run it without
    POST unless a post before them already did. Decode (N <= 16): one 16-token tile and one 128-column step per
    program, SPLIT = 4 * 4096 / 128 = 128 programs, so all of fn is requested at once by ~one program per SM
    (fn is what a decode call must stream). Prefill: 64-token tiles, SPLIT just enough for ~one wave.
  Kernel B, `_mix_kernel` (grid (N, 1 + H / BLOCK_H)): every program sums its token's SPLIT partials in a fixed
    order (deterministic): rs = rsqrt(trace(G) / K + norm_eps) and the logits it needs. Program 0 of a token
    computes post = 2 sigmoid(.) and comb (softmax over k + eps, 1 column and iters-1 (row, column)
    normalisations, eps in every denominator) on the [hc, hc] tile in fp32 registers; the others compute
    pre = sigmoid(.) + eps and x = sum_j pre_j X[j] over their BLOCK_H columns (fp32, one cast to X's dtype),
    concurrently with it. With NORM (the sub-block's RMSNorm weight w) they write rms_norm(x, w) instead: the
    sum of x^2 over all of H is pre^T G pre, so no program needs the whole row (fp32 rounding differs from the
    reference's sum over the bf16 x by ~1e-7 relative, below bf16's resolution unless the pre-weighted streams
    cancel to ~1e-3 of their size). BLOCK_H = one 16-byte vector per thread and stream (1024 bf16 / 512 fp32
    columns with 4 warps): at that width Triton's coalesced [hc, BLOCK_H] layout keeps a column's hc streams
    in one thread, so the sum over streams needs no shared memory.
  hc_head: kernels A and B with M = hc and no post/comb (HEAD).

Bounds: hc <= 4 (kernel B pads it to a power of 2 with masks), any H, N (N = 0 gives empty outputs), iters >= 0; X must be
[N, hc, H] fp32/bf16/fp16 and hc_post's out of X's dtype and shape [N, H], else the dispatchers run the
reference. Results differ from the reference only by fp32 rounding order (partial sums, tree reductions,
Triton's exp / rsqrt / division).

Bytes and time: an hc_pre call moves fn (1.57 MB) + X (N*K*2 bytes bf16: 32 KB a token) + x; X is read by both
kernels (B's read hits L2 at decode). At 4.3 TB/s that is ~0.4 us at N = 1..16, so decode is latency-bound:
launches, kernel A one DRAM round trip per program, kernel B the longer of the x programs and the Sinkhorn
program, a chain of 39 dependent [hc, hc] normalisations. hc_post moves 2*N*K*2 + N*H*2 bytes.
`bench` / `python -m moebox.ops.triton.mhc [--sweep]` times fused vs torch in CUDA-graph replay.

CUDA graphs: a call allocates its outputs (unless given `into`) and the scratch with torch.empty and launches
at most 2 kernels; no host sync, no data-dependent shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch

from moebox.ops.mhc import hc_head_reference, hc_post_reference, hc_pre_reference
from moebox.ops.norm import rms_norm

from moebox.ops.triton.runtime import (HAVE_TRITON, bench_start, cdiv, each_copy, graph_us, next_pow2,  # noqa: F401
                                       num_sms, pdl_args, pdl_start, rel_err, tl, triton)

__all__ = ["CHAIN_MAX_TOKENS", "HcConfig", "pick_config", "resolve_config", "partial_width", "fused_supported",
           "hc_pre_triton", "hc_post_triton", "hc_post_logits_triton", "hc_head_triton", "hc_pre_reference",
           "hc_post_reference", "hc_head_reference", "random_site", "bench", "sweep"]


@dataclass(frozen=True)
class HcConfig:
    """Kernel A tiling (hc_pre / hc_head's logits, hc_post with or without them): BLOCK_N tokens x BLOCK_K
    columns of one stream per step (hc * cdiv(H, BLOCK_K) steps), `split` programs along the steps (0 =
    automatic). Kernel B: mix_warps warps, BLOCK_H columns of H per program (0 = automatic: one 16-byte vector
    per thread, see `_block_h`)."""

    block_n: int = 16
    block_k: int = 128
    split: int = 0
    num_warps: int = 4
    num_stages: int = 3
    mix_warps: int = 4
    block_h: int = 0


MAX_SPLIT = 256  # kernel B loads all partials of a token as one [next_pow2(split), ...] tile


def _block_h(block_h: int, num_warps: int, dtype: torch.dtype, hidden: int) -> int:
    """Columns of H per program of kernel B. Automatic: exactly one 16-byte vector per thread and stream (1024
    bf16 or 512 fp32 columns with 4 warps), the width at which Triton's coalesced [hc, BLOCK_H] layout keeps all
    hc streams of a column in one thread, so sums over streams need no shared memory (narrower tiles spread the
    streams over warps). Capped at H rounded up to a power of 2."""
    if not block_h:
        block_h = 16 // dtype.itemsize * 32 * num_warps
    return min(block_h, next_pow2(hidden))


def pick_config(n: int, hc: int, hidden: int, sms: int = 132) -> HcConfig:
    """The default tiling (split resolved): decode (N <= 16) one 16-token tile and one 128-column step per
    program (128 programs at hc 4, H 4096); prefill 64-token tiles with >= 8 steps per program, ~one wave."""
    if n <= 16:
        cfg = HcConfig(block_n=16, block_k=128, num_warps=4, num_stages=3)
    else:
        cfg = HcConfig(block_n=64, block_k=64, num_warps=4, num_stages=3)
    return resolve_config(cfg, n, hc, hidden, sms)


def resolve_config(cfg: HcConfig, n: int, hc: int, hidden: int, sms: int = 132) -> HcConfig:
    """cfg with split 0 replaced by the automatic choice, and clamped to 1..min(steps, MAX_SPLIT) with every
    split the same number of steps (the last may be shorter)."""
    kb = hc * cdiv(hidden, cfg.block_k)
    split = cfg.split
    if not split:
        tiles = cdiv(n, cfg.block_n)
        split = min(kb, cdiv(2 * sms, tiles)) if n <= 16 else max(1, min(cdiv(sms, tiles), kb // 8))
    split = max(1, min(split, kb, MAX_SPLIT))
    return replace(cfg, split=cdiv(kb, cdiv(kb, split)))


CHAIN_MAX_TOKENS = 16  # hc_post computes the next site's logits up to this many tokens: at 2048 the fused
                       # launch took 1.7 ms against 0.8 for the two (H200, tenth session: all 4 new streams and
                       # their Gram products for each stream's columns, 4x the post's arithmetic)
MAX_HC = 4  # streams the fused kernels take (kernel A holds each in its own registers); V4 has 4


def partial_width(m: int) -> int:
    """Floats per (token, split) in the partials: m logits, then the Gram matrix (4 x 4 entries whatever hc <= 4),
    padded to a power of 2."""
    return next_pow2(m + MAX_HC * MAX_HC)


# ----------------------------------------------------------------------------------------------- kernels
if HAVE_TRITON:
    @triton.jit
    def _stream(X_ptr, rows, stride_Xn, H, hh, mh, j: tl.constexpr, HC: tl.constexpr):
        """Stream j of the tokens `rows` at columns hh, [BLOCK_N, BLOCK_K] fp32 (zeros for j >= HC)."""
        return tl.load(X_ptr + rows[:, None] * stride_Xn + j * H + hh[None, :], mask=mh[None, :] & (j < HC),
                       other=0.0).to(tl.float32)

    @triton.jit
    def _coef(ptr, rows, stride_n, offset, ok: tl.constexpr, Y_ptr):
        """A per-token hc_post coefficient [BLOCK_N, 1], rounded to the streams' dtype as the reference does."""
        c = tl.load(ptr + rows * stride_n + offset, mask=(rows >= 0) & ok, other=0.0)
        return c.to(Y_ptr.dtype.element_ty).to(tl.float32)[:, None]

    @triton.jit
    def _new_stream(o, x0, x1, x2, x3, post_ptr, comb_ptr, Y_ptr, rows, stride_pn, stride_pk, stride_cn, stride_cj,
                    stride_ck, k: tl.constexpr, HC: tl.constexpr):
        """hc_post's stream k: post[k] o + sum_j comb[j, k] X[j] in fp32, rounded once to Y's dtype (as stored)."""
        ok = k < HC
        y = _coef(post_ptr, rows, stride_pn, k * stride_pk, ok, Y_ptr) * o
        y += _coef(comb_ptr, rows, stride_cn, k * stride_ck, ok, Y_ptr) * x0
        y += _coef(comb_ptr, rows, stride_cn, stride_cj + k * stride_ck, ok & (HC > 1), Y_ptr) * x1
        y += _coef(comb_ptr, rows, stride_cn, 2 * stride_cj + k * stride_ck, ok & (HC > 2), Y_ptr) * x2
        y += _coef(comb_ptr, rows, stride_cn, 3 * stride_cj + k * stride_ck, ok & (HC > 3), Y_ptr) * x3
        return y.to(Y_ptr.dtype.element_ty).to(tl.float32)

    @triton.jit
    def _post_logits_kernel(X_ptr, o_ptr, post_ptr, comb_ptr, Y_ptr, fn_ptr, ws_ptr, N, H, M, STEPS_PER_SPLIT,
                            SPLIT, stride_Xn, stride_on, stride_Yn, stride_pn, stride_pk, stride_cn, stride_cj,
                            stride_ck, stride_fm, HC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            M_DOT: tl.constexpr, M_PAD: tl.constexpr, POST: tl.constexpr, LOGITS: tl.constexpr,
                            PDL: tl.constexpr):
        """Steps (stream k, BLOCK_K columns hh of H) of split s, for BLOCK_N tokens: the streams Z at hh are X,
        or with POST the new ones, Z[k] = post[k] o + sum_j comb[j, k] X[j] (Z[k] stored to Y); with LOGITS
        ws[n, s, :M] += Z[k, hh] @ fn[:, k H + hh]^T and ws[n, s, M + 4 k + j] += sum_hh Z[k] Z[j]."""
        pdl_start(PDL)
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
        hb = tl.cdiv(H, BLOCK_K)
        s0 = pid_s * STEPS_PER_SPLIT
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mn = offs_n < N
        rows = tl.minimum(offs_n, N - 1).to(tl.int64)      # rows past N re-read row N-1 and are never stored
        offs_c = tl.arange(0, BLOCK_K)
        offs_m = tl.arange(0, M_DOT)
        offs_g = tl.arange(0, 16)                          # Gram entry 4 k + j (hc <= 4)
        acc = tl.zeros((BLOCK_N, M_DOT), dtype=tl.float32)
        gram = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
        for step in range(s0, tl.minimum(s0 + STEPS_PER_SPLIT, HC * hb)):
            k = step // hb
            hh = (step % hb) * BLOCK_K + offs_c
            mh = hh < H
            z0 = _stream(X_ptr, rows, stride_Xn, H, hh, mh, 0, HC)
            z1 = _stream(X_ptr, rows, stride_Xn, H, hh, mh, 1, HC)
            z2 = _stream(X_ptr, rows, stride_Xn, H, hh, mh, 2, HC)
            z3 = _stream(X_ptr, rows, stride_Xn, H, hh, mh, 3, HC)
            if POST:
                o = tl.load(o_ptr + rows[:, None] * stride_on + hh[None, :], mask=mh[None, :], other=0.0)
                o = o.to(tl.float32)
                cs = (post_ptr, comb_ptr, Y_ptr, rows, stride_pn, stride_pk, stride_cn, stride_cj, stride_ck)
                y0 = _new_stream(o, z0, z1, z2, z3, *cs, 0, HC)
                y1 = _new_stream(o, z0, z1, z2, z3, *cs, 1, HC)
                y2 = _new_stream(o, z0, z1, z2, z3, *cs, 2, HC)
                y3 = _new_stream(o, z0, z1, z2, z3, *cs, 3, HC)
                z0, z1, z2, z3 = y0, y1, y2, y3
            zk = tl.where(k == 0, z0, tl.where(k == 1, z1, tl.where(k == 2, z2, z3)))
            if POST:
                tl.store(Y_ptr + offs_n.to(tl.int64)[:, None] * stride_Yn + k * H + hh[None, :],
                         zk.to(Y_ptr.dtype.element_ty), mask=mn[:, None] & mh[None, :])
            if LOGITS:
                w = tl.load(fn_ptr + offs_m[None, :] * stride_fm + k * H + hh[:, None],
                            mask=(offs_m < M)[None, :] & mh[:, None], other=0.0).to(tl.float32)   # fn^T tile
                acc = tl.dot(zk, w, acc, input_precision="ieee")
                gram += tl.where(offs_g[None, :] == 4 * k, tl.sum(zk * z0, axis=1)[:, None], 0.0)
                gram += tl.where(offs_g[None, :] == 4 * k + 1, tl.sum(zk * z1, axis=1)[:, None], 0.0)
                gram += tl.where(offs_g[None, :] == 4 * k + 2, tl.sum(zk * z2, axis=1)[:, None], 0.0)
                gram += tl.where(offs_g[None, :] == 4 * k + 3, tl.sum(zk * z3, axis=1)[:, None], 0.0)
        if LOGITS:
            ws = ws_ptr + (offs_n.to(tl.int64) * SPLIT + pid_s)[:, None] * M_PAD                 # [BN, 1]
            tl.store(ws + offs_m[None, :], acc, mask=mn[:, None] & (offs_m < M)[None, :])
            tl.store(ws + M + offs_g[None, :], gram, mask=mn[:, None])

    @triton.jit
    def _mix_kernel(X_ptr, ws_ptr, base_ptr, scale_ptr, w_ptr, x_ptr, post_ptr, comb_ptr,
                    H, K, SPLIT, iters, eps, norm_eps, stride_Xn, stride_xn,
                    HC: tl.constexpr, HC_PAD: tl.constexpr, M_PAD: tl.constexpr, S_PAD: tl.constexpr,
                    BLOCK_H: tl.constexpr, HEAD: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr):
        """Per token n: the logits and the Gram matrix G from the partials. Not HEAD: program 0 computes post and
        the Sinkhorn-normalised comb (first, so the longest dependency chain starts first), the other programs x
        over their BLOCK_H columns; HEAD: all programs compute x. NORM: x = rms_norm(x, w), its rms from G."""
        pdl_start(PDL)
        n = tl.program_id(0)
        ph = tl.program_id(1) - (0 if HEAD else 1)     # the H block of an x program; -1: post/comb
        M: tl.constexpr = HC if HEAD else (2 + HC) * HC
        offs_s = tl.arange(0, S_PAD)
        offs_j = tl.arange(0, HC_PAD)
        ms = offs_s < SPLIT
        mj = offs_j < HC
        jk = offs_j[:, None] * HC + offs_j[None, :]                                       # [HC_PAD, HC_PAD]
        valid = mj[:, None] & mj[None, :]
        ws_n = ws_ptr + (n.to(tl.int64) * SPLIT + offs_s) * M_PAD                       # [S_PAD]
        gram = tl.sum(tl.load(ws_n[:, None, None] + M + 4 * offs_j[None, :, None] + offs_j[None, None, :],
                              mask=ms[:, None, None] & valid[None, :, :], other=0.0), axis=0)
        sumsq = tl.sum(tl.sum(tl.where(offs_j[:, None] == offs_j[None, :], gram, 0.0), axis=1), axis=0)
        rs = 1.0 / tl.sqrt(sumsq / K + norm_eps)
        if ph >= 0:
            pre_l = tl.sum(tl.load(ws_n[:, None] + offs_j[None, :], mask=ms[:, None] & mj[None, :], other=0.0),
                           axis=0)
            b_pre = tl.load(base_ptr + offs_j, mask=mj, other=0.0).to(tl.float32)
            pre = tl.sigmoid(pre_l * rs * tl.load(scale_ptr).to(tl.float32) + b_pre) + eps
            hh = ph * BLOCK_H + tl.arange(0, BLOCK_H)
            mh = hh < H
            Xt = tl.load(X_ptr + n.to(tl.int64) * stride_Xn + offs_j[:, None] * H + hh[None, :],
                         mask=mj[:, None] & mh[None, :], other=0.0).to(tl.float32)
            x = tl.sum(pre[:, None] * Xt, axis=0)
            if NORM:   # sum_h x_h^2 = pre^T G pre: x's rms without a pass over all of H
                x = x.to(x_ptr.dtype.element_ty).to(tl.float32)           # the reference norms x in its dtype
                ss = tl.sum(tl.sum(gram * pre[:, None] * pre[None, :], axis=1), axis=0)
                x = x * (1.0 / tl.sqrt(ss / H + norm_eps)) * tl.load(w_ptr + hh, mask=mh, other=0.0).to(tl.float32)
            tl.store(x_ptr + n.to(tl.int64) * stride_xn + hh, x.to(x_ptr.dtype.element_ty), mask=mh)
        elif not HEAD:
            post_l = tl.sum(tl.load(ws_n[:, None] + HC + offs_j[None, :], mask=ms[:, None] & mj[None, :],
                                    other=0.0), axis=0)
            b_post = tl.load(base_ptr + HC + offs_j, mask=mj, other=0.0).to(tl.float32)
            post = 2.0 * tl.sigmoid(post_l * rs * tl.load(scale_ptr + 1).to(tl.float32) + b_post)
            tl.store(post_ptr + n.to(tl.int64) * HC + offs_j, post, mask=mj)
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


# ---------------------------------------------------------------------------------------------- wrappers
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fused_supported(X: torch.Tensor, out: torch.Tensor | None = None) -> bool:
    """Whether the fused kernels take these streams (and sub-block output): X [N, hc, H] fp32/bf16/fp16, out of
    X's dtype and shape [N, H]."""
    if X.dim() != 3 or X.dtype not in _DTYPES or X.shape[1] > MAX_HC:
        return False
    return out is None or (out.dtype == X.dtype and tuple(out.shape) == (X.shape[0], X.shape[2]))


def _streams(X: torch.Tensor) -> torch.Tensor:
    """X with each token's hc*H values contiguous (any token stride)."""
    if X.dim() != 3 or X.dtype not in _DTYPES or X.shape[1] > MAX_HC:
        raise ValueError(f"X must be [N, hc <= {MAX_HC}, H] fp32/bf16/fp16, got {tuple(X.shape)} {X.dtype}")
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


def _config(config: HcConfig | None, X: torch.Tensor) -> HcConfig:
    n, hc, hidden = X.shape
    sms = num_sms(X.device)
    return pick_config(n, hc, hidden, sms) if config is None else resolve_config(config, n, hc, hidden, sms)


def _kernel_a(X: torch.Tensor, cfg: HcConfig, fn: torch.Tensor | None, m: int,
              post_args: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor | None:
    """Kernel A over the streams X: with post_args = (out, post, comb, y) the new streams go to y (hc_post) and
    the logits are of those; with fn the fp32 partials [N, split, partial_width(m)] come back (else None)."""
    n, hc, hidden = X.shape
    ws = None
    if fn is not None:
        if tuple(fn.shape) != (m, hc * hidden):
            raise ValueError(f"fn must be [{m}, {hc * hidden}], got {tuple(fn.shape)}")
        fn = _rows(fn)
        ws = torch.empty((n, cfg.split, partial_width(m)), dtype=torch.float32, device=X.device)
    out, post, comb, y = post_args if post_args is not None else (X, X, X, X)
    per = cdiv(hc * cdiv(hidden, cfg.block_k), cfg.split)
    _post_logits_kernel[(cdiv(n, cfg.block_n), cfg.split)](
        X, out, post, comb, y, X if fn is None else fn, X if ws is None else ws, n, hidden, m, per, cfg.split,
        X.stride(0), out.stride(0), y.stride(0), post.stride(0), post.stride(-1), comb.stride(0),
        comb.stride(1) if comb.dim() == 3 else 0, comb.stride(-1), 0 if fn is None else fn.stride(0),
        HC=hc, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, M_DOT=max(16, next_pow2(m)),
        M_PAD=partial_width(m), POST=post_args is not None, LOGITS=fn is not None, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl_args(X))
    return ws


def _check_norm(norm: torch.Tensor | None, hidden: int) -> None:
    if norm is not None and norm.numel() != hidden:
        raise ValueError(f"the norm weight must have {hidden} elements, got {norm.numel()}")


def _checked_partials(partials: torch.Tensor, n: int, m: int) -> torch.Tensor:
    if (partials.dim() != 3 or partials.shape[0] != n or partials.shape[2] != partial_width(m)
            or not 1 <= partials.shape[1] <= MAX_SPLIT or partials.dtype != torch.float32
            or not partials.is_contiguous()):
        raise ValueError(f"partials must be contiguous fp32 [{n}, split <= {MAX_SPLIT}, {partial_width(m)}] "
                         f"(from hc_post_logits_triton with this site's fn), got {tuple(partials.shape)} "
                         f"{partials.dtype}")
    return partials


def _mix(X: torch.Tensor, ws: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, x: torch.Tensor,
         post: torch.Tensor | None, comb: torch.Tensor | None, norm: torch.Tensor | None, cfg: HcConfig, iters: int,
         eps: float, norm_eps: float) -> None:
    """Kernel B: x, normalised with the weight `norm` unless None (and post, comb unless hc_head)."""
    n, hc, hidden = X.shape
    head = post is None
    block_h = _block_h(cfg.block_h, cfg.mix_warps, X.dtype, hidden)
    h_blocks = cdiv(hidden, block_h)
    split = ws.shape[1]
    _mix_kernel[(n, h_blocks + (0 if head else 1))](
        X, ws, _rows(base), _rows(scale), x if norm is None else _rows(norm), x, x if head else post,
        x if head else comb, hidden, hc * hidden, split, iters, eps, norm_eps, X.stride(0), x.stride(0),
        HC=hc, HC_PAD=next_pow2(hc), M_PAD=ws.shape[2], S_PAD=next_pow2(split), BLOCK_H=block_h, HEAD=head,
        NORM=norm is not None, num_warps=cfg.mix_warps, **pdl_args(X))


def hc_pre_triton(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, iters: int,
                  eps: float, norm_eps: float, norm: torch.Tensor | None = None, partials: torch.Tensor | None = None,
                  into: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                  config: HcConfig | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused hc_pre: X [N, hc, H] -> (x [N, H] in X's dtype, post [N, hc] fp32, comb [N, hc, hc] fp32), as
    `hc_pre_reference`; with `norm` x is `rms_norm(x, norm, norm_eps)`. `partials`: kernel A's output for these
    streams and fn from `hc_post_logits_triton` (then only kernel B runs). `into` = (x, post, comb) buffers to
    fill (every element written). Runs on CUDA, or on CPU tensors under TRITON_INTERPRET=1."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed")
    X = _streams(X)
    n, hc, hidden = X.shape
    m = (2 + hc) * hc
    if base.numel() != m or scale.numel() < 3:
        raise ValueError(f"base must have {m} elements and scale 3, got {base.numel()} and {scale.numel()}")
    _check_norm(norm, hidden)
    bx, bp, bc = into if into is not None else (None, None, None)
    x = _filled(bx, (n, hidden), X.dtype, X.device, "x")
    post = _filled(bp, (n, hc), torch.float32, X.device, "post")
    comb = _filled(bc, (n, hc, hc), torch.float32, X.device, "comb")
    if n == 0:
        return x, post, comb
    cfg = _config(config, X)
    ws = _kernel_a(X, cfg, fn, m) if partials is None else _checked_partials(partials, n, m)
    _mix(X, ws, base, scale, x, post, comb, norm, cfg, iters, eps, norm_eps)
    return x, post, comb


def hc_head_triton(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, eps: float,
                   norm_eps: float, norm: torch.Tensor | None = None, partials: torch.Tensor | None = None,
                   into: torch.Tensor | None = None, config: HcConfig | None = None) -> torch.Tensor:
    """Fused hc_head: X [N, hc, H] -> y [N, H] in X's dtype, as `hc_head_reference` (`norm`, `partials`: as in
    `hc_pre_triton`)."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed")
    X = _streams(X)
    n, hc, hidden = X.shape
    if base.numel() != hc or scale.numel() < 1:
        raise ValueError(f"base must have {hc} elements and scale 1, got {base.numel()} and {scale.numel()}")
    _check_norm(norm, hidden)
    y = _filled(into, (n, hidden), X.dtype, X.device, "y")
    if n == 0:
        return y
    cfg = _config(config, X)
    ws = _kernel_a(X, cfg, fn, hc) if partials is None else _checked_partials(partials, n, hc)
    _mix(X, ws, base, scale, y, None, None, norm, cfg, 0, eps, norm_eps)
    return y


def hc_post_logits_triton(out: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                          next_fn: torch.Tensor | None, *, into: torch.Tensor | None = None,
                          config: HcConfig | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fused hc_post, as `hc_post_reference`: X_new [N, hc, H] in X's dtype (out [N, H] of X's dtype, post
    [N, hc], comb [N, hc, hc]); with `next_fn` (the next mHC site's fn, [M, hc H] with M = (2 + hc) hc, or hc for
    the head) in the same launch the partials of that site's hc_pre / hc_head over X_new, else None. `into`: the
    X_new buffer to fill; it must not alias X."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed")
    X = _streams(X)
    n, hc, hidden = X.shape
    if not fused_supported(X, out) or tuple(post.shape) != (n, hc) or tuple(comb.shape) != (n, hc, hc):
        raise ValueError(f"shapes/dtypes: out {tuple(out.shape)} {out.dtype}, X {tuple(X.shape)} {X.dtype}, "
                         f"post {tuple(post.shape)}, comb {tuple(comb.shape)}")
    y = _filled(into, (n, hc, hidden), X.dtype, X.device, "X_new")
    if n == 0 or hidden == 0:
        return y, None
    m = 0 if next_fn is None else next_fn.shape[0]
    ws = _kernel_a(X, _config(config, X), next_fn, m, (_rows(out), post, comb, y))
    return y, ws


def hc_post_triton(out: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, *,
                   into: torch.Tensor | None = None, config: HcConfig | None = None) -> torch.Tensor:
    """Fused hc_post alone: `hc_post_logits_triton` without a next site."""
    return hc_post_logits_triton(out, X, post, comb, None, into=into, config=config)[0]


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


def _normed(pre: tuple[torch.Tensor, ...], norm: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (rms_norm(pre[0], norm, 1e-6), *pre[1:])


def _bench_n(n: int, device: torch.device, hc: int, hidden: int, iters: int, dtype: torch.dtype,
             config: HcConfig | None, ops: Sequence[str], torch_ref: bool, l2_miss_bytes: int) -> list[dict]:
    """The bench rows of one N (its inputs are freed on return)."""
    kw = dict(iters=iters, eps=1e-6, norm_eps=1e-6)
    esz = dtype.itemsize
    m, k = (2 + hc) * hc, hc * hidden
    nbytes = {"hc_pre": m * k * 4 + n * k * esz + n * hidden * esz + n * (hc + hc * hc) * 4,
              "hc_post": 2 * n * k * esz + n * hidden * esz + n * (hc + hc * hc) * 4}
    nbytes["post+logits"] = nbytes["hc_post"] + m * k * 4
    nbytes["mix+norm"] = n * k * esz + n * hidden * esz + n * (hc + hc * hc) * 4
    copies = max(1, min(64, cdiv(l2_miss_bytes, nbytes["hc_pre"])))
    sites = [random_site(n, hc, hidden, dtype, device, seed=i) for i in range(copies)]
    outs = [torch.randn((n, hidden), device=device).to(dtype) for _ in range(copies)]
    mixes = [hc_pre_reference(*site, **kw) for site in sites]
    norm = torch.ones(hidden, device=device)
    partials = [_kernel_a(_streams(X), _config(None, X), fn, m) for X, fn, *_ in sites]   # as a post leaves them
    calls = {"hc_pre": (lambda i: hc_pre_triton(*sites[i], **kw, config=config),
                        lambda i: hc_pre_reference(*sites[i], **kw)),
             "hc_post": (lambda i: hc_post_triton(outs[i], sites[i][0], mixes[i][1], mixes[i][2]),
                         lambda i: hc_post_reference(outs[i], sites[i][0], mixes[i][1], mixes[i][2])),
             # the decode chain's two launches a site: post with the next site's logits, then its mix and norm
             "post+logits": (lambda i: hc_post_logits_triton(outs[i], sites[i][0], mixes[i][1], mixes[i][2],
                                                             sites[i][1])[0],
                             lambda i: hc_post_reference(outs[i], sites[i][0], mixes[i][1], mixes[i][2])),
             "mix+norm": (lambda i: hc_pre_triton(*sites[i], **kw, norm=norm, partials=partials[i]),
                          lambda i: _normed(hc_pre_reference(*sites[i], **kw), norm))}
    rows = []
    for op in ops:
        fused, ref = calls[op]
        got, want = fused(0), ref(0)
        err = max(rel_err(a, b) for a, b in zip(got, want)) if op in ("hc_pre", "mix+norm") else rel_err(got, want)
        us = graph_us(each_copy(fused, copies))
        us_ref = graph_us(each_copy(ref, copies)) if torch_ref else float("nan")
        rows.append(dict(op=op, N=n, bytes=nbytes[op], us=us, GB_s=nbytes[op] / us / 1e3, torch_us=us_ref,
                         torch_GB_s=nbytes[op] / us_ref / 1e3, rel_err=err, copies=copies))
    return rows


def bench(device: str | torch.device = "cuda", tokens: Sequence[int] = (1, 4, 16, 2048), hc: int = 4,
          hidden: int = 4096, iters: int = 20, dtype: torch.dtype = torch.bfloat16, config: HcConfig | None = None,
          ops: Sequence[str] = ("hc_pre", "hc_post", "post+logits", "mix+norm"), torch_ref: bool = True,
          l2_miss_bytes: int = 192 << 20, quiet: bool = False) -> list[dict]:
    """hc_pre, hc_post and the decode chain's two launches (post with the next site's logits; the mix and the
    RMSNorm), fused vs torch, each replayed from a CUDA graph of `copies` calls on distinct
    inputs (fn, X, out) totalling >= l2_miss_bytes, so each call reads its bytes from DRAM as consecutive
    layers do. GB/s = the bytes a call must move (fn + X read, x/post/comb written; X + out + post/comb read,
    X_new written) / time; rel err = the largest relative L2 error of the fused outputs vs torch. Prints one
    table (unless quiet); returns its rows."""
    device = torch.device(device)
    if not quiet:
        print(f"mHC hc={hc} H={hidden} iters={iters} X {str(dtype)[6:]}; CUDA-graph replay, inputs cycled past L2; "
              f"fused config {'auto' if config is None else config}")
        print(f"{'op':11s} {'N':>5s} {'bytes':>9s} | {'fused us':>9s} {'GB/s':>6s} | {'torch us':>9s} {'GB/s':>6s} | "
              f"{'speedup':>7s}  rel err")
    rows = []
    for n in tokens:
        for r in _bench_n(n, device, hc, hidden, iters, dtype, config, ops, torch_ref, l2_miss_bytes):
            rows.append(r)
            if not quiet:
                print(f"{r['op']:11s} {n:5d} {r['bytes'] / 1e6:7.2f}MB | {r['us']:9.2f} {r['GB_s']:6.0f} | "
                      f"{r['torch_us']:9.2f} {r['torch_GB_s']:6.0f} | {r['torch_us'] / r['us']:6.1f}x  "
                      f"{r['rel_err']:.1e}", flush=True)
        torch.cuda.empty_cache()
    if not quiet:
        for n in (t for t in tokens if t <= 16):
            us = {r["op"]: r["us"] for r in rows if r["N"] == n}
            line = f"per decode step at N={n} (43 layers x 2 sites):"
            if {"hc_pre", "hc_post"} <= us.keys():
                line += f" pre + post {86 * (us['hc_pre'] + us['hc_post']):6.0f} us (+ the sub-block norms)"
            if {"post+logits", "mix+norm"} <= us.keys():
                line += f", chained (post+logits, mix+norm) {86 * (us['post+logits'] + us['mix+norm']):6.0f} us"
            print(line)
    return rows


def sweep(device: str | torch.device = "cuda", tokens: Sequence[int] = (1, 16)) -> None:
    """hc_pre decode tilings around the default (fused only): which to make the default."""
    for block_k in (64, 128, 256):
        for warps in (2, 4, 8):
            for mix_warps in (2, 4, 8):
                cfg = HcConfig(16, block_k, 0, warps, 3, mix_warps)
                try:
                    rows = bench(device, tokens=tokens, config=cfg, ops=("hc_pre",), torch_ref=False, quiet=True)
                except Exception as e:  # noqa: BLE001 - e.g. triton's OutOfResources: report, go on
                    print(f"{cfg}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                print(f"{cfg}: " + "  ".join(f"N={r['N']} {r['us']:6.2f} us" for r in rows), flush=True)


if __name__ == "__main__":  # python -m moebox.ops.triton.mhc [--sweep]
    import sys
    bench_start()
    bench()
    if "--sweep" in sys.argv:
        sweep()
