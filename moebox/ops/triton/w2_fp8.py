"""The routed experts' decode gate-up on Hopper: the 2-bit codes unpacked to FP8 e4m3 in registers and fed to
wgmma (a Gluon kernel), writing h in the form the mma down kernel reads (`w2_moe._down_mma_kernel`), or as e4m3
terms for the FP8 down kernel (`w2_fp8_down`, from 8 tokens).

Why: the mma gate-up (`w2_moe._gate_up_mma_kernel`) spends 19 integer ALU ops a 16-code word making bf16 weight
pairs for mma.sync, and its math alone was about as slow as its loads (forty-eighth session). An e4m3 weight is one
byte, so one PRMT of a 4-byte table makes 4 weights and the selectors are the code bits masked into nibbles: 9 ALU
ops a word. mma.sync has no native FP8 form on sm_90, wgmma has, with A from registers; Gluon's explicit layouts
let the unpacked registers be the wgmma's A fragment as they are. Each row's codes are loaded two K steps at a time
(its whole 128-byte line): with one step (half a line) the same kernel was slower than the mma one from 4 tokens
(docs/benchmarks.md, forty-ninth and fiftieth sessions). wgmma exists on sm_90 only: other GPUs (Blackwell, the
DGX Spark) keep the mma kernels.

Math. w = level * 2^(s - 127), levels -4, -1, 1, 4 for codes 0..3, s the E8M0 byte of a row's 32-column group.
With R the largest s of the row (read by each program before its loop), q = level * 2^(s - R + 6) is an exact
e4m3 value (|q| <= 256) for s >= R - 12; groups below that are flushed to zero (2^-12 of the row's largest
group). Then w = q * 2^(R - 133). A group's table: byte c = e4m3(q of code c) = sign | exponent field << 3, the
field of +-1 being m = s - R + 13 and of +-4 m + 2: lut = m * 0x08080808 + 0x10008090. x is given as T = 3 e4m3
terms, x = 2^X (x_0 + x_1 + x_2) (`pack_x`), in the wgmma's N = 8 columns of one token, so they cost no tensor
time; 3 terms hold a bf16 x exactly down to 2^-15 of its largest element. Each 256-column K step's wgmmas start
from zero and are added to an fp32 total (FP8 wgmma keeps fewer accumulator bits; the short chains bound that).

Layout. A program (8 warps, two warpgroups) owns 64 rows of I: rows 0-63 of its [128, K] A operand are w1 rows
(gate), 64-127 the same w3 rows (up). Lane 4g + t of warp w loads words 4t..4t+3 of rows 16w + g and 16w + g + 8
of each 16-word K step, which is the wgmma A fragment's lane map. A word's 16 codes give 4 registers of 4 e4m3
bytes: codes {0,2,4,6}, {8,..,14}, {1,..,7}, {9,..,15}; the K order of x is permuted to match (`x_permutation`), so
no byte moves. x's terms go to shared memory once a program, by the TMA ([32 half steps, 8 rows, 128] e4m3; the
rows past T are the zeros of its out-of-bounds fill): after plain shared-memory stores Triton put a CTA barrier
before every step's wgmma.

Measured and dropped (forty-ninth to fifty-second sessions; bench/fp8_gate_up.py times the variants kept here): the
K loop unrolled; one accumulator chained through all steps with the wgmmas left in flight under the next step's
unpack (wrong: ptxas let the unpack overwrite A registers still being read); 4-warp programs of 32 rows. Within a
pair, the first step's wgmmas in flight under the second's unpack (correct, 107 registers); two register sets a
loop iteration, so that no copies close the loop (ptxas issues the next pair's loads after the pair's math, as
their registers are the pair's); the codes and scales by cp.async into a 3- or 4-pair shared-memory ring (99
registers, two CTA barriers a pair). From 2 tokens each was 1.09-1.23x slower, and at one token none beat pairs
two ahead (17.1 against 18.2-20.7 us; H100, code in bfd41e8): with three programs an SM (70-74 registers) the
loads' latency is not what binds.

Opt-in, not yet timed (fifty-fourth session): `Variant.split` 2 (MOEBOX_FP8_GATE_UP_SPLIT=1) gives each row block
two programs, each on half of K (and staging half of x); the second to finish adds the other's fp32 sums
(`_split_sum`: a + b = b + a, the same bits either way) and writes h. At one token the grid is 6 x 32 = 192
programs, 1.5 an SM, each a chain of 8 pairs (17.3 us: ~2 us a pair); split, 384 programs of 4 pairs fit one wave
at three an SM (72 registers)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from moebox.ops.triton.runtime import HAVE_TRITON, compute_capability, kernel_switched_on, opt_in, pdl_args

try:    # Gluon (Triton >= 3.5) with Hopper's TMA and wgmma
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared   # Triton 3.9 | 3.6
    HAVE_GLUON = HAVE_TRITON
except ImportError:
    HAVE_GLUON = False

if HAVE_TRITON:
    import triton
    import triton.language as tl

STEP = 256          # K columns a step (16 code words)
TERMS = 3           # e4m3 terms of x
ROWS = 64           # rows of I a program
PACK_BLOCK = 512    # columns a program of `pack_x`


class Variant(NamedTuple):
    """How the kernel reads its codes. pair: two K steps' codes loaded together (a row's whole 128-byte line),
    else one; prefetch: steps (pairs) ahead, 1 or 2; tiled: codes stored tile by tile (`w2_moe.tile_codes`, the
    decode's opt-in layout; the model's planes are row-major); split: programs a row block, each on its share of
    K (2: the second to finish adds the other's sums, `_split_sum`)."""

    pair: bool = True
    prefetch: int = 1
    tiled: bool = False
    split: int = 1


DEFAULT_VARIANT = Variant()
# one token: pairs two ahead (17.3 against 18.5 us; slower from 2 tokens, 104 registers against 70: fiftieth session)
ONE_TOKEN_VARIANT = Variant(prefetch=2)


def variant_for(tokens: int, tiled: bool = False, hidden: int = 4096) -> Variant:
    """The variant a call of this many tokens takes, on codes row-major or tile by tile; with
    MOEBOX_FP8_GATE_UP_SPLIT=1 each row block's K split over two programs where H holds two programs' pairs
    (opt-in, not yet timed: at one token the grid is 192 programs, each a chain of 8 pairs' load latencies; split,
    pairs one ahead, 72 registers: its 384 programs fit one wave at three an SM, where two ahead's 101 take two)."""
    if opt_in("MOEBOX_FP8_GATE_UP_SPLIT") and hidden % (4 * STEP) == 0:
        return DEFAULT_VARIANT._replace(tiled=tiled, split=2)
    return (ONE_TOKEN_VARIANT if tokens == 1 else DEFAULT_VARIANT)._replace(tiled=tiled)


def fp8_gate_up_takes(x: torch.Tensor, hidden: int, inter: int, wanted: bool = True) -> bool:
    """Whether the decode gate-up takes this kernel: `wanted` (the call's `DecodeConfig.fp8_gate_up`) unless
    MOEBOX_FP8_GATE_UP says 0 (never) or 1 (at every token count), a bf16/fp16 x on an sm_90 GPU (wgmma), Gluon
    present, H a multiple of two K steps and I of a program's rows. fp32 x keeps the mma kernel, whose bf16 terms
    hold it to 2^-24 (3 e4m3 terms to ~2^-12)."""
    return (HAVE_GLUON and x.is_cuda and kernel_switched_on(x, "MOEBOX_FP8_GATE_UP", wanted)
            and x.dtype in (torch.bfloat16, torch.float16) and hidden % (2 * STEP) == 0 and inter % ROWS == 0
            and compute_capability(x.device) == (9, 0))


def x_permutation() -> torch.Tensor:
    """long [256]: the column of a K step that A's K index kk (= 64 i + 32 h + 16 half + 4 t + b) holds: word
    4t + i, register P_(h + 2 half), byte b = code 8 h + 2 b + half."""
    kk = torch.arange(STEP)
    i, h, half, t, b = kk // 64, (kk // 32) % 2, (kk // 16) % 2, (kk // 4) % 4, kk % 4
    return 16 * (4 * t + i) + 8 * h + 2 * b + half


def x_scale_exponent(amax: torch.Tensor) -> torch.Tensor:
    """int32 X, the least with amax <= 448 * 2^X (448 = 1.75 * 2^8, the largest e4m3), from amax's bits: its
    exponent - 8, plus one where its mantissa is above 1.75 (no log2 rounding to disagree between kernel and
    torch); at least -126, so that 2^X and 2^-X are normal floats (a row of zeros, or of subnormals)."""
    bits = amax.float().view(torch.int32)
    x = ((bits >> 23) & 0xFF) - 127 - 8 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    return x.clamp_min(-126)


def pack_x_reference(x: torch.Tensor, terms: int = TERMS) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, H] -> (xq e4m3 [N, H/256, 2, terms, 128]: K step, half, term, the half's columns in the permuted K
    order; 2^X fp32 [N]) with x = 2^X * sum of the terms: what `pack_x` writes, in torch."""
    n, hidden = x.shape
    scale = torch.exp2(x_scale_exponent(x.float().abs().amax(dim=1)).float())
    r = x.float() / scale[:, None]
    xq = torch.empty((n, hidden // STEP, terms, STEP), dtype=torch.float8_e4m3fn, device=x.device)
    perm = x_permutation().to(x.device)
    for tau in range(terms):
        q = r.to(torch.float8_e4m3fn)
        r = r - q.float()
        xq[:, :, tau] = q.view(n, hidden // STEP, STEP)[:, :, perm]
    return xq.view(n, hidden // STEP, terms, 2, 128).transpose(2, 3).contiguous(), scale


def empty_packed(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, hidden = x.shape
    return (torch.empty((n, hidden // STEP, 2, TERMS, 128), dtype=torch.float8_e4m3fn, device=x.device),
            torch.empty((n,), dtype=torch.float32, device=x.device))


if HAVE_TRITON:
    from moebox.ops.triton.pair_layout import _column_slot, _store_bf16_terms
    from moebox.ops.triton.runtime import pdl_start

    @triton.jit
    def _scale_exponent(amax):
        """`x_scale_exponent` of an fp32 amax in a kernel (int32)."""
        bits = amax.to(tl.int32, bitcast=True)
        return tl.maximum(((bits >> 23) & 0xFF) - 127 - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32), -126)

    @triton.jit
    def _store_e4m3_terms(ptr, row, c, r, STEPS: tl.constexpr, T: tl.constexpr):
        """r (fp32, already scaled by 2^-X) at columns c of a row of STEPS K steps -> its T e4m3 terms in the
        permuted K order (`x_permutation`, inverted: column c of a step goes to kk) of `pack_x_reference`'s
        [rows, STEPS, 2, T, 128] layout."""
        col = c % 256
        word, wo = col // 16, col % 16
        kk = 64 * (word % 4) + 32 * (wo // 8) + 16 * (wo % 2) + 4 * (word // 4) + (wo % 8) // 2
        dst = ptr + ((row.to(tl.int64) * STEPS + c // 256) * 2 + kk // 128) * (T * 128) + kk % 128
        for tau in tl.static_range(T):
            q = r.to(tl.float8e4nv)
            tl.store(dst + tau * 128, q)
            r = r - q.to(tl.float32)

    @triton.jit
    def _pack_x_kernel(x_ptr, xq_ptr, xe_ptr, x_row_stride, H: tl.constexpr, T: tl.constexpr, BLOCK: tl.constexpr,
                       PDL: tl.constexpr):
        """Program (token, block of BLOCK columns): the token's scale 2^X (`x_scale_exponent`, from the whole row,
        which every program of the token reads: one launch, no second pass) and its block's T e4m3 terms."""
        pdl_start(PDL)
        n = tl.program_id(0)
        row = x_ptr + n.to(tl.int64) * x_row_stride
        amax = tl.max(tl.abs(tl.load(row + tl.arange(0, BLOCK)).to(tl.float32)), axis=0)
        for c0 in tl.static_range(BLOCK, H, BLOCK):
            amax = tl.maximum(amax, tl.max(tl.abs(tl.load(row + c0 + tl.arange(0, BLOCK)).to(tl.float32)), axis=0))
        ex = _scale_exponent(amax)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        if tl.program_id(1) == 0:
            tl.store(xe_ptr + n, ((ex + 127) << 23).to(tl.float32, bitcast=True))
        r = tl.load(row + c).to(tl.float32) * ((127 - ex) << 23).to(tl.float32, bitcast=True)
        _store_e4m3_terms(xq_ptr, n, c, r, H // 256, T)


def pack_x(x: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, H] (unit column stride, H a multiple of 512) -> (xq, 2^X) as `pack_x_reference` gives them, one
    launch of H / 512 programs a token."""
    n, hidden = x.shape
    xq, xe = out if out is not None else empty_packed(x)
    _pack_x_kernel[(n, hidden // PACK_BLOCK)](x, xq, xe, x.stride(0), H=hidden, T=TERMS, BLOCK=PACK_BLOCK,
                                              num_warps=4, **pdl_args(x, _pack_x_kernel))
    return xq, xe


# The 16 codes of a word -> 4 registers of 4 e4m3 bytes (operands: $0-$3 out, $4-$7 the word, $8-$11 its
# group's table; each input comes 4 times, a broadcast). Selector nibble k of a PRMT picks table byte code k.
_UNPACK_TEXT = "\n".join([
    "{", ".reg .b32 se, so, t;",
    "and.b32 se, $4, 0x33333333;",
    "shr.b32 t, $4, 2;", "and.b32 so, t, 0x33333333;",
    "prmt.b32 $0, $8, $8, se;",
    "shr.b32 t, se, 16;", "prmt.b32 $1, $8, $8, t;",
    "prmt.b32 $2, $8, $8, so;",
    "shr.b32 t, so, 16;", "prmt.b32 $3, $8, $8, t;",
    "}"])

if HAVE_GLUON:
    _UNPACK_ASM = gl.constexpr(_UNPACK_TEXT)
    # [128 rows, 16 words, 4 bytes]: lane 4g + t, warp w -> rows 16w + g (+8 in a register), words 4t + i
    _L3 = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 2, 0], [8, 0, 0]],
        lane_bases=[[0, 4, 0], [0, 8, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16, 0, 0], [32, 0, 0], [64, 0, 0]], block_bases=[], shape=[128, 16, 4]))
    _LW = gl.constexpr(gl.SliceLayout(2, _L3))
    # [128 rows, 8 groups, 2 words]: the same lanes, groups 2t, 2t + 1
    _LG3 = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 1, 0], [8, 0, 0]],
        lane_bases=[[0, 2, 0], [0, 4, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16, 0, 0], [32, 0, 0], [64, 0, 0]], block_bases=[], shape=[128, 8, 2]))
    _LG = gl.constexpr(gl.SliceLayout(2, _LG3))
    # [128 rows, 128 groups]: a row's scale bytes, 32 a lane (its rows' largest: R); row map as above
    _LR = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [0, 16], [8, 0]],
        lane_bases=[[0, 32], [0, 64], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0], [64, 0]], block_bases=[], shape=[128, 128]))
    _ACC = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, 8, 32]))
    _DOT = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_ACC, k_width=4))
    # x in shared memory, filled by the TMA; a box row is at most the 128-byte swizzle, so a K step's x is two
    # [8, 128] halves. The TMA writes [1, 8, 128] boxes of the [., T, 128] terms (_XD) into [1, 8, 128] views of
    # the [8, 128] slices the wgmma reads (_XS): the same bytes, as the swizzle acts on the last two dimensions
    _XS = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2))
    _XD = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=3))
    # the epilogue: [64 rows, gate / up]
    _EP = gl.constexpr(gl.BlockedLayout([1, 2], [32, 1], [2, 4], [1, 0]))

    @gluon.jit
    def _step_mma(a0, a1, x_smem, u, zero):
        """A K step's 8 wgmmas (64x8x32 e4m3 a warpgroup) from zero, on its two x halves."""
        d = warpgroup_mma(a0, x_smem.index(2 * u).permute((1, 0)), zero, use_acc=False)
        return warpgroup_mma(a1, x_smem.index(2 * u + 1).permute((1, 0)), d)

    @gluon.jit
    def _load_step(c_ptrs, s_ptrs, u, C_STEP: gl.constexpr):
        return gl.load(c_ptrs + u * C_STEP), gl.load(s_ptrs + u * 8)

    @gluon.jit
    def _unpack(codes, mm):
        """One K step's A operand as two [128, 128] e4m3 halves in the wgmma register layout: the words' tables
        from their groups' exponent fields mm (s - R + 13, [128, 8] in _LG; flushed below 1), then the unpack (no
        data moves between lanes or registers: the conversions are trivial)."""
        lut = gl.where(mm >= 1, mm * 0x08080808 + 0x10008090, 0)
        lutw = gl.reshape(gl.expand_dims(lut, 2).broadcast_to([128, 8, 2]), [128, 16])
        lutw = gl.convert_layout(lutw, _LW, assert_trivial=True)
        c4 = gl.expand_dims(codes, 2).broadcast_to([128, 16, 4])
        l4 = gl.expand_dims(lutw, 2).broadcast_to([128, 16, 4])
        o0, o1, o2, o3 = gl.inline_asm_elementwise(
            _UNPACK_ASM, "=r,=r,=r,=r,r,r,r,r,r,r,r,r", [c4, l4],
            dtype=(gl.float8e4nv, gl.float8e4nv, gl.float8e4nv, gl.float8e4nv), is_pure=True, pack=4)
        j = gl.join(gl.join(o0, o1), gl.join(o2, o3))          # [m, word, b, h, half]
        j = gl.reshape(j, [128, 4, 2, 2, 4, 2, 2])               # [m, t, i_hi, i_lo, b, h, half]: word 4t + i
        a = gl.reshape(gl.permute(j, (0, 3, 5, 6, 1, 4, 2)), [128, 128, 2])
        a0, a1 = gl.split(a)                                      # K halves: i_hi = 0, 1
        return gl.convert_layout(a0, _DOT, assert_trivial=True), gl.convert_layout(a1, _DOT, assert_trivial=True)

    @gluon.jit
    def _stage_terms(desc, first, BOXES: gl.constexpr):
        """BOXES [8, 128] boxes of e4m3 terms (x's or h's, `terms_descriptor`) from box `first` on -> shared
        memory by the TMA, all on one barrier, waited for: what the wgmmas read as B."""
        smem = gl.allocate_shared_memory(gl.float8e4nv, [BOXES, 8, 128], _XS)
        bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(bar, count=1)
        mbarrier.expect(bar, BOXES * 1024)
        for s in gl.static_range(BOXES):
            _tma_load(desc, [first + s, 0, 0], bar, smem.index(s).reshape([1, 8, 128]))
        mbarrier.wait(bar, phase=0)
        mbarrier.invalidate(bar)
        return smem

    @gluon.jit
    def _row_max_scale(wr, GROUPS: gl.constexpr):
        """R of each of a program's 128 rows: the largest of its GROUPS scale bytes, from wr (uint8 pointers to
        the rows' first bytes, [128, 1] in _LR) -> int32 [128] in _LR's row slice."""
        gr = gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, _LR)), 0)
        sr = gl.load(wr + gr, mask=gr < GROUPS, other=0)
        for g0 in gl.static_range(128, GROUPS, 128):     # rows longer than 128 groups
            sr = gl.maximum(sr, gl.load(wr + g0 + gr, mask=g0 + gr < GROUPS, other=0))
        return gl.max(sr.to(gl.int32), axis=1)

    _cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier     # Triton 3.9 | 3.6

    @gluon.jit
    def _split_sum(y, part_ptr, cnt_ptr, tile, tiles, z):
        """One of the two programs that split a tile's K: its fp32 sums y (a row vector) stored at slot
        (z, tile) of part_ptr ([2, tiles, len(y)]), then the tile's counter at cnt_ptr + tile raised (acq_rel,
        after a CTA barrier: every warp's stores first, as CUTLASS's split-K semaphore) -> (whether this program
        arrived second, y + the other's sums: the same bits whichever arrived first, as a + b = b + a). The one that
        arrived second finishes the tile and calls `_split_done`; the other's sum is read either way (its slot
        may be unwritten then: the value is not used)."""
        rows = gl.arange(0, y.shape[0], layout=y.type.layout)
        gl.store(part_ptr + (z * tiles + tile).to(gl.int64) * y.shape[0] + rows, y)
        _cta_barrier()
        second = gl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu") == 1
        other = gl.load(part_ptr + ((1 - z) * tiles + tile).to(gl.int64) * y.shape[0] + rows, cache_modifier=".cg")
        return second, y + other

    @gluon.jit
    def _split_done(cnt_ptr, tile):
        gl.store(cnt_ptr + tile, 0)     # the counter ready for the next call

    @gluon.jit
    def _step(acc, codes, sc, base, x_smem, u, zero):
        a0, a1 = _unpack(codes, sc.to(gl.int32) - gl.expand_dims(base, 1))
        return acc + _step_mma(a0, a1, x_smem, u, zero)

    @gluon.jit
    def _gate_up_out(v, r_row, xe_ptr, rw_ptr, hp_ptr, he_ptr, tok, p, rb, limit, I: gl.constexpr,
                     TH: gl.constexpr, HAS_LIMIT: gl.constexpr, H_FP8: gl.constexpr):
        """The epilogue: v (the 128 rows' sums over the token's terms: 64 gate rows, then their up rows) at the
        rows' and x's scales, clamped, SiLU, times up and the routing weight -> h in the down kernel's form."""
        ra = gl.convert_layout(r_row, gl.SliceLayout(1, _ACC), assert_trivial=True)
        v = v * ((ra - 6) << 23).to(gl.float32, bitcast=True) * gl.load(xe_ptr + tok)
        gate, up = gl.split(gl.convert_layout(gl.permute(gl.reshape(v, [2, 64]), (1, 0)), _EP))
        if HAS_LIMIT:
            gate = gl.minimum(gate, limit)
            up = gl.minimum(gl.maximum(up, -limit), limit)
        h = gate / (1.0 + gl.exp(-gate)) * up * gl.load(rw_ptr + p)
        i = rb * 64 + gl.arange(0, 64, layout=h.type.layout)
        if H_FP8:   # TH e4m3 terms for the FP8 down kernel, at this program's own 2^X (one per 64 columns of h)
            ex = _scale_exponent(gl.max(gl.abs(h), axis=0))
            gl.store(he_ptr + p * (I // 64) + rb, ex)
            _store_e4m3_terms(hp_ptr, p, i, h * ((127 - ex) << 23).to(gl.float32, bitcast=True), I // 256, TH)
        else:
            _store_bf16_terms(hp_ptr, p.to(gl.int64) * (TH * I) + _column_slot(i), h, TH, I)

    @gluon.jit
    def _fp8_gate_up_kernel(x_desc, xe_ptr, ids_ptr, rw_ptr, w1c_ptr, w1s_ptr, w3c_ptr, w3s_ptr, hp_ptr, he_ptr,
                            part_ptr, cnt_ptr, c_expert_stride, s_expert_stride, limit,
                            I: gl.constexpr, HW: gl.constexpr, K: gl.constexpr, T: gl.constexpr, TH: gl.constexpr,
                            HAS_LIMIT: gl.constexpr, PAIR: gl.constexpr, PREFETCH: gl.constexpr,
                            TILED: gl.constexpr, PDL: gl.constexpr, H_FP8: gl.constexpr = False,
                            SPLIT: gl.constexpr = 1):
        pdl_start(PDL)
        STEPS: gl.constexpr = HW // 16 // SPLIT     # K steps of this program (SPLIT programs share a row block)
        p = gl.program_id(0)                        # (token, expert) pair, t * K + j
        rb = gl.program_id(1)                       # rows 64 rb .. 64 rb + 63 of I
        tok = p // K
        e = gl.load(ids_ptr + p).to(gl.int64)

        # program row m: gate (w1) row 64 rb + m for m < 64, else the up (w3) row of m - 64
        m = gl.arange(0, 128, layout=gl.SliceLayout(1, _LW))
        w = gl.arange(0, 16, layout=gl.SliceLayout(0, _LW))
        row = rb * 64 + m % 64
        wc = gl.where(m < 64, w1c_ptr, w3c_ptr) + e * c_expert_stride
        if TILED:   # tile (row // 16, u) of 256 words at (row // 16 * HW / 16 + u) * 256, row % 16 at 16 words each
            c_ptrs = (gl.expand_dims(wc + (row // 16).to(gl.int64) * (16 * HW) + (row % 16) * 16, 1)
                      + gl.expand_dims(w, 0))
        else:
            c_ptrs = gl.expand_dims(wc + row.to(gl.int64) * HW, 1) + gl.expand_dims(w, 0)
        C_STEP: gl.constexpr = 256 if TILED else 16
        mg = gl.arange(0, 128, layout=gl.SliceLayout(1, _LG))
        grp = gl.arange(0, 8, layout=gl.SliceLayout(0, _LG))
        ws = gl.where(mg < 64, w1s_ptr, w3s_ptr) + e * s_expert_stride + (rb * 64 + mg % 64) * (HW // 2)
        s_ptrs = gl.expand_dims(ws, 1) + gl.expand_dims(grp, 0)
        first = tok * (2 * SPLIT * STEPS)           # the token's first box of x terms
        if SPLIT > 1:                               # steps u0 .. u0 + STEPS - 1 of the row
            u0 = gl.program_id(2) * STEPS
            c_ptrs += u0 * C_STEP
            s_ptrs += u0 * 8
            first += 2 * u0

        codes, sc = _load_step(c_ptrs, s_ptrs, 0, C_STEP)
        if PAIR or PREFETCH == 2:
            codes_b, sc_b = _load_step(c_ptrs, s_ptrs, 1, C_STEP)
        # x's terms -> shared memory (after the first code loads are issued)
        x_smem = _stage_terms(x_desc, first, 2 * STEPS)
        # R of each row: the largest of its 128 scale bytes, one line, which the first steps' scale loads have
        # asked for already. Here, after the wait: computed before it, the build took 127 registers, not 70
        mr = gl.arange(0, 128, layout=gl.SliceLayout(1, _LR))
        r_row = _row_max_scale(gl.expand_dims(gl.where(mr < 64, w1s_ptr, w3s_ptr) + e * s_expert_stride
                                              + (rb * 64 + mr % 64) * (HW // 2), 1), HW // 2)
        base = gl.convert_layout(r_row, gl.SliceLayout(1, _LG), assert_trivial=True) - 13

        acc = gl.zeros([128, 8], gl.float32, _ACC)
        zero = gl.zeros([128, 8], gl.float32, _ACC)
        # the loads PREFETCH steps (pairs) ahead are issued before this step's (pair's) math, clamped at the end
        if PAIR:    # steps 2v, 2v + 1 in hand
            if PREFETCH == 2:
                codes_a, sc_a = _load_step(c_ptrs, s_ptrs, 2, C_STEP)
                codes_ab, sc_ab = _load_step(c_ptrs, s_ptrs, 3, C_STEP)
            for v in range(STEPS // 2):
                nxt = gl.minimum(2 * (v + PREFETCH), STEPS - 2)
                codes_n, sc_n = _load_step(c_ptrs, s_ptrs, nxt, C_STEP)
                codes_nb, sc_nb = _load_step(c_ptrs, s_ptrs, nxt + 1, C_STEP)
                acc = _step(acc, codes, sc, base, x_smem, 2 * v, zero)
                acc = _step(acc, codes_b, sc_b, base, x_smem, 2 * v + 1, zero)
                if PREFETCH == 2:
                    codes, sc, codes_b, sc_b = codes_a, sc_a, codes_ab, sc_ab
                    codes_a, sc_a, codes_ab, sc_ab = codes_n, sc_n, codes_nb, sc_nb
                else:
                    codes, sc, codes_b, sc_b = codes_n, sc_n, codes_nb, sc_nb
        else:       # step u in hand, u + 1 loaded (codes_b) for PREFETCH 2
            for u in range(STEPS):
                codes_n, sc_n = _load_step(c_ptrs, s_ptrs, gl.minimum(u + PREFETCH, STEPS - 1), C_STEP)
                acc = _step(acc, codes, sc, base, x_smem, u, zero)
                if PREFETCH == 2:
                    codes, sc, codes_b, sc_b = codes_b, sc_b, codes_n, sc_n
                else:
                    codes, sc = codes_n, sc_n

        n = gl.arange(0, 8, layout=gl.SliceLayout(0, _ACC))
        v = gl.sum(gl.where(gl.expand_dims(n < T, 0), acc, 0.0), axis=1)
        if SPLIT == 1:
            _gate_up_out(v, r_row, xe_ptr, rw_ptr, hp_ptr, he_ptr, tok, p, rb, limit, I, TH, HAS_LIMIT, H_FP8)
        else:       # the second of the row block's two programs to finish adds the other's sums and writes h
            tile = p * gl.num_programs(1) + rb
            second, v = _split_sum(v, part_ptr, cnt_ptr, tile, gl.num_programs(0) * gl.num_programs(1),
                                   gl.program_id(2))
            if second:
                _gate_up_out(v, r_row, xe_ptr, rw_ptr, hp_ptr, he_ptr, tok, p, rb, limit, I, TH, HAS_LIMIT, H_FP8)
                _split_done(cnt_ptr, tile)


def terms_descriptor(terms: torch.Tensor) -> "TensorDescriptor":
    """The TMA descriptor of x's or h's e4m3 terms ([rows, steps, 2, TERMS, 128]) as the kernels read them:
    [1, 8, 128] boxes of a [., TERMS, 128] view, the rows past TERMS the TMA's zero fill."""
    return TensorDescriptor(terms, [terms.numel() // (128 * TERMS), TERMS, 128], [128 * TERMS, 128, 1], [1, 8, 128],
                            _XD.value)


def empty_h(pairs: int, inter: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """h for the FP8 down kernel: (e4m3 terms [pairs, I/256, 2, TERMS, 128], as `pack_x` lays out x, each 64
    columns at their own scale; int32 X [pairs, I/64]: h[64 c .. 64 c + 63] = 2^X[c] * the sum of its terms)."""
    return (torch.empty((pairs, inter // STEP, 2, TERMS, 128), dtype=torch.float8_e4m3fn, device=device),
            torch.empty((pairs, inter // ROWS), dtype=torch.int32, device=device))


def gate_up(xq: torch.Tensor, xe: torch.Tensor, ids: torch.Tensor, rw: torch.Tensor, w1c: torch.Tensor,
            w1s: torch.Tensor, w3c: torch.Tensor, w3s: torch.Tensor, limit: float | None, k: int, th: int,
            variant: Variant | None = None, out: torch.Tensor | tuple | None = None, fp8_h: bool = False
            ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """h as TH bf16 terms in the pair layout (int32 [N k, TH, I/16, 8], into `out` if given), what
    `w2_moe._down_mma_kernel` reads, or with fp8_h as `empty_h`'s pair, what `w2_fp8_down.down` reads, from x
    packed by `pack_x` (xq, xe), flat ids / routing weights [N k] and the planes as `w2_moe._gate_up_mma` takes
    them (int32 codes [E, I, H/16], uint8 scales; w1 and w3 sharing strides); variant None: `variant_for` the
    token count."""
    n = xe.shape[0]
    inter, hw = w1c.shape[1], w1c.shape[2]
    variant = variant if variant is not None else variant_for(n, hidden=16 * hw)
    if variant.split not in (1, 2) or hw % (16 * variant.split * (2 if variant.pair else 1)):
        raise ValueError(f"{variant}: H = {16 * hw} is not {variant.split} programs' whole pairs of K steps")
    if fp8_h:
        hp = out if out is not None else empty_h(n * k, inter, xq.device)
        h_args, th = hp, TERMS
    else:
        hp = torch.empty((n * k, th, inter // 16, 8), dtype=torch.int32, device=xq.device) if out is None else out
        h_args = (hp.view(torch.int16), hp)   # the second: no exponents to write
    grid = (n * k, inter // ROWS, variant.split)
    part, cnt = split_scratch(variant.split, grid[0] * grid[1], 128, xq.device, (xe, ids))
    _fp8_gate_up_kernel[grid](
        terms_descriptor(xq), xe, ids, rw, w1c, w1s, w3c, w3s, *h_args, part, cnt, w1c.stride(0), w1s.stride(0),
        float(limit) if limit else 0.0,
        I=inter, HW=hw, K=k, T=TERMS, TH=th, HAS_LIMIT=bool(limit), PAIR=variant.pair, PREFETCH=variant.prefetch,
        TILED=variant.tiled, H_FP8=fp8_h, SPLIT=variant.split, num_warps=8, **pdl_args(xq, _fp8_gate_up_kernel))
    return hp


_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def split_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """int32 [>= tiles] of zeros, kept per device: the arrival counters of split kernels (`_split_sum`), which the
    program that arrives second resets, so they are zero again for the next call (and a CUDA graph's replays).
    Outgrown ones are kept too: a captured graph may still point at them. Split calls must not overlap on two
    streams (the decode's routed experts run on the main stream, one kernel after another)."""
    kept = _COUNTERS.setdefault(device, [])
    if not kept or kept[-1].numel() < tiles:
        if torch.cuda.is_current_stream_capturing():    # its zeros would come only with the graph's first replay
            raise RuntimeError(f"a split kernel of {tiles} tiles first ran inside a CUDA graph capture: run it once "
                               "before capturing (as the decode graphs' warm-up does)")
        kept.append(torch.zeros((max(tiles, 4096),), dtype=torch.int32, device=device))
    return kept[-1]


def split_scratch(split: int, tiles: int, width: int, device: torch.device, unused: tuple) -> tuple:
    """(fp32 sums [2, tiles, width], arrival counters) for a launch with `split` programs a tile (`_split_sum`);
    with one, `unused`: two pointers the kernel does not read."""
    if split == 1:
        return unused
    return torch.empty((2, tiles, width), dtype=torch.float32, device=device), split_counters(device, tiles)


def build_sm90(variant: Variant = DEFAULT_VARIANT, hidden: int = 4096, inter: int = 2048, k: int = 6, th: int = 2,
               fp8_h: bool = False):
    """The gate-up built for sm_90 (no GPU needed), specialised as a V4-Flash launch."""
    from moebox.ops.triton.runtime import build_sm90 as build
    types = (f"tensordesc<fp8e4nv[1, 8, 128],{_XD.value!r}>", "*fp32", "*i64", "*fp32", "*i32", "*u8", "*i32", "*u8",
             "*fp8e4nv" if fp8_h else "*i16", "*i32", "*fp32", "*i32", "i32", "i32", "fp32")
    sig = dict(zip(_fp8_gate_up_kernel.arg_names, types))
    const = dict(I=inter, HW=hidden // 16, K=k, T=TERMS, TH=TERMS if fp8_h else th, HAS_LIMIT=True,
                 PAIR=variant.pair, PREFETCH=variant.prefetch, TILED=variant.tiled, PDL=True, H_FP8=fp8_h,
                 SPLIT=variant.split)
    return build(_fp8_gate_up_kernel, sig, const, [a for a, ty in sig.items() if ty[0] in "*i"], num_warps=8)


def sass_report(variant: Variant = DEFAULT_VARIANT, fp8_h: bool = False) -> dict:
    """The sm_90 build: registers, spill stack, and the SASS of the K loop (the shortest loop around the wgmmas;
    the TMA wait's retry loop spans the kernel): op counts and instructions a weight (a lane handles 2 rows x 64
    columns = 128 weights a step, two steps a pair loop); fp8_h: the build that writes h for the FP8 down kernel."""
    from moebox.ops.triton.runtime import loop_sass
    ops, registers, spills, _ = loop_sass(build_sm90(variant, fp8_h=fp8_h).asm["cubin"], around="QGMMA")
    return {"variant": variant, "registers": registers, "spills": spills, "loop_ops": ops,
            "instructions_per_weight": sum(ops.values()) / (256 if variant.pair else 128)}
