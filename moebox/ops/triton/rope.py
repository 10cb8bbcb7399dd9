"""The query path of an attention layer after the `from_qr` product in one Triton launch: per head RMSNorm then
RoPE of the q heads, RoPE alone of the indexer's qi heads (CSA layers); the attention output's inverse RoPE
(`inverse_rope_triton`) at decode batches whose attention kernel does not apply it in its combine; and a decode
step's new keys normed, rotated and stored in their window rings (`store_keys_triton`).

Why: at batch 1 a decode step is bound by its chain of dependent launches (~2 us each on the H200). The torch
path costs three inductor kernels a CSA layer (`norm_rope(q)`: a reduction then a pointwise; `apply_rope(qi)`:
one more), two elsewhere; here one launch does both. Grid (N, q head blocks + qi head blocks): a program takes
BH heads of one token, the whole head in registers; its block index says whether they are q or qi heads.
V4-Flash: q 2 heads x 512 a program, qi 8 x 128, so 32 + 8 programs a token, 4 warps (sm_90 build: 52
registers, nothing spilled).

Arithmetic as `moebox.ops.rope.norm_rope` / `apply_rope`: the norm in fp32 (sum of squares / D, rsqrt, times
the optional weight), rounded to the input dtype, then the trailing RD channels rotated in fp32 in interleaved
pairs (2i, 2i+1) by cos/sin of fp32 positions * inv_freq, rounded again. The pair partner of rope channel r is
loaded a second time at r ^ 1 (no reshape): out[r] = x[r] cos -/+ x[r ^ 1] sin (- for even r). FMA contraction
off, cos/sin libdevice's (full range reduction; the interpreter: numpy): results differ from the torch path
only by the order of the sum of squares and the last bit of rsqrt and cos/sin, i.e. by an ulp (of a normed
value, then of the rotation) where a value sits at a rounding midpoint.

`rope_tile` is the same norm and rotation for a kernel that reads the queries: the decode attention kernel
(q) and the indexer's score kernel (qi) take the raw products and rotate them as they load them, so a CSA
layer's decode step has no `query_rope` launch (`Attention._raw_queries`). On the H200 (thirty-second session,
docs/benchmarks.md) that gained 0.02-0.03 ms a step at batch 1 and 2, with the attention kernel's rotation read
before its PDL wait, beside the indexer's kernels; in the other layers the rotation sits on the critical path
and cost about what the launch did (every layer: batch 1 4.80-4.82 ms against 4.81-4.82 without).

Bounds: q [N, Hq, Dq] and qi [N, Hi, Di] (or None) fp32/bf16/fp16 with unit column stride and any token / head
strides (column slices of one product's rows are read in place); positions [N] int; inv_freq [RD/2] fp32,
RD <= Dq and Di; weight None or [Dq]. `moebox.ops.rope.query_rope` takes this path for CUDA decode-size
inputs (up to 16 tokens) outside autograd and torch.compile tracing; `MOEBOX_ROPE_KERNEL=0` keeps torch.
CUDA graphs: a call allocates its outputs with torch.empty and launches one kernel; no host sync.
"""

from __future__ import annotations

import torch

from moebox.ops.triton.runtime import (HAVE_TRITON, cdiv, device_cos, device_sin,  # noqa: F401
                                       interpreting, next_pow2, pdl_args, pdl_start, tl, triton)

TILE = 1024   # elements a program holds (heads per program: TILE // padded head width, at least 1)

if HAVE_TRITON:
    @triton.jit
    def _normed(x, rstd, w_ptrs, mask, HAS_WEIGHT: tl.constexpr):
        """x * rstd (* weight) in fp32, rounded to x's dtype as `rms_norm` returns it."""
        y = x.to(tl.float32) * rstd
        if HAS_WEIGHT:
            y = y * tl.load(w_ptrs, mask=mask, other=0.0).to(tl.float32)
        return y.to(x.dtype)

    @triton.jit
    def _rope_heads(x_row, y_row, w_ptr, inv_ptr, pos, hb, H, stride_h, eps, D: tl.constexpr,
                    D_PAD: tl.constexpr, RD: tl.constexpr, RD_PAD: tl.constexpr, BH: tl.constexpr,
                    NORM: tl.constexpr, HAS_WEIGHT: tl.constexpr, PRECISE: tl.constexpr,
                    INVERSE: tl.constexpr = False):
        """Heads hb*BH.. of one token (its H heads at x_row, stride_h apart): (NORM: RMSNorm, rounded, then) RoPE
        of the last RD channels (INVERSE: the conjugate rotation), rounded to x's dtype, into y_row's [H, D]."""
        heads = hb * BH + tl.arange(0, BH)
        hm = (heads < H)[:, None]
        src = x_row + heads[:, None] * stride_h
        dst = y_row + heads[:, None] * D
        cols = tl.arange(0, D_PAD)[None, :]
        r = tl.arange(0, RD_PAD)
        rc = (D - RD + r)[None, :]              # rope channels
        pc = (D - RD + (r ^ 1))[None, :]        # their pair partners
        m = hm & (cols < D)
        rm = hm & (r < RD)[None, :]
        x = tl.load(src + cols, mask=m, other=0.0)
        xr = tl.load(src + rc, mask=rm, other=0.0)
        xp = tl.load(src + pc, mask=rm, other=0.0)
        if NORM:
            xf = x.to(tl.float32)
            rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)[:, None]
            x = _normed(x, rstd, w_ptr + cols, cols < D, HAS_WEIGHT)
            xr = _normed(xr, rstd, w_ptr + rc, rm, HAS_WEIGHT)
            xp = _normed(xp, rstd, w_ptr + pc, rm, HAS_WEIGHT)
        f = pos * tl.load(inv_ptr + r // 2, mask=r < RD, other=0.0)
        cos, sin = device_cos(f, PRECISE), device_sin(f, PRECISE)
        sin = tl.where((r % 2 == 0) != INVERSE, -sin, sin)
        rot = xr.to(tl.float32) * cos[None, :] + xp.to(tl.float32) * sin[None, :]
        tl.store(dst + cols, x, mask=m & (cols < D - RD))
        tl.store(dst + rc, rot.to(x.dtype), mask=rm)

    @triton.jit
    def rope_pair_angles(col0, pos, inv_ptr, BD: tl.constexpr, D, RD: tl.constexpr):
        """(angles, rotated) [BD / 2] of the column pairs (2i, 2i+1) from col0 of a D-wide head whose trailing RD
        channels are rotated (col0 and D - RD even): pos * inv_freq where a pair is rotated, else 0."""
        c = col0 + 2 * tl.arange(0, BD // 2)                            # each pair's even column
        j = (c - (D - RD)) // 2
        rot = (j >= 0) & (c < D)
        return pos * tl.load(inv_ptr + j, mask=rot, other=0.0), rot

    @triton.jit
    def rope_tile(rows, hm, inv_ptr, pos, eps, D, D_PAD: tl.constexpr, RD: tl.constexpr, NORM: tl.constexpr,
                  PRECISE: tl.constexpr):
        """A consumer's own query heads, as `query_rope` would have written them: rows [BH, 1] pointers to the
        heads' first columns (unit column stride), hm [BH] the heads that exist -> [BH, D_PAD] in their dtype
        (columns past D and missing heads 0): (NORM: RMSNorm without weight, rounded, then) the trailing RD
        channels rotated by pos * inv_freq in pairs, rounded. The pairs are the even/odd columns (D - RD even),
        split from one row load (in-thread: a thread's columns are contiguous) so cos/sin are taken once a
        pair. FMA contraction is the caller's (`_rope_heads` turns it off): results may differ from `query_rope`
        by an ulp of the rotation."""
        cos, sin, rot = rope_tile_angles(inv_ptr, pos, D, D_PAD, RD, PRECISE)
        return rope_tile_by(rows, hm, cos, sin, rot, eps, D, D_PAD, NORM)

    @triton.jit
    def rope_tile_angles(inv_ptr, pos, D, D_PAD: tl.constexpr, RD: tl.constexpr, PRECISE: tl.constexpr):
        """(cos, sin, rotated) [D_PAD / 2] of a head's column pairs at position pos, which `rope_tile_by` rotates
        by: apart from the heads, so a consumer can take them before its PDL wait (positions are the step's
        input, written many launches back) and only load and rotate the heads after it."""
        f, rot = rope_pair_angles(0, pos, inv_ptr, D_PAD, D, RD)
        return device_cos(f, PRECISE), device_sin(f, PRECISE), rot

    @triton.jit
    def rope_tile_by(rows, hm, cos, sin, rot, eps, D, D_PAD: tl.constexpr, NORM: tl.constexpr):
        """`rope_tile` with its angles given (`rope_tile_angles`)."""
        BH: tl.constexpr = hm.shape[0]
        cols = tl.arange(0, D_PAD)
        x = tl.load(rows + cols[None, :], mask=hm[:, None] & (cols < D)[None, :], other=0.0)
        a, b = tl.split(tl.reshape(x, (BH, D_PAD // 2, 2)))
        if NORM:
            af, bf = a.to(tl.float32), b.to(tl.float32)
            rstd = tl.rsqrt((tl.sum(af * af, axis=1) + tl.sum(bf * bf, axis=1)) / D + eps)[:, None]
            a, b = (af * rstd).to(a.dtype), (bf * rstd).to(b.dtype)
        cos, sin = cos[None, :], sin[None, :]
        af, bf = a.to(tl.float32), b.to(tl.float32)
        a2 = tl.where(rot[None, :], (af * cos - bf * sin).to(a.dtype), a)
        b2 = tl.where(rot[None, :], (bf * cos + af * sin).to(b.dtype), b)
        return tl.reshape(tl.join(a2, b2), (BH, D_PAD))

    @triton.jit
    def _query_rope_kernel(q_ptr, qo_ptr, w_ptr, qi_ptr, qio_ptr, pos_ptr, inv_ptr, HQ, HI, NQB, sq_n, sq_h,
                           si_n, si_h, eps, DQ: tl.constexpr, DQ_PAD: tl.constexpr, BHQ: tl.constexpr,
                           DI: tl.constexpr, DI_PAD: tl.constexpr, BHI: tl.constexpr, RD: tl.constexpr,
                           RD_PAD: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_QI: tl.constexpr,
                           PRECISE: tl.constexpr, PDL: tl.constexpr):
        pdl_start(PDL)
        n = tl.program_id(0).to(tl.int64)
        hb = tl.program_id(1)
        pos = tl.load(pos_ptr + n).to(tl.float32)
        if hb < NQB:    # q heads: normed then rotated
            _rope_heads(q_ptr + n * sq_n, qo_ptr + n * HQ * DQ, w_ptr, inv_ptr, pos, hb, HQ, sq_h, eps, DQ, DQ_PAD,
                        RD, RD_PAD, BHQ, True, HAS_WEIGHT, PRECISE)
        else:
            if HAS_QI:  # qi heads: rotated only
                _rope_heads(qi_ptr + n * si_n, qio_ptr + n * HI * DI, w_ptr, inv_ptr, pos, hb - NQB, HI, si_h, eps,
                            DI, DI_PAD, RD, RD_PAD, BHI, False, False, PRECISE)

    @triton.jit
    def _inverse_rope_kernel(x_ptr, y_ptr, pos_ptr, inv_ptr, H, s_n, s_h, D: tl.constexpr, D_PAD: tl.constexpr,
                             BH: tl.constexpr, RD: tl.constexpr, RD_PAD: tl.constexpr, PRECISE: tl.constexpr,
                             PDL: tl.constexpr):
        pdl_start(PDL)
        n = tl.program_id(0).to(tl.int64)
        _rope_heads(x_ptr + n * s_n, y_ptr + n * H * D, x_ptr, inv_ptr, tl.load(pos_ptr + n).to(tl.float32),
                    tl.program_id(1), H, s_h, 0.0, D, D_PAD, RD, RD_PAD, BH, False, False, PRECISE, True)

    @triton.jit
    def _store_keys_kernel(kv_ptr, w_ptr, inv_ptr, pos_ptr, slot_ptr, ring_ptr, vis_ptr, s_kv, s_rs, s_rr, R,
                           window, eps, D: tl.constexpr, D_PAD: tl.constexpr, RD: tl.constexpr,
                           RD_PAD: tl.constexpr, R_PAD: tl.constexpr, PRECISE: tl.constexpr, PDL: tl.constexpr):
        pdl_start(PDL)
        n = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + n).to(tl.int64)
        row = ring_ptr + tl.load(slot_ptr + n).to(tl.int64) * s_rs + (pos % R) * s_rr
        _rope_heads(kv_ptr + n * s_kv, row, w_ptr, inv_ptr, pos.to(tl.float32), 0, 1, 0, eps, D, D_PAD, RD,
                    RD_PAD, 1, True, True, PRECISE)
        # ring row i holds the newest position <= pos that is i mod R (negative: never written)
        i = tl.arange(0, R_PAD)
        kpos = pos - ((pos - i) % R + R) % R
        visible = (kpos > pos - window) & (kpos >= 0)
        tl.store(vis_ptr + n * R + i, visible.to(tl.uint8), mask=i < R)
else:
    rope_tile = rope_pair_angles = None


def rope_tile_fits(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> bool:
    """Whether a consumer kernel can rotate the heads of x [B, H, D] itself with `rope_tile`: positions [B] and
    inv_freq on x's device, 2 * len(inv_freq) = RD <= D with D - RD even (its pairs are even/odd columns)."""
    rd = 2 * inv_freq.numel()
    return (x.dim() == 3 and tuple(positions.shape) == (x.shape[0],) and 0 < rd <= x.shape[2]
            and (x.shape[2] - rd) % 2 == 0 and positions.device == inv_freq.device == x.device)


def _heads(t: torch.Tensor, rd: int, name: str) -> torch.Tensor:
    """t [N, H, D] with unit column stride (copied otherwise), checked against the rope width."""
    if t.dim() != 3 or t.shape[-1] < rd:
        raise ValueError(f"{name} must be [N, H, D] with D >= {rd}, got {tuple(t.shape)}")
    return t if t.stride(-1) == 1 else t.contiguous()


def _block(h: int, d: int) -> tuple[int, int]:
    """(padded head width, heads per program)."""
    d_pad = next_pow2(d)
    return d_pad, min(next_pow2(h), max(1, TILE // d_pad))


def _no_fma() -> dict:
    """Every launch here: FMA contraction off (the roundings of the torch path; the interpreter takes no such
    option)."""
    return {} if interpreting() else {"enable_fp_fusion": False}


def _inv(inv_freq: torch.Tensor, device: torch.device) -> torch.Tensor:
    return inv_freq.to(device=device, dtype=torch.float32).contiguous()


def _positions(positions: torch.Tensor, n: int) -> torch.Tensor:
    if positions.shape != (n,):
        raise ValueError(f"positions must be [{n}], got {tuple(positions.shape)}")
    return positions.contiguous()


def query_rope_triton(q: torch.Tensor, qi: torch.Tensor | None, positions: torch.Tensor, inv_freq: torch.Tensor,
                      eps: float, weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rope(rms_norm(q, weight, eps)), rope(qi)) as `norm_rope` / `apply_rope` compute them, new contiguous
    tensors in the inputs' dtypes, in one launch. Runs on CUDA, or on CPU tensors under TRITON_INTERPRET=1."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed")
    rd = 2 * inv_freq.numel()
    q = _heads(q, rd, "q")
    n, hq, dq = q.shape
    if weight is not None and tuple(weight.shape) != (dq,):
        raise ValueError(f"weight must be [{dq}], got {tuple(weight.shape)}")
    positions = _positions(positions, n)
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    qio = None
    if qi is not None:
        qi = _heads(qi, rd, "qi")
        if qi.shape[0] != n:
            raise ValueError(f"qi must have {n} rows, got {tuple(qi.shape)}")
        qio = torch.empty(qi.shape, dtype=qi.dtype, device=qi.device)
    if n == 0:
        return qo, qio
    inv_freq = _inv(inv_freq, q.device)
    dq_pad, bhq = _block(hq, dq)
    nqb = cdiv(hq, bhq)
    hi, di = (qi.shape[1], qi.shape[2]) if qi is not None else (0, rd)
    di_pad, bhi = _block(max(hi, 1), di)
    ii = qi if qi is not None else q     # stands in for the absent qi (never read)
    _query_rope_kernel[(n, nqb + cdiv(hi, bhi))](
        q, qo, q if weight is None else weight, ii, qio if qio is not None else qo, positions,
        inv_freq, hq, hi, nqb, q.stride(0), q.stride(1), ii.stride(0), ii.stride(1), eps, DQ=dq, DQ_PAD=dq_pad,
        BHQ=bhq, DI=di, DI_PAD=di_pad, BHI=bhi, RD=rd, RD_PAD=next_pow2(rd), HAS_WEIGHT=weight is not None,
        HAS_QI=qi is not None, PRECISE=q.is_cuda, num_warps=4, **_no_fma(), **pdl_args(q, _query_rope_kernel))
    return qo, qio


def inverse_rope_triton(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """apply_rope(x, positions, inv_freq, inverse=True) for x [N, H, D] (fp32/bf16/fp16, unit column stride) as a
    new contiguous tensor, in one launch (the attention output's rotation back at batch 1-3, which the attention
    kernel's combine does from batch 4). Runs on CUDA, or on CPU tensors under TRITON_INTERPRET=1."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed")
    rd = 2 * inv_freq.numel()
    x = _heads(x, rd, "x")
    n, h, d = x.shape
    positions = _positions(positions, n)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if n == 0:
        return y
    d_pad, bh = _block(h, d)
    _inverse_rope_kernel[(n, cdiv(h, bh))](
        x, y, positions, _inv(inv_freq, x.device), h, x.stride(0), x.stride(1), D=d, D_PAD=d_pad, BH=bh, RD=rd,
        RD_PAD=next_pow2(rd), PRECISE=x.is_cuda, num_warps=4, **_no_fma(), **pdl_args(x, _inverse_rope_kernel))
    return y


def store_keys_triton(kv: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor,
                      inv_freq: torch.Tensor, slots: torch.Tensor, ring: torch.Tensor, window: int) -> torch.Tensor:
    """A decode step's new keys, one launch: kv [B, D] (any row stride) normed with `weight`, rotated at
    `positions` (`norm_rope`), rounded to kv's dtype and stored in each sequence's window ring ring[slots[b],
    positions[b] % R] (ring [S, R, D], any dtype, unit column stride); returns which ring rows are inside the
    window [B, R] bool, as `window_mask` (moebox/model/decode_attention.py) does after `norm_rope`. Why: on a
    batch-1 step that is six inductor kernels on attention's key branch, which the main stream waits for
    (moebox/ops/streams.py). Runs on CUDA, or on CPU tensors under TRITON_INTERPRET=1."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed")
    rd = 2 * inv_freq.numel()
    if kv.dim() != 2 or kv.stride(1) != 1 or kv.shape[1] < rd:
        raise ValueError(f"kv must be [B, D >= {rd}] with unit column stride, got {tuple(kv.shape)}")
    b, d = kv.shape
    if ring.dim() != 3 or ring.shape[2] != d or ring.stride(2) != 1:
        raise ValueError(f"ring must be [S, R, {d}] with unit column stride, got {tuple(ring.shape)}")
    if tuple(weight.shape) != (d,) or slots.shape != (b,):
        raise ValueError(f"weight must be [{d}] and slots [{b}], got {tuple(weight.shape)} and {tuple(slots.shape)}")
    positions = _positions(positions, b)
    r = ring.shape[1]
    visible = torch.empty((b, r), dtype=torch.bool, device=kv.device)
    if b == 0:
        return visible
    _store_keys_kernel[(b,)](
        kv, weight, _inv(inv_freq, kv.device), positions,
        slots.contiguous(), ring, visible.view(torch.uint8), kv.stride(0), ring.stride(0), ring.stride(1), r,
        int(window), eps, D=d, D_PAD=next_pow2(d), RD=rd, RD_PAD=next_pow2(rd), R_PAD=next_pow2(r),
        PRECISE=kv.is_cuda, num_warps=4, **_no_fma(), **pdl_args(kv, _store_keys_kernel))
    return visible
