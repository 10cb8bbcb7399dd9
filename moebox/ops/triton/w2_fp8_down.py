"""The routed experts' decode down projection on Hopper: w2's 2-bit codes unpacked to FP8 e4m3 in registers and fed
to wgmma (a Gluon kernel, `w2_fp8`'s unpack and layouts), against h as e4m3 terms, which `w2_fp8`'s gate-up writes
for it (`gate_up(..., fp8_h=True)`).

Why: with the FP8 gate-up the mma down kernel (`w2_moe._down_mma_kernel`, 19 integer ops a 16-code word for bf16
weight pairs) was the slower half of the expert call: at 8 tokens (V4-Flash, H100) the call took 156 us of which
the gate-up 91 for twice down's bytes (fiftieth session), i.e. down streamed ~55% of copy against gate-up's ~76%.

Math. out[t, r] = sum_j W2_e[r, :] h_tj (e = the token's j-th expert; the routing weight is in h). h comes in
64-column chunks, chunk c at its own 2^X_c (`x_scale_exponent` of its amax, written by the gate-up program that
computed those 64 columns). With X the largest X_c of the pair and R the largest scale byte of a row, a group's
table is built for the exponent field m = s - R + 13 + X_c - X (flushed below 1), so the products of every chunk
come out at one scale: W2 h = 2^(R - 133) 2^X sum q * terms. A weight is flushed where its product with its chunk's
largest h is below 2^-12 of the row's largest weight times the pair's largest h: the gate-up's bound. A lane's 4
words of a step are 64 columns, one chunk: one exponent a lane and step.

Layout. A program (8 warps) owns one token and 128 rows of H, the gate-up's A layout (rows 16w + g, +8); its K
runs over the token's k experts one after another, I/256 steps each, loaded two steps (a row's 128-byte line) at a
time, one pair ahead across the experts' boundaries (two ahead: 146 registers with Triton 3.6, one program an
SM; spills with 3.9). The token's h terms come by the TMA, all k experts' at once
(k I/128 boxes of 1 KB, their rows past the 3 terms the TMA's zero fill: 96 KB for V4-Flash). At each expert's
first pair, its rows' R (their scale bytes, already asked for by the prefetch) and its pair's X. Every output
element is written once, in the output's dtype, summed in a fixed order (no atomics).

Measured and dropped (fifty-first session, H100): each program asking L2 for its rows of the expert two ahead
(`cp.async.bulk.prefetch.L2`, 72 KB a request pair): the kernel alone 56.6 -> 69.5 us at 8 tokens, 106.9 -> 130.2
at 16, and the decode step lost its gain. Still open: at 1-4 tokens its 32 programs a token leave SMs idle (2
tokens: 33.7 us alone, where the whole call with the mma down takes 52.5 and its FP8 gate-up alone ~28).

Opt-in, not yet timed (fifty-third session): MOEBOX_FP8_DOWN_RING=1 stages h two experts at a time (a 2-slot ring,
32 KB) and caps registers at 80 (80 B spilled), so three programs fit an SM where 94 registers and 96 KB of h
allowed two (Nsight Compute, fifty-second session: 59% of DRAM peak at 8 tokens). But at 8 tokens the grid is 256
programs, under two an SM of the H100's 132 (ncu's 22.6% occupancy is the grid's), so the ring can only add
programs an SM from 16 tokens. MOEBOX_FP8_DOWN_SPLIT=1 (fifty-fourth session, not yet timed) doubles the programs
instead: two a token and row block, each on half of the experts and staging only their h (48 KB), registers capped
at 80 (40 B spilled), three an SM; each stores its fp32 sum, and the second to arrive (an acq_rel atomic on the
block's counter, after a CTA barrier) adds the other's and writes the output: a + b is b + a, so the result is the
same whichever finishes first, and that program sets the counter back to zero for the next call. With `tiled` the
kernel reads w2's codes stored tile by tile (`w2_moe.tile_codes`; the sm_90 build with Triton 3.6: 90 registers and
346 instructions a pair loop against 94 and 357)."""

from __future__ import annotations

import torch

from moebox.ops.triton import w2_fp8
from moebox.ops.triton.runtime import kernel_switched_on, next_pow2, opt_in, pdl_args

ROWS = 128                  # rows of H a program
CAPPED_REGISTERS = 80       # a thread's registers with the h ring or the split: 3 programs of 8 warps an SM (<= 85)
SMEM_LIMIT = 160 << 10      # bytes of h terms a program may stage (Hopper: 227 KB of shared memory a block)


def h_smem_bytes(k: int, inter: int) -> int:
    """Shared memory a program takes for its token's h terms: k experts x I/128 boxes of [8, 128] e4m3."""
    return k * (inter // 128) * 1024


def fp8_down_takes(x: torch.Tensor, hidden: int, inter: int, k: int, wanted: bool = True) -> bool:
    """Whether the decode down projection takes this kernel, given that the FP8 gate-up runs (the caller's
    `w2_fp8.fp8_gate_up_takes`, which writes its h): `wanted` (the call's `DecodeConfig.fp8_down`) unless
    MOEBOX_FP8_DOWN says 0 (never) or 1 (wherever the FP8 gate-up runs), H a multiple of a program's rows, I of
    two K steps, and the token's h terms within `SMEM_LIMIT`."""
    return (kernel_switched_on(x, "MOEBOX_FP8_DOWN", wanted) and hidden % ROWS == 0
            and inter % (2 * w2_fp8.STEP) == 0 and h_smem_bytes(k, inter) <= SMEM_LIMIT)


if w2_fp8.HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

    from moebox.ops.triton.runtime import pdl_start
    from moebox.ops.triton.w2_fp8 import (_ACC, _LG, _LR, _LW, _XS, _cta_barrier, _row_max_scale, _split_done,
                                          _split_sum, _stage_terms, _step_mma, _tma_load, _unpack)

    _L1 = gl.constexpr(gl.BlockedLayout([1], [32], [8], [0]))   # a pair's chunk exponents (replicated)

    @gluon.jit
    def _load_unit(w2c_ptr, w2s_ptr, ids_ptr, c_off, s_off, c_expert_stride, s_expert_stride, tok, unit,
                   K: gl.constexpr, PAIRS: gl.constexpr, C_STEP: gl.constexpr):
        """Unit = (expert j, pair v of its K steps): the codes and scale bytes of its two steps (C_STEP words
        from one step's codes of a row to the next)."""
        e = gl.load(ids_ptr + tok * K + unit // PAIRS).to(gl.int64)
        v = unit % PAIRS
        cb = w2c_ptr + e * c_expert_stride + c_off + 2 * C_STEP * v
        sb = w2s_ptr + e * s_expert_stride + s_off + 16 * v
        return gl.load(cb), gl.load(sb), gl.load(cb + C_STEP), gl.load(sb + 8)

    @gluon.jit
    def _stage_expert(desc, first, h_smem, bars, j: gl.constexpr, BOXES: gl.constexpr):
        """Expert j's BOXES boxes of h terms (from box `first` on) -> ring slot j % 2 by the TMA, on barrier j."""
        mbarrier.expect(bars.index(j), BOXES * 1024)
        for s in gl.static_range(BOXES):
            _tma_load(desc, [first + j * BOXES + s, 0, 0], bars.index(j),
                      h_smem.index((j % 2) * BOXES + s).reshape([1, 8, 128]))

    @gluon.jit
    def _chunk_step(acc, codes, sc, base, he_row, hx, chunk0, h_smem, u, scale, zero):
        """One K step: the tables at the step's chunk exponents (lane t: chunk chunk0 + t), 8 wgmmas from zero,
        added to acc at the expert's row scale."""
        grp = gl.arange(0, 8, layout=gl.SliceLayout(0, _LG))
        off = gl.load(he_row + chunk0 + grp // 2) - hx
        a0, a1 = _unpack(codes, sc.to(gl.int32) - gl.expand_dims(base, 1) + gl.expand_dims(off, 0))
        return acc + _step_mma(a0, a1, h_smem, u, zero) * scale

    @gluon.jit
    def _fp8_down_kernel(h_desc, he_ptr, ids_ptr, w2c_ptr, w2s_ptr, out_ptr, part_ptr, cnt_ptr, out_row_stride,
                         c_expert_stride, s_expert_stride, IW: gl.constexpr, K: gl.constexpr, T: gl.constexpr,
                         CHUNKS_P2: gl.constexpr, PDL: gl.constexpr, RING: gl.constexpr = False,
                         TILED: gl.constexpr = False, SPLIT: gl.constexpr = 1):
        STEPS: gl.constexpr = IW // 16          # K steps of one expert
        PAIRS: gl.constexpr = STEPS // 2
        KS: gl.constexpr = K // SPLIT           # experts a program
        CHUNKS: gl.constexpr = IW // 4          # 64-column chunks of a pair's h
        tok = gl.program_id(0)
        rb = gl.program_id(1)                   # rows 128 rb .. 128 rb + 127 of H
        if SPLIT == 1:
            j0 = 0
        else:                                   # experts j0 .. j0 + KS - 1 of the token
            j0 = gl.program_id(2) * KS
        last = (j0 + KS) * PAIRS - 1            # the program's last unit
        m = gl.arange(0, 128, layout=gl.SliceLayout(1, _LW))
        w = gl.arange(0, 16, layout=gl.SliceLayout(0, _LW))
        row = rb * 128 + m
        if TILED:   # tile (row // 16, step u) of 256 words at (row // 16 * STEPS + u) * 256, row % 16 at 16 words each
            c_off = gl.expand_dims((row // 16).to(gl.int64) * (16 * IW) + (row % 16) * 16, 1) + gl.expand_dims(w, 0)
        else:
            c_off = gl.expand_dims(row.to(gl.int64) * IW, 1) + gl.expand_dims(w, 0)
        C_STEP: gl.constexpr = 256 if TILED else 16     # words from a row's step to the next
        mg = gl.arange(0, 128, layout=gl.SliceLayout(1, _LG))
        grp = gl.arange(0, 8, layout=gl.SliceLayout(0, _LG))
        s_off = gl.expand_dims((rb * 128 + mg) * (IW // 2), 1) + gl.expand_dims(grp, 0)

        # The first units' planes load before the PDL wait: they are constant, and the ids are the routing's,
        # which finished before gate-up (the kernel before) could start; only h is gate-up's.
        codes, sc, codes_b, sc_b = _load_unit(w2c_ptr, w2s_ptr, ids_ptr, c_off, s_off, c_expert_stride,
                                              s_expert_stride, tok, j0 * PAIRS, K, PAIRS, C_STEP)
        pdl_start(PDL)
        first = (tok * K + j0) * (2 * STEPS)    # the program's first box of h terms
        if RING:    # two experts' h at a time (32 KB for V4-Flash, not 96): room for three programs an SM
            h_smem = gl.allocate_shared_memory(gl.float8e4nv, [4 * STEPS, 8, 128], _XS)
            bars = gl.allocate_shared_memory(gl.int64, [K, 1], mbarrier.MBarrierLayout())
            for j in gl.static_range(K):
                mbarrier.init(bars.index(j), count=1)
            fence_async_shared()
            for j in gl.static_range(2 if K > 1 else 1):
                _stage_expert(h_desc, first, h_smem, bars, j, 2 * STEPS)
        else:
            h_smem = _stage_terms(h_desc, first, 2 * KS * STEPS)

        r_off = (rb * 128 + gl.arange(0, 128, layout=gl.SliceLayout(1, _LR))) * (IW // 2)
        ch = gl.arange(0, CHUNKS_P2, layout=_L1)
        acc = gl.zeros([128, 8], gl.float32, _ACC)
        zero = gl.zeros([128, 8], gl.float32, _ACC)
        for jj in gl.static_range(KS):  # unrolled: a loop here took Triton 3.9's build to 255 registers and spills
            j = j0 + jj
            p = tok * K + j
            e = gl.load(ids_ptr + p).to(gl.int64)
            # the expert's R a row (its scale bytes' largest) and the pair's X (its chunks' largest)
            r_row = _row_max_scale(gl.expand_dims(w2s_ptr + e * s_expert_stride + r_off, 1), IW // 2)
            base = gl.convert_layout(r_row, gl.SliceLayout(1, _LG), assert_trivial=True) - 13
            he_row = he_ptr + p * CHUNKS
            hx = gl.max(gl.load(he_row + ch, mask=ch < CHUNKS, other=-126), axis=0)
            ra = gl.convert_layout(r_row, gl.SliceLayout(1, _ACC), assert_trivial=True)
            scale = gl.expand_dims(((ra - 6) << 23).to(gl.float32, bitcast=True)
                                   * ((hx + 127) << 23).to(gl.float32, bitcast=True), 1)
            if RING:
                mbarrier.wait(bars.index(jj), phase=0)
            for v in range(PAIRS):
                nxt = gl.minimum(j * PAIRS + v + 1, last)
                codes_n, sc_n, codes_nb, sc_nb = _load_unit(w2c_ptr, w2s_ptr, ids_ptr, c_off, s_off,
                                                            c_expert_stride, s_expert_stride, tok, nxt, K, PAIRS,
                                                            C_STEP)
                u = ((jj % 2) if RING else jj) * STEPS + 2 * v
                acc = _chunk_step(acc, codes, sc, base, he_row, hx, 8 * v, h_smem, u, scale, zero)
                acc = _chunk_step(acc, codes_b, sc_b, base, he_row, hx, 8 * v + 4, h_smem, u + 1, scale, zero)
                codes, sc, codes_b, sc_b = codes_n, sc_n, codes_nb, sc_nb
            if RING and jj + 2 < K:     # every warp's wgmmas on slot jj % 2 are done: refill it
                _cta_barrier()
                _stage_expert(h_desc, first, h_smem, bars, jj + 2, 2 * STEPS)

        n = gl.arange(0, 8, layout=gl.SliceLayout(0, _ACC))
        y = gl.sum(gl.where(gl.expand_dims(n < T, 0), acc, 0.0), axis=1)
        rows = rb * 128 + gl.arange(0, 128, layout=gl.SliceLayout(1, _ACC))
        dst = out_ptr + tok.to(gl.int64) * out_row_stride + rows
        if SPLIT == 1:
            gl.store(dst, y.to(out_ptr.dtype.element_ty))
        else:   # two programs a token and row block: the second to finish adds the first's sum and writes
            tile = tok * gl.num_programs(1) + rb
            second, y = _split_sum(y, part_ptr, cnt_ptr, tile, gl.num_programs(0) * gl.num_programs(1),
                                   gl.program_id(2))
            if second:
                gl.store(dst, y.to(out_ptr.dtype.element_ty))
                _split_done(cnt_ptr, tile)


def _options(ring: bool, split: int) -> dict:
    """The launch's compile options: the register cap of the ring and of the split (three programs an SM)."""
    return {"maxnreg": CAPPED_REGISTERS} if ring or split > 1 else {}


def split_for(k: int, ring: bool) -> int:
    """Programs a token and row block: 2 where MOEBOX_FP8_DOWN_SPLIT is 1, the k experts split evenly and h
    staged whole; else 1."""
    return 2 if opt_in("MOEBOX_FP8_DOWN_SPLIT") and k % 2 == 0 and not ring else 1


def down(hq: torch.Tensor, he: torch.Tensor, ids: torch.Tensor, w2c: torch.Tensor, w2s: torch.Tensor,
         out: torch.Tensor, k: int, ring: bool | None = None, tiled: bool = False, split: int | None = None
         ) -> torch.Tensor:
    """out [N, H] (written in full, in its dtype) = the sum over each token's k experts of W2_e h, from h as
    `w2_fp8.gate_up(..., fp8_h=True)` writes it (hq, he), flat ids [N k] and w2's planes as `w2_moe` takes them
    (int32 codes [E, H, I/16], uint8 scales [E, H, I/32], rows contiguous; tiled: the codes in tile order,
    `w2_moe.tile_codes`). `ring` (default: MOEBOX_FP8_DOWN_RING is 1): h staged two experts at a time, registers
    capped at `CAPPED_REGISTERS`. `split` (default `split_for`): 2 programs a token and row block, each on half of
    its experts (and their h), the second to finish adding the first's fp32 sum (no ring; k even)."""
    n, hidden = out.shape
    iw = w2c.shape[2]
    if ring is None:
        ring = opt_in("MOEBOX_FP8_DOWN_RING")
    split = split_for(k, ring) if split is None else split
    if split not in (1, 2) or (split == 2 and (ring or k % 2)):
        raise ValueError(f"split {split}: 1, or 2 with h staged whole and an even k (k = {k}, ring = {ring})")
    part, cnt = w2_fp8.split_scratch(split, n * (hidden // ROWS), ROWS, out.device, (out, ids))
    _fp8_down_kernel[(n, hidden // ROWS, split)](
        w2_fp8.terms_descriptor(hq), he, ids, w2c, w2s, out, part, cnt, out.stride(0), w2c.stride(0), w2s.stride(0),
        IW=iw, K=k, T=w2_fp8.TERMS, CHUNKS_P2=next_pow2(iw // 4), RING=ring, TILED=tiled, SPLIT=split, num_warps=8,
        **_options(ring, split), **pdl_args(out, _fp8_down_kernel))
    return out


def build_sm90(hidden: int = 4096, inter: int = 2048, k: int = 6, ring: bool = False, tiled: bool = False,
               split: int = 1):
    """The kernel built for sm_90 (no GPU needed), specialised as a V4-Flash launch with a bf16 output."""
    from moebox.ops.triton.runtime import build_sm90 as build
    types = (f"tensordesc<fp8e4nv[1, 8, 128],{w2_fp8._XD.value!r}>", "*i32", "*i64", "*i32", "*u8", "*bf16",
             "*fp32", "*i32", "i32", "i32", "i32")
    sig = dict(zip(_fp8_down_kernel.arg_names, types))
    const = dict(IW=inter // 16, K=k, T=w2_fp8.TERMS, CHUNKS_P2=next_pow2(inter // 64), PDL=True, RING=ring,
                 TILED=tiled, SPLIT=split)
    return build(_fp8_down_kernel, sig, const, [a for a, ty in sig.items() if ty[0] in "*i"], num_warps=8,
                 **_options(ring, split))


def sass_report(ring: bool = False, tiled: bool = False, split: int = 1) -> dict:
    """The sm_90 build: registers, spill stack, and the SASS of the first expert's K loop (the shortest loop
    around the first wgmma): op counts and instructions a weight (a lane handles 2 rows x 64 columns a step, two
    steps a loop)."""
    from moebox.ops.triton.runtime import loop_sass
    ops, registers, spills, _ = loop_sass(build_sm90(ring=ring, tiled=tiled, split=split).asm["cubin"], around="QGMMA",
                                          first=True)
    return {"registers": registers, "spills": spills, "loop_ops": ops,
            "instructions_per_weight": sum(ops.values()) / 256}
