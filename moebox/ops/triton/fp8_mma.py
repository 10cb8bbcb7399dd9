"""FP8 e4m3 x 128x128-block-scaled decode products (1-16 tokens) on the tensor cores: y = x W^T, as
`moebox.ops.triton.fp8_linear` defines it, for `Fp8Config(kernel="mma")`.

Why: the CUDA-core GEMV (`_fp8_gemv_kernel`) takes ~4.1 SASS instructions a weight at one token (1/2 F2FP,
1 HADD2.F32 to widen each f16 to fp32, 1 FFMA, addresses and scales) and more per further token; on the H200
it streamed the big decode products at 66-70% of the copy bandwidth at N = 1 and read wo_a from L2 at only
3.5 TB/s, so it is bounded by its own issue and latency, not by DRAM. Here one mma.sync.m16n8k16 (f16 x f16
-> fp32) multiplies 16 rows x 16 columns of weights with up to 8 tokens: per weight 1/2 F2FP (e4m3x2 ->
f16x2, the A operand straight from the loaded bytes) and 1/8 HMMA, whatever N <= 8 is; N = 9..16 takes a
second mma per A fragment. Measured on the H200 (fourteenth session, `fp8_linear --sweep --kernels mma`): up
to 1.5x the previous picks at N = 2-8 (wq_b at N = 8: 20.5 -> 13.8 us), even with the GEMV at N = 1-2 (where
every product costs ~2.3 us plus its bytes at 3.55 TB/s, whatever the kernel) and behind the fp16 dot at 16;
TUNED_DECODE takes it where it won.

Layout (no shared memory, no layout conversion). A program owns BLOCK_O = 16 R S output rows: S warps, each
with R 16-row mma tiles, all walking the whole K range (or the program's split of it) in steps of one
128-column scale block, so a step's scale is one byte per program. A warp's step loads a [16 R, 16] tile of
int32 words per 64-column half ("chunk"): word w = columns 4w..4w+3. Triton gives such a tile the blocked
layout sizePerThread [1, 4], threadsPerWarp [8, 4]: lane 4 g + t holds words 4t..4t+3 (16 bytes, columns
16t..16t+15) of rows g and g + 8 of each mma tile, which are the rows of mma.sync's A fragment. The columns
are not where the fragment wants them (lane t's A registers hold k = 2t, 2t+1, 2t+8, 2t+9), but a dot
product does not care how k is numbered as long as A and B agree: for word j the mma takes logical k
(2t, 2t+1) = columns 16t + 4j + (0, 1) and (2t+8, 2t+9) = 16t + 4j + (2, 3), and lane (g, t) loads its B
fragment (x of token g) from the same columns. So a lane needs x[token g, 16t .. 16t+15] of each chunk: two
16-byte loads (`_x_tile`), converted from bf16 pairs to f16 pairs once a step (3 instructions a pair) and
shared by the R tiles. Per lane and step: 2 chunks x R tiles x 2 rows x 16 columns = 64 R weights, 32 R F2FP,
8 R HMMA (16 R with a second token set), 8 R FFMA for the scale, and ~48 instructions of x conversion.

Accumulators: the asm returns, per 8-element pack of the tile (one mma tile: a lane's 4 words of its two rows),
two mma chains' D fragments in the slot order of `moebox.ops.triton.w2_moe` (slot 4 rho + i = D[row rho]
[column 2t + i % 2] of chain i // 2); chain = chunk for N <= 8, token set (tokens 0-7, 8-15) for N > 8. They
are scaled by the step's block scale (E8M0 byte in the fp32 exponent) into fp32 accumulators; at the end the
chains are summed (N <= 8) and each (row, token) is stored once. With split K the fp32 partials are summed by
`_split_sum_kernel` (moebox.ops.triton.fp8_linear). Tried and dropped (seventeenth session): the last program
of a row block to arrive (an atomic count, fences on both sides) summing the partials itself instead: its GPU
tests passed, but decode lost ~0.25-0.3 ms at batch 4 and 8 (wo_a and wo_b take split K there): that program's
serial tail cost more than the launch it saved.

PDL: a program loads its first K block's weights before `pdl_start` (they do not depend on the kernel before),
so their DRAM latency overlaps that kernel's last programs; the rest waits. Nineteenth session, H200, same
calls: batch 8 12.36 -> 12.26 ms with the routed experts' down kernel doing the same (docs/benchmarks.md). The
same early load in the CUDA-core GEMV (batch 1's products) gained nothing or lost, so the GEMV waits first.

Numerics: e4m3 -> f16 is exact; bf16 x -> f16 is exact for |x| in [2^-14, 65504] (f16 keeps bf16's 8
mantissa bits), smaller values lose bits, larger ones become inf. So, as the fp16 dot path, this is for
products whose inputs are normed or bounded (every TUNED_DECODE entry already assumed it from N = 4 up).
Products are exact and summed in fp32.

Bounds (`mma_takes`): x bf16 or fp16 with 16-byte aligned rows, N <= 16, in % 128 == 0, weight rows 16-byte
aligned; BLOCK_O divides 128 (a program's rows share one scale row) and the group's rows. Others take the
GEMV. Triton's interpreter cannot run inline asm: there (TRITON_INTERPRET=1) the kernel computes each slot's
value with plain loads and sums (`_plain_step`), so the addressing, splits, masks and the final reduction are
what the CPU tests check; the PTX itself is checked in a one-warp emulator (tests/test_triton_fp8_mma.py) and
on the GPU.
"""

from __future__ import annotations

import torch

from moebox.ops.triton.runtime import (HAVE_TRITON, build_sm90, cdiv, interpreting, loop_sass, packed_asm_layout,
                                       pdl_args, pdl_start, tl, triton)

_SLOT = (0, 1, 4, 5, 2, 3, 6, 7)   # D register 4 chain + k -> output slot


def mma_asm(token_sets: int) -> str:
    """PTX for one 8-element pack (one mma tile). Operands: $0..$7 the D slots out; $8.. chunk a's words
    (slot 4 rho + j: word j of row rho), $16.. chunk b's; x pairs as f16x2: $24.. chunk a pairs 0-3, $32.. a
    4-7, $40.. b 0-3, $48.. b 4-7, each slot 4 h + q = token set h (slots 4-7 repeat 0-3 with one set)."""
    words, xa, xb = (8, 16), (24, 40), (32, 48)
    asm = ["{", ".reg .b16 lo, hi;", ".reg .b32 a<4>;", ".reg .f32 d<8>;"]
    asm += [f"mov.f32 d{k}, 0f00000000;" for k in range(8)]
    for c in range(2):
        for j in range(4):
            for rho in range(2):
                asm += [f"mov.b32 {{lo, hi}}, ${words[c] + 4 * rho + j};",
                        f"cvt.rn.f16x2.e4m3x2 a{rho}, lo;", f"cvt.rn.f16x2.e4m3x2 a{2 + rho}, hi;"]
            for h in range(token_sets):
                b = [f"${(xa if q < 4 else xb)[c] + 4 * h + q % 4}" for q in (2 * j, 2 * j + 1)]
                chain = c if token_sets == 1 else h
                d = ", ".join(f"d{4 * chain + k}" for k in range(4))
                asm.append(f"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {{{d}}}, {{a0, a1, a2, a3}}, "
                           f"{{{b[0]}, {b[1]}}}, {{{d}}};")
    asm += [f"mov.b32 ${_SLOT[k]}, d{k};" for k in range(8)] + ["}"]
    return "\n".join(asm)


# bf16 pair -> f16 pair (cvt.rn.f16x2.f32 d, a, b puts a in the high half)
BF16_TO_F16_ASM = "{ .reg .b32 lo, hi; shl.b32 lo, $1, 16; and.b32 hi, $1, -65536; cvt.rn.f16x2.f32 $0, hi, lo; }"

if HAVE_TRITON:
    _ASM_1 = tl.constexpr(mma_asm(1))
    _ASM_2 = tl.constexpr(mma_asm(2))
    _CONSTRAINTS = tl.constexpr(",".join(["=r"] * 8 + ["r"] * 48))
    _BF16_TO_F16 = tl.constexpr(BF16_TO_F16_ASM)

    @triton.jit
    def _x_tile(x_words, off, R: tl.constexpr, S: tl.constexpr, X_F16: tl.constexpr):
        """x words at word offset `off` of the lanes' 16-column runs as f16x2, loaded as [token sets, 8S, 16]
        (once a step, whatever R is) and spread over the R tiles: [16RS, 16]."""
        v = tl.load(x_words + off)
        if not X_F16:
            v = tl.inline_asm_elementwise(_BF16_TO_F16, "=r,r", [v], dtype=tl.int32, is_pure=True, pack=1)
        return tl.reshape(tl.broadcast_to(v[None, :, :, :], (R, 2, 8 * S, 16)), (16 * R * S, 16))

    @triton.jit
    def _w_step(w_words, s_row, kb):
        """K block kb's weight words (chunk a, chunk b) and its scale byte."""
        return tl.load(w_words + kb * 32), tl.load(w_words + kb * 32 + 16), tl.load(s_row + kb)

    @triton.jit
    def _plain_step(w8_ptr, row, x_ptr, stride_wo, stride_xn, N, kb, TOKEN_SETS: tl.constexpr):
        """What the asm leaves in each slot for K block kb, with plain loads (the interpreter): slot (r2, 4t + i)
        = row `row` . token 2t + i % 2 (+ 8 (i // 2) with two token sets) over chunk i // 2 (one set) or the
        whole block (two sets), x rounded to f16 as on the GPU."""
        w = tl.arange(0, 16)[None, :]
        i = w % 4
        if TOKEN_SETS == 1:
            tok = 2 * (w // 4) + i % 2
            cols = kb * 128 + ((i // 2) * 64)[:, :, None] + tl.arange(0, 64)[None, None, :]
        else:
            tok = 2 * (w // 4) + i % 2 + 8 * (i // 2)
            cols = kb * 128 + tl.arange(0, 128)[None, None, :]
        tok = tl.minimum(tok, N - 1)
        wv = tl.load(w8_ptr + row.to(tl.int64)[:, :, None] * stride_wo + cols).to(tl.float32)
        xv = tl.load(x_ptr + tok.to(tl.int64)[:, :, None] * stride_xn + cols).to(tl.float16).to(tl.float32)
        return tl.sum(wv * xv, axis=2)

    # N, OUT, ROWS and the split/scale/output strides are not specialized on, as in the GEMV
    @triton.jit(do_not_specialize=["N", "OUT", "ROWS", "STEPS", "STEPS_PER_SPLIT", "stride_so", "stride_yn",
                                   "stride_yg", "stride_ys"])
    def _fp8_mma_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, OUT, ROWS, STEPS, STEPS_PER_SPLIT,
                        stride_xn, stride_xg, stride_wo, stride_so, stride_yn, stride_yg, stride_ys,
                        R: tl.constexpr, S: tl.constexpr, TOKEN_SETS: tl.constexpr, X_F16: tl.constexpr,
                        PREFETCH: tl.constexpr, USE_ASM: tl.constexpr, PDL: tl.constexpr):
        """x [N, in] (row stride stride_xn, group stride stride_xg, elements), w [OUT, in] e4m3 (row stride
        stride_wo bytes), s E8M0 bytes, y [split, N, OUT] as in `_fp8_gemv_kernel`; grid (OUT / BLOCK_O,
        split); in = 128 STEPS. The first K block's weights load before the PDL wait (they do not depend on the
        kernel before: their DRAM latency overlaps its last programs)."""
        BLOCK_O: tl.constexpr = 16 * R * S
        pid_o = tl.program_id(0)
        pid_k = tl.program_id(1)
        row0 = pid_o * BLOCK_O
        group = row0 // ROWS
        x_ptr += group.to(tl.int64) * stride_xg
        y_ptr += group.to(tl.int64) * stride_yg - group * ROWS
        # tile row r2 = rep * 8S + warp * 8 + g; rep 2m + rho = row 8 rho + g of the warp's mma tile m
        r2 = tl.arange(0, BLOCK_O)[:, None]
        w = tl.arange(0, 16)[None, :]
        rows = row0 + ((r2 // 8) % S) * (16 * R) + 8 * (r2 // (8 * S)) + r2 % 8
        row = tl.minimum(rows, OUT - 1)   # rows past OUT: loaded, never stored
        w_words = w_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + row.to(tl.int64) * (stride_wo // 4) + w
        # x: [token sets, 8S, 16], lane (g, t) of any warp reads token g (+ 8 h) at words 8t + i (+ 4)
        xh = tl.arange(0, TOKEN_SETS)[:, None, None]
        xr = tl.arange(0, 8 * S)[None, :, None]
        xw = tl.arange(0, 16)[None, None, :]
        tok = tl.minimum(xr % 8 + 8 * xh, N - 1)
        x_words = (x_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + tok.to(tl.int64) * (stride_xn // 2)
                   + xw + 4 * (xw // 4))
        s_row = s_ptr + (row0 // 128) * stride_so
        kb0 = pid_k * STEPS_PER_SPLIT
        kb1 = tl.minimum(kb0 + STEPS_PER_SPLIT, STEPS)
        acc = tl.zeros((BLOCK_O, 16), dtype=tl.float32)
        if USE_ASM:
            wa, wb, sb = _w_step(w_words, s_row, kb0)
        pdl_start(PDL)
        if USE_ASM:
            for kb in range(kb0, kb1):
                if PREFETCH:   # the next block's words and scale are loaded before this block's math
                    na, nb, ns = _w_step(w_words, s_row, tl.minimum(kb + 1, kb1 - 1))
                else:
                    wa, wb, sb = _w_step(w_words, s_row, kb)
                xo = kb * 64   # chunk a's words 8t + i: pairs 0-3 at +0, 4-7 at +4; chunk b's at +32, +36
                xa0 = _x_tile(x_words, xo, R, S, X_F16)
                xa1 = _x_tile(x_words, xo + 4, R, S, X_F16)
                xb0 = _x_tile(x_words, xo + 32, R, S, X_F16)
                xb1 = _x_tile(x_words, xo + 36, R, S, X_F16)
                if TOKEN_SETS == 1:
                    d = tl.inline_asm_elementwise(_ASM_1, _CONSTRAINTS, [wa, wb, xa0, xa1, xb0, xb1],
                                                  dtype=tl.int32, is_pure=True, pack=8)
                else:
                    d = tl.inline_asm_elementwise(_ASM_2, _CONSTRAINTS, [wa, wb, xa0, xa1, xb0, xb1],
                                                  dtype=tl.int32, is_pure=True, pack=8)
                acc += d.to(tl.float32, bitcast=True) * (sb.to(tl.int32) << 23).to(tl.float32, bitcast=True)
                if PREFETCH:
                    wa, wb, sb = na, nb, ns
        else:
            for kb in range(kb0, kb1):
                d = _plain_step(w_ptr, row, x_ptr, stride_wo, stride_xn, N, kb, TOKEN_SETS)
                acc += d * (tl.load(s_row + kb).to(tl.int32) << 23).to(tl.float32, bitcast=True)
        if TOKEN_SETS == 1:   # slots (t, chain, column): add the chains; token 2t + column
            y = tl.reshape(tl.sum(tl.reshape(acc, (BLOCK_O, 4, 2, 2)), axis=2), (BLOCK_O, 8))
            tok_out = tl.arange(0, 8)[None, :]
        else:                 # slots (t, set, column): token 2t + column + 8 set
            y = acc
            tok_out = 2 * (w // 4) + w % 2 + 8 * ((w % 4) // 2)
        ptrs = y_ptr + pid_k.to(tl.int64) * stride_ys + tok_out.to(tl.int64) * stride_yn + rows
        tl.store(ptrs, y.to(y_ptr.dtype.element_ty), mask=(tok_out < N) & (rows < OUT))


def mma_takes(x: torch.Tensor, data: torch.Tensor, n: int, in_f: int, x_strides: tuple[int, int]) -> bool:
    """Whether the mma kernel can run this call (see the module doc's bounds); else the GEMV does."""
    return (x.dtype in (torch.bfloat16, torch.float16) and 1 <= n <= 16 and in_f % 128 == 0
            and data.stride(0) % 16 == 0 and data.data_ptr() % 16 == 0 and x.data_ptr() % 16 == 0
            and all(s % 8 == 0 for s in x_strides))


def launch_mma(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, y: torch.Tensor, n: int, out_f: int,
               rows: int, in_f: int, split: int, x_strides: tuple[int, int], y_strides: tuple[int, int, int],
               block_o: int, warps: int, prefetch: bool) -> None:
    """One launch over out_f rows (groups of `rows`) with `split` K ranges: y [split, n, out_f] partials (strides
    y_strides = (token, group, split)) or the output itself (split 1)."""
    steps = in_f // 128
    per_split = cdiv(steps, split)
    tiles = block_o // (16 * warps)
    _fp8_mma_kernel[(cdiv(out_f, block_o), cdiv(steps, per_split))](
        x, data, scale, y, n, out_f, rows, steps, per_split, x_strides[0], x_strides[1], data.stride(0),
        scale.stride(0), *y_strides, R=tiles, S=warps, TOKEN_SETS=1 if n <= 8 else 2,
        X_F16=x.dtype == torch.float16, PREFETCH=prefetch, USE_ASM=not interpreting(), num_warps=warps,
        num_stages=1, **pdl_args(x, _fp8_mma_kernel))


def sass_report(tiles: int = 1, warps: int = 4, token_sets: int = 1, prefetch: bool = True,
                x_f16: bool = False) -> dict:
    """Build the kernel for sm_90 on any machine with Triton's NVIDIA backend (no GPU needed) and report what
    the asm relies on and what it costs: the blocked layout Triton gave the asm operands, registers, spill
    stack, and the loop body's SASS (op counts, instructions per weight: a lane takes 64 R weights a step). The
    TTGIR's conversions of the x tiles into the spread layout are not counted: they are the same register
    layout (no shared memory in the loop's SASS, which the tests check)."""
    sig = dict(zip(_fp8_mma_kernel.arg_names, ("*bf16", "*fp8e4nv", "*u8", "*bf16") + ("i32",) * 16))
    const = dict(R=tiles, S=warps, TOKEN_SETS=token_sets, X_F16=x_f16, PREFETCH=prefetch, USE_ASM=True, PDL=False)
    compiled = build_sm90(_fp8_mma_kernel, sig, const, ("x_ptr", "w_ptr", "s_ptr", "y_ptr", "stride_xn",
                                                         "stride_xg", "stride_wo"), num_warps=warps, num_stages=1)
    ops, registers, spills, _ = loop_sass(compiled.asm["cubin"])
    return {"tiles": tiles, "warps": warps, "token_sets": token_sets,
            "asm_layout": packed_asm_layout(compiled.asm["ttgir"]), "registers": registers, "spills": spills,
            "loop_ops": ops, "instructions_per_weight": sum(ops.values()) / (64 * tiles)}


__all__ = ["mma_asm", "mma_takes", "launch_mma", "BF16_TO_F16_ASM", "sass_report"]
