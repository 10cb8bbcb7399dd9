"""The routed experts' gate-up product at decode on FP8 tensor cores: 4 weights a byte permute instead of 2.

Why: at 4-16 tokens the bf16 gate-up kernel (`w2_moe._gate_up_mma_kernel`) is bound by its integer ALU pipe:
one PRMT makes 2 bf16 weights, and the selectors that feed it cost 11 more integer ops a 16-code word (19 a
word, 1.2 a weight; docs/benchmarks.md, sixteenth and seventeenth sessions). An e4m3 weight is one byte, so
one PRMT makes 4 of them straight from a word's codes: the selector of 4 codes is one AND (or a shift and an
AND) of the word, 9 integer ops a word in all, into `mma.sync.m16n8k32.e4m3`.

What it computes: the same h as the bf16 kernel (gate/up rows, clamp, SiLU, routing weight; h written as bf16
terms in the pair layout, so the down kernel is unchanged), up to the rounding of x to FP8 terms.
- Weights: code c of a row's 32-column group with scale byte s is level[c] * 2^(s - 127), level = -4, -1, 1,
  4. In e4m3 the kernel holds level[c] * 2^(s - ref) with ref = (the row's largest scale byte) - 6, so s - ref
  <= 6 and 4 * 2^6 = 256 fits e4m3 (max 448); a group with s - ref < -6 (more than 12 octaves below the row's
  largest) is flushed to 0 (its weights are < 2^-10 of that group's). Exact otherwise: the e4m3 byte of
  level * 2^d is LUT[c] + 8d in each byte (`_BASE_LUT`), one IMAD a row and group. `row_refs` computes
  ref per (expert, row) once per scale tensor (cached; not inside a CUDA-graph capture).
- x: per token, x * 2^-sigma (sigma makes max |x| land in [128, 256)) as `E8_TERMS` e4m3 terms rounded to
  nearest (each term the rounding of what the ones before left; ~2^-4 of the rest each, values below 2^-9
  after scaling are lost: < 2^-17 of the token's largest). Term tau is mma column tau (the B operand has 8
  columns and one token), so the terms cost no extra mma; lanes of columns >= T read a copy of the last term
  and `_reduce_tile` drops those columns.
- The mma accumulates in fp32; each chain of 4 mmas (K = 128 a row) starts from 0 and is added to the fp32
  accumulator, so the tensor core never sums more than 128 products (its FP8 accumulation is not full fp32).
  The row sum is then multiplied by 2^(ref - 127 + sigma).

Layout: the lane map of the bf16 kernel (lane 4g + t of warp s holds words 4t..4t+3 of tile rows g and g + 8;
see `w2_moe`'s module doc). Per K step (a 16-word tile, 256 columns) a lane runs 8 mmas: word i (0..3), half
h (codes 0-7 or 8-15 of the word). mma (i, h): A row g = codes 2j + 8h (j = 0..3: a0, K = 4t + j) and 2j + 1
+ 8h (a2, K = 16 + 4t + j) of the row-g word, likewise a1/a3 from the row-(g+8) word. So K position 4t + j
of mma (i, h) is column 16(4t + i) + 8h + 2j, position 16 + 4t + j is that + 1, and x is packed to match
(`_x_pos`): per (token, term) K bytes, tile u at byte 256u, lane t's 64 bytes at 64t, int32 word
8b + 4h + i holding the columns 16(4t + i) + 8h + 2j + b, j = 0..3 (b = 0: the b0 register, 1: b1).

Status: an experiment, off unless MOEBOX_W2_E8 is set to a token count (the decode calls of at least that many
tokens take it); docs/benchmarks.md has its measurements.
"""

from __future__ import annotations

import os

import torch

from moebox.ops.triton.runtime import HAVE_TRITON, build_sm90, loop_sass, packed_asm_layout, pdl_start, tl, triton

E8_TERMS = 3
_BASE_LUT = 0x4838B8C8   # e4m3 bytes of -4, -1, 1, 4 (codes 0..3) at scale 2^0; + 8 a byte for each octave
_REF_HEADROOM = 6        # ref = max scale byte - 6: the largest group's 4 * 2^6 = 256 <= 448
_refs: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def e8_from_tokens() -> int:
    """The smallest decode call (in tokens) that takes the FP8 gate-up: MOEBOX_W2_E8, 0 (off) when unset."""
    return int(os.environ.get("MOEBOX_W2_E8", "0") or 0)


def row_refs(scales: torch.Tensor) -> torch.Tensor:
    """int32 [E, rows]: each row's largest scale byte - 6 (scales uint8 [E, rows, groups]). Cached per tensor
    (data pointer, shape, strides; the cache holds the tensor, so its memory cannot be reused under the same
    key): the planes are static, and inside a CUDA-graph capture the first call would be recorded into the
    graph and rerun at every replay, so it raises there."""
    key = (scales.data_ptr(), tuple(scales.shape), scales.stride(), scales.device)
    entry = _refs.get(key)
    if entry is None:
        if scales.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("w2 FP8 gate-up: row_refs of new planes inside a CUDA-graph capture; run the "
                               "call once before capturing")
        entry = _refs[key] = (scales, scales.amax(dim=2).to(torch.int32) - _REF_HEADROOM)
    return entry[1]


if HAVE_TRITON:
    from moebox.ops.triton.w2_moe import _MMA_SLOTS, _reduce_tile, _store_bf16_terms, _pair_slot, _tile_coords

    def _e8_asm() -> str:
        """PTX for one lane's K step: $0..$7 acc out; $8.. codes (slot 4 rho + i: word i of row rep rho),
        $16.. scale bytes (slot 4 rho + b: the lane's group b), $24.. the row's ref (slot 4 rho), $32.. / $40..
        the b0 / b1 registers of x (slot 4 h + i), $48.. acc in (slot as `w2_moe._mma_asm`)."""
        codes, scales, refs, xa, xb, acc = 8, 16, 24, 32, 40, 48
        asm = ["{", ".reg .b32 L<4>, rb, lo, t, e0, o0, e1, o1, a<4>;", ".reg .f32 d<8>, z;", ".reg .pred p;",
               "mov.f32 z, 0f00000000;"]
        for rho in range(2):
            r = f"${refs + 4 * rho}"
            asm += [f"mad.lo.u32 rb, {r}, {(-0x08080808) & 0xFFFFFFFF}, {_BASE_LUT};",   # LUT - 8 ref a byte
                    f"sub.s32 lo, {r}, {_REF_HEADROOM};"]
            for b in range(2):   # L[2b + rho]: row rep rho, the lane's group b
                s = f"${scales + 4 * rho + b}"
                asm += [f"mad.lo.u32 t, {s}, 0x08080808, rb;", f"setp.lt.s32 p, {s}, lo;",
                        f"selp.b32 L{2 * b + rho}, 0, t, p;"]
        for i in range(4):
            lut = f"L{2 * (i // 2)}, L{2 * (i // 2) + 1}"   # bytes 0-3: row g's LUT, 4-7: row g + 8's
            c0, c1 = f"${codes + i}", f"${codes + 4 + i}"
            asm += [f"and.b32 e0, {c0}, 0x33333333;", f"shr.b32 t, {c0}, 2;", "and.b32 o0, t, 0x33333333;",
                    f"lop3.b32 e1, {c1}, 0x33333333, 0x44444444, 0xea;", f"shr.b32 t, {c1}, 2;",
                    "lop3.b32 o1, t, 0x33333333, 0x44444444, 0xea;"]
            for h in range(2):
                if h:
                    asm += [f"shr.b32 {v}, {v}, 16;" for v in ("e0", "o0", "e1", "o1")]
                asm += [f"prmt.b32 a0, {lut}, e0;", f"prmt.b32 a1, {lut}, e1;", f"prmt.b32 a2, {lut}, o0;",
                        f"prmt.b32 a3, {lut}, o1;"]
                chain = i // 2
                d = ", ".join(f"d{4 * chain + k}" for k in range(4))
                c = "z, z, z, z" if i % 2 == 0 and h == 0 else d
                asm.append(f"mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {{{d}}}, {{a0, a1, a2, a3}}, "
                           f"{{${xa + 4 * h + i}, ${xb + 4 * h + i}}}, {{{c}}};")
        asm += [f"add.f32 ${_MMA_SLOTS[k]}, ${acc + _MMA_SLOTS[k]}, d{k};" for k in range(8)] + ["}"]
        return "\n".join(asm)

    _E8_ASM = tl.constexpr(_e8_asm())
    _E8_CONSTRAINTS = tl.constexpr(",".join(["=r"] * 8 + ["r"] * 48))

    @triton.jit
    def _e8_word_dot(cw, sb, ref, xa, xb, acc):
        """acc [16S, 16] fp32 += the tile's words against x's e4m3 terms on the tensor cores (`_e8_asm`)."""
        out = tl.inline_asm_elementwise(_E8_ASM, _E8_CONSTRAINTS,
                                        [cw, sb.to(tl.int32), ref, xa, xb, acc.to(tl.int32, bitcast=True)],
                                        dtype=tl.int32, is_pure=True, pack=8)
        return out.to(tl.float32, bitcast=True)

    @triton.jit
    def _e4m3_value(byte):
        """fp32 value of e4m3 bytes (int32 0..255; no NaN in what the pack writes)."""
        ex = (byte >> 3) & 15
        man = (byte & 7).to(tl.float32)
        mag = tl.where(ex == 0, man * 0.001953125, (8.0 + man) * tl.exp2((ex - 10).to(tl.float32)))
        return tl.where(byte >= 128, -mag, mag)

    @triton.jit
    def _plain_e8_dot(cw, sb, ref, xw_ptr, T: tl.constexpr, TERM_STRIDE: tl.constexpr):
        """The asm's values without inline asm (Triton's interpreter): per element, word cw (its 16 codes) at
        scale byte sb and row ref against x's T e4m3 terms (int8 view; xw_ptr: the word's lane block + i)."""
        m = tl.arange(0, 16)[None, None, :]
        c = (cw[:, :, None] >> (2 * m)) & 3
        level = tl.where(c == 0, -4.0, tl.where(c == 1, -1.0, tl.where(c == 2, 1.0, 4.0)))
        d = (sb - ref)[:, :, None]
        v = tl.where(d < -_REF_HEADROOM, 0.0, level * tl.exp2(d.to(tl.float32)))
        # column 8h + 2j + b of the word: int32 word 8b + 4h (+ i, in xw_ptr) of the lane block, byte j
        off = 4 * (8 * (m % 2) + 4 * (m // 8)) + (m % 8) // 2
        x = tl.zeros(v.shape, dtype=tl.float32)
        for tau in tl.static_range(T):
            byte = tl.load(xw_ptr[:, :, None] + tau * TERM_STRIDE + off).to(tl.int32) & 255
            x += _e4m3_value(byte)
        return tl.sum(v * x, axis=2)

    @triton.jit
    def _x_pos(col):
        """Byte of column col in a (token, term) row of the packed x (module doc)."""
        cc = col % 256
        t, i, w = cc // 64, (cc // 16) % 4, cc % 16
        return (col // 256) * 256 + 64 * t + 4 * (8 * (w % 2) + 4 * (w // 8) + i) + (w % 8) // 2

    @triton.jit
    def _e4m3_rn(v):
        """(byte, value): v (fp32, |v| < 448) rounded to the nearest e4m3 (ties to even) and its bit pattern."""
        a = tl.abs(v)
        ex = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 255) - 127, -6)   # subnormals: quantum 2^-9
        q = ((ex + 124) << 23).to(tl.float32, bitcast=True)          # 2^(ex - 3): 8 steps an octave
        r = (a * ((130 - ex) << 23).to(tl.float32, bitcast=True) + 12582912.0) - 12582912.0   # a / q, ties even
        mag = r * q
        mb = mag.to(tl.int32, bitcast=True)
        e = ((mb >> 23) & 255) - 127
        byte = tl.where(e >= -6, ((e + 7) << 3) | ((mb >> 20) & 7), (mag * 512.0).to(tl.int32))
        byte = tl.where(mag == 0.0, 0, byte)
        neg = v < 0.0
        return tl.where(neg, byte | 128, byte), tl.where(neg, -mag, mag)

    @triton.jit
    def _pack_x_e8_kernel(x_ptr, xq_ptr, sig_ptr, x_row_stride, H: tl.constexpr, T: tl.constexpr,
                          BLOCK: tl.constexpr, PDL: tl.constexpr):
        """One program per token: sigma (int32) and x * 2^-sigma as T e4m3 terms (int8 [N, T, H], `_x_pos`)."""
        pdl_start(PDL)
        n = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        big = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, H, BLOCK):
            big = tl.maximum(big, tl.abs(tl.load(x_ptr + n * x_row_stride + k0 + offs).to(tl.float32)))
        m = tl.max(big, axis=0)
        sig = tl.where(m > 0.0, ((m.to(tl.int32, bitcast=True) >> 23) & 255) - 134, 0)
        sig = tl.minimum(tl.maximum(sig, -100), 100)
        tl.store(sig_ptr + n, sig)
        inv = ((127 - sig) << 23).to(tl.float32, bitcast=True)
        for k0 in range(0, H, BLOCK):
            col = k0 + offs
            v = tl.load(x_ptr + n * x_row_stride + col).to(tl.float32) * inv
            pos = _x_pos(col)
            for tau in tl.static_range(T):
                byte, val = _e4m3_rn(v)
                tl.store(xq_ptr + (n * T + tau) * H + pos, byte.to(tl.int8))
                v = v - val

    @triton.jit
    def _gate_e8_tiles(w1c_ptr, w1s_ptr, w3c_ptr, w3s_ptr, c_row, s_row, u, LAST: tl.constexpr):
        """The w1 and w3 code words and scale bytes of K tile u (clamped to the last) and its first word."""
        wb = tl.minimum(u, LAST) * 16
        return (tl.load(w1c_ptr + c_row + wb), tl.load(w1s_ptr + s_row + wb // 2),
                tl.load(w3c_ptr + c_row + wb), tl.load(w3s_ptr + s_row + wb // 2), wb)

    @triton.jit
    def _row_scale(ref, sig):
        """2^(ref - 127 + sig) in fp32: ref + sig is its biased exponent."""
        return ((ref + sig) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _gate_up_e8_kernel(xq_ptr, sig_ptr, ids_ptr, rw_ptr, w1c_ptr, w1s_ptr, w3c_ptr, w3s_ptr, r1_ptr, r3_ptr,
                           hp_ptr, c_expert_stride, s_expert_stride, limit,
                           I: tl.constexpr, HW: tl.constexpr, K: tl.constexpr, T: tl.constexpr,
                           TH: tl.constexpr, HAS_LIMIT: tl.constexpr, S: tl.constexpr,
                           USE_ASM: tl.constexpr, PDL: tl.constexpr):
        """`w2_moe._gate_up_mma_kernel` (prefetch 1) on e4m3 weights and x terms: grid (pairs, I / 16)."""
        pdl_start(PDL)
        p = tl.program_id(0)
        rw = tl.program_id(1)
        t = p // K
        e = tl.load(ids_ptr + p).to(tl.int64)
        g, sp, rho, w = _tile_coords(S)
        r = 8 * rho + g
        row = 16 * rw + (r >> 1) + ((r >> 1) & 4) + 4 * (r & 1)   # as the bf16 kernel: h rows in pair order
        c_row = e * c_expert_stride + row.to(tl.int64) * HW + w
        if USE_ASM:   # slots 4 rho + b: the lane's groups b = 0, 1 (2t + b of the tile)
            s_row = e * s_expert_stride + row * (HW // 2) + 2 * (w // 4) + (w % 2)
        else:         # each word's own group
            s_row = e * s_expert_stride + row * (HW // 2) + w // 2
        ref1 = tl.load(r1_ptr + e * I + row)
        ref3 = tl.load(r3_ptr + e * I + row)
        XW: tl.constexpr = HW * 4                                 # int32 words of one (token, term) row
        if USE_ASM:   # lane (g, t): term g (a copy of the last past T), int32 words 4 rho + i (+ 8: b1)
            x_row = xq_ptr + (t * T + tl.minimum(g, T - 1)).to(tl.int64) * XW + 16 * (w // 4) + 4 * rho + w % 4
        else:         # bytes: the word's lane block, + i
            x_row = (xq_ptr.to(tl.pointer_type(tl.int8)) + t.to(tl.int64) * (T * XW * 4) + 64 * (w // 4)
                     + 4 * (w % 4) + 0 * g)
        LAST: tl.constexpr = HW // 16 - 1
        acc_g = tl.zeros((16 * S, 16), dtype=tl.float32)
        acc_u = tl.zeros((16 * S, 16), dtype=tl.float32)
        c1, s1, c3, s3, wb = _gate_e8_tiles(w1c_ptr, w1s_ptr, w3c_ptr, w3s_ptr, c_row, s_row, sp, LAST)
        for u0 in tl.range(0, LAST + 1, S):
            n1, m1, n3, m3, nb = _gate_e8_tiles(w1c_ptr, w1s_ptr, w3c_ptr, w3s_ptr, c_row, s_row, u0 + S + sp,
                                                LAST)
            if USE_ASM:
                xa = tl.load(x_row + wb * 4)
                xb = tl.load(x_row + wb * 4 + 8)
                acc_g = _e8_word_dot(c1, s1, ref1, xa, xb, acc_g)
                acc_u = _e8_word_dot(c3, s3, ref3, xa, xb, acc_u)
            else:
                acc_g += _plain_e8_dot(c1, s1.to(tl.int32), ref1, x_row + wb * 16, T, XW * 4)
                acc_u += _plain_e8_dot(c3, s3.to(tl.int32), ref3, x_row + wb * 16, T, XW * 4)
            c1, s1, c3, s3, wb = n1, m1, n3, m3, nb
        r_out = 8 * tl.arange(0, 2)[:, None] + tl.arange(0, 8)[None, :]    # tile row of [rep, lane group]
        row_out = 16 * rw + (r_out >> 1) + ((r_out >> 1) & 4) + 4 * (r_out & 1)
        sig = tl.load(sig_ptr + t)
        gate = _reduce_tile(acc_g, T, S, USE_ASM) * _row_scale(tl.load(r1_ptr + e * I + row_out), sig)
        up = _reduce_tile(acc_u, T, S, USE_ASM) * _row_scale(tl.load(r3_ptr + e * I + row_out), sig)
        if HAS_LIMIT:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        h = gate / (1.0 + tl.exp(-gate)) * up * tl.load(rw_ptr + p).to(tl.float32)
        IW: tl.constexpr = I // 16
        _store_bf16_terms(hp_ptr, p.to(tl.int64) * TH * IW * 16 + 2 * _pair_slot(rw, r_out // 2) + r_out % 2, h,
                          TH, IW * 16)


def empty_e8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Buffers of `pack_x_e8`: xq int32 [N, T, H/4] (x's e4m3 terms in the lane layout), sigma int32 [N]."""
    n, hidden = x.shape
    return (torch.empty((n, E8_TERMS, hidden // 4), dtype=torch.int32, device=x.device),
            torch.empty((n,), dtype=torch.int32, device=x.device))


def pack_x_e8(x: torch.Tensor, packed: tuple[torch.Tensor, torch.Tensor], pdl: dict
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, H] (unit column stride) into `empty_e8`'s buffers, for `gate_up_e8`."""
    n, hidden = x.shape
    xq, sig = packed
    _pack_x_e8_kernel[(n,)](x, xq.view(torch.int8), sig, x.stride(0), H=hidden, T=E8_TERMS,
                            BLOCK=min(1024, hidden), num_warps=4, **pdl)
    return packed


def gate_up_e8(packed: tuple[torch.Tensor, torch.Tensor], ids: torch.Tensor, rw: torch.Tensor,
               w1c: torch.Tensor, w1s: torch.Tensor, w3c: torch.Tensor, w3s: torch.Tensor, hp: torch.Tensor,
               limit: float | None, k: int, split: int, use_asm: bool, pdl: dict) -> None:
    """h (bf16 terms, the pair layout `w2_moe._down_mma_kernel` reads) of every (token, expert) pair, as
    `w2_moe._gate_up_mma_kernel` writes it."""
    xq, sig = packed
    inter, hw = w1c.shape[1], w1c.shape[2]
    r1, r3 = row_refs(w1s), row_refs(w3s)
    has_limit = bool(limit)
    _gate_up_e8_kernel[(ids.numel(), inter // 16)](
        xq, sig, ids, rw, w1c, w1s, w3c, w3s, r1, r3, hp.view(torch.int16),
        w1c.stride(0), w1s.stride(0), float(limit) if has_limit else 0.0,
        I=inter, HW=hw, K=k, T=E8_TERMS, TH=hp.shape[1], HAS_LIMIT=has_limit, S=split, USE_ASM=use_asm,
        num_warps=split, num_stages=1, **pdl)


def sass_report(split: int) -> dict:
    """Build the FP8 gate-up kernel (V4-Flash constants, bf16 x) for sm_90 on any machine with Triton's NVIDIA
    backend and report the asm operands' layout, layout conversions in the K loop, registers, spills and the
    loop body's SASS (op counts, instructions per weight: a lane handles 2 x 128 weights a K step)."""
    types = ("*i32", "*i32", "*i64", "*fp32", "*i32", "*u8", "*i32", "*u8", "*i32", "*i32", "*i16", "i32", "i32",
             "fp32")
    sig = dict(zip(_gate_up_e8_kernel.arg_names, types))
    const = dict(I=2048, HW=256, K=6, T=E8_TERMS, TH=2, HAS_LIMIT=True, S=split, USE_ASM=True, PDL=False)
    compiled = build_sm90(_gate_up_e8_kernel, sig, const, [a for a, ty in sig.items() if ty != "fp32"],
                          num_warps=split, num_stages=1)
    ttgir = compiled.asm["ttgir"]
    loop = ttgir[ttgir.index("scf.for"):ttgir.index("scf.yield")]
    ops, registers, spills, _ = loop_sass(compiled.asm["cubin"])
    return {"split": split, "asm_layout": packed_asm_layout(ttgir), "loop_converts": loop.count("convert_layout"),
            "registers": registers, "spills": spills, "loop_ops": ops,
            "instructions_per_weight": sum(ops.values()) / 256}
