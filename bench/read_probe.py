"""How fast can a kernel in a dependent chain read a decode product's weight bytes, with no arithmetic at all?

Why: at one token every FP8 product of a decode step lies on ~1.7-2.3 us + bytes / 3.33-3.55 TB/s (docs/benchmarks
.md), against the 4.25 TB/s device copy, and the twenty-fifth session's TMA kernel with no arithmetic was no faster.
This probe reads each call's own buffer (so every call misses L2) with plain 16-byte loads, chained in one CUDA
graph with PDL as a decode step chains its kernels: a flat read (programs a contiguous chunk each), the GEMV's walk
([R rows, BK bytes] tiles of a [rows, in] matrix, plain or stored as contiguous 128 x 128-byte blocks), and beside
them cuBLAS's bf16 GEMV, the production FP8 GEMV (its pick for the shape) and the FP8 mma kernel at one token on the
same bytes. Thirty-sixth session, H200: the best tilings of either walk read 33.6 MB in 8.9-9.0 us (8.4 MB in
3.4-3.5), against the FP8 GEMV's 10.2-10.8 on the three 33.6 MB products: what a chain can read is ~4.5 TB/s beyond
a ~1.6 us start, and the GEMV's 1.3-1.9 us a large product above it is the kernel's own work, not its access
pattern (docs/benchmarks.md has the table). A plainer GEMV (x scaled by the blocks' scales, one FFMA a weight;
f1dc705) was 0.3-1.2 us slower than the production pick on every product. `--gemv` times the words GEMV against
the production pick on the V4-Flash products: the weights read as int32 words (4 e4m3 each), optionally the next
step's words loaded into registers before this step's math, converted by PTX or by bit moves.

    python -m bench.read_probe [--mb 33.56 8.4] [--copies 40] [--gemv]
"""

from __future__ import annotations

import argparse
import functools
import itertools

import numpy as np
import torch

from moebox.ops.triton.runtime import HAVE_TRITON, bench_start, each_copy, graph_us, pdl_args, pdl_start, tl, triton

if HAVE_TRITON:
    @triton.jit
    def _read_kernel(src_ptr, out_ptr, words, CHUNK: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """Program p xors the int32 words [p CHUNK, (p + 1) CHUNK) of src (BLOCK a step) into out[p]."""
        pdl_start(PDL)
        p = tl.program_id(0)
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for k in range(0, CHUNK, BLOCK):
            offs = p * CHUNK + k + tl.arange(0, BLOCK)
            acc ^= tl.load(src_ptr + offs, mask=offs < words, other=0, cache_modifier=".cg")
        tl.store(out_ptr + p, tl.xor_sum(acc, axis=0))

    @triton.jit
    def _tile_read_kernel(src_ptr, out_ptr, KW, R: tl.constexpr, BW: tl.constexpr, BLOCKED: tl.constexpr,
                          PDL: tl.constexpr):
        """Program p xors rows [p R, (p + 1) R) of an int32 [rows, KW] matrix, [R, BW] a step, as the FP8 GEMV
        walks a weight; BLOCKED: the matrix stored as contiguous 128-row x 32-word (128 x 128 byte) blocks."""
        pdl_start(PDL)
        p = tl.program_id(0)
        rows = p * R + tl.arange(0, R)
        cols = tl.arange(0, BW)
        acc = tl.zeros([R, BW], dtype=tl.int32)
        for k in range(0, KW, BW):
            c = k + cols
            if BLOCKED:
                off = ((rows // 128) * (KW // 32))[:, None] * 4096 + (c // 32)[None, :] * 4096 \
                    + (rows % 128)[:, None] * 32 + (c % 32)[None, :]
            else:
                off = rows[:, None] * KW + c[None, :]
            acc ^= tl.load(src_ptr + off, cache_modifier=".cg")
        tl.store(out_ptr + p, tl.xor_sum(tl.xor_sum(acc, axis=1), axis=0))


if HAVE_TRITON:
    # e4m3 x4 (one int32 word, byte j = column 4c + j) -> 4 f32, by the hardware conversion (sm_89+)
    _E4M3X4_TO_F32 = tl.constexpr(
        "{ .reg .b16 l, h, a0, a1, b0, b1; .reg .b32 a, b; .reg .f32 f<4>;"
        " mov.b32 {l, h}, $4; cvt.rn.f16x2.e4m3x2 a, l; cvt.rn.f16x2.e4m3x2 b, h;"
        " mov.b32 {a0, a1}, a; mov.b32 {b0, b1}, b;"
        " cvt.f32.f16 f0, a0; cvt.f32.f16 f1, a1; cvt.f32.f16 f2, b0; cvt.f32.f16 f3, b1;"
        " mov.b32 $0, f0; mov.b32 $1, f1; mov.b32 $2, f2; mov.b32 $3, f3; }")

    @triton.jit
    def _e4m3_bits(w, J: tl.constexpr):
        """Byte J of each word as an f32 of value e4m3 * 2^-120: its sign to bit 31, its exponent and mantissa
        to bits 26..20 (an e4m3 subnormal lands on an f32 subnormal, so the factor holds for every code)."""
        sign = (w << (24 - 8 * J)) if J < 3 else w
        mag = (w << (20 - 8 * J)) if J < 3 else (w >> 4)
        return ((sign & -2147483648) | (mag & 0x07F00000)).to(tl.float32, bitcast=True)

    @triton.jit
    def _word_products(acc, w, x_words, s_row, c, CVT: tl.constexpr):
        """acc [R, BW] + one step's products: w [R, BW] int32 words of 4 e4m3 weights (columns 4c .. 4c + 3 of
        word column c), x_words the bf16 x as int32 pairs, s_row the row block's E8M0 bytes (one a 32 words)."""
        if CVT:
            q0, q1, q2, q3 = tl.inline_asm_elementwise(_E4M3X4_TO_F32, "=r,=r,=r,=r,r", [w],
                                                       dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                                                       is_pure=True, pack=1)
            w0, w1 = q0.to(tl.float32, bitcast=True), q1.to(tl.float32, bitcast=True)
            w2, w3 = q2.to(tl.float32, bitcast=True), q3.to(tl.float32, bitcast=True)
        else:
            w0, w1, w2, w3 = _e4m3_bits(w, 0), _e4m3_bits(w, 1), _e4m3_bits(w, 2), _e4m3_bits(w, 3)
        # x (and the scales) loaded as [R, BW] tiles, each lane its own copy from L1: as [BW] vectors they came
        # in another layout and went through shared memory, with barriers, every step
        c = c[None, :] + tl.zeros_like(w)
        s = tl.load(s_row + c // 32).to(tl.int32)
        if CVT:
            scale = (s << 23).to(tl.float32, bitcast=True)
        else:   # the 2^120 that _e4m3_bits leaves out, folded into the scale (scale bytes <= 134: scales <= 2^7)
            scale = ((s + 120) << 23).to(tl.float32, bitcast=True)
        x01 = tl.load(x_words + 2 * c)
        x23 = tl.load(x_words + 2 * c + 1)
        x0 = (x01 << 16).to(tl.float32, bitcast=True)
        x1 = (x01 & -65536).to(tl.float32, bitcast=True)
        x2 = (x23 << 16).to(tl.float32, bitcast=True)
        x3 = (x23 & -65536).to(tl.float32, bitcast=True)
        return acc + (w0 * x0 + w1 * x1 + w2 * x2 + w3 * x3) * scale

    @triton.jit
    def _words_gemv_kernel(x_words, w_words, s_ptr, y_ptr, KW, S_STRIDE, R: tl.constexpr, BW: tl.constexpr,
                           AHEAD: tl.constexpr, CVT: tl.constexpr, PDL: tl.constexpr):
        """y[rows] = W8[rows] @ x for one token, the weights read as int32 words (4 e4m3 each), program p rows
        [p R, (p + 1) R) (R divides 128: one scale row), [R, BW] words a step. AHEAD: the next step's words
        are loaded into registers before this step's math (a register double buffer; Triton would keep loop-
        carried e4m3 values one a register, words hold 4). The first step's words are loaded before the PDL
        wait (the weights are constant). CVT: e4m3 -> f32 by cvt.rn.f16x2.e4m3x2 (inline PTX), else by bit
        moves (what the interpreter can run)."""
        p = tl.program_id(0)
        cols = tl.arange(0, BW)
        w_ptrs = w_words + (p * R + tl.arange(0, R)).to(tl.int64)[:, None] * KW + cols[None, :]
        s_row = s_ptr + (p * R // 128) * S_STRIDE
        w = tl.load(w_ptrs)
        pdl_start(PDL)
        acc = tl.zeros([R, BW], dtype=tl.float32)
        for k in range(BW, KW, BW):
            if AHEAD:
                w_next = tl.load(w_ptrs + k)
                acc = _word_products(acc, w, x_words, s_row, k - BW + cols, CVT)
                w = w_next
            else:
                acc = _word_products(acc, w, x_words, s_row, k - BW + cols, CVT)
                w = tl.load(w_ptrs + k)
        acc = _word_products(acc, w, x_words, s_row, KW - BW + cols, CVT)
        tl.store(y_ptr + p * R + tl.arange(0, R), tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty))


def words_gemv(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, r: int, bw: int, warps: int,
               ahead: bool, cvt: bool) -> torch.Tensor:
    """x [1, in] bf16, data [out, in] e4m3, scale [out / 128, in / 128] E8M0 -> y [1, out] bf16, by
    `_words_gemv_kernel` (r rows and bw words a program's step)."""
    out_f, in_f = data.shape
    if x.dtype != torch.bfloat16 or out_f % r or 128 % r or in_f % (4 * bw) or bw % 32:
        raise ValueError(f"words_gemv needs bf16 x, r | gcd(out, 128) and 128 | 4 bw | in: {out_f}, {in_f}, {r}, "
                         f"{bw}")
    y = torch.empty(1, out_f, dtype=x.dtype, device=x.device)
    _words_gemv_kernel[(out_f // r,)](x.view(torch.int32), data.view(torch.int32), scale.view(torch.uint8), y,
                                      in_f // 4, scale.stride(0), R=r, BW=bw, AHEAD=ahead, CVT=cvt,
                                      num_warps=warps, **pdl_args(x, _words_gemv_kernel))
    return y


def gemv_rows(copies: int) -> list[tuple[str, float, float]]:
    """The words GEMV's tilings against the production pick on the V4-Flash one-token products: (label, us,
    relative error against fp8_linear_reference)."""
    from moebox.bench.synthetic import _fp8
    from moebox.ops.triton.fp8_linear import fp8_linear_reference, fp8_linear_triton
    from moebox.ops.triton.runtime import rel_err
    from moebox.weights.schema import TensorSpec
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for name, (out_f, in_f) in {"wq_a+wkv": (1536, 4096), "shared w1+w3": (4096, 4096), "wq_b": (32768, 1024),
                                "wo_a": (8192, 4096), "wo_b": (4096, 8192)}.items():
        w = _fp8(TensorSpec(name, (out_f, in_f), "fp8"), g, dev)
        ws = [w] + [type(w)(w.kind, w.data.clone(), w.scale.clone(), w.block) for _ in range(copies - 1)]
        x = torch.randn(1, in_f, generator=g, device=dev).to(torch.bfloat16)
        ref = fp8_linear_reference(x, w)
        us = graph_us(each_copy(lambda i: fp8_linear_triton(x, ws[i]), copies))
        rows.append((f"{name} [{out_f}, {in_f}] production", us, rel_err(fp8_linear_triton(x, w), ref)))
        for r, bw, warps, ahead, cvt in itertools.product((8, 16, 32), (128, 256, 512, 1024), (4, 8), (False, True),
                                                          (False, True)):
            if in_f % (4 * bw) or r * bw > 8192 or r * bw > 64 * 32 * warps:
                continue
            fn = functools.partial(words_gemv, r=r, bw=bw, warps=warps, ahead=ahead, cvt=cvt)
            us = graph_us(each_copy(lambda i: fn(x, ws[i].data, ws[i].scale), copies))
            rows.append((f"{name} words {r}x{4 * bw} w{warps}{' ahead' if ahead else ''}{' cvt' if cvt else ''}",
                         us, rel_err(fn(x, w.data, w.scale), ref)))
        del ws
    return rows


def read_call(src: torch.Tensor, out: torch.Tensor, programs: int, block: int, warps: int) -> None:
    """The flat read of src (int32) by `programs` programs, `block` words a step; out[p] = program p's xor."""
    words = src.numel()
    chunk = -(-words // programs // block) * block
    _read_kernel[(programs,)](src, out, words, CHUNK=chunk, BLOCK=block, num_warps=warps,
                              **pdl_args(src, _read_kernel))


def read_reference(src: torch.Tensor, programs: int, block: int) -> torch.Tensor:
    """out of `read_call` in torch: each program's chunk xor-reduced (zero-padded)."""
    words = src.numel()
    chunk = -(-words // programs // block) * block
    flat = torch.zeros(programs * chunk, dtype=torch.int32, device=src.device)
    flat[:words] = src
    return torch.from_numpy(np.bitwise_xor.reduce(flat.view(programs, chunk).cpu().numpy(), axis=1))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, nargs="+", default=[33.56, 8.4])
    p.add_argument("--copies", type=int, default=40, help="buffers a chain (each call misses L2)")
    p.add_argument("--gemv", action="store_true", help="only the words GEMV's tilings against the production pick")
    args = p.parse_args(argv)
    bench_start()
    if args.gemv:
        print(f"\n{'product / kernel':44s} {'us':>7s} {'rel err':>9s}")
        for label, us, err in gemv_rows(args.copies):
            print(f"{label:44s} {us:7.2f} {err:9.2e}")
        return
    from moebox.ops.triton.fp8_linear import Fp8Config, fp8_linear_triton
    from moebox.weights.formats import QuantTensor
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows = []
    for mb in args.mb:
        words = int(mb * 1e6) // 4 // 4096 * 4096
        bufs = [torch.randint(-2 ** 31, 2 ** 31 - 1, (words,), dtype=torch.int32, device=dev)
                for _ in range(args.copies)]
        out = torch.empty(1 << 16, dtype=torch.int32, device=dev)
        nbytes = words * 4
        ref = read_reference(bufs[0], 2 * sms, 4096)
        read_call(bufs[0], out, 2 * sms, 4096, 8)
        assert torch.equal(out[:2 * sms].cpu(), ref), "read kernel differs from its reference"
        for progs, block, warps in itertools.product((2 * sms, 4 * sms, 8 * sms), (1024, 8192), (4, 8)):
            if block < warps * 32 * 4:
                continue
            us = graph_us(each_copy(lambda i: read_call(bufs[i], out, progs, block, warps), args.copies))
            rows.append((mb, f"read {progs // sms}/SM block {block * 4 // 1024} KB w{warps}", us, nbytes / us / 1e3))
        # cuBLAS bf16 GEMV over the same bytes ([rows, 4096] bf16)
        mats = [b.view(torch.bfloat16).view(-1, 4096) for b in bufs]
        x = torch.randn(4096, dtype=torch.bfloat16, device=dev)
        us = graph_us(each_copy(lambda i: torch.mv(mats[i], x), args.copies))
        rows.append((mb, "cuBLAS bf16 mv", us, nbytes / us / 1e3))
        # the production FP8 GEMV (its default pick) over the same bytes ([rows, 1024] e4m3, the wq_b shape)
        for inp in (1024, 4096, 8192):
            ws = [QuantTensor("fp8", b.view(torch.float8_e4m3fn).view(-1, inp),
                              torch.full((-(-nbytes // inp // 128), inp // 128), 120, dtype=torch.uint8,
                                         device=dev).view(torch.float8_e8m0fnu), (128, 128)) for b in bufs]
            xi = torch.randn(1, inp, dtype=torch.bfloat16, device=dev)
            us = graph_us(each_copy(lambda i: fp8_linear_triton(xi, ws[i]), args.copies))
            rows.append((mb, f"fp8 GEMV [{nbytes // inp}, {inp}]", us, nbytes / us / 1e3))
            mma = Fp8Config(block_o=64, num_stages=2, kernel="mma")
            us = graph_us(each_copy(lambda i: fp8_linear_triton(xi, ws[i], config=mma), args.copies))
            rows.append((mb, f"fp8 mma [{nbytes // inp}, {inp}]", us, nbytes / us / 1e3))
        for inp in ((1024, 4096, 8192) if mb > 30 else ()):
            kw, nrows = inp // 4, words // (inp // 4) // 128 * 128
            for r, bk, warps, blocked in itertools.product((8, 16, 32), (512, 1024), (4, 8), (False, True)):
                us = graph_us(each_copy(lambda i: _tile_read_kernel[(nrows // r,)](
                    bufs[i], out, kw, R=r, BW=bk // 4, BLOCKED=blocked, num_warps=warps,
                    **pdl_args(bufs[i], _tile_read_kernel)), args.copies))
                rows.append((mb, f"tiles [{nrows}, {inp}] {r}x{bk} w{warps}{' blocked' if blocked else ''}", us,
                             nrows * inp / us / 1e3))
        del bufs, mats
    print(f"\n{'MB':>6s}  {'kernel':36s} {'us':>7s} {'GB/s':>7s}")
    for mb, name, us, rate in rows:
        print(f"{mb:6.1f}  {name:36s} {us:7.2f} {rate:7.0f}")


if __name__ == "__main__":
    main()
