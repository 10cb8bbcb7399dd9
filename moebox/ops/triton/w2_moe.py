"""Routed experts from w2 planes on the GPU, decode path (a few tokens): Triton kernels, two variants.

    out[t] = sum_j  W2_e ( w_tj * silu(min(W1_e x_t, L)) * clamp(W3_e x_t, -L, L) ),   e = expert_ids[t, j]

the semantics of `moebox.ops.moe.routed_experts` (gate/up in fp32, clamp, SiLU, routing weight applied to h
before the down projection, sum over the k experts). `w2_moe_decode_reference` is that torch code.
`DecodeConfig.variant` picks the kernels: "mma" (the default; H and I multiples of 256) or "fma" (any shape
that is a multiple of 32; what "mma" falls back to).

Bytes and the bandwidth to approach. One expert = 3 matrices of I*H weights at 2.25 bits:
3 * (I*H/4 + I*H/32) bytes; V4-Flash (H=4096, I=2048): 7,077,888 B = 7.08 MB. A call reads each DISTINCT
expert of the batch once from DRAM (pairs that share an expert run at the same time and hit L2) plus x/h/out
(negligible):  N=1, k=6: 6 experts = 42.5 MB -> 10 us at 4.25 TB/s (the H200 device-copy rate);  N=4: ~23.2
experts (random routing, E=256) = 164 MB -> 39 us;  N=16: ~80.8 experts = 572 MB -> 135 us.

Why the old kernels (variant "fma") sat at 16-23% of that: (1) the in-register dequant: 5.1-6.1 SASS
instructions per weight in the loop body (sm_90 build; 5.41 / 5.14 for gate-up / down with Triton 3.9,
6.06 / 5.89 with 3.6), against an issue rate of ~3.3e13 thread-instructions/s (132 SMs x 128 lanes x 1.98
GHz) = ~6e12 weights/s = ~35% of the copy rate; (2) no prefetch: Triton (3.6 and 3.9) software-pipelines only
loads that feed tl.dot, so each K step waited for its own loads; (3) at N=1 the down kernel had 256 programs
of 4 warps (2 warps per SM scheduler), far too few bytes in flight.

Variant "mma": tensor cores on bf16 operands dequantized in registers, three launches. On sm_90 with bf16/fp16 x
the gate-up is `w2_fp8`'s instead from 2 tokens (e4m3 weights into wgmma; `DecodeConfig.fp8_gate_up`;
MOEBOX_FP8_GATE_UP=0 / 1: never / at every token count): x is packed in that kernel's form, the down kernel is the
same up to 7 tokens; from 8 it is `w2_fp8_down`'s (the same unpack and wgmma, h as e4m3 terms that the FP8 gate-up
writes for it; `DecodeConfig.fp8_down`, MOEBOX_FP8_DOWN=0 / 1: never / wherever the FP8 gate-up runs).
  `_pack_x_kernel` writes x as T bf16 "terms" (T = 1 for bf16 x, 2 for fp16, 3 for fp32: x = sum of the
  terms, exact for bf16/fp16, ~2^-24 relative for fp32) in the pair layout below. `_gate_up_mma_kernel`,
  grid (N*k pairs, I/16): one program = one pair and 16 rows of I (w1 and w3), its S warps (gate_split)
  splitting the K range (warp s takes 16-word tiles s, s+S, ...; summed across warps at the end, in a fixed
  order); it applies clamp/SiLU/product/routing weight and writes h as T_h bf16 terms (2; 3 for fp32 x) in
  the pair layout. `_down_mma_kernel`, grid (N, H/16): one program = one token and 16 rows of H, its S warps
  (down_split) splitting the k experts x I/256 tiles; the sum over experts and tiles is inside the program
  (no atomics, deterministic), each output element written once in x's dtype. Pairs / tokens are grid axis 0
  so programs reading the same expert rows run together (L2).
  The work unit is one mma.sync.m16n8k16 (bf16 x bf16 -> fp32), issued from inline PTX. A program's tile of
  code words is [16 S, 16] int32 (16 words = 256 columns per row); the sm_90 build gives it (and every other
  operand of the asm) the blocked layout sizePerThread [1, 4], threadsPerWarp [8, 4], warpsPerCTA [S, 1],
  order [1, 0]: lane 4 g + t of warp s holds words 4t..4t+3 of rows g and g + 8 of its 16 rows, which is the
  A-fragment lane map of mma.sync (groupID g = rows, threadID_in_group t = k). The asm packs those 8 words:
  each word's 16 codes become 8 bf16x2 registers (the A fragment) and go through 4 mmas against the matching
  x pairs (the B fragment: column n = lane group g = the term index; lanes g >= T read a copy of term T-1,
  whose columns are dropped). `sass_report` (`--sass`) builds the kernels on any machine and checks that
  layout; `tests/test_triton_w2.py` also runs the PTX in a small warp emulator against a plain dot.
  Dequant: the level*scale of code c in bf16 has a high byte LUT[c] (sign | exponent >> 1) and a low byte
  shared by the 4 codes ((s & 1) << 7), so one PRMT (byte permute) makes two weights with the scale folded
  in: prmt(lob, lut, selector), selector nibbles [0, 4 | code_a, 0, 4 | code_b]; LUT = (s >> 1) * 0x01010101 +
  0x01008081 (4 ops per row and 32 columns; exact for scale bytes s <= 252). The selectors of a word are 4
  masked shifts ((cw << 4|2|0, >> 2) & 0x30303030 | 0x40404040) and their >> 16: pair j of a word holds codes
  c = j + (j & 4) (low half) and c + 4 (high half). Per word: 7 + 4 + 8 = 19 integer ops for 16 weights, plus
  4 HMMA per 2 rows. With `selector_fma` (the default from 4 tokens) the 4 `>> 16` are f16x2 adds of -0 whose
  operand takes the high half twice (HADD2 .H1_H1 in SASS, the FMA pipe): 15 integer ops a word.
  Pair layout of x and h (int32 bf16x2 [token or pair, term, K tile of 16 words, 128
  slots], `_pair_slot`): in a K tile, pair 4 rho + jj of word 4 t + i is at slot 32 i + 16 rho + 4 t + jj, so
  each B-fragment load (word i, rep rho) is one 16-byte load a lane and the 4 lanes t read 64 contiguous bytes.
  The plain [word, pair] order had them 128 bytes apart: 4 L1 lines a load, and ncu showed the kernels L1-bound
  (L1/TEX 70-95% of peak against 19-40% of DRAM); the tiled order cut down's time at N = 8 from 98 to 65 us
  (docs/benchmarks.md, ninth session). h rows are computed in that order.
  Loads: the code/scale tiles of the step `prefetch` (1 or 2) steps ahead are issued before this step's math
  (loop unrolled by 2 for depth 2, no register copies); x/h come from L2/L1 in the step. Down loads its first
  tiles (and the expert ids they need) before its PDL wait: the planes are constant and the routing that wrote
  the ids finished before gate-up, the kernel in between, started; only h is gate-up's (nineteenth session:
  batch 1 5.60 -> 5.56 ms, batch 8 12.36 -> 12.26 with the FP8 mma kernel's early load). Gate-up cannot: its
  ids come from the kernel right before it.
  SASS of the loop body (sm_90, bf16 x, gate_split 4 / down_split 8, prefetch 2; Triton 3.6 and 3.9 agree
  within 0.05): 1.66 instructions per weight for gate-up (PRMT 0.53, SHF/IMAD-shift/LOP3 ~0.92, HMMA 0.125,
  LDG 0.06), 1.90 for down (per-unit expert lookup and addresses); 130 / 80 registers, no spills. At N=1 that
  is ~8 us of issue for the 151M weights, under the 10 us of DRAM time, so the call should be memory- and
  latency-bound (launches and tails); `python -m moebox.ops.triton.w2_moe --sweep` measures it. The default
  gate split is 2 (1.68 instructions a weight), the fastest in the fifth and eighth sessions' sweeps at N = 1,
  4 and 16. The default prefetch is 1 (sixteenth session: 3-7% faster than 2 at every N from 1 to 16; 128 / 68
  registers, so 16 gate-up warps an SM instead of 15 and 3 down programs instead of 2), and one token takes
  down split 16 (`default_config`). Loading x/h with the codes, two steps ahead (instead of from L2 in the
  step) cost 36 / 84 more registers and lost 4-30% in the eighth session's sweep (docs/benchmarks.md).
  Tried and dropped (sixteenth session): register caps (maxnreg 96-104 for gate-up, 64 for down: 16-24 bytes of
  spills) lost at N = 1-16; at down split 16 (one token's default since) a cap of 64 (8 bytes spilled, two programs
  an SM, one wave) tied (twentieth session: 26.7 against 26.6 us a call); the right shifts as IMAD.HI
  (multiply-high by 2^(32-s), to move them off the integer ALU pipe that the PRMT/LOP3/SHF mix saturates at N >= 4)
  lost 7-13%: IMAD.HI is slower than its issue count suggests; Triton's pipeliner instead of the register prefetch
  (`tl.range(num_stages=2-3)`: the code/scale tiles and down's h fragments through shared memory with cp.async,
  12-126 KB a program) lost 1.3-2.5x at every N. Seventeenth session: each program asking L2 for all its plane
  bytes first (the TMA's bulk prefetch, one request per contiguous code/scale range) tied or lost at every N for
  either kernel (down at split 8: +4-10% except a tie at N = 2; gate-up: +1-9% up to N = 8, a tie at 16); down
  loading the next step's h fragments with its codes (83 registers; with a cap of 80 too) was within 2% of the
  default except at N = 2 (49.7 against 52.6 us); a one-warp gate-up lost (N = 1: 36.8 against 30.0 us). So neither
  DRAM nor L2 latency bounds the two kernels at N >= 4; their instruction issue does.
  Accuracy: the products are exact (bf16 weights with the scale folded in, bf16 x terms) and summed in fp32,
  so fp32 x gives ~1e-6 relative error and bf16 x is bounded by the bf16 output rounding.
  Triton's interpreter cannot run inline asm: there (TRITON_INTERPRET=1) the same kernels run `_plain_word_dot`,
  the same arithmetic in plain Triton on the same pair layout, scale bytes and bf16 terms (all terms of a word
  per element, so the per-lane term columns and the mask go).
  Tried and dropped (ninth session): programs of 2-4 m-tiles (16 rows each) sharing each step's x fragments.
  Once the fragments came one L1 line a load they lost at every N (more registers, fewer programs).
  Next: gate-up is now issue-bound (ncu at N = 8: 67% SM throughput, 0.5 issued a cycle a scheduler, 128 registers,
  4 warps a scheduler), and 0.5 a cycle is what the integer ALU pipe takes (16 lanes a scheduler): PRMT, LOP3 and
  SHF are ~70% of the loop, so fewer ALU ops a weight is the lever (moving the shifts to the FMA pipe as IMAD.HI
  lost, see above). `bench/pipe_probe.py` (twenty-fourth session, H200) measured the pipes: PRMT, LOP3, SHF and
  F2FP (the e4m3 -> f16x2 conversion) share the integer ALU pipe (0.48 a cycle a scheduler alone, pairs no faster);
  IMAD, HFMA2 and the swizzled HADD2 run beside it on the FMA pipe (pairs with LOP3 at twice the rate); IMAD.HI is
  quarter rate and the loop's mix with it is no faster (why the IMAD.HI shifts lost). In that probe the loop's mix
  took 9.39 cycles an SM and 7.74 with selector_fma; in the kernels it gains 1-5% from 4 tokens (N = 8: 160 -> 155
  us, 16: 299 -> 286) and loses at 1-2 (N = 2: 51.6 -> 53.6; N = 1 at down split 16: 26.6 -> 31.5), where the longer
  chain to the PRMT costs more than ALU issue saves, hence `default_config`. Not built yet, priced in
  docs/benchmarks.md (forty-first session): no dequant at all, on bit planes (level = 3 b0 + 5 b1 - 4), with
  one native b1 mma (BMMA) against x as 16 bit planes with one exponent per 32 columns, ~1.35 instructions a weight
  split over the ALU and FMA pipes. It needs a GPU-side plane layout, and first the BMMA's rate
  (`bench/pipe_probe.py`).
  Tried and dropped (eighteenth session, commit 07e2fd2 has the code): e4m3 weights, 4 a PRMT
  straight from a word's codes (9 integer ops a word instead of 19), the scale folded into the PRMT's table against
  a per-row reference exponent, x as e4m3 terms, into mma.sync m16n8k32 e4m3. ptxas emulates FP8 mma.sync on sm_90
  (each one 2 f16 HMMAs and F2FP conversions of the bytes): the loop went from 1.71 to 1.98 instructions a weight
  and the call lost 16-26% at N = 1-16. The s8 form of the same mma (IMMA.16832) is native on sm_90 (that build:
  1.20 instructions a weight; integer ALU ops 311 -> 183 a loop iteration), but an s8 weight holds level * 2^d only
  for d = 0..4, 5 exponents, fewer than a row's scales take (the bench's random planes: 6): exact s8 needs each
  mma's 32 K values of a row in one scale group (then the LUT is constant and the scale is applied per group after
  an s32 mma), i.e. a GPU-side plane layout in which the 4 lanes of a row read one group, and x/h as s8 terms with
  a per-token / per-pair scale. Counted before building it (nineteenth session, the sm_90 SASS of that step on the
  CPU, assuming the relaid planes: 4 PRMT an mma from a constant table, the s32 result read as a float through the
  accumulator's magic 0x4B400000, then one FFMA with the group's 2^s and one FADD into fp32 per result): 2.01
  instructions a weight against the bf16 loop's 1.71, although its integer ALU ops fall from 312 to 196 a loop
  iteration: the 4 results an mma of 16 weights a lane each cost 2 float ops (64 FFMA, 64 FADD, 32 FMUL, 32 scale
  IMADs an iteration). If the loop is bound by its total issue (the e4m3 form's 16-26% loss matched its 1.98 /
  1.71), s8 would lose ~18%; if by the integer pipe (the bf16 loop issues ~0.5 a cycle a scheduler, 70% of it
  PRMT/SHF/LOP3; 2 cycles each), up to ~1.2x (622 pipe cycles a loop iteration against s8's 514 instructions at one
  a cycle). Timed without the relayout (twentieth session, both loops on the same planes; the probe is in commit
  15fb357's bench/w2_s8_probe.py): s8 18.2 against 17.1 us at N = 1, 2-4% faster at N = 4-16 (53.2 / 99.1 / 185.5
  against 55.5 / 102.0 / 189.8 us), too little for a layout every GPU reader of the planes would have to follow:
  not built. Also open: for verify steps whose tokens share experts, grouping the (token, expert) pairs by expert
  (the mma has 8 columns: up to 8/T tokens of one expert per unpack; random routing at N = 8 has ~44 distinct
  experts in 48 pairs, so the bench would not show it).
  Also tried and dropped (thirty-first session, commit dd493a1 has the code): a stream-K gate-up for one token,
  the (pair, row tile, K tile) units in equal runs over 16 warps' worth of programs an SM in one wave (the grid
  above holds ~11.6), a row tile cut between programs finished by its last one from the others' partial sums:
  32.9 against 26.6 us a call at N = 1, decode 4.97 against 4.80 ms at batch 1. More warps an SM barely help the
  one-token call anyway: k = 8 (1 024 programs, ~15.5 warps an SM) streams 1 682 GB/s against k = 6's 1 595.
  Also tried and dropped (thirty-eighth session, commit 92006a0 has the code): gate-up's programs asking L2 for
  down's planes of their expert (one bulk prefetch of a 1/I-th slice each, at their start or after their K loop),
  so that down reads L2: a call 26.6 -> 28.9 (start) / 26.8 (end) us at N = 1, slower at N = 2-8, and decode at
  batch 1 / 2 / 8 4.82 / 6.17 / 11.66 -> 4.90 / 6.37 / 12.18 ms (start), 4.81 / 6.19 / 11.99 (end).
  Also tried and dropped (thirty-ninth session built it, the forty-first timed it; commit 1091603 has the code): a
  gate-up whose code tiles came by the TMA (5-d descriptors, one box a program and K step) into a shared-memory
  ring that Triton's pipeliner kept 2-5 steps ahead, so that bytes in flight cost no registers (95-96 against
  126-128), for 1.88-1.94 instructions a weight against 1.70 (the ring's barriers, waits and shared-memory loads).
  A call at N = 1 / 2 / 4 / 8: 27.0 / 50.5 / 92.2 / 170.8 us with 3 stages against 26.6 / 50.5 / 88.1 / 155.2 for
  the defaults, 6 stages slower still; decode at batch 1 / 2 / 8 4.96 / 6.21 / 11.68 ms (3 stages) and 5.24 / 6.44
  / 11.90 (6) against 4.82 / 6.16 / 11.65. So more bytes in flight do not speed the one-token call either.

Variant "fma" (CUDA cores, exact fp32): `_gate_up_kernel`, grid (N*k, I/ROWS), and `_down_kernel`, grid
(N, H/ROWS), same split of the work; [ROWS, WORDS] int32 tiles, per word ~10 ops give a "big" bit (codes 0, 3)
at 2m and a "negative" bit at 2m+7, then per code ((q << (24 - 2m)) & 0x81000000) | 0x3E800000 is the fp32
level/4, one FFMA per weight and token, the E8M0 byte placed in the fp32 exponent once per word
((s + 2) << 23). `transpose_x` word-transposes x (one copy kernel) for unit-stride loads.

Layout the kernels take (`w2_moe_decode_split`): for w1, w3 and w2, codes uint8 [E, rows, cols/4] and scales
E8M0 (float8_e8m0fnu or uint8) [E, rows, cols/32], rows contiguous within an expert, any expert stride
(a multiple of 4 bytes for codes; 16 bytes and 16-byte aligned codes for the mma kernels, else fma). w1 and
w3 must share their strides. So the planes can be stacked tensors (`stack_planes`) or zero-copy views of a
plane-store layer buffer [E, slot stride] (`layer_views`). `w2_moe_decode` takes the w13 stacked form:
w13 = [E, 2I, ...], w1 rows then w3 rows. With `tiled` the codes of each matrix are stored tile by tile
(`tile_codes`: a 16-row block's K tiles of 16 words, 1 KB each, contiguous; scales row-major), which the mma and
FP8 kernels read (a warp's K step is then one contiguous KB, not 16 rows' 64-byte pieces), and the prefill's "rows"
kernels too; the fma kernels do not. The FP8 gate-up alone took 85.2 against 90.9 us at N = 8 on that order (H100,
fiftieth session). MOEBOX_TILED_CODES=1 relays each CUDA layer buffer as the model is built (`tile_layer_codes`,
`moebox.model.moe.MoE`; the store stays row-major); whether a decode step gains is for `moebox bench decode
--tiled-codes` to say, and it stays off until then.

CUDA graphs: a call allocates only its scratch (x/h pairs, or h and x^T for fma) and `out` with torch.empty
(graph-safe with the caching allocator) and launches 3 kernels; no host sync, no data-dependent shapes.
`bench` replays back-to-back calls on different routings in one graph, so the planes miss L2 as in a decode
step over 43 layers (the earlier numbers, 681 GB/s at N=1, replayed one call whose 42.5 MB partly stayed
in the 50 MB L2).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace
from typing import Sequence

import torch

from moebox.ops.moe import routed_experts
from moebox.ops.streams import Branch
from moebox.quant.w2 import W2Tensor

from moebox.ops.triton import w2_fp8, w2_fp8_down
from moebox.ops.triton.pair_layout import _column_slot, _pair_offset, _pair_slot, _store_bf16_terms
from moebox.ops.triton.runtime import (HAVE_TRITON, bench_start, build_sm90, graph_us, interpreting,  # noqa: F401
                                       kernel_or_fallback, loop_sass, packed_asm_layout, pdl_args, pdl_start, tl,
                                       triton, versions)


@dataclass(frozen=True)
class DecodeConfig:
    """Kernel variant and blocks (see the module doc). "mma": gate_split / down_split warps per program, each
    taking every split-th 16-word K tile (powers of two, capped to what the shape divides into); prefetch: how many
    K steps ahead the code/scale loads run (1 or 2); selector_fma: the unpack's upper PRMT selectors moved by an f16x2
    add on the FMA pipe instead of a shift on the integer ALU pipe (`_mma_asm`); fp8_gate_up: where
    `w2_fp8.fp8_gate_up_takes` (sm_90, bf16/fp16 x), gate-up by that module's kernel instead, before the same down
    kernel; fp8_down: where the FP8 gate-up runs and `w2_fp8_down.fp8_down_takes`, the down projection by that
    module's kernel too (h as e4m3 terms). "fma": ROWS output rows x WORDS code words per program and step,
    num_warps, num_stages, transpose_x.
    Shapes the mma kernels do not take run "fma"."""

    gate_rows: int = 16
    gate_words: int = 32
    gate_warps: int = 4
    down_rows: int = 16
    down_words: int = 32
    down_warps: int = 4
    num_stages: int = 3
    transpose_x: bool = True
    variant: str = "mma"
    gate_split: int = 2
    down_split: int = 8
    prefetch: int = 1
    selector_fma: bool = False
    fp8_gate_up: bool = True
    fp8_down: bool = False

    def __post_init__(self) -> None:
        pow2 = (self.gate_split, self.down_split, self.gate_rows, self.gate_words, self.down_rows, self.down_words)
        if self.variant not in ("mma", "fma") or self.prefetch not in (1, 2) or any(v < 1 or v & (v - 1)
                                                                                     for v in pow2):
            raise ValueError(f"bad decode config {self}: variant mma/fma, prefetch 1/2, blocks powers of two")


DEFAULT_CONFIG = DecodeConfig()
# one token: 16 warps a down program (256 programs; the sixteenth session's sweep: 27.7 against 30.0 us a call);
# the mma gate-up: with the FP8 one a 36-layer batch-1 decode step took 4.78 against 4.69 ms (fiftieth session, H100),
# and with its x packed by 8 programs and pairs two ahead 4.61 against 4.61 (fifty-first)
BATCH1_CONFIG = replace(DEFAULT_CONFIG, down_split=16, fp8_gate_up=False)
# 4+ tokens, where the integer ALU pipe binds the kernels: the selectors' FMA-pipe move gained 1-5% there; at 1-2
# tokens, where latency binds, it lost with the tilings those take (twenty-fourth session)
MANY_TOKENS_CONFIG = replace(DEFAULT_CONFIG, selector_fma=True)
# 8+ tokens: the FP8 down too (36-layer decode on the H100, fifty-first session: batch 8 10.37 -> 10.06 ms, 16 15.50
# -> 15.15); with fewer, its one program a token and 128 rows leaves SMs idle (batch 2: 5.60 -> 6.57 ms)
FP8_DOWN_TOKENS = 8
FP8_DOWN_CONFIG = replace(MANY_TOKENS_CONFIG, fp8_down=True)


def default_config(n: int) -> DecodeConfig:
    """The tiling a call of n tokens takes when it is given none (docs/benchmarks.md, sixteenth, twenty-fourth,
    fiftieth and fifty-first sessions)."""
    if n == 1:
        return BATCH1_CONFIG
    return DEFAULT_CONFIG if n < 4 else MANY_TOKENS_CONFIG if n < FP8_DOWN_TOKENS else FP8_DOWN_CONFIG


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
                        X_WORDS: tl.constexpr, ROWS: tl.constexpr, WORDS: tl.constexpr, PDL: tl.constexpr):
        pdl_start(PDL)
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
                     ROWS: tl.constexpr, WORDS: tl.constexpr, PDL: tl.constexpr):
        pdl_start(PDL)
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


    # ------------------------------------------------------------------------------------ mma variant
    def _mma_asm(selector_fma: bool = False) -> str:
        """PTX for one pack of 8 elements of a [16*S, 16] word tile: one lane's words 4t..4t+3 (slot i) of its
        two rows (rep rho: rows g and g+8 of the m16n8k16 fragment). Operands: $0..$7 out acc, $8.. codes,
        $16.. scale bytes (slot 4 rho + b: scale block b of the lane), $24.. x (operand 24 + 8 i + q: pair q
        of word i), $56.. acc in. Slot 4 rho + i of acc holds D[row rho][column 2t + i % 2]; words 0-1 and
        2-3 accumulate in two mma chains (i // 2). selector_fma: see the selectors' loop."""
        codes, scales, xs, acc = 8, 16, 24, 56
        slot = (0, 1, 4, 5, 2, 3, 6, 7)   # D register k of chain k // 4 -> acc slot
        asm = ["{", ".reg .b32 lut<4>, lob<4>, y<4>, yh<4>, p<16>, t;", ".reg .f32 d<8>;"]
        if selector_fma:
            asm += [".reg .b32 mz;", ".reg .b16 lo, hi;", "mov.b32 mz, 0x80008000;"]   # mz: f16x2 (-0, -0)
        asm += [f"mov.b32 d{k}, ${acc + slot[k]};" for k in range(8)]
        for rho in range(2):
            for b in range(2):   # the bf16 high byte of each code's value and the shared low byte, see the doc
                s, i = f"${scales + 4 * rho + b}", 2 * rho + b
                asm += [f"shr.b32 t, {s}, 1;", f"mad.lo.u32 lut{i}, t, 0x01010101, 0x01008081;",
                        f"and.b32 t, {s}, 1;", f"mul.lo.u32 lob{i}, t, 0x80808080;"]
        for word in range(4):
            for rho in range(2):
                c, i = f"${codes + 4 * rho + word}", 2 * rho + word // 2
                # selector q: byte k = [low nibble 0 -> lob, high nibble 4 | code 4k+q -> lut byte]
                for q, shift in enumerate(("shl.b32 t, {c}, 4;", "shl.b32 t, {c}, 2;", None, "shr.b32 t, {c}, 2;")):
                    src = c if shift is None else "t"
                    if shift is not None:
                        asm.append(shift.format(c=c))
                    asm.append(f"lop3.b32 y{q}, {src}, 0x30303030, 0x40404040, 0xea;")   # (a & b) | c
                for q in range(4):
                    # yh = y's high half in the low one (a PRMT selector is its low 16 bits). selector_fma: an
                    # f16x2 add of -0 whose operand swizzle (.H1_H1) moves it, on the FMA pipe instead of a SHF on
                    # the integer ALU pipe that the PRMTs and LOP3s saturate (the halves are normal f16 numbers,
                    # 0x4040-0x7070, so the add is exact); it lengthens the chain to the PRMT, which costs where
                    # latency binds (few tokens)
                    asm += ([f"mov.b32 {{lo, hi}}, y{q};", f"mov.b32 yh{q}, {{hi, hi}};",
                             f"add.rn.f16x2 yh{q}, yh{q}, mz;"] if selector_fma else [f"shr.b32 yh{q}, y{q}, 16;"])
                    asm += [f"prmt.b32 p{8 * rho + q}, lob{i}, lut{i}, y{q};",
                            f"prmt.b32 p{8 * rho + 4 + q}, lob{i}, lut{i}, yh{q};"]
            for grp in range(4):
                j0, j1 = 2 * grp, 2 * grp + 1
                d = ", ".join(f"d{4 * (word // 2) + k}" for k in range(4))
                asm.append(f"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{{d}}}, "
                           f"{{p{j0}, p{8 + j0}, p{j1}, p{8 + j1}}}, "
                           f"{{${xs + 8 * word + j0}, ${xs + 8 * word + j1}}}, {{{d}}};")
        asm += [f"mov.b32 ${slot[k]}, d{k};" for k in range(8)] + ["}"]
        return "\n".join(asm)

    _MMA_ASM = tl.constexpr(_mma_asm())
    _MMA_ASM_SELECTOR_FMA = tl.constexpr(_mma_asm(selector_fma=True))
    _MMA_CONSTRAINTS = tl.constexpr(",".join(["=r"] * 8 + ["r"] * 56))

    @triton.jit
    def _mma_word_dot(cw, sb, x0, x1, x2, x3, acc, SELECTOR_FMA: tl.constexpr):
        """acc [16S, 16] fp32 += the tile's words (int32 cw) at scale bytes sb against x (int32 bf16x2 pairs,
        x_i: the 8 pairs of the lane's word i, 4 per rep) on the tensor cores, as laid out in `_mma_asm`."""
        out = tl.inline_asm_elementwise(_MMA_ASM_SELECTOR_FMA if SELECTOR_FMA else _MMA_ASM, _MMA_CONSTRAINTS,
                                        [cw, sb.to(tl.int32), x0, x1, x2, x3, acc.to(tl.int32, bitcast=True)],
                                        dtype=tl.int32, is_pure=True, pack=8)
        return out.to(tl.float32, bitcast=True)

    # A probe's stand-in for `_mma_asm` (bench/gate_up_bound.py): all 48 operands xor-ed into every output (the
    # reduction keeps only some acc slots, so an operand folded into one slot alone could lose its load to ptxas's
    # dead-code pass), 24 LOP3 a pack: the loads without the unpack and the mmas.
    _XOR_ASM = tl.constexpr("\n".join(
        ["{", ".reg .b32 t;", "xor.b32 t, $8, $9;"]
        + [f"lop3.b32 t, t, ${a}, ${a + 1}, 0x96;" for a in range(10, 56, 2)]
        + [f"xor.b32 ${k}, t, ${56 + k};" for k in range(8)] + ["}"]))

    @triton.jit
    def _xor_word_dot(cw, sb, x0, x1, x2, x3, acc):
        """`_mma_word_dot`'s operands xor-ed into acc's bits: the loads without the math (a probe, not a result)."""
        out = tl.inline_asm_elementwise(_XOR_ASM, _MMA_CONSTRAINTS,
                                        [cw, sb.to(tl.int32), x0, x1, x2, x3, acc.to(tl.int32, bitcast=True)],
                                        dtype=tl.int32, is_pure=True, pack=8)
        return out.to(tl.float32, bitcast=True)

    @triton.jit
    def _b_fragments(xb):
        """The 4 B-fragment registers of a lane for one K step (x or h pairs of its words i = 0..3, at slot
        offset 32 i from xb in the `_pair_slot` layout)."""
        return tl.load(xb), tl.load(xb + 32), tl.load(xb + 64), tl.load(xb + 96)

    @triton.jit
    def _plain_word_dot(cw, sb, xw_ptr, T: tl.constexpr, TERM_STRIDE: tl.constexpr):
        """The same values without inline asm (Triton's interpreter): per element, word cw at scale byte sb
        against x given as T bf16 terms of its 8 pairs at xw_ptr + tau * TERM_STRIDE + j -> fp32 dot."""
        j = tl.arange(0, 8)[None, None, :]
        c = cw[:, :, None] >> (2 * (j + (j & 4)))   # pair j: codes j + (j & 4) (low half) and 4 more (high)
        lut = ((sb >> 1) * 0x01010101 + 0x01008081)[:, :, None]
        low = ((sb & 1) << 23)[:, :, None]
        v_lo = ((((lut >> (8 * (c & 3))) & 0xFF) << 24) | low).to(tl.float32, bitcast=True)
        v_hi = ((((lut >> (8 * ((c >> 8) & 3))) & 0xFF) << 24) | low).to(tl.float32, bitcast=True)
        x_lo = tl.zeros(v_lo.shape, dtype=tl.float32)
        x_hi = tl.zeros(v_lo.shape, dtype=tl.float32)
        for tau in tl.static_range(T):
            v = tl.load(xw_ptr[:, :, None] + tau * TERM_STRIDE + _pair_offset(j))
            x_lo += (v << 16).to(tl.float32, bitcast=True)
            x_hi += (v & -65536).to(tl.float32, bitcast=True)
        return tl.sum(v_lo * x_lo + v_hi * x_hi, axis=2)

    @triton.jit
    def _tile_coords(S: tl.constexpr, REPS: tl.constexpr):
        """Row decomposition of the [8 S REPS, 16] word tile: tile row r2 = rho * 8S + s * 8 + g, where g is the
        lane group (the mma fragment row), s the warp (its share of K) and rho the rep (here: rows g / g + 8)."""
        r2 = tl.arange(0, 8 * S * REPS)[:, None]
        w = tl.arange(0, 16)[None, :]
        return r2 % 8, (r2 // 8) % S, r2 // (8 * S), w

    @triton.jit
    def _reduce_tile(acc, T: tl.constexpr, S: tl.constexpr, USE_ASM: tl.constexpr):
        """acc [16S, 16] -> [2, 8] (rep, lane group): the sum over words, warps and the T term columns."""
        w = tl.arange(0, 16)[None, :]
        if USE_ASM:   # slot w of lane t holds mma column 2t + w % 2; columns >= T are other lanes' copies
            acc = tl.where(2 * (w // 4) + (w % 2) < T, acc, 0.0)
        return tl.sum(tl.reshape(tl.sum(acc, axis=1), (2, S, 8)), axis=1)

    @triton.jit
    def _pack_x_kernel(x_ptr, xp_ptr, x_row_stride, KW: tl.constexpr, T: tl.constexpr, BLOCK: tl.constexpr,
                       PDL: tl.constexpr):
        """x [N, 16 KW] -> xp: T bf16 terms in the pair layout (module doc, `_pair_slot`), int16 view
        [N, T, KW * 16]."""
        pdl_start(PDL)
        n = tl.program_id(0)
        k = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + n.to(tl.int64) * x_row_stride + k).to(tl.float32)
        _store_bf16_terms(xp_ptr, n.to(tl.int64) * (T * KW * 16) + _column_slot(k), v, T, KW * 16)

    @triton.jit
    def _gate_tiles(w1c_ptr, w1s_ptr, w3c_ptr, w3s_ptr, c_row, s_row, u, LAST: tl.constexpr,
                    TILE_WORDS: tl.constexpr):
        """The w1 and w3 code words and scale bytes of K tile u (16 words; clamped to the last tile); TILE_WORDS:
        words from one tile of a row's codes to the next (256 for codes stored tile by tile, `tile_codes`)."""
        tile = tl.minimum(u, LAST)
        wb, cb = tile * 16, tile * TILE_WORDS
        return (tl.load(w1c_ptr + c_row + cb), tl.load(w1s_ptr + s_row + wb // 2),
                tl.load(w3c_ptr + c_row + cb), tl.load(w3s_ptr + s_row + wb // 2), wb)

    @triton.jit
    def _gate_up_mma_kernel(xp_ptr, ids_ptr, rw_ptr, w1c_ptr, w1s_ptr, w3c_ptr, w3s_ptr, hp_ptr,
                            c_expert_stride, s_expert_stride, limit,
                            I: tl.constexpr, HW: tl.constexpr, K: tl.constexpr, TX: tl.constexpr,
                            TH: tl.constexpr, HAS_LIMIT: tl.constexpr, S: tl.constexpr,
                            PREFETCH: tl.constexpr, USE_ASM: tl.constexpr, SELECTOR_FMA: tl.constexpr,
                            PDL: tl.constexpr, LOADS_ONLY: tl.constexpr = False, TILED: tl.constexpr = False):
        pdl_start(PDL)
        p = tl.program_id(0)                        # (token, expert) pair, t * K + j
        rw = tl.program_id(1)                       # 16 rows of I: one word of h
        t = p // K
        e = tl.load(ids_ptr + p).to(tl.int64)
        g, sp, rho, w = _tile_coords(S, 2)
        r = 8 * rho + g
        row = 16 * rw + (r >> 1) + ((r >> 1) & 4) + 4 * (r & 1)   # tile row r = 2 j + half -> h row of pair j
        TILE_WORDS: tl.constexpr = 256 if TILED else 16
        if TILED:   # the 16 rows' K tiles of 16 words stored tile by tile (`tile_codes`)
            c_row = e * c_expert_stride + (16 * rw).to(tl.int64) * HW + (row - 16 * rw) * 16 + w
        else:
            c_row = e * c_expert_stride + row.to(tl.int64) * HW + w
        if USE_ASM:   # x pairs: lane (g, t) reads x term g (a copy of term TX-1 past TX), its words' pairs
            s_row = e * s_expert_stride + row * (HW // 2) + 2 * (w // 4) + (w % 2)
            x_row = xp_ptr + (t * TX + tl.minimum(g, TX - 1)).to(tl.int64) * (HW * 8) + 16 * rho + w
        else:
            s_row = e * s_expert_stride + row * (HW // 2) + w // 2
            x_row = xp_ptr + t.to(tl.int64) * (TX * HW * 8) + _pair_slot(w, 0) + 0 * g
        LAST: tl.constexpr = HW // 16 - 1
        acc_g = tl.zeros((16 * S, 16), dtype=tl.float32)
        acc_u = tl.zeros((16 * S, 16), dtype=tl.float32)
        # warp s takes K tiles s, s + S, ...; the loads of the tile PREFETCH steps ahead are issued before
        # this tile's math (Triton does not pipeline loads in loops without tl.dot)
        c1, s1, c3, s3, wb = _gate_tiles(w1c_ptr, w1s_ptr, w3c_ptr, w3s_ptr, c_row, s_row, sp, LAST, TILE_WORDS)
        if PREFETCH == 2:
            d1, e1, d3, e3, db = _gate_tiles(w1c_ptr, w1s_ptr, w3c_ptr, w3s_ptr, c_row, s_row, sp + S, LAST,
                                             TILE_WORDS)
        for u0 in tl.range(0, LAST + 1, S, loop_unroll_factor=PREFETCH):
            n1, m1, n3, m3, nb = _gate_tiles(w1c_ptr, w1s_ptr, w3c_ptr, w3s_ptr, c_row, s_row,
                                             u0 + PREFETCH * S + sp, LAST, TILE_WORDS)
            if USE_ASM:
                xb = x_row + wb * 8
                x0, x1, x2, x3 = _b_fragments(xb)
                if LOADS_ONLY:
                    acc_g = _xor_word_dot(c1, s1, x0, x1, x2, x3, acc_g)
                    acc_u = _xor_word_dot(c3, s3, x0, x1, x2, x3, acc_u)
                else:
                    acc_g = _mma_word_dot(c1, s1, x0, x1, x2, x3, acc_g, SELECTOR_FMA)
                    acc_u = _mma_word_dot(c3, s3, x0, x1, x2, x3, acc_u, SELECTOR_FMA)
            else:
                acc_g += _plain_word_dot(c1, s1.to(tl.int32), x_row + wb * 8, TX, HW * 8)
                acc_u += _plain_word_dot(c3, s3.to(tl.int32), x_row + wb * 8, TX, HW * 8)
            if PREFETCH == 2:
                c1, s1, c3, s3, wb = d1, e1, d3, e3, db
                d1, e1, d3, e3, db = n1, m1, n3, m3, nb
            else:
                c1, s1, c3, s3, wb = n1, m1, n3, m3, nb
        gate = _reduce_tile(acc_g, TX, S, USE_ASM)
        up = _reduce_tile(acc_u, TX, S, USE_ASM)
        if HAS_LIMIT:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        h = gate / (1.0 + tl.exp(-gate)) * up * tl.load(rw_ptr + p).to(tl.float32)
        IW: tl.constexpr = I // 16
        r_out = 8 * tl.arange(0, 2)[:, None] + tl.arange(0, 8)[None, :]   # h row 16 rw + r_out: pair r_out // 2
        _store_bf16_terms(hp_ptr, p.to(tl.int64) * TH * IW * 16 + 2 * _pair_slot(rw, r_out // 2) + r_out % 2, h,
                          TH, IW * 16)

    @triton.jit
    def _down_tiles(ids_ptr, w2c_ptr, w2s_ptr, c_row, s_row, c_expert_stride, s_expert_stride, t, u,
                    K: tl.constexpr, TILES: tl.constexpr, TILE_WORDS: tl.constexpr):
        """Unit u (clamped to the last) = (expert j, K tile): the pair, its tile's first word, codes, scales;
        TILE_WORDS as in `_gate_tiles`."""
        u = tl.minimum(u, K * TILES - 1)
        p = t * K + u // TILES
        e = tl.load(ids_ptr + p).to(tl.int64)
        tile = u % TILES
        wb = tile * 16
        return (tl.load(w2c_ptr + e * c_expert_stride + c_row + tile * TILE_WORDS),
                tl.load(w2s_ptr + e * s_expert_stride + s_row + wb // 2), p, wb)

    @triton.jit
    def _down_mma_kernel(hp_ptr, ids_ptr, w2c_ptr, w2s_ptr, out_ptr,
                         out_row_stride, c_expert_stride, s_expert_stride,
                         IW: tl.constexpr, K: tl.constexpr, TH: tl.constexpr, S: tl.constexpr,
                         PREFETCH: tl.constexpr, USE_ASM: tl.constexpr, SELECTOR_FMA: tl.constexpr,
                         PDL: tl.constexpr, TILED: tl.constexpr = False):
        t = tl.program_id(0)
        rb = tl.program_id(1)
        g, sp, rho, w = _tile_coords(S, 2)
        row = 16 * rb + 8 * rho + g
        TILES: tl.constexpr = IW // 16
        TILE_WORDS: tl.constexpr = 256 if TILED else 16
        if TILED:   # the 16 rows' K tiles of 16 words stored tile by tile (`tile_codes`)
            c_row = rb.to(tl.int64) * (16 * IW) + (row - 16 * rb) * 16 + w
        else:
            c_row = row.to(tl.int64) * IW + w
        if USE_ASM:
            s_row = row * (IW // 2) + 2 * (w // 4) + (w % 2)
            x_col = tl.minimum(g, TH - 1) * (IW * 8) + 16 * rho + w
        else:
            s_row = row * (IW // 2) + w // 2
            x_col = _pair_slot(w, 0) + 0 * g
        acc = tl.zeros((16 * S, 16), dtype=tl.float32)
        # units (expert j, K tile): warp s takes units s, s + S, ...; loads PREFETCH units ahead
        c, s, p, wb = _down_tiles(ids_ptr, w2c_ptr, w2s_ptr, c_row, s_row, c_expert_stride, s_expert_stride,
                                  t, sp, K, TILES, TILE_WORDS)
        if PREFETCH == 2:
            dc, ds, dp, db = _down_tiles(ids_ptr, w2c_ptr, w2s_ptr, c_row, s_row, c_expert_stride,
                                         s_expert_stride, t, sp + S, K, TILES, TILE_WORDS)
        # The first tiles load before the PDL wait: the planes are constant and the expert ids come from the
        # routing, which finished before gate-up (the kernel before) could start; only h is gate-up's.
        pdl_start(PDL)
        for u0 in tl.range(0, K * TILES, S, loop_unroll_factor=PREFETCH):
            nc, ns, np_, nb = _down_tiles(ids_ptr, w2c_ptr, w2s_ptr, c_row, s_row, c_expert_stride,
                                          s_expert_stride, t, u0 + PREFETCH * S + sp, K, TILES, TILE_WORDS)
            xb = hp_ptr + p.to(tl.int64) * (TH * IW * 8) + x_col + wb * 8
            if USE_ASM:
                x0, x1, x2, x3 = _b_fragments(xb)
                acc = _mma_word_dot(c, s, x0, x1, x2, x3, acc, SELECTOR_FMA)
            else:
                acc += _plain_word_dot(c, s.to(tl.int32), xb, TH, IW * 8)
            if PREFETCH == 2:
                c, s, p, wb = dc, ds, dp, db
                dc, ds, dp, db = nc, ns, np_, nb
            else:
                c, s, p, wb = nc, ns, np_, nb
        y = _reduce_tile(acc, TH, S, USE_ASM)
        r_out = 16 * rb + 8 * tl.arange(0, 2)[:, None] + tl.arange(0, 8)[None, :]
        tl.store(out_ptr + t.to(tl.int64) * out_row_stride + r_out, y.to(out_ptr.dtype.element_ty))


# ---------------------------------------------------------------------------------------------- wrappers
def _pow2_block(want: int, size: int) -> int:
    """Largest power of two <= want that divides size."""
    b = 1 << int(math.log2(max(1, want)))
    while size % b:
        b //= 2
    return b


_TERMS = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}   # bf16 terms that hold x exactly (~ for fp32)


def _decode_fma(x: torch.Tensor, ids: torch.Tensor, rw: torch.Tensor, w1c: torch.Tensor, w1s: torch.Tensor,
                w3c: torch.Tensor, w3s: torch.Tensor, w2c: torch.Tensor, w2s: torch.Tensor, limit: float | None,
                out: torch.Tensor, k: int, cfg: DecodeConfig) -> None:
    n, hidden = x.shape
    inter = w1c.shape[1]
    hw, iw = hidden // 16, inter // 16
    pairs = n * k
    h = torch.empty((pairs, inter), dtype=torch.float32, device=x.device)
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
        num_warps=cfg.gate_warps, num_stages=cfg.num_stages, **pdl_args(x, _gate_up_kernel))
    _down_kernel[(n, hidden // d_rows)](
        h, ids, w2c, w2s, out,
        out.stride(0), w2c.stride(0), w2s.stride(0),
        H=hidden, IW=iw, K=k, ROWS=d_rows, WORDS=d_words,
        num_warps=cfg.down_warps, num_stages=cfg.num_stages, **pdl_args(x, _down_kernel))


def _decode_mma(x: torch.Tensor, ids: torch.Tensor, rw: torch.Tensor, w1c: torch.Tensor, w1s: torch.Tensor,
                w3c: torch.Tensor, w3s: torch.Tensor, w2c: torch.Tensor, w2s: torch.Tensor, limit: float | None,
                out: torch.Tensor, k: int, cfg: DecodeConfig, xp: torch.Tensor | tuple | None = None,
                tiled: bool = False) -> None:
    n, hidden = x.shape
    inter = w1c.shape[1]
    hp = None
    if w2_fp8.fp8_gate_up_takes(x, hidden, inter, cfg.fp8_gate_up):   # Hopper: e4m3 into wgmma
        xq = xp if isinstance(xp, tuple) else w2_fp8.pack_x(x)
        variant = w2_fp8.variant_for(n, tiled, hidden)

        def gate_up(fp8_h: bool):
            return w2_fp8.gate_up(*xq, ids, rw, w1c, w1s, w3c, w3s, limit, k, th=2, variant=variant, fp8_h=fp8_h)
        if w2_fp8_down.fp8_down_takes(x, hidden, inter, k, cfg.fp8_down) and kernel_or_fallback(
                "fp8 down", "MOEBOX_FP8_DOWN",
                lambda: w2_fp8_down.down(*gate_up(True), ids, w2c, w2s, out, k, tiled=tiled) is out, lambda: False):
            return
        hp = kernel_or_fallback("fp8 gate-up", "MOEBOX_FP8_GATE_UP", lambda: gate_up(False), lambda: None)
    if hp is None:
        if xp is None or isinstance(xp, tuple):
            xp = _pack_x(x, _empty_packed(x))
        hp = _gate_up_mma(x, xp, ids, rw, w1c, w1s, w3c, w3s, limit, k, cfg, tiled=tiled)
    iw, th = hp.shape[2], hp.shape[1]
    down_split = _pow2_block(cfg.down_split, k * (iw // 16))
    _down_mma_kernel[(n, hidden // 16)](
        hp, ids, w2c, w2s, out, out.stride(0), w2c.stride(0), w2s.stride(0),
        IW=iw, K=k, TH=th, S=down_split, PREFETCH=cfg.prefetch, USE_ASM=not interpreting(),
        SELECTOR_FMA=cfg.selector_fma, TILED=tiled,
        num_warps=down_split, num_stages=1, **pdl_args(x, _down_mma_kernel))


def _gate_up_mma(x: torch.Tensor, xp: torch.Tensor, ids: torch.Tensor, rw: torch.Tensor, w1c: torch.Tensor,
                 w1s: torch.Tensor, w3c: torch.Tensor, w3s: torch.Tensor, limit: float | None, k: int,
                 cfg: DecodeConfig, loads_only: bool = False, tiled: bool = False) -> torch.Tensor:
    """Launch the mma gate-up kernel on x packed into xp -> h as bf16 terms in the pair layout (int32 [N k, T_h,
    I/16, 8]), what the down kernel reads. Apart from `_decode_mma` so that a bench can time it alone;
    loads_only: the probe's kernel without the math (`_xor_word_dot`, h meaningless); tiled: the codes stored tile
    by tile (`tile_codes`; on row-major codes the bench's probe of that order, h meaningless)."""
    n, hidden = x.shape
    inter = w1c.shape[1]
    hw, iw = hidden // 16, inter // 16
    tx, th = _TERMS[x.dtype], 3 if x.dtype == torch.float32 else 2
    hp = torch.empty((n * k, th, iw, 8), dtype=torch.int32, device=x.device)
    has_limit = bool(limit)
    gate_split = _pow2_block(cfg.gate_split, hw // 16)
    _gate_up_mma_kernel[(n * k, iw)](
        xp, ids, rw, w1c, w1s, w3c, w3s, hp.view(torch.int16),
        w1c.stride(0), w1s.stride(0), float(limit) if has_limit else 0.0,
        I=inter, HW=hw, K=k, TX=tx, TH=th, HAS_LIMIT=has_limit, S=gate_split, PREFETCH=cfg.prefetch,
        USE_ASM=not interpreting(), SELECTOR_FMA=cfg.selector_fma, LOADS_ONLY=loads_only, TILED=tiled,
        num_warps=gate_split, num_stages=1, **pdl_args(x, _gate_up_mma_kernel))
    return hp


def _empty_packed(x: torch.Tensor) -> torch.Tensor:
    n, hidden = x.shape
    return torch.empty((n, _TERMS[x.dtype], hidden // 16, 8), dtype=torch.int32, device=x.device)


def _pack_x(x: torch.Tensor, xp: torch.Tensor) -> torch.Tensor:
    """x [N, H] (unit column stride) into xp: its bf16 terms in the pair layout the mma kernels read."""
    n, hidden = x.shape
    block = _pow2_block(1024, hidden)
    _pack_x_kernel[(n, hidden // block)](x, xp.view(torch.int16), x.stride(0), KW=hidden // 16, T=_TERMS[x.dtype],
                                         BLOCK=block, num_warps=4, **pdl_args(x, _pack_x_kernel))
    return xp


@dataclass
class PackedX:
    """x packed for the mma decode kernels on a side stream (`pack_x_ahead`): `get()` joins it. xp: the pair
    layout's bf16 terms, or the (e4m3 terms, scales) of `w2_fp8.pack_x` where that gate-up runs."""

    xp: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    branch: Branch

    def get(self) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        self.branch.join()
        return self.xp


def _takes_mma(config: DecodeConfig, hidden: int, inter: int, codes: Sequence[torch.Tensor]) -> bool:
    """Whether the mma kernels take these planes (int32 views of the codes): else the fma ones run."""
    aligned = all(c.stride(0) % 4 == 0 and c.data_ptr() % 16 == 0 for c in codes)   # 16-byte loads
    return config.variant == "mma" and hidden % 256 == 0 and inter % 256 == 0 and aligned


def pack_x_ahead(x: torch.Tensor, w1_codes: torch.Tensor, w3_codes: torch.Tensor, w2_codes: torch.Tensor,
                 config: DecodeConfig | None = None) -> PackedX | None:
    """Start packing x for `w2_moe_decode_split(..., packed=)` on a side stream (the "pack" Branch), so that
    the packing runs beside the router's product and the routing, which come before the experts at decode:
    one launch fewer on the main stream (a layer's `_pack_x_kernel`, ~1.6 us at batch 1). The buffer is
    allocated on the main stream, which reads it after the join. None where the mma kernels do not take these
    planes (nothing to pack)."""
    codes = [c.view(torch.int32) for c in (w1_codes, w3_codes, w2_codes)]
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype not in _TERMS:
        return None
    config = config or default_config(x.shape[0])     # the call's, so that x is packed in the form it reads
    if not _takes_mma(config, x.shape[1], w1_codes.shape[1], codes):
        return None
    fp8 = w2_fp8.fp8_gate_up_takes(x, x.shape[1], w1_codes.shape[1], config.fp8_gate_up)
    xp = w2_fp8.empty_packed(x) if fp8 else _empty_packed(x)
    with Branch(x, "pack", reads=(x,), purpose="pack") as branch:
        w2_fp8.pack_x(x, xp) if fp8 else _pack_x(x, xp)
    return PackedX(xp, branch)


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


def check_layer_planes(hidden: int, inter: int, multiple: int, w1_codes: torch.Tensor, w1_scales: torch.Tensor,
                       w3_codes: torch.Tensor, w3_scales: torch.Tensor, w2_codes: torch.Tensor,
                       w2_scales: torch.Tensor) -> None:
    """ValueError unless H and I are multiples of `multiple` and the planes have the layout the kernels read."""
    if hidden % multiple or inter % multiple:
        raise ValueError(f"hidden ({hidden}) and intermediate ({inter}) must be multiples of {multiple}")
    _check_planes(w1_codes, w1_scales, inter, hidden, "w1")
    _check_planes(w3_codes, w3_scales, inter, hidden, "w3")
    _check_planes(w2_codes, w2_scales, hidden, inter, "w2")
    if w1_codes.stride() != w3_codes.stride() or w1_scales.stride() != w3_scales.stride():
        raise ValueError("w1 and w3 must share their strides")


def w2_moe_decode_split(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                        w1_codes: torch.Tensor, w1_scales: torch.Tensor, w3_codes: torch.Tensor,
                        w3_scales: torch.Tensor, w2_codes: torch.Tensor, w2_scales: torch.Tensor,
                        limit: float | None, *, out: torch.Tensor | None = None,
                        config: DecodeConfig | None = None, packed: PackedX | None = None,
                        tiled: bool = False) -> torch.Tensor:
    """The Triton path with w1/w3/w2 given apart (stacked tensors or zero-copy layer-buffer views).
    `packed`: `pack_x_ahead`'s x, packed on a side stream (the mma kernels then launch no packing of their own).
    `tiled`: the three matrices' codes are stored tile by tile (`tile_codes`; their scales row-major), which the
    mma and FP8 kernels read; the fma ones cannot (ValueError).
    `config.transpose_x` adds one small copy kernel that word-transposes x so kernel 1 reads it with
    unit stride (vector loads) instead of stride-16 gathers: which is faster is for the bench to say.

    x [N, H] bf16/fp16/fp32; expert_ids [N, k] integer; weights [N, k] (fp32); planes as in the module doc.
    `out` [N, H] in x's dtype (written in place, every element) or None. `config` None: `default_config(N)`.
    Runs on CUDA, or on CPU tensors under TRITON_INTERPRET=1."""
    xp = packed.get() if packed is not None else None   # joined first, whatever runs or raises below
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed")
    n, hidden = x.shape
    config = config or default_config(n)
    k = expert_ids.shape[-1]
    inter = w1_codes.shape[1]
    check_layer_planes(hidden, inter, 32, w1_codes, w1_scales, w3_codes, w3_scales, w2_codes, w2_scales)
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
    w1c, w3c, w2c = (c.view(torch.int32) for c in (w1_codes, w3_codes, w2_codes))
    w1s, w3s, w2s = (_u8(s) for s in (w1_scales, w3_scales, w2_scales))
    if _takes_mma(config, hidden, inter, (w1c, w3c, w2c)):
        _decode_mma(x, ids, rw, w1c, w1s, w3c, w3s, w2c, w2s, limit, out, k, config, xp, tiled)
    elif tiled:
        raise ValueError("codes stored tile by tile need the mma kernels (variant 'mma', H and I multiples of 256, "
                         "16-byte aligned codes)")
    else:
        _decode_fma(x, ids, rw, w1c, w1s, w3c, w3s, w2c, w2s, limit, out, k, config)
    return out


def _split_w13(w13_codes: torch.Tensor, w13_scales: torch.Tensor):
    inter = w13_codes.shape[1] // 2
    return w13_codes[:, :inter], w13_scales[:, :inter], w13_codes[:, inter:], w13_scales[:, inter:]


def w2_moe_decode_triton(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                         w13_codes: torch.Tensor, w13_scales: torch.Tensor, w2_codes: torch.Tensor,
                         w2_scales: torch.Tensor, limit: float | None, *, out: torch.Tensor | None = None,
                         config: DecodeConfig | None = None, tiled: bool = False) -> torch.Tensor:
    """The Triton path on stacked planes: w13_codes uint8 [E, 2I, H/4] (w1 rows, then w3 rows),
    w13_scales E8M0 [E, 2I, H/32], w2_codes uint8 [E, H, I/4], w2_scales E8M0 [E, H, I/32]; tiled: the codes
    stored tile by tile (`tile_codes` of each)."""
    w1c, w1s, w3c, w3s = _split_w13(w13_codes, w13_scales)
    return w2_moe_decode_split(x, expert_ids, weights, w1c, w1s, w3c, w3s, w2_codes, w2_scales, limit,
                               out=out, config=config, tiled=tiled)


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
                  config: DecodeConfig | None = None) -> torch.Tensor:
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


def miss_routes(tokens: int, experts: int, k: int, per_expert: int, l2_miss_bytes: int, device: torch.device
                ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], float]:
    """Enough random routings of `tokens` tokens that back-to-back calls on them read more than l2_miss_bytes of
    planes (so each call misses L2, as consecutive layers do), and the mean bytes of distinct experts a call reads
    (per_expert bytes each): what the kernel benches replay."""
    calls = max(2, -(-l2_miss_bytes // (min(experts, tokens * k) * per_expert)))
    routes = [random_routing(tokens, experts, k, device=device, seed=1000 * tokens + c) for c in range(calls)]
    return routes, sum(int(torch.unique(ids).numel()) for ids, _ in routes) * per_expert / calls


def tile_order_fits(hidden: int, intermediate: int) -> bool:
    """Whether an expert's codes can be stored tile by tile for the kernels that read that order: H and I
    multiples of 256 (whole 16-word K tiles, which the mma kernels take)."""
    return hidden % 256 == 0 and intermediate % 256 == 0


def tile_codes(codes: torch.Tensor) -> torch.Tensor:
    """Codes uint8 [E, rows, cols/4] (rows contiguous within an expert, any expert stride) -> a new contiguous
    tensor of the same bytes tile by tile, viewed [E, rows, cols/4] again: each 16-row block's K tiles of 16 words
    (1 KB each) contiguous, the order the decode kernels read with `tiled` (`w2_moe_decode_split`)."""
    e, rows, nb = codes.shape
    return codes.view(e, rows // 16, 16, nb // 64, 64).permute(0, 1, 3, 2, 4).contiguous().view(e, rows, nb)


def untile_codes(codes: torch.Tensor) -> torch.Tensor:
    """`tile_codes`'s inverse: codes stored tile by tile [E, rows, cols/4] -> a new row-major tensor."""
    e, rows, nb = codes.shape
    return codes.reshape(e, rows // 16, nb // 64, 16, 64).permute(0, 1, 3, 2, 4).contiguous().view(e, rows, nb)


def tile_layer_codes(buf: torch.Tensor, hidden: int, intermediate: int) -> None:
    """A plane-store layer buffer's w1, w3 and w2 codes relaid tile by tile in place (`tile_codes`; scales
    untouched): the layer views then go to `w2_moe_decode_split(..., tiled=True)`. Needs the room of one
    matrix's codes for all experts (0.5 GB for V4-Flash)."""
    for codes in layer_views(buf, hidden, intermediate)[::2]:
        codes.copy_(tile_codes(codes))


def gate_up_operands(w1_codes: torch.Tensor, w1_scales: torch.Tensor, w3_codes: torch.Tensor,
                     w3_scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """w1/w3 planes -> (w1 codes int32, w1 scales uint8, w3 codes, w3 scales): the views `_gate_up_mma` takes."""
    return w1_codes.view(torch.int32), _u8(w1_scales), w3_codes.view(torch.int32), _u8(w3_scales)


# ----------------------------------------------------------------------------------------------- sm_90 build
def sass_report(kernel: str, split: int, prefetch: int = 2, selector_fma: bool = False, loads_only: bool = False
                ) -> dict:
    """Build one mma kernel ("gate_up" or "down", V4-Flash constants, bf16 x) for sm_90 on any machine with
    Triton's NVIDIA backend (no GPU needed) and report what the inline asm relies on and what it costs: the
    layout of the asm operands, layout conversions inside the K loop, registers and spill stack, and the SASS
    of the loop body (op counts, instructions per weight; one lane handles 8 weights per HMMA)."""
    if kernel == "gate_up":
        fn, types = _gate_up_mma_kernel, ("*i32", "*i64", "*fp32", "*i32", "*u8", "*i32", "*u8", "*i16",
                                          "i32", "i32", "fp32")
        const = dict(I=2048, HW=256, K=6, TX=1, TH=2, HAS_LIMIT=True, LOADS_ONLY=loads_only)
    else:
        fn, types = _down_mma_kernel, ("*i32", "*i64", "*i32", "*u8", "*bf16", "i32", "i32", "i32")
        const = dict(IW=128, K=6, TH=2)
    const.update(S=split, PREFETCH=prefetch, USE_ASM=True, SELECTOR_FMA=selector_fma, PDL=False)
    sig = dict(zip(fn.arg_names, types))
    compiled = build_sm90(fn, sig, const, [a for a, ty in sig.items() if ty != "fp32"], num_warps=split,
                          num_stages=1)
    ttgir = compiled.asm["ttgir"]
    steps = (16 if kernel == "gate_up" else 48) // split   # K steps of a warp; a loop of <= prefetch unrolls
    loop = ttgir[ttgir.index("scf.for"):ttgir.index("scf.yield")] if "scf.for" in ttgir else ttgir
    ops, registers, spills, looped = loop_sass(compiled.asm["cubin"])
    # weights per lane and loop iteration (unrolled by prefetch), or per whole kernel without a loop
    weights = (2 if kernel == "gate_up" else 1) * 128 * (prefetch if looped else steps)
    return {"kernel": kernel, "split": split, "prefetch": prefetch, "asm_layout": packed_asm_layout(ttgir),
            "loop_converts": loop.count("convert_layout"), "registers": registers, "spills": spills,
            "loop_ops": ops, "weights_per_iter": weights, "instructions_per_weight": sum(ops.values()) / weights}


# ----------------------------------------------------------------------------------------------- bench
SWEEP: tuple[tuple[str, DecodeConfig], ...] = tuple(
    [("fp8 gate-up, mma down d8", DEFAULT_CONFIG),
     ("fp8 gate-up, mma down d16", replace(BATCH1_CONFIG, fp8_gate_up=True))]
    + [(f"mma g{g} d{d} p{p}", DecodeConfig(gate_split=g, down_split=d, prefetch=p, fp8_gate_up=False))
       for g, d, p in ((2, 8, 1), (2, 16, 1), (2, 8, 2), (4, 8, 1), (2, 4, 1))]
    + [("mma g2 d8 p1 selector-fma", replace(MANY_TOKENS_CONFIG, fp8_gate_up=False)),
       ("fma r16 w32 x^T", DecodeConfig(variant="fma"))])


def bench(device: str | torch.device = "cuda", tokens: Sequence[int] = (1, 4, 16), hidden: int = 4096,
          intermediate: int = 2048, experts: int = 256, k: int = 6, limit: float = 10.0,
          dtype: torch.dtype = torch.bfloat16, configs: Sequence[tuple[str, DecodeConfig | None]] = (("default",
                                                                                                       None),),
          copy_gbs: float | None = None, l2_miss_bytes: int = 256 << 20, rep: int = 100) -> list[dict]:
    """Time the V4-Flash-shaped decode call (random planes and routing) for each (name, config) and N in
    `tokens`, as a CUDA graph replay of back-to-back calls on different routings (enough that their planes
    miss L2, as consecutive layers do). GB/s counts each call's distinct experts' plane bytes; % is of the
    device copy bandwidth measured in the same run. Prints one table (and the best config per N), returns
    its rows."""
    from moebox.ops.triton.fp8_linear import copy_bandwidth
    device = torch.device(device)
    if copy_gbs is None:
        copy_gbs = copy_bandwidth(device)
    planes = random_planes(experts, hidden, intermediate, device=device)
    per_expert = expert_bytes(hidden, intermediate)
    print(f"copy bandwidth {copy_gbs:.0f} GB/s (read + written); x {dtype}; H {hidden} I {intermediate} "
          f"E {experts} k {k}\n{'variant':22s} {'N':>3s} {'calls':>5s} {'us':>8s} {'GB/s':>7s} {'% copy':>7s}",
          flush=True)
    rows = []
    for n in tokens:
        routes, nbytes = miss_routes(n, experts, k, per_expert, l2_miss_bytes, device)
        calls = len(routes)
        x = torch.randn((n, hidden), device=device).to(dtype)
        out = torch.empty((n, hidden), device=device, dtype=dtype)
        for name, cfg in configs:
            fns = [lambda ids=ids, w=w: w2_moe_decode_triton(x, ids, w, *planes, limit, out=out, config=cfg)
                   for ids, w in routes]
            ms = graph_us(fns, rep) / 1e3
            row = {"variant": name, "config": cfg or default_config(n), "tokens": n, "calls": calls,
                   "plane_bytes": nbytes, "ms": ms, "GB/s": nbytes / ms / 1e6, "copy_GB/s": copy_gbs}
            rows.append(row)
            print(f"{name:22s} {n:3d} {calls:5d} {ms * 1e3:8.1f} {row['GB/s']:7.0f} {row['GB/s'] / copy_gbs:7.1%}",
                  flush=True)
    if len(configs) > 1:
        for n in tokens:
            best = min((r for r in rows if r["tokens"] == n), key=lambda r: r["ms"])
            print(f"best N={n:<3d} {best['variant']:22s} {best['ms'] * 1e3:7.1f} us "
                  f"{best['GB/s'] / copy_gbs:6.1%}  {best['config']}")
    return rows


def _parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m moebox.ops.triton.w2_moe",
                                description="Time the routed-expert decode call at the V4-Flash shape (CUDA-graph "
                                            "replay). Several --k values give one table each: at one token the "
                                            "gate-up grid grows with k (128 programs of 2 warps an expert), so k = 8 "
                                            "against 6 says whether more warps an SM, still one wave, stream faster.")
    p.add_argument("--sweep", action="store_true", help="time the SWEEP tilings, not only the default")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16], help="tokens a call (default 1 4 16)")
    p.add_argument("--k", type=int, nargs="+", default=[6], help="experts a token (default 6, V4-Flash's)")
    p.add_argument("--sass", action="store_true", help="only build the default kernels for sm_90 and report their "
                                                       "registers and loop instructions (no GPU needed)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse(argv)
    if args.sass:
        print(versions())
        for name, split in (("gate_up", DEFAULT_CONFIG.gate_split), ("down", DEFAULT_CONFIG.down_split)):
            for selector_fma in (False, True):
                print(sass_report(name, split, DEFAULT_CONFIG.prefetch, selector_fma))
        return
    bench_start()
    for k in args.k:
        bench(tokens=args.tokens, k=k, configs=SWEEP if args.sweep else (("default", None),))


if __name__ == "__main__":  # python -m moebox.ops.triton.w2_moe [--sweep] [--tokens ...] [--k ...] [--sass]
    main()
