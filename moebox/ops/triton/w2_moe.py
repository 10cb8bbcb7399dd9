"""Routed experts from w2 planes on the GPU, decode path (a few tokens): two Triton kernels.

    out[t] = sum_j  W2_e ( w_tj * silu(min(W1_e x_t, L)) * clamp(W3_e x_t, -L, L) ),   e = expert_ids[t, j]

the semantics of `moebox.ops.moe.routed_experts` (gate/up in fp32, clamp, SiLU, routing weight applied to h
before the down projection, sum over the k experts). `w2_moe_decode_reference` is that torch code.

Kernel 1, `_gate_up_kernel`, grid (N*k pairs, I / ROWS): one program per (token, expert) pair and block of
  ROWS rows of I. It streams the w1 and the w3 rows of the pair's expert over all of H (both planes in one
  loop, fp32 accumulation), applies clamp/SiLU/product and the routing weight and writes h (fp32) to a small
  scratch [N*k, I] in the word-transposed order kernel 2 reads with unit stride.
Kernel 2, `_down_kernel`, grid (N, H / ROWS): one program per token and block of ROWS rows of H; it loops
  over the token's k experts (the reduction over k is inside the program, no atomics): the sum is exact fp32
  in registers, deterministic, each output element is written exactly once, in the output dtype, so `out`
  needs no zeroing and no extra cast kernel.
  The pair (kernel 1) / token (kernel 2) is grid axis 0, the fastest-varying one, so programs that read the
  same expert rows (the same expert picked by several tokens) run at the same time and the repeat reads hit
  L2: DRAM traffic stays about one read of each distinct expert's planes per call.

In-register dequant (the part that decides whether the kernel is memory- or issue-bound). Codes are read as
int32 words of 16 codes (column 16w+m in bits 2m..2m+1, which is w2.py's byte layout read little-endian);
each program loads a [ROWS, WORDS] tile of words per step (16-byte vector loads along the row). Per word,
~10 integer ops precompute two 16-bit-wide words holding, for each code, a "big" bit (|level| = 4: code 0
or 3) at bit 2m and a "negative" bit (code 0 or 1) at bit 2m+7. Then for each code m (unrolled, constant
shifts) ONE shift and ONE and/or give the fp32 bit pattern of level/4 directly:

    bits = ((q << (24 - 2m)) & 0x81000000) | 0x3E800000     -> +-0.25 or +-1.0

(bit 24 is exponent bit 1: 2^-2 -> 2^0; bit 31 the sign), so a weight costs 2 integer ops + 1 FMA per
token. The 16 products of a word are summed first, then multiplied once by the word's scale: the E8M0 byte
s is placed straight into the fp32 exponent, ((s + 2) << 23) = 4 * 2^(s-127) (the 4 undoes level/4; exact for
s in 0..252, i.e. for every scale up to 2^125). Activations are loaded as fp32 (bf16 converted in registers).
x is read with stride 16 (x[16w+m] for the tile's words) from L1; h is written by kernel 1 in the
transposed order [pair, m, I/16] so kernel 2 reads it contiguously.

Bytes and the bandwidth to approach. One expert = 3 matrices of I*H weights at 2.25 bits:
3 * (I*H/4 + I*H/32) bytes; V4-Flash (H=4096, I=2048): 7,077,888 B = 7.08 MB. A call reads each DISTINCT
expert of the batch once from DRAM (repeats come from L2, see above) plus x/h/out (negligible):
    N=1, k=6:  6 experts   =  42.5 MB  -> 9.9 us at 4.3 TB/s (the H200 device-copy rate measured here)
    N=4:      ~23.2 experts (random routing, E=256) = 164 MB  -> 38 us
    N=16:     ~80.8 experts = 572 MB  -> 133 us
`bench` reports the exact distinct-expert bytes of its routing and GB/s over them; the target is the copy
bandwidth (~4.3 TB/s; >= 70% of it is the issue's goal). What may bound it instead: instruction issue. The
SASS of both kernels for sm_90 (compiled ahead of time on a CPU machine, Triton 3.9, ROWS=16, WORDS=32, 4
warps; not yet timed) has ~5.1 instructions per weight in the loop body at N=1 (the ideal 3: shift, and/or,
FFMA; the rest is the per-word sign/big precompute, rematerialized mask constants, addresses and loads). The
SMs issue ~3.3e13 thread-instructions/s (132 SMs x 128 lanes x 1.98 GHz), i.e. ~6.5e12 weights/s = ~1.5 TB/s
of planes (4.44 weights a byte): expect roughly 35% of the copy bandwidth at N=1 until the dequant gets
cheaper. Pairs that share an expert (N > 1) are dequantized once per pair (L2 saves the bytes, not the ALU
work). Next steps, in order of payoff: (1) tensor cores with the dequant done on bf16x2 pairs: the same trick
places codes m and m+8 of a word in one register as two bf16 (((q << (8 - 2m)) & 0x81008100) | 0x3E803E80, for
4 codes per q word), 1 instruction per weight, the products and the fp32 sum in mma (needs inline PTX or a
Triton dot operand layout that keeps the registers); (2) group pairs by expert so one program serves all
tokens of an expert. `config.transpose_x` trades the stride-16 x gathers of kernel 1 for one small copy
kernel; `python -m moebox.ops.triton.w2_moe --sweep` times the variants.

Layout the kernels take (`w2_moe_decode_split`): for w1, w3 and w2, codes uint8 [E, rows, cols/4] and scales
E8M0 (float8_e8m0fnu or uint8) [E, rows, cols/32], rows contiguous within an expert, any expert stride
(a multiple of 4 bytes for codes). w1 and w3 must share their strides. So the planes can be stacked tensors
(`stack_planes`) or zero-copy views of a plane-store layer buffer [E, slot stride] (`layer_views`).
`w2_moe_decode` takes the w13 stacked form the brief names: w13 = [E, 2I, ...], w1 rows then w3 rows.

CUDA graphs: the call allocates h and out with torch.empty (graph-safe with the caching allocator) and
launches 2 kernels (3 with transpose_x); no host sync, no data-dependent shapes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from moebox.ops.moe import routed_experts
from moebox.quant.w2 import W2Tensor

from moebox.ops.triton.runtime import HAVE_TRITON, tl, triton  # noqa: F401 - Triton is optional


@dataclass(frozen=True)
class DecodeConfig:
    """Block shapes: ROWS output rows x WORDS int32 code words (16 columns each) per program and step."""

    gate_rows: int = 16
    gate_words: int = 32
    gate_warps: int = 4
    down_rows: int = 16
    down_words: int = 32
    down_warps: int = 4
    num_stages: int = 3
    transpose_x: bool = False


DEFAULT_CONFIG = DecodeConfig()


def expert_bytes(hidden: int, intermediate: int) -> int:
    """Plane bytes of one expert (w1, w3, w2 codes + scales)."""
    n = hidden * intermediate
    return 3 * (n // 4 + n // 32)


# ----------------------------------------------------------------------------------------------- kernels
if HAVE_TRITON:
    # int32 bit patterns (written as negative numbers where bit 31 is set, so they stay int32)
    _HI_BITS = tl.constexpr(-1431655766)    # 0xAAAAAAAA: bit 2m+1 of every code
    _LO_BITS = tl.constexpr(0x55555555)     # bit 2m
    _SIGN_EXP1 = tl.constexpr(-2130706432)  # 0x81000000: fp32 sign bit | exponent bit 1
    _QUARTER = tl.constexpr(0x3E800000)     # 0.25f: exponent 125, exponent bit 1 clear

    @triton.jit
    def _sign_big_words(cw):
        """int32 code words -> (q_lo, q_hi): for codes 0..7 (q_lo) and 8..15 (q_hi, as code m - 8), the
        "big" bit (codes 0 and 3, |level| = 4) at bit 2m and the "negative" bit (codes 0 and 1) at bit 2m+7."""
        big = ~(cw ^ (cw >> 1)) & _LO_BITS         # bit 2m: lo == hi
        neg = ~cw & _HI_BITS                       # bit 2m+1: hi == 0
        q_lo = (big & 0xFFFF) | ((neg & 0xFFFF) << 6)
        q_hi = ((big >> 16) & 0xFFFF) | (((neg >> 16) & 0xFFFF) << 6)
        return q_lo, q_hi

    @triton.jit
    def _level_quarter(q, m: tl.constexpr):
        """level(code m) / 4 as fp32 (+-0.25 or +-1.0): bit 2m -> exponent bit 1 (bit 24), bit 2m+7 -> sign."""
        return (((q << (24 - 2 * m)) & _SIGN_EXP1) | _QUARTER).to(tl.float32, bitcast=True)

    @triton.jit
    def _word_dot(cw, v_ptr, wi, v_stride):
        """cw: int32 [R, W] code words; the 16 inputs of word w at v_ptr + m * v_stride + wi[w]
        -> fp32 [R, W]: sum_m level(code_m) / 4 * v_m (the caller applies the scale)."""
        q_lo, q_hi = _sign_big_words(cw)
        acc = tl.zeros(cw.shape, dtype=tl.float32)
        for m in tl.static_range(8):
            v = tl.load(v_ptr + m * v_stride + wi).to(tl.float32)
            acc += _level_quarter(q_lo, m) * v[None, :]
        for m in tl.static_range(8):
            v = tl.load(v_ptr + (m + 8) * v_stride + wi).to(tl.float32)
            acc += _level_quarter(q_hi, m) * v[None, :]
        return acc

    @triton.jit
    def _word_dot2(ca, cb, v_ptr, wi, v_stride):
        """`_word_dot` of two code tiles (w1 and w3 rows) against the same inputs, each input loaded once."""
        qa_lo, qa_hi = _sign_big_words(ca)
        qb_lo, qb_hi = _sign_big_words(cb)
        acc_a = tl.zeros(ca.shape, dtype=tl.float32)
        acc_b = tl.zeros(cb.shape, dtype=tl.float32)
        for m in tl.static_range(8):
            v = tl.load(v_ptr + m * v_stride + wi).to(tl.float32)[None, :]
            acc_a += _level_quarter(qa_lo, m) * v
            acc_b += _level_quarter(qb_lo, m) * v
        for m in tl.static_range(8):
            v = tl.load(v_ptr + (m + 8) * v_stride + wi).to(tl.float32)[None, :]
            acc_a += _level_quarter(qa_hi, m) * v
            acc_b += _level_quarter(qb_hi, m) * v
        return acc_a, acc_b

    @triton.jit
    def _scale_x4(s):
        """E8M0 bytes (uint8 tensor) -> 4 * 2^(s-127) as fp32, built in the exponent field."""
        return ((s.to(tl.int32) + 2) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _gate_up_kernel(x_ptr, ids_ptr, rw_ptr, w1c_ptr, w1s_ptr, w3c_ptr, w3s_ptr, h_ptr,
                        x_row_stride, c_expert_stride, s_expert_stride, limit,
                        I: tl.constexpr, HW: tl.constexpr, K: tl.constexpr, HAS_LIMIT: tl.constexpr,
                        X_WORDS: tl.constexpr, ROWS: tl.constexpr, WORDS: tl.constexpr):
        p = tl.program_id(0)                        # (token, expert) pair, t * K + j
        rb = tl.program_id(1)
        t = p // K
        e = tl.load(ids_ptr + p).to(tl.int64)
        rw = tl.load(rw_ptr + p).to(tl.float32)
        rows = rb * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, WORDS)
        c_row = e * c_expert_stride + rows[:, None].to(tl.int64) * HW          # int32 words
        s_row = e * s_expert_stride + rows[:, None].to(tl.int64) * (HW // 2)   # bytes
        x_base = x_ptr + t.to(tl.int64) * x_row_stride
        acc_g = tl.zeros((ROWS, WORDS), dtype=tl.float32)
        acc_u = tl.zeros((ROWS, WORDS), dtype=tl.float32)
        for w0 in range(0, HW, WORDS):
            wi = w0 + cols
            c1 = tl.load(w1c_ptr + c_row + wi[None, :])
            c3 = tl.load(w3c_ptr + c_row + wi[None, :])
            s1 = tl.load(w1s_ptr + s_row + (wi // 2)[None, :])
            s3 = tl.load(w3s_ptr + s_row + (wi // 2)[None, :])
            # each x element is loaded once for w1 and w3
            if X_WORDS:   # x given word-transposed [N, 16, H/16]: x[16 w + m] at m * HW + w, unit stride
                d1, d3 = _word_dot2(c1, c3, x_base, wi, HW)
            else:         # x [N, H]: x[16 w + m] at m + 16 w, stride-16 gathers from L1
                d1, d3 = _word_dot2(c1, c3, x_base, wi * 16, 1)
            acc_g += d1 * _scale_x4(s1)
            acc_u += d3 * _scale_x4(s3)
        g = tl.sum(acc_g, axis=1)
        u = tl.sum(acc_u, axis=1)
        if HAS_LIMIT:
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
        h = g / (1.0 + tl.exp(-g)) * u * rw
        # transposed store: row r = 16 q + m goes to [p, m, q], so kernel 2 reads h[16 q + m] at m * (I/16) + q
        IW: tl.constexpr = I // 16
        dst = p.to(tl.int64) * I + (rows % 16) * IW + rows // 16
        tl.store(h_ptr + dst, h)

    @triton.jit
    def _down_kernel(h_ptr, ids_ptr, w2c_ptr, w2s_ptr, out_ptr,
                     out_row_stride, c_expert_stride, s_expert_stride,
                     H: tl.constexpr, IW: tl.constexpr, K: tl.constexpr,
                     ROWS: tl.constexpr, WORDS: tl.constexpr):
        t = tl.program_id(0)
        rb = tl.program_id(1)
        rows = rb * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, WORDS)
        row_c = rows[:, None].to(tl.int64) * IW
        row_s = rows[:, None].to(tl.int64) * (IW // 2)
        acc = tl.zeros((ROWS, WORDS), dtype=tl.float32)
        STEPS: tl.constexpr = IW // WORDS
        # one flat loop over (expert j, word block) so the pipeliner keeps loads in flight across experts
        for it in range(0, K * STEPS):
            j = it // STEPS
            w0 = (it % STEPS) * WORDS
            p = t * K + j
            e = tl.load(ids_ptr + p).to(tl.int64)
            wi = w0 + cols
            c = tl.load(w2c_ptr + e * c_expert_stride + row_c + wi[None, :])
            s = tl.load(w2s_ptr + e * s_expert_stride + row_s + (wi // 2)[None, :])
            hp = h_ptr + p.to(tl.int64) * (IW * 16)
            acc += _word_dot(c, hp, wi, IW) * _scale_x4(s)
        y = tl.sum(acc, axis=1)
        tl.store(out_ptr + t.to(tl.int64) * out_row_stride + rows, y.to(out_ptr.dtype.element_ty))


# ---------------------------------------------------------------------------------------------- wrappers
def _pow2_block(want: int, size: int) -> int:
    """Largest power of two <= want that divides size."""
    b = 1 << int(math.log2(max(1, want)))
    while size % b:
        b //= 2
    return b


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _check_planes(codes: torch.Tensor, scales: torch.Tensor, rows: int, cols: int, name: str) -> None:
    if codes.dim() != 3 or tuple(codes.shape[1:]) != (rows, cols // 4):
        raise ValueError(f"{name} codes: want [E, {rows}, {cols // 4}], got {tuple(codes.shape)}")
    if scales.dim() != 3 or tuple(scales.shape[1:]) != (rows, cols // 32):
        raise ValueError(f"{name} scales: want [E, {rows}, {cols // 32}], got {tuple(scales.shape)}")
    if codes.stride(2) != 1 or codes.stride(1) != cols // 4 or scales.stride(2) != 1 or scales.stride(1) != cols // 32:
        raise ValueError(f"{name}: rows must be contiguous within an expert")
    if codes.stride(0) % 4 or codes.storage_offset() % 4:
        raise ValueError(f"{name} codes: expert stride and offset must be multiples of 4 bytes")


def w2_moe_decode_split(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                        w1_codes: torch.Tensor, w1_scales: torch.Tensor, w3_codes: torch.Tensor,
                        w3_scales: torch.Tensor, w2_codes: torch.Tensor, w2_scales: torch.Tensor,
                        limit: float | None, *, out: torch.Tensor | None = None,
                        config: DecodeConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """The Triton path with w1/w3/w2 given apart (stacked tensors or zero-copy layer-buffer views).
    `config.transpose_x` adds one small copy kernel that word-transposes x so kernel 1 reads it with
    unit stride (vector loads) instead of stride-16 gathers: which is faster is for the bench to say.

    x [N, H] bf16/fp16/fp32; expert_ids [N, k] integer; weights [N, k] (fp32); planes as in the module doc.
    `out` [N, H] in x's dtype (written in place, every element) or None. Runs on CUDA, or on CPU tensors
    under TRITON_INTERPRET=1."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed")
    n, hidden = x.shape
    k = expert_ids.shape[-1]
    inter = w1_codes.shape[1]
    if hidden % 32 or inter % 32:
        raise ValueError(f"hidden ({hidden}) and intermediate ({inter}) must be multiples of 32")
    _check_planes(w1_codes, w1_scales, inter, hidden, "w1")
    _check_planes(w3_codes, w3_scales, inter, hidden, "w3")
    _check_planes(w2_codes, w2_scales, hidden, inter, "w2")
    if w1_codes.stride() != w3_codes.stride() or w1_scales.stride() != w3_scales.stride():
        raise ValueError("w1 and w3 must share their strides")
    if x.stride(1) != 1:
        x = x.contiguous()
    ids = expert_ids.reshape(-1)
    ids = ids if ids.is_contiguous() else ids.contiguous()
    rw = weights.reshape(-1).to(torch.float32)
    rw = rw if rw.is_contiguous() else rw.contiguous()
    if out is None:
        out = torch.empty((n, hidden), dtype=x.dtype, device=x.device)
    elif out.shape != (n, hidden) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError("out must be [N, H] in x's dtype with contiguous rows")
    pairs = n * k
    h = torch.empty((pairs, inter), dtype=torch.float32, device=x.device)

    hw, iw = hidden // 16, inter // 16
    w1c, w3c, w2c = (c.view(torch.int32) for c in (w1_codes, w3_codes, w2_codes))
    w1s, w3s, w2s = (_u8(s) for s in (w1_scales, w3_scales, w2_scales))
    cfg = config
    g_rows, g_words = _pow2_block(cfg.gate_rows, inter), _pow2_block(cfg.gate_words, hw)
    d_rows, d_words = _pow2_block(cfg.down_rows, hidden), _pow2_block(cfg.down_words, iw)
    has_limit = bool(limit)
    if cfg.transpose_x:
        xt = torch.empty((n, 16, hw), dtype=x.dtype, device=x.device)
        xt.copy_(x.view(n, hw, 16).transpose(1, 2))
        x_arg, x_stride = xt, 16 * hw
    else:
        x_arg, x_stride = x, x.stride(0)
    _gate_up_kernel[(pairs, inter // g_rows)](
        x_arg, ids, rw, w1c, w1s, w3c, w3s, h,
        x_stride, w1c.stride(0), w1s.stride(0), float(limit) if has_limit else 0.0,
        I=inter, HW=hw, K=k, HAS_LIMIT=has_limit, X_WORDS=cfg.transpose_x, ROWS=g_rows, WORDS=g_words,
        num_warps=cfg.gate_warps, num_stages=cfg.num_stages)
    _down_kernel[(n, hidden // d_rows)](
        h, ids, w2c, w2s, out,
        out.stride(0), w2c.stride(0), w2s.stride(0),
        H=hidden, IW=iw, K=k, ROWS=d_rows, WORDS=d_words,
        num_warps=cfg.down_warps, num_stages=cfg.num_stages)
    return out


def _split_w13(w13_codes: torch.Tensor, w13_scales: torch.Tensor):
    inter = w13_codes.shape[1] // 2
    return w13_codes[:, :inter], w13_scales[:, :inter], w13_codes[:, inter:], w13_scales[:, inter:]


def w2_moe_decode_triton(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                         w13_codes: torch.Tensor, w13_scales: torch.Tensor, w2_codes: torch.Tensor,
                         w2_scales: torch.Tensor, limit: float | None, *, out: torch.Tensor | None = None,
                         config: DecodeConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """The Triton path on stacked planes: w13_codes uint8 [E, 2I, H/4] (w1 rows, then w3 rows),
    w13_scales E8M0 [E, 2I, H/32], w2_codes uint8 [E, H, I/4], w2_scales E8M0 [E, H, I/32]."""
    w1c, w1s, w3c, w3s = _split_w13(w13_codes, w13_scales)
    return w2_moe_decode_split(x, expert_ids, weights, w1c, w1s, w3c, w3s, w2_codes, w2_scales, limit,
                               out=out, config=config)


def w2_moe_decode_reference(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                            w13_codes: torch.Tensor, w13_scales: torch.Tensor, w2_codes: torch.Tensor,
                            w2_scales: torch.Tensor, limit: float | None, *,
                            out: torch.Tensor | None = None, config: DecodeConfig | None = None) -> torch.Tensor:
    """The torch reference (moebox.ops.moe.routed_experts over W2Tensor views), same arguments."""
    w1c, w1s, w3c, w3s = _split_w13(w13_codes, w13_scales)

    def experts(e: int) -> tuple[W2Tensor, W2Tensor, W2Tensor]:
        return W2Tensor(w1c[e], w1s[e]), W2Tensor(w3c[e], w3s[e]), W2Tensor(w2_codes[e], w2_scales[e])

    y = routed_experts(x, expert_ids.long(), weights.float(), experts, limit)
    if out is not None:
        out.copy_(y)
        return out
    return y


def w2_moe_decode(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, w13_codes: torch.Tensor,
                  w13_scales: torch.Tensor, w2_codes: torch.Tensor, w2_scales: torch.Tensor,
                  limit: float | None, *, out: torch.Tensor | None = None,
                  config: DecodeConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """Dispatcher: the Triton kernels for CUDA tensors (when triton imports), the torch reference elsewhere."""
    fn = w2_moe_decode_triton if (x.is_cuda and HAVE_TRITON) else w2_moe_decode_reference
    return fn(x, expert_ids, weights, w13_codes, w13_scales, w2_codes, w2_scales, limit, out=out, config=config)


# ----------------------------------------------------------------------------------------------- planes
def stack_planes(experts: Sequence[tuple[W2Tensor, W2Tensor, W2Tensor]], device: torch.device | str | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """[(w1, w3, w2) per expert] -> (w13_codes [E, 2I, H/4] uint8, w13_scales [E, 2I, H/32] e8m0,
    w2_codes [E, H, I/4] uint8, w2_scales [E, H, I/32] e8m0), on `device` (default: where the planes are)."""
    def cat(ts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        s = torch.stack([_u8(t).to(device) if device is not None else _u8(t) for t in ts])
        return s if dtype == torch.uint8 else s.view(dtype)

    w13c = cat([torch.cat([w1.codes, w3.codes]) for w1, w3, _ in experts], torch.uint8)
    w13s = cat([torch.cat([_u8(w1.scales), _u8(w3.scales)]) for w1, w3, _ in experts], torch.float8_e8m0fnu)
    w2c = cat([w2.codes for _, _, w2 in experts], torch.uint8)
    w2s = cat([w2.scales for _, _, w2 in experts], torch.float8_e8m0fnu)
    return w13c, w13s, w2c, w2s


def layer_views(buf: torch.Tensor, hidden: int, intermediate: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Zero-copy [E, rows, ...] views (w1c, w1s, w3c, w3s, w2c, w2s) of a plane-store layer buffer
    (uint8 [E, slot stride], slot = w1 codes | w1 scales | w3 codes | w3 scales | w2 codes | w2 scales, see
    moebox.store.plane_store) for `w2_moe_decode_split`."""
    if buf.dim() != 2 or buf.dtype != torch.uint8 or buf.stride(1) != 1:
        raise ValueError("want a uint8 [experts, stride] layer buffer with contiguous slots")
    out, off = [], 0
    for rows, cols in ((intermediate, hidden), (intermediate, hidden), (hidden, intermediate)):
        n_codes, n_scales = rows * cols // 4, rows * cols // 32
        out.append(buf[:, off:off + n_codes].view(-1, rows, cols // 4))
        out.append(buf[:, off + n_codes:off + n_codes + n_scales].view(-1, rows, cols // 32))
        off += n_codes + n_scales
    return tuple(out)  # type: ignore[return-value]


def random_planes(experts: int, hidden: int, intermediate: int, device: torch.device | str = "cpu",
                  seed: int = 0, scale_byte: tuple[int, int] = (118, 124)
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random stacked planes (uniform codes, scale bytes in [lo, hi)) made on `device`: the test/bench input.
    The default scales (2^-9..2^-4) keep activations O(1) for unit-variance x at the V4-Flash sizes."""
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(shape, lo=0, hi=256):
        return torch.randint(lo, hi, shape, generator=g, device=device, dtype=torch.uint8)

    w13c = rnd((experts, 2 * intermediate, hidden // 4))
    w13s = rnd((experts, 2 * intermediate, hidden // 32), *scale_byte).view(torch.float8_e8m0fnu)
    w2c = rnd((experts, hidden, intermediate // 4))
    w2s = rnd((experts, hidden, intermediate // 32), *scale_byte).view(torch.float8_e8m0fnu)
    return w13c, w13s, w2c, w2s


def random_routing(tokens: int, experts: int, k: int, device: torch.device | str = "cpu", seed: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """k distinct random experts per token (long [N, k]) and positive weights (fp32 [N, k])."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    w = torch.rand((tokens, k), generator=g) + 0.5
    return ids.to(device), w.to(device)


# ----------------------------------------------------------------------------------------------- bench
def bench(device: str | torch.device = "cuda", tokens: Sequence[int] = (1, 4, 16), hidden: int = 4096,
          intermediate: int = 2048, experts: int = 256, k: int = 6, limit: float = 10.0,
          dtype: torch.dtype = torch.bfloat16, config: DecodeConfig = DEFAULT_CONFIG,
          graph: bool = True) -> list[dict]:
    """Time the V4-Flash-shaped decode call (random planes, random routing) with triton.testing.do_bench
    (and, with `graph`, do_bench_cudagraph, which leaves launch overhead out as a captured decode step does).
    Prints and returns per N: distinct experts, plane bytes read (distinct experts' planes), time, GB/s."""
    device = torch.device(device)
    planes = random_planes(experts, hidden, intermediate, device=device)
    per_expert = expert_bytes(hidden, intermediate)
    rows = []
    for n in tokens:
        ids, w = random_routing(n, experts, k, device=device, seed=n)
        x = torch.randn((n, hidden), device=device).to(dtype)
        out = torch.empty((n, hidden), device=device, dtype=dtype)

        def call():
            w2_moe_decode_triton(x, ids, w, *planes, limit, out=out, config=config)

        call()
        ms = triton.testing.do_bench(call, warmup=50, rep=500)
        ms_graph = None
        if graph:
            with torch.cuda.stream(torch.cuda.Stream()):
                ms_graph = triton.testing.do_bench_cudagraph(call, rep=500)
        distinct = int(torch.unique(ids).numel())
        nbytes = distinct * per_expert
        row = {"tokens": n, "distinct_experts": distinct, "plane_bytes": nbytes, "ms": ms,
               "GB/s": nbytes / ms / 1e6, "ms_graph": ms_graph,
               "GB/s_graph": nbytes / ms_graph / 1e6 if ms_graph else None}
        rows.append(row)
        g = f", graph {ms_graph * 1e3:8.1f} us = {row['GB/s_graph']:7.1f} GB/s" if ms_graph else ""
        print(f"N={n:3d} k={k} distinct experts {distinct:3d}  planes {nbytes / 1e6:8.1f} MB  "
              f"{ms * 1e3:8.1f} us = {row['GB/s']:7.1f} GB/s{g}", flush=True)
    return rows


if __name__ == "__main__":  # python -m moebox.ops.triton.w2_moe [--sweep]
    import sys
    print(f"torch {torch.__version__}, triton {triton.__version__ if HAVE_TRITON else None}, "
          f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA'}")
    bench()
    if "--sweep" in sys.argv:
        for rows_, words, warps in ((8, 32, 4), (16, 64, 4), (32, 32, 4), (32, 64, 8), (64, 32, 8)):
            for stages in (2, 3, 4):
                cfg = DecodeConfig(rows_, words, warps, rows_, words, warps, stages)
                print(f"-- {cfg}")
                bench(config=cfg, graph=False)
        print(f"-- {DecodeConfig(transpose_x=True)}")
        bench(config=DecodeConfig(transpose_x=True))
