"""Routed experts from w2 planes on the GPU, prefill path (many tokens): a grouped GEMM over the (token, expert)
pairs sorted by expert, with the planes dequantized in registers.

Why: the torch reference dequantizes every hit expert's three matrices to fp32 on each call. A 2048-token chunk
hits all 256 experts of a V4-Flash layer, so that is 6.4 G weights written and read again per layer: the prefill
bench took 12 s for a 2048-token prompt (171 tok/s, docs/benchmarks.md, seventh session). Here each weight is
read once per block of up to BLOCK_M pairs of its expert and never leaves registers as anything wider than the
dot's operand.

Semantics: those of `moebox.ops.moe.routed_experts` (gate/up, clamp, SiLU, the routing weight applied to h, down,
sum over the k experts); `w2_moe_decode_reference` is that torch code over the same planes.

Steps (no host sync, so it also runs inside a CUDA graph):
1. `align_pairs` (torch): the N*k pairs (p = t*k + j) sorted by expert, each expert's run padded with a
   sentinel (N*k) to a multiple of BLOCK_M, and the expert of every block of BLOCK_M slots (E past the end: the
   block's programs exit at once). The grid is the bound min(N*k, cdiv(N*k + E*(BLOCK_M-1), BLOCK_M)) blocks.
2. `_gate_up_kernel`, grid (blocks, I / BLOCK_N): A = the x rows of the block's pairs [BLOCK_M, BLOCK_K], B = the
   w1 and w3 tiles [BLOCK_K, BLOCK_N] dequantized in registers, two tl.dot into fp32; epilogue: clamp, SiLU, the
   product and the routing weight -> h [blocks * BLOCK_M, I] in the dot's dtype.
3. `_down_kernel`, grid (blocks, H / BLOCK_N): A = the block's h rows, B = w2 tiles -> y [N*k, H] fp32, each
   pair's row written once (padding rows are not stored).
4. out = y.view(N, k, H).sum(1): a fixed order, so results are deterministic.

Dequant: a code byte holds 4 columns (bits 2c..2c+1 = column 4j + c) and levels are +-1, +-4 times 2^(s-127), a
power of two: its fp32 bits are built directly, sign << 31 | (s + 2 * big) << 23, then cast to the dot dtype.
Dot dtype: x's for bf16/fp16 (the weights are exact there: powers of two within range), fp32 ("ieee") for fp32 x,
which is also what Triton's interpreter runs (its bf16 dot is broken). h is rounded to the dot dtype, so bf16
results differ from the fp32 reference by ~bf16 rounding; fp32 agrees to fp32 rounding.

Layout: the planes as `w2_moe_decode_split` takes them (stacked tensors or zero-copy plane-store layer views),
H and I multiples of BLOCK_K (64, or 32 when they are not); with `tiled` the codes tile by tile (`w2_moe.tile_codes`),
which the "rows" kernels read (H and I multiples of 256; a row's 8 bytes a step, the next tile after 8 steps).
`python -m moebox.ops.triton.w2_moe_prefill` times it at the V4-Flash expert shapes against a bf16 matmul.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

import torch

from moebox.ops.triton.runtime import (HAVE_TRITON, bench_start, build_sm90, cdiv, loop_sass, pdl_args,
                                       pdl_start, tl, triton)
from moebox.ops.triton.w2_moe import (_u8, check_layer_planes, random_planes, random_routing,
                                      w2_moe_decode_reference)


@dataclass(frozen=True)
class PrefillConfig:
    """BLOCK_M pairs x BLOCK_N output columns per program, BLOCK_K inputs per step (0: 64 where the shapes
    allow, else 32). `variant` "tile": the dequantized weight tile is the dot's second operand [BLOCK_K,
    BLOCK_N] (the seventh session's default, block_n 128); "rows": it is the first, [BLOCK_N, 32] (the output
    transposed, one scale block a step, the code bytes expanded by interleaving): about half the SASS
    instructions a weight (`--sass`: 7.7 against 14.1), and the default since the eighth session's sweep on the
    H200 (2048 tokens: 4.41 ms a layer against 5.33 for "tile"; docs/benchmarks.md)."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 0
    num_warps: int = 4
    num_stages: int = 3
    variant: str = "rows"

    def __post_init__(self) -> None:
        if self.variant not in ("tile", "rows") or (self.variant == "rows" and self.block_k not in (0, 32)):
            raise ValueError(f"bad prefill config {self}: variant tile or rows (rows: block_k 32)")


DEFAULT_CONFIG = PrefillConfig()


def align_pairs(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """expert_ids [N, k] -> (slots int32 [blocks * block_m]: the pair id in each slot, N*k for padding;
    block_expert int32 [blocks]: each block's expert, num_experts past the last used block)."""
    flat = expert_ids.reshape(-1).long()
    n_pairs, dev = flat.numel(), flat.device
    blocks = min(n_pairs, cdiv(n_pairs + num_experts * (block_m - 1), block_m))
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    start = torch.cumsum(counts, 0) - counts
    sorted_e = flat[order]
    dest = (pad_end - padded)[sorted_e] + torch.arange(n_pairs, device=dev) - start[sorted_e]
    slots = torch.full((blocks * block_m,), n_pairs, dtype=torch.int32, device=dev)
    slots.scatter_(0, dest, order.to(torch.int32))
    first_slot = torch.arange(blocks, device=dev) * block_m
    block_expert = torch.searchsorted(pad_end, first_slot, right=True).to(torch.int32)
    return slots, block_expert


# ----------------------------------------------------------------------------------------------- kernels
if HAVE_TRITON:
    @triton.jit
    def _w_tile(c_ptr, s_ptr, e, rows, row_ok, k0, c_es, s_es, KC: tl.constexpr, BLOCK_K: tl.constexpr,
                BLOCK_N: tl.constexpr, DT: tl.constexpr):
        """W[rows, k0:k0+BLOCK_K]^T of expert e dequantized: [BLOCK_K, BLOCK_N] in DT (KC: W's input dim)."""
        j = tl.arange(0, BLOCK_K // 4)
        cb = tl.load(c_ptr + e * c_es + rows[None, :] * (KC // 4) + (k0 // 4 + j)[:, None],
                     mask=row_ok[None, :], other=0).to(tl.int32)                       # [BK/4, BN]
        shift = 2 * tl.arange(0, 4)
        c = tl.reshape((cb[:, None, :] >> shift[None, :, None]) & 3, (BLOCK_K, BLOCK_N))  # row 4j + c
        b = tl.arange(0, BLOCK_K // 32)
        sb = tl.load(s_ptr + e * s_es + rows[None, :] * (KC // 32) + (k0 // 32 + b)[:, None],
                     mask=row_ok[None, :], other=0).to(tl.int32)                       # [BK/32, BN]
        s = tl.reshape(tl.broadcast_to(sb[:, None, :], (BLOCK_K // 32, 32, BLOCK_N)), (BLOCK_K, BLOCK_N))
        neg = 1 - (c >> 1)                       # codes 0, 1
        big = 1 - ((c ^ (c >> 1)) & 1)           # codes 0, 3: |level| = 4 = 2^2
        w = ((neg << 31) | ((s + 2 * big) << 23)).to(tl.float32, bitcast=True)
        return w.to(DT)

    @triton.jit
    def _block(slots_ptr, bexp_ptr, n_pairs, BLOCK_M: tl.constexpr):
        """The program's block of slots: its expert (int64; E past the last used block), slots, pair ids, real
        pairs."""
        blk = tl.program_id(0)
        slot = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(slots_ptr + slot)
        return tl.load(bexp_ptr + blk).to(tl.int64), slot, pair, pair < n_pairs

    @triton.jit
    def _out_columns(size, BLOCK_N: tl.constexpr):
        """The program's output columns (grid axis 1), which are in range, and the columns clamped (for loads)."""
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        return cols, cols < size, tl.minimum(cols, size - 1).to(tl.int64)

    @triton.jit
    def _swiglu(g, u, limit, HAS_LIMIT: tl.constexpr):
        """silu(min(g, limit)) * clamp(u, -limit, limit), in fp32 (the routed experts' clamp)."""
        if HAS_LIMIT:
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
        return g / (1.0 + tl.exp(-g)) * u

    @triton.jit
    def _gate_up_kernel(x_ptr, slots_ptr, bexp_ptr, rw_ptr, w1c_ptr, w1s_ptr, w3c_ptr, w3s_ptr, h_ptr,
                        n_pairs, n_experts, stride_x, c_es, s_es, limit,
                        H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr, HAS_LIMIT: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        DT: tl.constexpr, PRECISION: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
        pdl_start(PDL)
        e, slot, pair, valid = _block(slots_ptr, bexp_ptr, n_pairs, BLOCK_M)
        if e >= n_experts:
            return
        tok = tl.where(valid, pair // TOP_K, 0).to(tl.int64)
        rows, row_ok, rows_c = _out_columns(I, BLOCK_N)
        kk = tl.arange(0, BLOCK_K)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in tl.range(0, H, BLOCK_K, num_stages=STAGES):
            a = tl.load(x_ptr + tok[:, None] * stride_x + (k0 + kk)[None, :], mask=valid[:, None], other=0.0)
            a = a.to(DT)
            w1 = _w_tile(w1c_ptr, w1s_ptr, e, rows_c, row_ok, k0, c_es, s_es, H, BLOCK_K, BLOCK_N, DT)
            acc_g = tl.dot(a, w1, acc_g, input_precision=PRECISION)
            w3 = _w_tile(w3c_ptr, w3s_ptr, e, rows_c, row_ok, k0, c_es, s_es, H, BLOCK_K, BLOCK_N, DT)
            acc_u = tl.dot(a, w3, acc_u, input_precision=PRECISION)
        rw = tl.load(rw_ptr + pair, mask=valid, other=0.0)
        h = _swiglu(acc_g, acc_u, limit, HAS_LIMIT) * rw[:, None]
        tl.store(h_ptr + slot.to(tl.int64)[:, None] * I + rows[None, :], h.to(DT), mask=row_ok[None, :])

    @triton.jit
    def _down_kernel(h_ptr, slots_ptr, bexp_ptr, w2c_ptr, w2s_ptr, y_ptr, n_pairs, n_experts, c_es, s_es,
                     H: tl.constexpr, I: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, DT: tl.constexpr, PRECISION: tl.constexpr, STAGES: tl.constexpr,
                     PDL: tl.constexpr):
        pdl_start(PDL)
        e, slot, pair, valid = _block(slots_ptr, bexp_ptr, n_pairs, BLOCK_M)
        if e >= n_experts:
            return
        cols, col_ok, cols_c = _out_columns(H, BLOCK_N)
        kk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in tl.range(0, I, BLOCK_K, num_stages=STAGES):
            a = tl.load(h_ptr + slot.to(tl.int64)[:, None] * I + (k0 + kk)[None, :])
            w2 = _w_tile(w2c_ptr, w2s_ptr, e, cols_c, col_ok, k0, c_es, s_es, I, BLOCK_K, BLOCK_N, DT)
            acc = tl.dot(a, w2, acc, input_precision=PRECISION)
        dst = y_ptr + tl.where(valid, pair, 0).to(tl.int64)[:, None] * H + cols[None, :]
        tl.store(dst, acc, mask=valid[:, None] & col_ok[None, :])

    # ------------------------------------------------------------------------ variant "rows" (BLOCK_K = 32)
    @triton.jit
    def _w_rows(c_ptrs, s_ptrs, row_ok, DT: tl.constexpr):
        """32 inputs of BLOCK_N weight rows dequantized: [BLOCK_N, 32] in DT, from the code bytes [BLOCK_N, 8]
        at c_ptrs and the rows' scale bytes [BLOCK_N] at s_ptrs. The fp32 bits are the scale's exponent plus
        a per-code byte on top (sign | 2 for |level| 4) picked from the constant 0x01008081 by the code."""
        cb = tl.load(c_ptrs, mask=row_ok[:, None], other=0).to(tl.int32)
        c = tl.interleave(tl.interleave(cb & 3, (cb >> 4) & 3), tl.interleave((cb >> 2) & 3, (cb >> 6) & 3))
        sb = tl.load(s_ptrs, mask=row_ok, other=0).to(tl.int32)
        bits = (sb << 23)[:, None] + ((0x01008081 >> (c << 3)) << 24)
        return bits.to(tl.float32, bitcast=True).to(DT)

    @triton.jit
    def _row_codes(rows, KC: tl.constexpr, TILED: tl.constexpr):
        """Byte offsets [BLOCK_N, 8] of the rows' first 32 inputs in an expert's codes (KC inputs a row): row-major,
        or tile by tile (`w2_moe.tile_codes`: 16 rows x 64 bytes a 1 KB tile, a row's tiles 1 KB apart)."""
        if TILED:
            return (rows // 16 * (4 * KC) + rows % 16 * 64)[:, None] + tl.arange(0, 8)[None, :]
        return rows[:, None] * (KC // 4) + tl.arange(0, 8)[None, :]

    @triton.jit
    def _next_codes(c_off, k0, TILED: tl.constexpr):
        """The offsets of the next 32 inputs after those at k0: 8 bytes on, and tile by tile the next tile after
        a tile's last 8 bytes."""
        if TILED:
            return c_off + tl.where(k0 % 256 == 224, 1024 - 56, 8)
        return c_off + 8

    @triton.jit
    def _gate_up_rows_kernel(x_ptr, slots_ptr, bexp_ptr, rw_ptr, w1c_ptr, w1s_ptr, w3c_ptr, w3s_ptr, h_ptr,
                             n_pairs, n_experts, stride_x, c_es, s_es, limit,
                             H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr, HAS_LIMIT: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             DT: tl.constexpr, PRECISION: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr,
                             TILED: tl.constexpr = False):
        pdl_start(PDL)
        e, slot, pair, valid = _block(slots_ptr, bexp_ptr, n_pairs, BLOCK_M)
        if e >= n_experts:
            return
        tok = tl.where(valid, pair // TOP_K, 0).to(tl.int64)
        rows, row_ok, rows_c = _out_columns(I, BLOCK_N)
        c_off = e * c_es + _row_codes(rows_c, H, TILED)
        s_off = e * s_es + rows_c * (H // 32)
        x_ptrs = x_ptr + tok[None, :] * stride_x + tl.arange(0, 32)[:, None]          # x^T [32, BLOCK_M]
        acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in tl.range(0, H, 32, num_stages=STAGES):
            xt = tl.load(x_ptrs, mask=valid[None, :], other=0.0).to(DT)
            acc_g = tl.dot(_w_rows(w1c_ptr + c_off, w1s_ptr + s_off, row_ok, DT), xt, acc_g,
                           input_precision=PRECISION)
            acc_u = tl.dot(_w_rows(w3c_ptr + c_off, w3s_ptr + s_off, row_ok, DT), xt, acc_u,
                           input_precision=PRECISION)
            c_off = _next_codes(c_off, k0, TILED)
            s_off += 1
            x_ptrs += 32
        rw = tl.load(rw_ptr + pair, mask=valid, other=0.0)
        h = _swiglu(acc_g, acc_u, limit, HAS_LIMIT) * rw[None, :]
        tl.store(h_ptr + slot.to(tl.int64)[None, :] * I + rows[:, None], h.to(DT), mask=row_ok[:, None])

    @triton.jit
    def _down_rows_kernel(h_ptr, slots_ptr, bexp_ptr, w2c_ptr, w2s_ptr, y_ptr, n_pairs, n_experts, c_es, s_es,
                          H: tl.constexpr, I: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, DT: tl.constexpr, PRECISION: tl.constexpr,
                          STAGES: tl.constexpr, PDL: tl.constexpr, TILED: tl.constexpr = False):
        pdl_start(PDL)
        e, slot, pair, valid = _block(slots_ptr, bexp_ptr, n_pairs, BLOCK_M)
        if e >= n_experts:
            return
        cols, col_ok, cols_c = _out_columns(H, BLOCK_N)
        c_off = e * c_es + _row_codes(cols_c, I, TILED)
        s_off = e * s_es + cols_c * (I // 32)
        h_ptrs = h_ptr + slot.to(tl.int64)[None, :] * I + tl.arange(0, 32)[:, None]    # h^T [32, BLOCK_M]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in tl.range(0, I, 32, num_stages=STAGES):
            acc = tl.dot(_w_rows(w2c_ptr + c_off, w2s_ptr + s_off, col_ok, DT), tl.load(h_ptrs), acc,
                         input_precision=PRECISION)
            c_off = _next_codes(c_off, k0, TILED)
            s_off += 1
            h_ptrs += 32
        dst = y_ptr + tl.where(valid, pair, 0).to(tl.int64)[None, :] * H + cols[:, None]
        tl.store(dst, acc, mask=valid[None, :] & col_ok[:, None])


_DOT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _tl_dtype(dtype: torch.dtype):
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]


def w2_moe_prefill_split(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                         w1_codes: torch.Tensor, w1_scales: torch.Tensor, w3_codes: torch.Tensor,
                         w3_scales: torch.Tensor, w2_codes: torch.Tensor, w2_scales: torch.Tensor,
                         limit: float | None, *, config: PrefillConfig = DEFAULT_CONFIG,
                         tiled: bool = False) -> torch.Tensor:
    """x [N, H] bf16/fp16/fp32, expert_ids [N, k], weights [N, k] -> [N, H] in x's dtype. Planes as
    `w2_moe_decode_split` takes them (tiled: the codes tile by tile, which the "rows" variant reads, with H and
    I multiples of 256). Runs on CUDA, or on CPU tensors under TRITON_INTERPRET=1."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed")
    if x.dtype not in _DOT_DTYPES:
        raise ValueError(f"x must be bf16, fp16 or fp32, got {x.dtype}")
    n, hidden = x.shape
    k = expert_ids.shape[-1]
    n_experts, inter = w1_codes.shape[0], w1_codes.shape[1]
    rows = config.variant == "rows"
    block_k = 32 if rows else config.block_k or (64 if hidden % 64 == 0 and inter % 64 == 0 else 32)
    check_layer_planes(hidden, inter, 256 if tiled else block_k, w1_codes, w1_scales, w3_codes, w3_scales,
                       w2_codes, w2_scales)
    if tiled and not rows:
        raise ValueError(f"codes stored tile by tile need the prefill variant 'rows', not {config.variant!r}")
    if n == 0:
        return torch.empty_like(x)
    x = x if x.stride(1) == 1 else x.contiguous()
    bm, bn = config.block_m, config.block_n
    slots, block_expert = align_pairs(expert_ids, n_experts, bm)
    blocks = block_expert.numel()
    rw = weights.reshape(-1).to(torch.float32).contiguous()
    dt = _tl_dtype(x.dtype)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"   # only fp32 operands read it
    h = torch.empty((blocks * bm, inter), dtype=x.dtype, device=x.device)
    y = torch.empty((n * k, hidden), dtype=torch.float32, device=x.device)
    w1c, w3c, w2c = (_u8(c) for c in (w1_codes, w3_codes, w2_codes))
    w1s, w3s, w2s = (_u8(s) for s in (w1_scales, w3_scales, w2_scales))
    common = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=block_k, DT=dt, PRECISION=precision, STAGES=config.num_stages,
                  num_warps=config.num_warps)
    gate_args = (x, slots, block_expert, rw, w1c, w1s, w3c, w3s, h, n * k, n_experts, x.stride(0), w1c.stride(0),
                 w1s.stride(0), float(limit or 0.0))
    down_args = (h, slots, block_expert, w2c, w2s, y, n * k, n_experts, w2c.stride(0), w2s.stride(0))
    gate_grid, down_grid = (blocks, cdiv(inter, bn)), (blocks, cdiv(hidden, bn))
    gate_kw = dict(TOP_K=k, HAS_LIMIT=bool(limit))
    if rows:
        _gate_up_rows_kernel[gate_grid](*gate_args, H=hidden, I=inter, **gate_kw, **common, TILED=tiled,
                                        **pdl_args(x, _gate_up_rows_kernel))
        _down_rows_kernel[down_grid](*down_args, H=hidden, I=inter, **common, TILED=tiled,
                                     **pdl_args(x, _down_rows_kernel))
    else:
        _gate_up_kernel[gate_grid](*gate_args, H=hidden, I=inter, **gate_kw, **common, **pdl_args(x, _gate_up_kernel))
        _down_kernel[down_grid](*down_args, H=hidden, I=inter, **common, **pdl_args(x, _down_kernel))
    return y.view(n, k, hidden).sum(dim=1).to(x.dtype)


def w2_moe_prefill(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, w13_codes: torch.Tensor,
                   w13_scales: torch.Tensor, w2_codes: torch.Tensor, w2_scales: torch.Tensor,
                   limit: float | None, *, config: PrefillConfig = DEFAULT_CONFIG, tiled: bool = False
                   ) -> torch.Tensor:
    """The Triton path on stacked planes (w13 = w1 rows then w3 rows, as `w2_moe_decode_triton` takes them)."""
    inter = w13_codes.shape[1] // 2
    return w2_moe_prefill_split(x, expert_ids, weights, w13_codes[:, :inter], w13_scales[:, :inter],
                                w13_codes[:, inter:], w13_scales[:, inter:], w2_codes, w2_scales, limit,
                                config=config, tiled=tiled)


# ----------------------------------------------------------------------------------------------- bench
_TILE = PrefillConfig(block_n=128, variant="tile")   # the seventh session's default
SWEEP = [replace(_TILE, **kw) for kw in (
    {}, dict(block_m=128), dict(block_n=64), dict(block_n=256, num_warps=8), dict(block_k=32), dict(block_k=128),
    dict(num_warps=8), dict(block_m=128, num_warps=8), dict(num_stages=2), dict(num_stages=4), dict(block_m=32),
    dict(variant="rows"), dict(variant="rows", num_warps=8), dict(variant="rows", block_n=64),
    dict(variant="rows", block_m=128, num_warps=8), dict(variant="rows", num_stages=4))]


def bench(tokens: tuple[int, ...] = (256, 2048, 8192), hidden: int = 4096, inter: int = 2048, experts: int = 256,
          k: int = 6, sweep: bool = False, tiled: bool = False) -> None:
    """Time the prefill kernels at the V4-Flash expert shapes (random planes and routing, bf16 x) and compare
    their rate with a bf16 matmul of the same FLOPs; `sweep`: every tiling of SWEEP, each checked against the
    fp32 reference at 64 tokens before it is timed; `tiled`: the default tiling also on the codes stored tile by
    tile."""
    from moebox.ops.triton.w2_moe import tile_codes
    bench_start()
    planes = random_planes(experts, hidden, inter, device="cuda")
    tiled_planes = (tile_codes(planes[0]), planes[1], tile_codes(planes[2]), planes[3]) if tiled else None
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = triton.testing.do_bench(lambda: a @ a, warmup=5, rep=50)
    mm_rate = 2 * 8192 ** 3 / (mm_ms * 1e-3)
    print(f"bf16 matmul 8192^3: {mm_rate / 1e12:.0f} TFLOP/s")
    ids, w = random_routing(64, experts, k, device="cuda", seed=1)
    x = torch.randn(64, hidden, device="cuda", dtype=torch.bfloat16)
    ref = w2_moe_decode_reference(x.float(), ids, w, *planes, 10.0)
    runs = [(cfg, False) for cfg in (SWEEP if sweep else [DEFAULT_CONFIG])] + ([(DEFAULT_CONFIG, True)] * tiled)
    for cfg, t in runs:
        p = tiled_planes if t else planes
        y = w2_moe_prefill(x, ids, w, *p, 10.0, config=cfg, tiled=t)
        print(f"{cfg}{', codes tile by tile' if t else ''}: rel err vs the fp32 reference at 64 tokens "
              f"{float((y.float() - ref).norm() / ref.norm()):.2e}")
        for n in tokens:
            ids_n, w_n = random_routing(n, experts, k, device="cuda", seed=n)
            x_n = torch.randn(n, hidden, device="cuda", dtype=torch.bfloat16)
            ms = triton.testing.do_bench(lambda: w2_moe_prefill(x_n, ids_n, w_n, *p, 10.0, config=cfg, tiled=t),
                                         warmup=3, rep=30)
            rate = 2 * 3 * n * k * hidden * inter / (ms * 1e-3)
            print(f"  N={n:5d} k={k}: {ms:8.3f} ms  {rate / 1e12:6.1f} TFLOP/s ({rate / mm_rate:.1%} of bf16 "
                  f"matmul), {n / (ms * 1e-3):,.0f} tok/s a layer")


def sass_report(config: PrefillConfig = DEFAULT_CONFIG) -> dict:
    """Build `_gate_up_kernel` (V4-Flash shapes, bf16 x) for sm_90 on any machine with Triton's NVIDIA backend
    (no GPU needed), specialised as a real launch is: registers, spill stack, the K loop's SASS op counts and
    instructions per dequantized weight (w1 and w3: 2 x BLOCK_K x BLOCK_N weights a loop iteration, over
    num_warps x 32 threads). The decode kernels' inline-PTX dequant does it in 1.7."""
    rows = config.variant == "rows"
    fn = _gate_up_rows_kernel if rows else _gate_up_kernel
    types = ["*bf16", "*i32", "*i32", "*fp32", "*u8", "*u8", "*u8", "*u8", "*bf16", "i32", "i32", "i32", "i32",
             "i32", "fp32"]
    const = dict(H=4096, I=2048, TOP_K=6, HAS_LIMIT=True, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                 BLOCK_K=32 if rows else config.block_k or 64, DT=tl.bfloat16, PRECISION="tf32",
                 STAGES=config.num_stages, PDL=False)
    sig = dict(zip(fn.arg_names, types))
    ints = ("stride_x", "c_es", "s_es", "n_experts")      # multiples of 16 at V4-Flash: specialised so
    compiled = build_sm90(fn, sig, const, [a for a, ty in sig.items() if ty.startswith("*") or a in ints],
                          num_warps=config.num_warps, num_stages=config.num_stages)
    ops, registers, spills, _ = loop_sass(compiled.asm["cubin"])
    weights = 2 * const["BLOCK_K"] * config.block_n / (32 * config.num_warps)
    return {"config": config, "registers": registers, "spills": spills, "loop_ops": ops,
            "instructions_per_weight": sum(ops.values()) / weights}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="w2 routed-expert prefill kernels: time and check")
    p.add_argument("--sweep", action="store_true", help="time every tiling of SWEEP")
    p.add_argument("--tiled", action="store_true", help="also time the default on codes stored tile by tile")
    p.add_argument("--sass", action="store_true",
                   help="no GPU needed: build each tiling of SWEEP for sm_90 and report its K loop's SASS")
    args = p.parse_args()
    if args.sass:
        for cfg in SWEEP:
            rep = sass_report(cfg)
            print(f"{cfg}: {rep['instructions_per_weight']:.1f} instructions a weight, {rep['registers']} "
                  f"registers, {rep['spills']} B spilled; {dict(list(rep['loop_ops'].items())[:6])}", flush=True)
    else:
        bench(sweep=args.sweep, tiled=args.tiled)
