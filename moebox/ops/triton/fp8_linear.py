"""FP8 e4m3 x 128x128-block-scaled dense linear on the GPU: y = x W^T, a CUDA-core GEMV for decode and a
tensor-core kernel (tl.dot) for prefill.

    y[n, o] = sum_kb  2^(s[o // 128, kb] - 127) * sum_{k in block kb} W8[o, k] * x[n, k]

W8 is the float8_e4m3fn weight [out, in] and s its E8M0 scale bytes [ceil(out/128), ceil(in/128)], as
`moebox.weights.formats.QuantTensor("fp8", ...)` keeps them (`quant_fp8_block` makes them). The weight is never
widened in memory: each program loads FP8 tiles and converts them in registers. `fp8_linear_reference` is the
torch reference (dequantize to fp32, F.linear in fp32, cast back to x's dtype) with the same signature;
`fp8_linear` dispatches (Triton for CUDA tensors when triton imports, the reference elsewhere).

Three kernels; `pick_config` chooses by N, out and in (`Fp8Config.kernel`), and a config can force any: the two
below, and for N <= 16 the tensor-core decode kernel of `moebox.ops.triton.fp8_mma` (kernel "mma", bf16/fp16 x
and in % 128 == 0; other calls given an mma config take the GEMV), which TUNED_DECODE picks at N = 2-8.

GEMV, `_fp8_gemv_kernel` (decode, N <= GEMV_MAX_N by default). A decode call is a stream of the weight's bytes
with N multiply-adds per weight, so what bounds it is DRAM and, as N grows, instruction issue; the tl.dot path
reached only 7-29% of the copy bandwidth there on the H200 (CUDA-graph replay, N = 1). No tensor cores:
  - A program owns BLOCK_N tokens x BLOCK_O output rows and walks its K range in steps of BLOCK_K columns (a
    multiple of 128). A thread holds 16-byte chunks (16 consecutive weights of a row, one 16-byte load) of R
    rows at one K offset: the lanes, then the warps, spread along K first, so a large BLOCK_K is a split-K
    inside one program (the small shapes need no second kernel), and the x values a thread loads serve its R
    rows. Per chunk and token: 16 fp32 FMAs in registers, then one multiply by the chunk's 128-column block
    scale (the E8M0 byte placed in the fp32 exponent, as in the dot path) into a per-(token, row, chunk) fp32
    accumulator; one reduction across lanes and warps at the end. Split-K over the grid (`split_k`, fp32
    partials summed by `_split_sum_kernel`) only when out is too short to give each SM a program.
  - Loads: the tiles are 2-D [rows x chunks, 16] with the chunk index fastest, reshaped for the math. With one
    contiguous dimension Triton gives each thread whole 16-byte chunks and puts the lanes along K (3-D tiles
    left that to its tie-break between dims of equal contiguity, which put the lanes along the rows in some
    versions). The K loop is `tl.range(..., num_stages=NUM_STAGES)`: NUM_STAGES > 1 streams the w and x tiles
    through a shared-memory ring with cp.async (LDGSTS.128 in the sm_90 SASS); the launch's num_stages
    option alone pipelines only loads that feed a tl.dot. Scale bytes are plain loads (1 per 16 weights).
    A register prefetch of the next tile was tried and dropped: Triton carries FP8 loop values one byte per
    register, ~2 PRMT per weight. `early` (a tiling field) loads the first K step's weights before the PDL
    wait: in every GEMV of a decode step it lost (twenty-sixth session), but in the one-token sweep it gains
    on the two small products whose kernel before reads little (wq_a+wkv 4.31 -> 3.56 us, shared w2 4.40 ->
    4.08; thirtieth session), so only their N = 1 picks take it. N, out and the split/scale/output strides
    are not specialized on, so one compile of a tiling serves every shape whose in and row strides are
    multiples of 16, at any N. Other strides get narrower loads and a layout that sums each chunk across
    lanes: correct, slower (odd shapes).
  - Conversion: `.to(tl.float32)` of an e4m3 tile is F2FP.F16.E4M3 (two weights per instruction) + HADD2.F32,
    both exact and no F2F (the slow single conversion the bf16 dot path needs). The e4m3 -> fp16 bit trick
    (sign and magnitude shifted into place, value * 2^-8 exactly, the 2^8 folded into the block scale) would
    trade the half F2FP per weight for ~2 integer ops, so it is not used. x is converted to fp32 in registers
    (bf16, fp16 and fp32 x alike; `split_dtype` and `bf16_as_fp16` do not apply); all math is fp32.
  - Issue budget (sm_90 SASS built on CPU with Triton 3.6, the version on the H200): the N = 1 loop is ~4.1
    instructions per weight (1/2 F2FP, 1 HADD2, 1 FFMA, the rest addresses, cp.async and scales), against
    ~7.8 per weight that 132 SMs x 4 schedulers x 1.98 GHz can issue at 4.25e12 weights/s; each further token
    adds ~1.1-1.5 (1 FFMA, 1/R x conversion, the scale multiply per chunk): ~8.5 per weight at N = 4, ~14 at
    N = 8. So N = 1..3 can stream at the DRAM rate, N = 4 is at the issue limit and larger N is issue-bound;
    beyond GEMV_MAX_N the dot path takes over by default.
  - Masks: rows past out and tokens past N are clamped to the last row (loaded, never stored); full K steps
    load with no mask, the partial last step (in % BLOCK_K != 0) is masked along K; stores are masked, so
    every element of `out` is written exactly once.
  - RMSNorm (NORM, `fp8_linear_triton(..., norm=(weight, eps))`): attention normalises its q latent right
    before the wq_b product, and at batch 1 that norm was a launch of its own (5.2 us in a timeline on the
    H200). With NORM a program multiplies each x chunk by the norm weight as it loads it, sums the chunk's
    squares beside, and scales its dot products by 1 / rms(x) at the end: no pass over x before the weight
    stream (a first version read the row first; in the fifteenth session's timelines the two took 20.6 and
    20.3 us for wq_b, both beside the key branch's product, so neither was measured alone). It needs the
    whole row in one program, so only single-split GEMVs fuse it (`fuses_norm`); the others get rms_norm(x)
    first. The normed x is not rounded to x's dtype before the product as the unfused path rounds it: the
    results differ by that rounding (~2^-9 relative per element in bf16, averaging out in the sums). NORM
    off compiles to the plain kernel.

Dot, `_fp8_linear_kernel` (prefill, N > 16; decode N in (GEMV_MAX_N, 16] by default):
  - The program computes acc[BLOCK_O, BLOCK_N] = W8_tile [BLOCK_O, 128] @ x_tile^T [128, BLOCK_N] with tl.dot,
    so the operand converted in registers (FP8 -> bf16, exact: e4m3 fits bf16) is the A operand, which
    Hopper's wgmma may take from registers, and x (already bf16) the B operand, from shared memory. The
    scale of the 128x128 block is one E8M0 byte per output row and K step, applied ONCE per 128 columns to
    the fp32 partial: acc += dot(W8, x^T) * 2^(s-127) (the byte placed straight in the fp32 exponent field;
    scale bytes 1..254 are exact, 0 flushes to 0, 255 gives inf). The K step is 128 = the scale block: 128
    contiguous bytes per row, 16-byte vector loads, num_stages of them in flight (Triton pipelines the loads
    of a dot operand through shared memory with async copies).
  - Decode tiles (N <= 16): BLOCK_N = 16 (the smallest dot tile; rows past N re-read row N-1 of x), BLOCK_O =
    16 or 32, split-K when the output is too short to give every SM a few programs (grid (1, out/BLOCK_O,
    SPLIT), fp32 partials in a [SPLIT, N, out] scratch, then `_split_sum_kernel` adds them in a fixed order:
    deterministic, no atomics, no zeroing).
  - Prefill (N > 16): BLOCK_N = 64 or 128, BLOCK_O = 128, 8 warps, grid (N-blocks, out-blocks) with the N block
    on axis 0 (fastest varying), so the programs running together share one weight tile and it is read from
    DRAM about once; split-K again only when the grid would not fill the SMs.
  - x fp32: two bf16 terms per x tile (hi = bf16(x), lo = bf16(x - hi)), two dots into the same fp32
    accumulator; W8 is exact in bf16, so the products keep ~16 mantissa bits of x (rel. error ~1e-5), at twice
    the MMA work. x bf16 / fp16: one dot in x's dtype (e4m3 is exact in fp16 too).
  - Masks as in the GEMV with BLOCK_K = 128: clamped rows, unmasked full K blocks (16-byte vector loads that
    the pipeliner turns into async copies when the row strides are multiples of 16), one masked partial block.
  - The FP8 -> bf16 conversion (sm_90 SASS, Triton 3.9): per weight 1/2 F2FP.F16.E4M3, 1 F2F.BF16.F16 (one at
    a time, on the narrow conversion pipe, ~16/clk/SM) and 1/2 PRMT; loads are LDGSTS.128, the MMA is
    HMMA.16816 (decode tiles) or HGMMA (prefill, 128x128). `Fp8Config(bf16_as_fp16=True)` dots in fp16 instead
    (e4m3 -> f16 is 1/2 F2FP per weight; x converted per tile, |x| > 65504 becomes inf, so only for normed
    activations).
  - Triton's CPU interpreter computes bf16 dots wrongly (seen with triton 3.9), so under TRITON_INTERPRET=1 the
    fp32-x path uses fp16 terms (`Fp8Config.split_dtype`); fp16 x runs the GPU's single-dot path unchanged.

Picking (`pick_config`): a decode call takes its weight shape's entry in TUNED_DECODE (filled from the sweep's
output on the H200: it prints the lines to paste; the keys are the stacked products the model calls,
`V4_FLASH_DECODE_SHAPES`) if there is one, else the GEMV heuristic (`_gemv_config`:
rows per program so that out / BLOCK_O gives ~3 programs per SM, BLOCK_K so that a step is 64 bytes per
thread, 3 stages when there are several steps) for N <= GEMV_MAX_N and the dot decode tiles above that.

Grouped, `fp8_grouped_linear(x [N, g, in], w [g*R, in], g) -> [N, g, R]` (DeepSeek-V4's grouped output
projection wo_a: group i times weight rows [i*R, (i+1)*R)). One launch of the same kernels instead of one call
per group: the g groups' row blocks lie side by side on the grid's row axis and each program offsets its x and
y rows by its group's strides (weight and scale rows are the global ones; R % 128 == 0 and BLOCK_O divides R,
so no program or scale block straddles two groups). At V4-Flash size (g = 8, R = 1024, in = 4096) the 8 calls
of a layer were each 4 MB, latency-bound like wq_a below, 344 launches per decode step over 43 layers; one
call is a 33.5 MB stream like wo_b's. The tiling is the one picked for a [g*R, in] weight.

Bytes and the bandwidth to approach. A decode call reads out*in bytes of FP8 plus out*in/16384 bytes of
scales (0.006%), plus x and y (N*(in+out)*2 bytes, negligible), so it should approach the device copy
bandwidth (~4.25 TB/s on the H200, read+written bytes of a device copy, KINDS.md). The V4-Flash dense shapes
(out x in), their FP8 bytes and the time at 4.25 TB/s:
    wq_a          1024 x 4096    4.19 MB    0.99 us
    wq_b         32768 x 1024   33.55 MB    7.89 us
    wkv            512 x 4096    2.10 MB    0.49 us
    wo_b          4096 x 8192   33.55 MB    7.89 us
    shared w1/w3  2048 x 4096    8.39 MB    1.97 us each
    shared w2     4096 x 2048    8.39 MB    1.97 us
    e_proj/h_proj 4096 x 4096   16.78 MB    3.95 us   (MTP)
    wo_a       8 x 1024 x 4096  33.55 MB    7.89 us   (8 groups, fp8_grouped_linear)
The big ones (wq_b, wo_b, e/h_proj) can get near the bandwidth; wkv and wq_a are ~0.5-1 us of bytes, below a
kernel's ramp-up and tail (a few us standalone, ~1-2 us inside a CUDA graph), so they are latency-bound: one
kernel whose programs all fit on the GPU at once and load their whole K range in one or two steps is the most
a kernel can do; fewer launches (wq_a and wkv concatenated, since they read the same x) is the next fix.
Prefill (N = 2048) is compute-bound: 2*N*out*in FLOP against the bf16 tensor-core rate (~790 TFLOP/s measured
on random data here).

`bench` (`python -m moebox.ops.triton.fp8_linear`) times the default picks on these shapes at N = 1, 4, 16
(GB/s of weight bytes vs the measured copy bandwidth, cold L2, and replayed from a CUDA graph that cycles over
enough weight copies to miss L2, as consecutive layers do) and N = 2048 (TFLOP/s), next to cuBLAS bf16
F.linear on the dense bf16 weight. `sweep` (`--sweep`) times GEMV variants against the dot path at N = 1, 4,
16 in that graph replay and prints one table, the best variant per (shape, N) and TUNED_DECODE lines;
`--sweep-prefill` times prefill tilings; `--grouped` (also run after the plain bench) times the grouped wo_a
call against the loop of one call per group, at N = 1, 4, 16 in the same graph replay.

CUDA graphs: a call (grouped or not) allocates only `out` (when None) and the split-K scratch with torch.empty
(graph-safe with the caching allocator) and launches 1 kernel (2 with split-K); no host sync, no data-dependent
shapes.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, replace
from typing import Sequence

import torch
import torch.nn.functional as F

from moebox.ops.norm import Norm, rms_norm
from moebox.weights.formats import QuantTensor

from moebox.ops.triton.fp8_mma import launch_mma, mma_takes
from moebox.ops.triton.runtime import (HAVE_TRITON, bench_start, default_hold, each_copy, graph_us,  # noqa: F401
                                       interpreting, next_pow2, num_sms, pdl_args, pdl_start, tl, triton)

BLOCK = 128  # the FP8 scale block, both dimensions; also the dot kernel's K step

# (name, out, in): the V4-Flash dense weights a decode step reads through this kernel
V4_FLASH_SHAPES: tuple[tuple[str, int, int], ...] = (
    ("wq_a", 1024, 4096), ("wq_b", 32768, 1024), ("wkv", 512, 4096), ("wo_b", 4096, 8192),
    ("shared_w1", 2048, 4096), ("shared_w2", 4096, 2048), ("e_proj", 4096, 4096))
# (name, groups, rows per group, in): the grouped output projection (fp8_grouped_linear)
V4_FLASH_GROUPED: tuple[str, int, int, int] = ("wo_a", 8, 1024, 4096)
# (name, out, in): the products a V4-Flash decode step calls, weights stacked as the model stacks them
# (SharedInputLinear: wq_a + wkv, wq_b + the indexer's wq_b in CSA layers, the shared w1 + w3; wo_a as [g*R, in]),
# which are the TUNED_DECODE keys the sweep fills
V4_FLASH_DECODE_SHAPES: tuple[tuple[str, int, int], ...] = (
    ("wq_a+wkv", 1536, 4096), ("wq_b", 32768, 1024), ("wq_b+idx_wq_b", 40960, 1024), ("wo_a", 8192, 4096),
    ("wo_b", 4096, 8192), ("shared_w1+w3", 4096, 4096), ("shared_w2", 4096, 2048))


@dataclass(frozen=True)
class Fp8Config:
    """Tiling. kernel "dot": BLOCK_N tokens x BLOCK_O output rows per program with tl.dot, K step 128,
    num_stages the pipeliner's depth. kernel "gemv": BLOCK_N tokens x BLOCK_O rows per program on the CUDA
    cores, K step block_k (a multiple of 128), num_stages its cp.async ring depth (1 = plain loads).
    kernel "mma" (`moebox.ops.triton.fp8_mma`, N <= 16): BLOCK_O rows per program (16-row mma tiles, a divisor
    of 128) over num_warps warps, all tokens, K step 128; num_stages 2 loads the next step's weights before
    this step's math, 1 does not.
    split_k: programs sharing the K range of a tile (0 = pick from the grid size). Dot path only:
    split_dtype, the dot dtype of fp32 x's two terms; bf16_as_fp16, convert bf16 x to fp16 and dot in fp16.
    GEMV only: early, the first K step's weights and scales loaded before the PDL wait (see the module doc)."""

    block_n: int = 16
    block_o: int = 32
    split_k: int = 0
    num_warps: int = 4
    num_stages: int = 4
    split_dtype: str = "bf16"
    bf16_as_fp16: bool = False
    kernel: str = "dot"
    block_k: int = BLOCK
    early: bool = False

    @property
    def label(self) -> str:
        """Short name for tables: kernel, tokens x rows (x K step) per program, warps, stages, split."""
        if self.kernel == "mma":
            return f"mma {self.block_o} w{self.num_warps} s{self.num_stages} split{self.split_k or 'A'}"
        k = f"x{self.block_k}" if self.kernel == "gemv" else ""
        fp16 = " fp16" if self.bf16_as_fp16 else ""
        early = " early" if self.early else ""
        return (f"{self.kernel} {self.block_n}x{self.block_o}{k} w{self.num_warps} s{self.num_stages} "
                f"split{self.split_k or 'A'}{fp16}{early}")


# Decode calls (shapes without a TUNED_DECODE entry) with N <= GEMV_MAX_N take the GEMV, larger decode N the dot
# path: a guess until the sweep runs.
GEMV_MAX_N = 8

# The sweep's best decode configs on the H200, {(out, in): ((max N, config), ...)} with max N ascending: a
# decode call takes the entry with max N / 2 < N <= max N (the sweep timed each at max N: a GEMV's work grows with
# its tokens per program, a dot's does not shrink with N). split_k 0 = automatic.
# `--sweep` prints these lines.
# From `python3 -m moebox.ops.triton.fp8_linear --sweep`, 2026-11-30 (twelfth session; the N = 2 entries from the
# thirteenth's `--sweep --tokens 2`, up to 1.3x the GEMV heuristic's pick; the mma entries from the fourteenth's
# `--sweep --kernels mma`, up to 1.5x the dot at N = 8: docs/benchmarks.md). The mma kernel wins at N = 2-8 on
# most products, the dot path in fp16 at N = 16 (1.6-1.8x the bf16 dot): both convert bf16 x to fp16 in the
# kernel, so these products assume |x| < 65504 (normed or clamped activations, attention and its latents).
# The N = 1 entries of wq_a+wkv and shared w2 (early loads) are the thirtieth session's `--sweep --tokens 1`.
TUNED_DECODE: dict[tuple[int, int], tuple[tuple[int, Fp8Config], ...]] = {
    (1536, 4096): (  # wq_a+wkv
        (1, Fp8Config(block_n=1, block_o=4, split_k=1, num_stages=3, kernel='gemv', block_k=2048, early=True)),
        (2, Fp8Config(block_n=2, block_o=2, num_stages=1, kernel='gemv', block_k=4096)),
        (4, Fp8Config(bf16_as_fp16=True)),
        (8, Fp8Config(bf16_as_fp16=True)),
        (16, Fp8Config(bf16_as_fp16=True)),
    ),
    (32768, 1024): (  # wq_b
        (1, Fp8Config(block_n=1, block_o=16, num_stages=1, kernel='gemv', block_k=512)),
        (2, Fp8Config(block_o=64, num_stages=2, kernel='mma')),
        (4, Fp8Config(block_o=64, num_stages=2, kernel='mma')),
        (8, Fp8Config(block_o=64, num_stages=2, kernel='mma')),
        (16, Fp8Config(bf16_as_fp16=True)),
    ),
    (40960, 1024): (  # wq_b+idx_wq_b
        (1, Fp8Config(block_n=1, block_o=16, num_stages=1, kernel='gemv', block_k=512)),
        (2, Fp8Config(block_o=128, num_warps=8, num_stages=2, kernel='mma')),
        (4, Fp8Config(block_o=128, num_warps=8, num_stages=2, kernel='mma')),
        (8, Fp8Config(block_o=128, num_warps=2, num_stages=2, kernel='mma')),
        (16, Fp8Config(block_o=64, bf16_as_fp16=True)),
    ),
    (8192, 4096): (  # wo_a
        (1, Fp8Config(block_n=1, block_o=16, kernel='gemv', block_k=512)),
        (2, Fp8Config(block_n=2, block_o=16, num_stages=3, kernel='gemv', block_k=1024)),
        (4, Fp8Config(block_o=128, num_warps=8, num_stages=2, kernel='mma')),
        (8, Fp8Config(block_o=128, num_warps=8, num_stages=2, kernel='mma')),
        (16, Fp8Config(bf16_as_fp16=True)),
    ),
    (4096, 8192): (  # wo_b
        (1, Fp8Config(block_n=1, block_o=8, num_stages=3, kernel='gemv', block_k=1024)),
        (2, Fp8Config(block_n=2, block_o=16, num_stages=3, kernel='gemv', block_k=512)),
        (4, Fp8Config(block_o=128, num_warps=8, num_stages=2, kernel='mma')),
        (8, Fp8Config(block_o=64, split_k=10, num_stages=2, kernel='mma')),
        (16, Fp8Config(bf16_as_fp16=True)),
    ),
    (4096, 4096): (  # shared_w1+w3
        (1, Fp8Config(block_n=1, block_o=8, num_stages=3, kernel='gemv', block_k=1024)),
        (2, Fp8Config(block_n=2, block_o=16, num_stages=3, kernel='gemv', block_k=512)),
        (4, Fp8Config(block_o=64, split_k=10, num_stages=2, kernel='mma')),
        (8, Fp8Config(block_o=64, split_k=10, num_stages=2, kernel='mma')),
        (16, Fp8Config(bf16_as_fp16=True)),
    ),
    (4096, 2048): (  # shared_w2
        (1, Fp8Config(block_n=1, block_o=8, split_k=1, num_stages=3, kernel='gemv', block_k=1024, early=True)),
        (2, Fp8Config(block_n=2, block_o=16, num_stages=3, kernel='gemv', block_k=512)),
        (4, Fp8Config(block_o=64, split_k=8, num_stages=2, kernel='mma')),
        (8, Fp8Config(block_o=128, num_warps=8, num_stages=2, kernel='mma')),
        (16, Fp8Config(bf16_as_fp16=True)),
    ),
}


def _pow2_floor(v: int) -> int:
    return 1 << (max(1, v).bit_length() - 1)


def pick_config(n: int, out_features: int, in_features: int, x_dtype: torch.dtype = torch.bfloat16,
                sms: int = 132) -> Fp8Config:
    """The default tiling for a call (split_k resolved): for decode (N <= 16) the TUNED_DECODE entry of the
    weight shape for N (max N / 2 < N <= max N), else the GEMV for N <= GEMV_MAX_N and the dot decode tiles
    above; GEMM tiles for N > 16."""
    if n <= 16:
        tuned = next((c for max_n, c in TUNED_DECODE.get((out_features, in_features), ()) if max_n // 2 < n <= max_n),
                     None)
        if tuned is not None:
            cfg = tuned
        elif n <= GEMV_MAX_N:
            cfg = _gemv_config(n, out_features, in_features, sms)
        else:
            cfg = Fp8Config(block_n=16, block_o=32 if out_features >= 2048 else 16, num_warps=4, num_stages=4)
    else:
        block_n = 64 if (n <= 64 or x_dtype == torch.float32) else 128
        cfg = Fp8Config(block_n=block_n, block_o=128, num_warps=8 if block_n == 128 else 4, num_stages=3)
    return resolve_split(cfg, n, out_features, in_features, sms)


def _gemv_config(n: int, out_features: int, in_features: int, sms: int, weight_bytes: int = 1) -> Fp8Config:
    """The GEMV heuristic: up to 4 tokens per program (x and the accumulators take registers per token),
    rows per program (1..16) leaving ~3 programs per SM per token block, a K step of 64 bytes per thread
    (4 warps: BLOCK_O x BLOCK_K = 8 KB of FP8, or of `weight_bytes`-byte floats, at most the padded row),
    3 stages when there are several steps."""
    block_o = min(16, _pow2_floor(out_features // (3 * sms)))
    block_k = max(BLOCK, min(8192 // (block_o * weight_bytes), next_pow2(in_features)))
    stages = 3 if in_features > block_k else 1
    return Fp8Config(block_n=min(4, next_pow2(n)), block_o=block_o, num_warps=4, num_stages=stages,
                     kernel="gemv", block_k=block_k)


def resolve_split(cfg: Fp8Config, n: int, out_features: int, in_features: int, sms: int = 132) -> Fp8Config:
    """cfg with split_k 0 replaced by the automatic split for its tiles. Dot: enough programs for a few per SM
    (decode, N <= 16: 4 per SM, each at least 4 K steps long) or one wave (prefill: at least 8 K steps each).
    GEMV: none unless the grid has fewer programs than SMs, then up to 2 per SM."""
    if cfg.split_k:
        return cfg
    tiles = -(-n // cfg.block_n) * -(-out_features // cfg.block_o)
    if cfg.kernel == "gemv":
        steps = -(-in_features // cfg.block_k)
        split = 1 if tiles >= sms else min(steps, -(-2 * sms // tiles))
        return replace(cfg, split_k=_even_split(steps, split))
    if cfg.kernel == "mma":   # all tokens in one program; splits of >= 2 K blocks up to ~2 programs an SM
        tiles = -(-out_features // cfg.block_o)
        steps = -(-in_features // BLOCK)
        split = 1 if tiles >= 2 * sms else min(max(1, steps // 2), -(-2 * sms // tiles))
        return replace(cfg, split_k=_even_split(steps, split))
    kb = -(-in_features // BLOCK)
    target, min_steps = (4 * sms, 4) if n <= 16 else (sms, 8)
    split = max(1, min(-(-target // tiles), kb // min_steps))
    return replace(cfg, split_k=_even_split(kb, split))


def _even_split(steps: int, split: int) -> int:
    """The split count that gives every split the same number of K steps (the last may be shorter)."""
    split = max(1, min(split, steps))
    return -(-steps // -(-steps // split))


def _check_config(cfg: Fp8Config) -> None:
    if cfg.kernel not in ("dot", "gemv", "mma"):
        raise ValueError(f"Fp8Config.kernel must be 'dot', 'gemv' or 'mma', got {cfg.kernel!r}")
    if cfg.kernel == "mma" and (cfg.block_o % (16 * cfg.num_warps) or BLOCK % cfg.block_o
                                or cfg.num_stages not in (1, 2)):
        raise ValueError(f"an mma config takes 16-row tiles per warp in a divisor of {BLOCK} rows and 1 or 2 "
                         f"stages: {cfg}")
    pow2 = all(v > 0 and v & (v - 1) == 0 for v in (cfg.block_n, cfg.block_o, cfg.block_k))
    if not pow2 or cfg.block_k < BLOCK:
        raise ValueError(f"block sizes must be powers of 2 and block_k >= {BLOCK}: {cfg}")
    if cfg.kernel == "dot" and cfg.block_k != BLOCK:
        raise ValueError(f"the dot kernel's K step is {BLOCK}: {cfg}")
    if cfg.early and cfg.kernel != "gemv":
        raise ValueError(f"early loads are the GEMV's: {cfg}")


# ----------------------------------------------------------------------------------------------- kernels
if HAVE_TRITON:
    @triton.jit
    def _scaled_block_dot(w, xt, sb, X_TERMS: tl.constexpr, DOT_DTYPE: tl.constexpr):
        """FP8 tile w [BO, 128] x x^T tile [128, BN] -> fp32 [BO, BN], times each row's block scale 2^(sb-127)."""
        wd = w.to(DOT_DTYPE)
        if X_TERMS == 1:
            part = tl.dot(wd, xt.to(DOT_DTYPE))
        else:  # fp32 x as hi + lo in DOT_DTYPE; the weight is exact in it
            hi = xt.to(DOT_DTYPE)
            lo = (xt - hi.to(tl.float32)).to(DOT_DTYPE)
            part = tl.dot(wd, lo, tl.dot(wd, hi))
        scale = (sb.to(tl.int32) << 23).to(tl.float32, bitcast=True)   # the E8M0 byte as the fp32 exponent
        return part * scale[:, None]

    @triton.jit
    def _fp8_linear_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, OUT, ROWS, IN, KB_PER_SPLIT,
                           stride_xn, stride_xg, stride_wo, stride_so, stride_yn, stride_yg, stride_ys,
                           BLOCK_N: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr,
                           X_TERMS: tl.constexpr, DOT_DTYPE: tl.constexpr, PDL: tl.constexpr):
        pdl_start(PDL)
        pid_n = tl.program_id(0)
        pid_o = tl.program_id(1)
        pid_k = tl.program_id(2)
        # Output rows in groups of ROWS (fp8_grouped_linear; one group: ROWS = OUT): BLOCK_O divides ROWS, so a
        # program's rows are in one group, whose x and y rows start at the group strides. y_ptr is moved back by
        # the group's first row, so the global row index offs_o addresses the group's columns.
        group = (pid_o * BLOCK_O) // ROWS
        x_ptr += group.to(tl.int64) * stride_xg
        y_ptr += group.to(tl.int64) * stride_yg - group * ROWS
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_o = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
        offs_k = tl.arange(0, BLOCK_K)
        # Rows past N / OUT are clamped to the last row instead of masked (their results are never stored), so
        # the full K blocks load with no mask at all: vector loads the pipeliner can issue as async copies.
        # Only the last, partial K block (IN % 128 != 0) is masked along K.
        rows_o = tl.minimum(offs_o, OUT - 1)
        rows_n = tl.minimum(offs_n, N - 1)
        w_rows = w_ptr + rows_o.to(tl.int64)[:, None] * stride_wo      # [BO, 1]
        x_cols = x_ptr + rows_n.to(tl.int64)[None, :] * stride_xn      # [1, BN]: the x^T tile is [BK, BN]
        s_rows = s_ptr + (rows_o // BLOCK_K) * stride_so               # [BO]: the scale row of each output row
        kb0 = pid_k * KB_PER_SPLIT
        kb1 = tl.minimum(kb0 + KB_PER_SPLIT, tl.cdiv(IN, BLOCK_K))
        kb_full = tl.minimum(kb1, IN // BLOCK_K)
        acc = tl.zeros((BLOCK_O, BLOCK_N), dtype=tl.float32)
        for kb in range(kb0, kb_full):
            k = kb * BLOCK_K + offs_k
            w = tl.load(w_rows + k[None, :])
            xt = tl.load(x_cols + k[:, None])
            sb = tl.load(s_rows + kb)
            acc += _scaled_block_dot(w, xt, sb, X_TERMS, DOT_DTYPE)
        if kb_full < kb1:  # the partial last K block is in this split
            k = kb_full * BLOCK_K + offs_k
            mask_k = k < IN
            w = tl.load(w_rows + k[None, :], mask=mask_k[None, :], other=0.0)
            xt = tl.load(x_cols + k[:, None], mask=mask_k[:, None], other=0.0)
            sb = tl.load(s_rows + kb_full)
            acc += _scaled_block_dot(w, xt, sb, X_TERMS, DOT_DTYPE)
        y = y_ptr + pid_k.to(tl.int64) * stride_ys + offs_n.to(tl.int64)[None, :] * stride_yn + offs_o[:, None]
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=(offs_o < OUT)[:, None] & (offs_n < N)[None, :])

    @triton.jit
    def _gemv_step(x, w, sb, BLOCK_N: tl.constexpr, BLOCK_O: tl.constexpr, KC: tl.constexpr, SCALED: tl.constexpr):
        """One K step on the CUDA cores. x [BN*KC, 16] and w [BO*KC, 16] (FP8, or float when not SCALED) are
        rows of 16-column chunks, chunk c of token/row i at i*KC + c; sb [BO*KC] the scale byte of each w chunk.
        Returns the fp32 [BN, BO, KC] partial sums of the chunks (16 products each, summed in a thread), times
        their scales."""
        w4 = tl.reshape(w, (1, BLOCK_O, KC, 16)).to(tl.float32)   # e4m3 -> f16 (2 per cvt) -> f32, exact
        x4 = tl.reshape(x, (BLOCK_N, 1, KC, 16)).to(tl.float32)
        part = tl.sum(w4 * x4, axis=3)
        if SCALED:
            part = part * (tl.reshape(sb, (1, BLOCK_O, KC)).to(tl.int32) << 23).to(tl.float32, bitcast=True)
        return part

    @triton.jit
    def _masked_weights(w_ptrs, s_ptrs, w_cols, vec, k0, lim, SCALED: tl.constexpr):
        """The GEMV's weight tile and scale bytes of the K step at k0, columns past lim read as 0."""
        w = tl.load(w_ptrs + k0, mask=(k0 + w_cols)[:, None] + vec[None, :] < lim, other=0.0)
        sb = tl.load(s_ptrs + k0 // 128, mask=k0 + w_cols < lim, other=0) if SCALED else 0
        return w, sb

    @triton.jit
    def _masked_x(x_ptrs, nw_ptrs, x_cols, vec, k0, lim, ss, NORM: tl.constexpr):
        """The GEMV's x chunks of the K step at k0, columns past lim read as 0; with NORM times the norm weight,
        their squares added to ss."""
        mask = (k0 + x_cols)[:, None] + vec[None, :] < lim
        x = tl.load(x_ptrs + k0, mask=mask, other=0.0)
        if NORM:
            x = x.to(tl.float32)
            ss += x * x
            x = x * tl.load(nw_ptrs + k0, mask=mask, other=0.0).to(tl.float32)
        return x, ss

    # N, OUT, ROWS and the split/scale/output strides are not specialized on (== 1, % 16), so one compile serves
    # all shapes and N alike; IN and the x / w row and x group strides are (% 16: the 16-byte vector loads and
    # the tail mask).
    @triton.jit(do_not_specialize=["N", "OUT", "ROWS", "STEPS_PER_SPLIT", "stride_so", "stride_yn", "stride_yg",
                                   "stride_ys"])
    def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, nw_ptr, N, OUT, ROWS, IN, STEPS_PER_SPLIT,
                         stride_xn, stride_xg, stride_wo, stride_so, stride_yn, stride_yg, stride_ys, eps,
                         BLOCK_N: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr,
                         NUM_STAGES: tl.constexpr, SCALED: tl.constexpr, NORM: tl.constexpr, EARLY: tl.constexpr,
                         PDL: tl.constexpr):
        """y [N, OUT] (or a split's fp32 partials) = x @ dequant(w)^T on the CUDA cores. EARLY: the first K
        step's weight tile and scales are loaded before the PDL wait (their DRAM round trip overlaps the kernel
        before), the step itself is done after it."""
        KC: tl.constexpr = BLOCK_K // 16   # 16-column chunks per row and K step (16 bytes of FP8)
        pid_n = tl.program_id(0)
        pid_o = tl.program_id(1)
        pid_k = tl.program_id(2)
        group = (pid_o * BLOCK_O) // ROWS   # the program's group of output rows, as in _fp8_linear_kernel
        x_ptr += group.to(tl.int64) * stride_xg
        y_ptr += group.to(tl.int64) * stride_yg - group * ROWS
        vec = tl.arange(0, 16)
        # [rows x chunks, 16] tiles, chunk fastest (see the module doc); rows past OUT / N are clamped
        r = tl.arange(0, BLOCK_O * KC)
        w_rows = tl.minimum(pid_o * BLOCK_O + r // KC, OUT - 1)
        w_cols = (r % KC) * 16
        w_ptrs = w_ptr + (w_rows.to(tl.int64) * stride_wo + w_cols)[:, None] + vec[None, :]
        s_ptrs = s_ptr + (w_rows // 128) * stride_so + w_cols // 128   # + k0 // 128 (k0 is a multiple of 128)
        xr = tl.arange(0, BLOCK_N * KC)
        x_rows = tl.minimum(pid_n * BLOCK_N + xr // KC, N - 1)
        x_cols = (xr % KC) * 16
        x_ptrs = x_ptr + (x_rows.to(tl.int64) * stride_xn + x_cols)[:, None] + vec[None, :]
        # the RMSNorm (NORM): x * weight in the loop, its sum of squares beside, 1 / rms applied at the end
        nw_ptrs = nw_ptr + x_cols[:, None] + vec[None, :]
        ss = tl.zeros((BLOCK_N * KC, 16), dtype=tl.float32)
        step0 = pid_k * STEPS_PER_SPLIT
        step1 = tl.minimum(step0 + STEPS_PER_SPLIT, tl.cdiv(IN, BLOCK_K))
        full = tl.minimum(step1, IN // BLOCK_K)
        if EARLY:   # the first step (full or the partial last one; none if the split is empty): its weights
            lim = tl.where(step0 < step1, IN, 0)
            w_first, sb_first = _masked_weights(w_ptrs, s_ptrs, w_cols, vec, step0 * BLOCK_K, lim, SCALED)
        pdl_start(PDL)
        acc = tl.zeros((BLOCK_N, BLOCK_O, KC), dtype=tl.float32)
        first = step0
        if EARLY:
            x, ss = _masked_x(x_ptrs, nw_ptrs, x_cols, vec, step0 * BLOCK_K, lim, ss, NORM)
            acc += _gemv_step(x, w_first, sb_first, BLOCK_N, BLOCK_O, KC, SCALED)
            first = step0 + 1
        for step in tl.range(first, full, num_stages=NUM_STAGES):  # full steps: no masks
            k0 = step * BLOCK_K
            x = tl.load(x_ptrs + k0)
            if NORM:
                x = x.to(tl.float32)
                ss += x * x
                x = x * tl.load(nw_ptrs + k0).to(tl.float32)
            w = tl.load(w_ptrs + k0)
            sb = tl.load(s_ptrs + k0 // 128) if SCALED else 0
            acc += _gemv_step(x, w, sb, BLOCK_N, BLOCK_O, KC, SCALED)
        if (full < step1) & (full >= first):  # the partial last step is in this split (and not done above)
            x, ss = _masked_x(x_ptrs, nw_ptrs, x_cols, vec, full * BLOCK_K, IN, ss, NORM)
            w, sb = _masked_weights(w_ptrs, s_ptrs, w_cols, vec, full * BLOCK_K, IN, SCALED)
            acc += _gemv_step(x, w, sb, BLOCK_N, BLOCK_O, KC, SCALED)
        y = tl.sum(acc, axis=2)   # [BN, BO]: across the lanes and warps, once
        if NORM:   # the whole row was this program's (one split): its mean square is complete
            y = y * (1.0 / tl.sqrt(tl.sum(tl.reshape(ss, (BLOCK_N, KC * 16)), axis=1) / IN + eps))[:, None]
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_o = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
        y_ptrs = y_ptr + pid_k.to(tl.int64) * stride_ys + offs_n.to(tl.int64)[:, None] * stride_yn + offs_o[None, :]
        tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=(offs_n < N)[:, None] & (offs_o < OUT)[None, :])

    @triton.jit
    def _split_sum_kernel(ws_ptr, y_ptr, OUT, ROWS, stride_ws, stride_yn, stride_yg, SPLIT: tl.constexpr,
                          BLOCK: tl.constexpr, PDL: tl.constexpr):
        """y[n, :] = sum over the SPLIT fp32 partials ws[s, n, :], in order, cast to y's dtype; y's columns in
        groups of ROWS (BLOCK divides ROWS, or ROWS = OUT) at y + group * stride_yg."""
        pdl_start(PDL)
        n = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        group = (tl.program_id(1) * BLOCK) // ROWS
        m = offs < OUT
        row = n.to(tl.int64) * OUT + offs
        acc = tl.load(ws_ptr + row, mask=m, other=0.0)
        for s in tl.static_range(1, SPLIT):
            acc += tl.load(ws_ptr + s * stride_ws + row, mask=m, other=0.0)
        y = y_ptr + n.to(tl.int64) * stride_yn + group.to(tl.int64) * stride_yg + (offs - group * ROWS)
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m)

    _DOT_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
    _SPLIT_DTYPES = {"bf16": tl.bfloat16, "fp16": tl.float16}


# ---------------------------------------------------------------------------------------------- wrappers
def _check_weight(w: QuantTensor) -> tuple[int, int]:
    if not isinstance(w, QuantTensor) or w.kind != "fp8":
        raise TypeError("w must be a QuantTensor of kind 'fp8'")
    if tuple(w.block) != (BLOCK, BLOCK):
        raise ValueError(f"only {BLOCK}x{BLOCK} scale blocks are supported, got {w.block}")
    out_f, in_f = w.data.shape
    want = (-(-out_f // BLOCK), -(-in_f // BLOCK))
    if tuple(w.scale.shape) != want:
        raise ValueError(f"scale must be {want}, got {tuple(w.scale.shape)}")
    return out_f, in_f


def _check(x: torch.Tensor, w: QuantTensor) -> tuple[int, int, int]:
    out_f, in_f = _check_weight(w)
    if x.dim() != 2:
        raise ValueError(f"x must be [N, in], got {tuple(x.shape)}")
    if x.shape[1] != in_f:
        raise ValueError(f"x has {x.shape[1]} features, the weight {in_f}")
    return x.shape[0], out_f, in_f


def _check_grouped(x: torch.Tensor, w: QuantTensor, groups: int) -> tuple[int, int, int]:
    """(N, rows per group, in) of a grouped call, or the error that names the shapes."""
    out_f, in_f = _check_weight(w)
    if x.dim() != 3:
        raise ValueError(f"x must be [N, groups, in], got {tuple(x.shape)}")
    if groups < 1 or x.shape[1] != groups:
        raise ValueError(f"x {tuple(x.shape)} must have {groups} groups (dim 1), and groups must be >= 1")
    if x.shape[2] != in_f:
        raise ValueError(f"x {tuple(x.shape)} has {x.shape[2]} features per group, the weight {tuple(w.data.shape)} "
                         f"{in_f}")
    rows = out_f // groups
    if out_f % groups or rows % BLOCK:
        raise ValueError(f"each group's rows must be a multiple of {BLOCK} (whole scale blocks): the weight "
                         f"{tuple(w.data.shape)} in {groups} groups (x {tuple(x.shape)}) gives {out_f / groups:g}")
    return x.shape[0], rows, in_f


def _out(x: torch.Tensor, out: torch.Tensor | None, n: int, out_f: int) -> torch.Tensor:
    if out is None:
        return torch.empty((n, out_f), dtype=x.dtype, device=x.device)
    if tuple(out.shape) != (n, out_f) or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"out must be [{n}, {out_f}] {x.dtype} on {x.device}, got {tuple(out.shape)} {out.dtype}")
    if n and out_f > 1 and out.stride(1) != 1:
        raise ValueError("out must have contiguous rows")
    return out


def _kernel_weight(w: QuantTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w's FP8 data with contiguous rows and its scale bytes as uint8 with contiguous rows."""
    data = w.data if w.data.stride(1) == 1 else w.data.contiguous()
    scale = w.scale if w.scale.dtype == torch.uint8 else w.scale.view(torch.uint8)
    if scale.stride(-1) != 1:
        scale = scale.contiguous()
    return data, scale


def fp8_linear_triton(x: torch.Tensor, w: QuantTensor, out: torch.Tensor | None = None,
                      config: Fp8Config | None = None, norm: Norm | None = None) -> torch.Tensor:
    """The Triton path. x [N, in] bf16/fp16/fp32 (any row stride), w QuantTensor fp8 (data [out, in] e4m3 with
    contiguous rows, scale E8M0 [ceil(out/128), ceil(in/128)]); returns (or fills, every element) `out`
    [N, out] in x's dtype. `config` overrides the kernel and tiling (split_k 0 = automatic). `norm` = (weight
    [in], eps): the product of rms_norm(x, weight, eps) instead, fused into the GEMV where `fuses_norm`. Runs on
    CUDA, or on CPU tensors under TRITON_INTERPRET=1."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed")
    n, out_f, in_f = _check(x, w)
    _check_dtype(x)
    _check_norm(norm, in_f)
    out = _out(x, out, n, out_f)
    if x.stride(1) != 1:
        x = x.contiguous()
    return _run(x, w, out, n, out_f, out_f, in_f, (x.stride(0), 0), (out.stride(0), 0), config, norm)


def _check_norm(norm: Norm | None, in_f: int) -> None:
    if norm is not None and tuple(norm[0].shape) != (in_f,):
        raise ValueError(f"the norm weight must be [{in_f}], got {tuple(norm[0].shape)}")


def fuses_norm(cfg: Fp8Config, scale: torch.Tensor | None, in_f: int) -> bool:
    """Whether a call with `norm` runs the RMSNorm inside the kernel (else rms_norm runs first, a launch of its
    own): only the FP8 GEMV without split-K, whose programs see each token's whole row, so they can sum its
    squares as they stream it and scale their sums by 1 / rms at the end; the mma and dot kernels feed x to the
    tensor cores as it is in memory."""
    return cfg.kernel == "gemv" and scale is not None and _even_split(-(-in_f // cfg.block_k), cfg.split_k) == 1


def _check_dtype(x: torch.Tensor) -> None:
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be bf16, fp16 or fp32, got {x.dtype}")


def _run(x: torch.Tensor, w: QuantTensor | torch.Tensor, out: torch.Tensor, n: int, out_f: int, rows: int,
         in_f: int, x_strides: tuple[int, int], out_strides: tuple[int, int], config: Fp8Config | None,
         norm: Norm | None = None) -> torch.Tensor:
    """What the plain, the grouped and the dense call share once x and out are checked: the empty cases, the
    tiling (the one for the whole [out_f, in] weight, or `config`), the launch. A float weight (`dense_gemv`) has
    no scales and runs the GEMV only, by default with the GEMV heuristic for its element size. `norm` (plain
    calls only: x [N, in]): fused when `fuses_norm`, else rms_norm(x) first."""
    if n == 0 or out_f == 0:
        return out
    if in_f == 0:
        return out.zero_()
    data, scale = _kernel_weight(w) if isinstance(w, QuantTensor) else (w, None)
    sms = num_sms(x.device)
    if config is None:
        config = (pick_config(n, out_f, in_f, x.dtype, sms) if scale is not None else
                  _gemv_config(n, out_f, in_f, sms, w.element_size()))
    if config.kernel == "mma" and not (scale is not None and mma_takes(x, data, n, in_f, x_strides)):
        config = _gemv_config(n, out_f, in_f, sms, 1 if scale is not None else w.element_size())   # the GEMV
    cfg = resolve_split(config, n, out_f, in_f, sms)
    _check_config(cfg)
    if scale is None and cfg.kernel != "gemv":
        raise ValueError(f"a float weight takes GEMV configs only: {cfg}")
    if rows != out_f and rows % cfg.block_o:
        raise ValueError(f"block_o {cfg.block_o} must divide the {rows} rows of a group: {cfg}")
    if norm is not None and not fuses_norm(cfg, scale, in_f):
        x, norm = rms_norm(x, *norm).contiguous(), None
        x_strides = (x.stride(0), 0)
    _launch(x, data, scale, out, n, out_f, rows, in_f, x_strides, out_strides, cfg, norm)
    return out


def gemv_holds(cfg: Fp8Config) -> bool:
    """Whether a GEMV launch lets the kernel after it launch only at its end (`PDL_HOLD`) instead of at its start:
    when its programs take several tokens (block_n > 1; MOEBOX_GEMV_HOLD=0: never). On the H200 (V4-Flash, 4K
    context, twenty-third session, `MOEBOX_PDL_HOLD=_fp8_gemv_kernel`, every GEMV held): batch 2 6.76 -> 6.33 ms
    in two runs (the GEMVs' device time 3.8 -> 2.8 ms a step, the shared expert's SiLU 0.53 -> 0.21, the
    compressors' 0.52 -> 0.27: the dependents' programs, parked in their PDL wait, slowed the 2-token GEMVs and
    were slowed by them); batch 1 lost 0.02-0.07 ms, 3-16 within 0.02 either way."""
    return default_hold(cfg.block_n > 1, "MOEBOX_GEMV_HOLD")


def _launch(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor | None, out: torch.Tensor, n: int, out_f: int,
            rows: int, in_f: int, x_strides: tuple[int, int], out_strides: tuple[int, int], cfg: Fp8Config,
            norm: Norm | None = None) -> None:
    """The kernel launch (+ the split-K sum) for out_f output rows in groups of `rows` (one group: rows = out_f):
    group i reads x[n] at x + n * x_strides[0] + i * x_strides[1] and writes out[n] at out + n * out_strides[0]
    + i * out_strides[1] (x and out with unit column stride). cfg.block_o divides rows when there are groups.
    scale None: a float weight (`dense_gemv`), GEMV only. norm: the GEMV's fused RMSNorm (`fuses_norm`)."""
    steps = -(-in_f // cfg.block_k)   # K steps (the dot kernel's are the 128-column blocks)
    split = _even_split(steps, cfg.split_k)
    per_split = -(-steps // split)
    if split == 1:
        y, (stride_yn, stride_yg), stride_ys = out, out_strides, 0
    else:  # fp32 partials [split, N, out_f], the groups side by side
        y = torch.empty((split, n, out_f), dtype=torch.float32, device=x.device)
        stride_yn, stride_yg, stride_ys = out_f, rows, n * out_f
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(out_f, cfg.block_o), split)
    if cfg.kernel == "mma":
        launch_mma(x, data, scale, y, n, out_f, rows, in_f, split, x_strides, (stride_yn, stride_yg, stride_ys),
                   cfg.block_o, cfg.num_warps, cfg.num_stages == 2)
    elif cfg.kernel == "gemv":
        scaled = scale is not None
        nw, eps = (norm[0].contiguous(), float(norm[1])) if norm is not None else (x, 0.0)
        _fp8_gemv_kernel[grid](
            x, data, scale if scaled else data, y, nw, n, out_f, rows, in_f, per_split,
            x_strides[0], x_strides[1], data.stride(0), scale.stride(0) if scaled else 0, stride_yn, stride_yg,
            stride_ys, eps, BLOCK_N=cfg.block_n, BLOCK_O=cfg.block_o, BLOCK_K=cfg.block_k,
            NUM_STAGES=cfg.num_stages, SCALED=scaled, NORM=norm is not None, EARLY=cfg.early,
            num_warps=cfg.num_warps, num_stages=1, **pdl_args(x, _fp8_gemv_kernel, hold=gemv_holds(cfg)))
    else:
        if x.dtype == torch.float32:
            terms = 2
            split_dtype = "fp16" if interpreting() else cfg.split_dtype  # the interpreter's bf16 dot is wrong
            dot_dtype = _SPLIT_DTYPES[split_dtype]
        else:
            terms = 1
            dot_dtype = tl.float16 if (cfg.bf16_as_fp16 and x.dtype == torch.bfloat16) else _DOT_DTYPES[x.dtype]
        _fp8_linear_kernel[grid](
            x, data, scale, y, n, out_f, rows, in_f, per_split,
            x_strides[0], x_strides[1], data.stride(0), scale.stride(0), stride_yn, stride_yg, stride_ys,
            BLOCK_N=cfg.block_n, BLOCK_O=cfg.block_o, BLOCK_K=BLOCK, X_TERMS=terms, DOT_DTYPE=dot_dtype,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(x, _fp8_linear_kernel))
    if split > 1:
        # a sum block never straddles two groups: rows is a multiple of 128 when there are several
        sum_block = min(1024, triton.next_power_of_2(out_f) if rows == out_f else rows & -rows)
        _split_sum_kernel[(n, triton.cdiv(out_f, sum_block))](
            y, out, out_f, rows, stride_ys, out_strides[0], out_strides[1], SPLIT=split, BLOCK=sum_block,
            num_warps=4, **pdl_args(x, _split_sum_kernel))


def fp8_linear_reference(x: torch.Tensor, w: QuantTensor, out: torch.Tensor | None = None,
                         config: Fp8Config | None = None, norm: Norm | None = None
                         ) -> torch.Tensor:
    """The torch reference: dequantize w to fp32, F.linear in fp32, cast back to x's dtype (same arguments;
    `norm`: rms_norm(x) first)."""
    n, out_f, in_f = _check(x, w)
    _check_norm(norm, in_f)
    if norm is not None:
        x = rms_norm(x, *norm)
    y = F.linear(x.float(), w.dequantize(torch.float32)).to(x.dtype)
    if out is not None:
        return _out(x, out, n, out_f).copy_(y)
    return y


def fp8_linear(x: torch.Tensor, w: QuantTensor, out: torch.Tensor | None = None,
               config: Fp8Config | None = None, norm: Norm | None = None) -> torch.Tensor:
    """Dispatcher: the Triton kernel for CUDA tensors (when triton imports), the torch reference elsewhere."""
    fn = fp8_linear_triton if (x.is_cuda and HAVE_TRITON) else fp8_linear_reference
    return fn(x, w, out=out, config=config, norm=norm)


_DENSE_WEIGHTS = (torch.bfloat16, torch.float16, torch.float32)


def dense_gemv(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None,
               config: Fp8Config | None = None) -> torch.Tensor:
    """x [N, in] @ w.T for a float weight w [out, in] (bf16/fp16/fp32, contiguous rows) through the GEMV kernel
    (products and sums in fp32, one rounding to out_dtype, default x's dtype): for decode-size N, where cuBLAS
    takes a split-K GEMM and a second launch to reduce it (the router's 2 MB gate: ~9 us a layer on the H200).
    `config`: a "gemv" Fp8Config (default: the GEMV heuristic for w's element size)."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed")
    _check_dtype(x)
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1] or w.dtype not in _DENSE_WEIGHTS:
        raise ValueError(f"x [N, in] and a bf16/fp16/fp32 weight [out, in]: got x {tuple(x.shape)}, "
                         f"w {tuple(w.shape)} {w.dtype}")
    n, (out_f, in_f) = x.shape[0], w.shape
    out = torch.empty((n, out_f), dtype=out_dtype or x.dtype, device=x.device)
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    return _run(x, w, out, n, out_f, out_f, in_f, (x.stride(0), 0), (out.stride(0), 0), config)


# ------------------------------------------------------------------------------------------ grouped
def _out_grouped(x: torch.Tensor, out: torch.Tensor | None, n: int, groups: int, rows: int) -> torch.Tensor:
    if out is None:
        return torch.empty((n, groups, rows), dtype=x.dtype, device=x.device)
    if tuple(out.shape) != (n, groups, rows) or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"out must be [{n}, {groups}, {rows}] {x.dtype} on {x.device}, got {tuple(out.shape)} "
                         f"{out.dtype}")
    if out.numel() and rows > 1 and out.stride(2) != 1:
        raise ValueError("out must have contiguous rows (unit stride in its last dimension)")
    return out


def fp8_grouped_linear_triton(x: torch.Tensor, w: QuantTensor, groups: int, out: torch.Tensor | None = None,
                              config: Fp8Config | None = None) -> torch.Tensor:
    """Block-diagonal FP8 linear in one launch: x [N, g, in] (bf16/fp16/fp32, any N and group strides), w
    QuantTensor fp8 [g*R, in] with R % 128 == 0; returns (or fills, every element) `out` [N, g, R] (any view
    with unit last stride) in x's dtype, out[:, i] = x[:, i] @ W[i*R:(i+1)*R]^T. The kernels of
    fp8_linear_triton, with the groups' row blocks side by side on the grid's row axis; the tiling is the one
    fp8_linear_triton picks for [g*R, in] (TUNED_DECODE key (g*R, in)), or `config` (block_o must divide R)."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed")
    n, rows, in_f = _check_grouped(x, w, groups)
    _check_dtype(x)
    out = _out_grouped(x, out, n, groups, rows)
    if x.stride(2) != 1:
        x = x.contiguous()
    return _run(x, w, out, n, groups * rows, rows, in_f, (x.stride(0), x.stride(1)),
                (out.stride(0), out.stride(1)), config)


def fp8_grouped_linear_reference(x: torch.Tensor, w: QuantTensor, groups: int, out: torch.Tensor | None = None,
                                 config: Fp8Config | None = None) -> torch.Tensor:
    """The torch reference: fp8_linear_reference per group over views of w (same arguments)."""
    n, rows, _ = _check_grouped(x, w, groups)
    srows = rows // BLOCK
    y = torch.stack([fp8_linear_reference(x[:, i], QuantTensor("fp8", w.data[i * rows:(i + 1) * rows],
                                                               w.scale[i * srows:(i + 1) * srows], w.block))
                     for i in range(groups)], dim=1)
    if out is not None:
        return _out_grouped(x, out, n, groups, rows).copy_(y)
    return y


def fp8_grouped_linear(x: torch.Tensor, w: QuantTensor, groups: int, out: torch.Tensor | None = None,
                       config: Fp8Config | None = None) -> torch.Tensor:
    """Dispatcher for the grouped call, as fp8_linear: Triton for CUDA tensors, the torch reference elsewhere."""
    fn = fp8_grouped_linear_triton if (x.is_cuda and HAVE_TRITON) else fp8_grouped_linear_reference
    return fn(x, w, groups, out=out, config=config)


def random_fp8_weight(out_features: int, in_features: int, device: torch.device | str = "cpu", seed: int = 0,
                      scale_byte: tuple[int, int] = (115, 121)) -> QuantTensor:
    """A random FP8 weight made on `device` (normal values rounded to e4m3, scale bytes uniform in [lo, hi)):
    the bench input. The default scales (2^-12..2^-7) keep outputs of order 1-10 for unit-variance x here."""
    g = torch.Generator(device=device).manual_seed(seed)
    data = (torch.randn((out_features, in_features), generator=g, device=device) * 32).to(torch.float8_e4m3fn)
    shape = (-(-out_features // BLOCK), -(-in_features // BLOCK))
    scale = torch.randint(*scale_byte, shape, generator=g, device=device, dtype=torch.uint8)
    return QuantTensor("fp8", data, scale.view(torch.float8_e8m0fnu), (BLOCK, BLOCK))


# ----------------------------------------------------------------------------------------------- bench
def copy_bandwidth(device: torch.device | str = "cuda", nbytes: int = 1 << 30) -> float:
    """Device-to-device copy rate in GB/s, bytes read + written (as KINDS.md counts it), L2 flushed each rep."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=20, rep=200)
    return 2 * nbytes / ms / 1e6


def _weight_copies(w: QuantTensor, l2_miss_bytes: int) -> list[QuantTensor]:
    """w and clones of it: >= l2_miss_bytes in all (at most 128 copies), so calls cycling over them miss L2."""
    copies = max(1, min(128, -(-l2_miss_bytes // w.nbytes)))
    return [w] + [QuantTensor("fp8", w.data.clone(), w.scale.clone(), w.block) for _ in range(copies - 1)]


def bench(device: str | torch.device = "cuda", shapes: Sequence[tuple[str, int, int]] = V4_FLASH_SHAPES,
          tokens: Sequence[int] = (1, 4, 16), prefill: Sequence[int] = (2048,), dtype: torch.dtype = torch.bfloat16,
          config: Fp8Config | None = None, graph: bool = True, cublas: bool = True,
          l2_miss_bytes: int = 256 << 20, copy_gbs: float | None = None) -> list[dict]:
    """Time fp8_linear (the default picks, or `config`) on the V4-Flash dense shapes with triton.testing.do_bench
    (L2 flushed before each rep): decode N in `tokens` as GB/s of FP8 weight bytes (and the fraction of the
    measured copy bandwidth), prefill N in `prefill` as TFLOP/s; cuBLAS bf16 F.linear on the same shapes for
    comparison; with `graph`, the decode calls replayed from a CUDA graph over enough weight copies
    (>= l2_miss_bytes) that each call misses L2. Prints and returns one row per (shape, N)."""
    device = torch.device(device)
    if copy_gbs is None:
        copy_gbs = copy_bandwidth(device)
    print(f"device copy bandwidth {copy_gbs:.0f} GB/s (read + written); x {dtype}; "
          f"config {'default picks' if config is None else config.label}", flush=True)
    rows = []
    for name, out_f, in_f in shapes:
        w = random_fp8_weight(out_f, in_f, device=device, seed=out_f + in_f)
        wb = w.dequantize(dtype) if cublas else None  # cuBLAS on the dense weight in x's dtype
        wbytes = w.nbytes
        for n in tuple(tokens) + tuple(prefill):
            x = torch.randn((n, in_f), device=device, dtype=dtype)
            out = torch.empty((n, out_f), device=device, dtype=dtype)
            sms = num_sms(device)
            cfg = pick_config(n, out_f, in_f, dtype, sms) if config is None else resolve_split(config, n, out_f,
                                                                                               in_f, sms)
            fp8_linear_triton(x, w, out=out, config=cfg)
            ms = triton.testing.do_bench(lambda: fp8_linear_triton(x, w, out=out, config=cfg), warmup=25, rep=200)
            row = {"shape": name, "out": out_f, "in": in_f, "N": n, "config": cfg, "ms": ms,
                   "weight_bytes": wbytes, "GB/s": wbytes / ms / 1e6, "TFLOP/s": 2 * n * out_f * in_f / ms / 1e9}
            if cublas:
                ms_ref = triton.testing.do_bench(lambda: F.linear(x, wb), warmup=25, rep=200)
                row.update(ms_cublas=ms_ref, cublas_GB_s=wb.numel() * wb.element_size() / ms_ref / 1e6,
                           cublas_TFLOP_s=2 * n * out_f * in_f / ms_ref / 1e9)
            decode = n <= 16
            if graph and decode:
                ws = _weight_copies(w, l2_miss_bytes)
                ms_g = graph_us(each_copy(lambda i: fp8_linear_triton(x, ws[i], out=out, config=cfg), len(ws)),
                                rep=200) / 1e3
                row.update(ms_graph=ms_g, GB_s_graph=wbytes / ms_g / 1e6, graph_copies=len(ws))
                del ws
            rows.append(row)
            if decode:
                g = (f" | graph {row['ms_graph'] * 1e3:7.2f} us {row['GB_s_graph']:7.0f} GB/s "
                     f"{row['GB_s_graph'] / copy_gbs:5.1%}") if "ms_graph" in row else ""
                c = (f" | cuBLAS {str(dtype)[6:]} {row['ms_cublas'] * 1e3:7.2f} us {row['cublas_GB_s']:7.0f} GB/s"
                     if cublas else "")
                print(f"{name:10s} {out_f:5d}x{in_f:<5d} N={n:<4d} {ms * 1e3:7.2f} us {row['GB/s']:7.0f} GB/s "
                      f"{row['GB/s'] / copy_gbs:5.1%} of copy{g}{c}  {cfg.label}", flush=True)
            else:
                c = (f" | cuBLAS {str(dtype)[6:]} {row['ms_cublas'] * 1e3:8.1f} us "
                     f"{row['cublas_TFLOP_s']:6.1f} TFLOP/s" if cublas else "")
                print(f"{name:10s} {out_f:5d}x{in_f:<5d} N={n:<4d} {ms * 1e3:8.1f} us "
                      f"{row['TFLOP/s']:6.1f} TFLOP/s{c}  {cfg.label}", flush=True)
        w = wb = None
        torch.cuda.empty_cache()
    for r in rows:
        r["copy_GB/s"] = copy_gbs
    return rows


def bench_grouped(device: str | torch.device = "cuda", shape: tuple[str, int, int, int] = V4_FLASH_GROUPED,
                  tokens: Sequence[int] = (1, 4, 16), dtype: torch.dtype = torch.bfloat16,
                  l2_miss_bytes: int = 256 << 20, copy_gbs: float | None = None) -> list[dict]:
    """fp8_grouped_linear (one launch) against the loop of one fp8_linear call per group over views of the
    weight (what `grouped_linear` ran before it), both replayed from a CUDA graph over enough weight copies
    (>= l2_miss_bytes) that each call misses L2. Both outputs are checked against the reference first. Prints
    and returns one row per N: us per grouped call, GB/s of weight bytes and the fraction of the copy bandwidth,
    for each of the two, and the speedup."""
    device = torch.device(device)
    if copy_gbs is None:
        copy_gbs = copy_bandwidth(device)
    name, groups, rows, in_f = shape
    out_f, srows = groups * rows, rows // BLOCK
    print(f"grouped {name}: {groups} groups x {rows} rows x {in_f} in; x {dtype}; copy bandwidth {copy_gbs:.0f} GB/s;"
          f" CUDA-graph replay over >= {l2_miss_bytes >> 20} MiB of weight copies", flush=True)
    w = random_fp8_weight(out_f, in_f, device=device, seed=out_f + in_f)
    ws = _weight_copies(w, l2_miss_bytes)
    views = [[QuantTensor("fp8", c.data[i * rows:(i + 1) * rows], c.scale[i * srows:(i + 1) * srows], c.block)
              for i in range(groups)] for c in ws]

    def loop(x: torch.Tensor, parts: list[QuantTensor], out: torch.Tensor) -> torch.Tensor:
        for i, part in enumerate(parts):
            fp8_linear_triton(x[:, i], part, out=out[:, i])
        return out

    rows_out = []
    for n in tokens:
        x = torch.randn((n, groups, in_f), device=device, dtype=dtype)
        out = torch.empty((n, groups, rows), device=device, dtype=dtype)
        ref = fp8_grouped_linear_reference(x.float(), w, groups)
        cfg = pick_config(n, out_f, in_f, dtype, num_sms(device))
        head = f"{name:6s} {groups}x{rows}x{in_f} N={n:<3d}"
        errs = [float((y.float() - ref).norm() / ref.norm()) for y in
                (fp8_grouped_linear_triton(x, w, groups, out=out.fill_(float("nan"))).clone(),
                 loop(x, views[0], out.fill_(float("nan"))))]
        if not max(errs) < 2e-2:  # NaN (an element not written) too
            print(f"{head} WRONG: rel. error grouped {errs[0]:.1e}, loop {errs[1]:.1e}", flush=True)
            continue
        ms = graph_us(each_copy(lambda i: fp8_grouped_linear_triton(x, ws[i], groups, out=out), len(ws)),
                      rep=200) / 1e3
        ms_loop = graph_us(each_copy(lambda i: loop(x, views[i], out), len(ws)), rep=200) / 1e3
        gbs, gbs_loop = w.nbytes / ms / 1e6, w.nbytes / ms_loop / 1e6
        rows_out.append({"shape": name, "groups": groups, "rows": rows, "in": in_f, "N": n, "config": cfg,
                         "us": ms * 1e3, "GB/s": gbs, "copy": gbs / copy_gbs, "us_loop": ms_loop * 1e3,
                         "GB/s_loop": gbs_loop, "copy_loop": gbs_loop / copy_gbs, "copy_GB/s": copy_gbs})
        print(f"{head} | 1 launch {ms * 1e3:7.2f} us {gbs:5.0f} GB/s {gbs / copy_gbs:6.1%} of copy | {groups} calls "
              f"{ms_loop * 1e3:7.2f} us {gbs_loop:5.0f} GB/s {gbs_loop / copy_gbs:6.1%} | x{ms_loop / ms:4.2f}  "
              f"{cfg.label}", flush=True)
    return rows_out


def _mma_variants(n: int, out_f: int, in_f: int, sms: int = 132) -> list[Fp8Config]:
    """The tensor-core decode kernel's tilings the sweep times (N <= 16, in % 128 == 0): rows per program x
    warps (1-4 16-row tiles a warp), with and without the next step's prefetch, and the automatic split halved
    and doubled for the first."""
    if n > 16 or in_f % BLOCK:
        return []
    out = [Fp8Config(kernel="mma", block_o=bo, num_warps=w, num_stages=st)
           for bo, w, st in ((64, 4, 2), (64, 2, 2), (128, 4, 2), (128, 8, 2), (128, 2, 2), (32, 2, 2), (64, 4, 1))]
    auto = resolve_split(out[0], n, out_f, in_f, sms).split_k
    out += [replace(out[0], split_k=s) for s in {max(1, auto // 2), 2 * auto} - {auto}]
    return out


def _sweep_variants(n: int, out_f: int, in_f: int, sms: int = 132) -> list[Fp8Config]:
    """What the sweep times for one call: the dot decode default, the GEMV default and its neighbours (half and
    twice the rows per program at the same bytes per step, a twice-as-long step, 8 warps with a twice-as-long
    step, 1 and 4 stages and split-K 2 when there are several steps, half the tokens per program for N > 1
    and 8 for N > 4); for N > 1 also the dot path in fp16 (bf16_as_fp16: one e4m3 -> f16 conversion a weight
    pair where bf16 takes a further f16 -> bf16 one a weight) at 16, 32 and 64 rows a program, and 64 rows
    with 8 warps; for N = 1 the default and the pick each with and without their first step loaded before the
    PDL wait (`early`); then the tensor-core kernel's (`_mma_variants`). (Lean one-token GEMVs, 8 rows x 512 or
    256 columns a step for two programs an SM, lost on every product: thirtieth session.)"""
    g = _gemv_config(n, out_f, in_f, sms)
    pad = max(BLOCK, next_pow2(in_f))

    def gemv(**kw: int) -> Fp8Config:
        c = replace(g, **kw)
        return c if "num_stages" in kw else replace(c, num_stages=3 if in_f > c.block_k else 1)

    out = [Fp8Config(block_n=16, block_o=32 if out_f >= 2048 else 16, num_warps=4, num_stages=4), g]
    for bo in (g.block_o // 2, g.block_o * 2):
        if 1 <= bo <= 32:
            out.append(gemv(block_o=bo, block_k=max(BLOCK, min(pad, g.block_o * g.block_k // bo))))
    out.append(gemv(block_k=min(pad, 2 * g.block_k)))
    out.append(gemv(num_warps=8, block_k=min(pad, 2 * g.block_k)))
    if in_f > g.block_k:
        out += [gemv(num_stages=1), gemv(num_stages=4), gemv(split_k=2)]
    if n > 1:
        out.append(gemv(block_n=g.block_n // 2))
    if n > 4:
        out.append(gemv(block_n=8))
    if n > 1:
        out += [Fp8Config(block_n=16, block_o=bo, num_warps=w, num_stages=4, bf16_as_fp16=True)
                for bo, w in ((16, 4), (32, 4), (64, 4), (64, 8))]
    if n == 1:
        for c in (g, pick_config(1, out_f, in_f, sms=sms)):
            if c.kernel == "gemv":   # split resolved, so a tiling and its twin are timed once each (below)
                c = resolve_split(c, 1, out_f, in_f, sms)
                out += [replace(c, early=False), replace(c, early=True)]
    return list(dict.fromkeys(out + _mma_variants(n, out_f, in_f, sms)))  # unique, in order


def _config_src(cfg: Fp8Config) -> str:
    """cfg as Python source with only its non-default fields, for TUNED_DECODE."""
    default = Fp8Config()
    args = ", ".join(f"{f}={getattr(cfg, f)!r}" for f in cfg.__dataclass_fields__
                     if getattr(cfg, f) != getattr(default, f))
    return f"Fp8Config({args})"


def _precompile_one(out_f: int, in_f: int, n: int, cfg: Fp8Config, dtype: torch.dtype) -> None:
    w = random_fp8_weight(out_f, in_f, device="cuda")
    fp8_linear_triton(torch.zeros((n, in_f), device="cuda", dtype=dtype), w, config=cfg)
    torch.cuda.synchronize()


def _precompile(jobs: Sequence[tuple[int, int, int, Fp8Config]], dtype: torch.dtype, timeout_s: float) -> None:
    """Compile the kernels of (out, in, N, config) calls in worker processes (one compile is ~1-4 s of one CPU
    core and the sweep has dozens), so the timing loop finds them in Triton's on-disk cache. Whatever fails or
    is not done within timeout_s is compiled (and its error reported) by the timing loop."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, wait
    todo: dict[tuple, tuple] = {}
    for out_f, in_f, n, cfg in jobs:  # GEMV compiles depend on the config and in % 16 only, mma ones on the
        split = resolve_split(cfg, n, out_f, in_f).split_k > 1   # config and N > 8; dot ones on all
        key = ((replace(cfg, split_k=0), split, in_f % 16) if cfg.kernel == "gemv" else
               (replace(cfg, split_k=0), split, n > 8) if cfg.kernel == "mma" else (cfg, n, out_f, in_f))
        todo.setdefault(key, (out_f, in_f, n, cfg, dtype))
    workers = max(1, min(len(todo), (os.cpu_count() or 2) - 2, 14))
    t0 = time.monotonic()
    try:
        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
        futures = [pool.submit(_precompile_one, *job) for job in todo.values()]
        done, _ = wait(futures, timeout=timeout_s)
        pool.shutdown(wait=False, cancel_futures=True)
    except Exception as e:  # noqa: BLE001 - e.g. no process pool here: the timing loop compiles
        print(f"precompile skipped: {type(e).__name__}: {e}", flush=True)
        return
    ok = sum(f.exception() is None for f in done)
    print(f"precompiled {ok} of {len(todo)} kernel configs in {time.monotonic() - t0:.0f} s with {workers} "
          f"processes", flush=True)


def sweep(device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16,
          shapes: Sequence[tuple[str, int, int]] = V4_FLASH_DECODE_SHAPES, tokens: Sequence[int] = (1, 2, 4, 8, 16),
          l2_miss_bytes: int = 256 << 20, budget_s: float = 200.0, kernels: Sequence[str] = ("dot", "gemv", "mma"),
          ) -> list[dict]:
    """Decode variants (`_sweep_variants`: the dot path and GEMV tilings) at each N in `tokens` on each shape,
    each replayed from a CUDA graph over >= l2_miss_bytes of weight copies. Prints one table (shape, N,
    variant, us per call, GB/s of weight bytes, % of the copy bandwidth; 'pick' marks pick_config's choice),
    then the best variant per (shape, N) and TUNED_DECODE lines for them. Each variant's output is checked
    against the reference before it is timed. Variants not reached within budget_s seconds of the start are
    skipped (and counted). `kernels` keeps only those kernels' variants (and the pick). Returns the rows."""
    t0 = time.monotonic()
    device = torch.device(device)
    sms = num_sms(device)
    plan = {(name, n): [c for c in _sweep_variants(n, out_f, in_f, sms)
                        if c.kernel in kernels or resolve_split(c, n, out_f, in_f, sms) == pick_config(n, out_f, in_f,
                                                                                                    dtype, sms)]
            for name, out_f, in_f in shapes for n in tokens}
    _precompile([(out_f, in_f, n, cfg) for name, out_f, in_f in shapes for n in tokens for cfg in plan[name, n]],
                dtype, timeout_s=budget_s / 2)
    copy_gbs = copy_bandwidth(device)
    print(f"copy bandwidth {copy_gbs:.0f} GB/s; x {dtype}; CUDA-graph replay over >= {l2_miss_bytes >> 20} MiB "
          f"of weight copies\n{'shape':20s} {'N':>3s}  {'variant':34s} {'us':>8s} {'GB/s':>7s} {'copy':>6s}",
          flush=True)
    rows, skipped = [], 0
    for name, out_f, in_f in shapes:
        w = random_fp8_weight(out_f, in_f, device=device, seed=out_f + in_f)
        ws = _weight_copies(w, l2_miss_bytes)
        for n in tokens:
            x = torch.randn((n, in_f), device=device, dtype=dtype)
            out = torch.empty((n, out_f), device=device, dtype=dtype)
            ref = fp8_linear_reference(x.float(), w)
            pick = pick_config(n, out_f, in_f, dtype, sms)
            for cfg in plan[name, n]:
                if time.monotonic() - t0 > budget_s:
                    skipped += 1
                    continue
                head = f"{f'{name} {out_f}x{in_f}':20s} {n:3d}  {cfg.label:34s}"
                mark = " pick" if resolve_split(cfg, n, out_f, in_f, sms) == pick else ""
                try:  # checked against the reference first: a wrong variant is reported, never timed
                    err = float((fp8_linear_triton(x, w, out=out.fill_(float("nan")), config=cfg).float() - ref)
                                .norm() / ref.norm())
                    if not err < 2e-2:  # NaN (an element not written) too
                        print(f"{head} WRONG: rel. error {err:.1e}", flush=True)
                        continue
                    ms = graph_us(each_copy(lambda i: fp8_linear_triton(x, ws[i], out=out, config=cfg), len(ws)),
                                  rep=20) / 1e3
                except Exception as e:  # noqa: BLE001 - e.g. triton's OutOfResources
                    print(f"{head} failed: {type(e).__name__}: {str(e)[:80]}", flush=True)
                    continue
                gbs = w.nbytes / ms / 1e6
                rows.append({"shape": name, "out": out_f, "in": in_f, "N": n, "config": cfg, "us": ms * 1e3,
                             "bytes": w.nbytes, "GB/s": gbs, "copy": gbs / copy_gbs})
                print(f"{head} {ms * 1e3:8.2f} {gbs:7.0f} {gbs / copy_gbs:6.1%}{mark}", flush=True)
    best: dict[tuple[str, int], dict] = {}
    for r in rows:
        if (r["shape"], r["N"]) not in best or r["us"] < best[r["shape"], r["N"]]["us"]:
            best[r["shape"], r["N"]] = r
    print(f"\nbest per (shape, N){f'; {skipped} variants skipped (over {budget_s:.0f} s)' if skipped else ''}:")
    for (name, n), r in best.items():
        print(f"  {name:10s} N={n:<3d} {r['config'].label:34s} {r['us']:8.2f} us {r['copy']:6.1%}")
    for n in tokens:
        fit = launch_cost_fit([r for (_, m), r in best.items() if m == n])
        if fit is not None:
            print(f"  N={n:<3d} best times ~ {fit[0]:.2f} us a call + weight bytes at {fit[1]:.2f} TB/s")
    print("TUNED_DECODE entries (paste into TUNED_DECODE in moebox/ops/triton/fp8_linear.py):")
    for name, out_f, in_f in shapes:
        entries = ", ".join(f"({n}, {_config_src(best[name, n]['config'])})" for n in tokens if (name, n) in best)
        if entries:
            print(f"    ({out_f}, {in_f}): ({entries}),  # {name}")
    print(f"sweep took {time.monotonic() - t0:.0f} s", flush=True)
    return rows


def launch_cost_fit(best: Sequence[dict]) -> tuple[float, float] | None:
    """(fixed us a call, TB/s) of the least-squares line time = fixed + bytes / rate through the best rows of one
    N (dicts with "us" and "bytes"), or None with fewer than 3 distinct sizes: how much of a product's time its
    bytes explain and how much is a per-launch cost that no inner loop removes (docs/benchmarks.md, fourteenth
    session: 2.3 us + bytes / 3.55 TB/s at N = 1 on the H200)."""
    if len({r["bytes"] for r in best}) < 3:
        return None
    a = torch.tensor([[r["bytes"] / 1e6, 1.0] for r in best], dtype=torch.float64)
    slope, fixed = torch.linalg.lstsq(a, torch.tensor([[r["us"]] for r in best], dtype=torch.float64)).solution[:, 0]
    return float(fixed), 1.0 / float(slope)


def sweep_prefill(device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16) -> None:
    """Prefill tilings of the dot kernel around the defaults (no graphs, no cuBLAS)."""
    copy_gbs = copy_bandwidth(device)
    for block_n, block_o, warps, stages in ((64, 128, 4, 3), (128, 128, 8, 3), (128, 128, 8, 4), (128, 64, 4, 4),
                                            (64, 256, 8, 3), (128, 256, 8, 3)):
        cfg = Fp8Config(block_n, block_o, 0, warps, stages)
        try:
            bench(device, tokens=(), prefill=(2048,), dtype=dtype, config=cfg, graph=False, cublas=False,
                  copy_gbs=copy_gbs)
        except Exception as e:  # noqa: BLE001 - a tiling that does not fit (shared memory) is reported, not fatal
            print(f"   {cfg.label} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m moebox.ops.triton.fp8_linear",
                                description="Time the FP8 linear kernels on the V4-Flash shapes (CUDA). With no "
                                            "option: the bench of the dense shapes, then the grouped wo_a.")
    p.add_argument("--sweep", action="store_true", help="time GEMV variants against the dot path (decode)")
    p.add_argument("--sweep-prefill", action="store_true", help="time prefill tilings of the dot kernel")
    p.add_argument("--grouped", action="store_true",
                   help="time fp8_grouped_linear (one launch) against one call per group, CUDA-graph replay")
    p.add_argument("--groups", type=int, default=V4_FLASH_GROUPED[1], help="--grouped: groups (default %(default)s)")
    p.add_argument("--rows", type=int, default=V4_FLASH_GROUPED[2],
                   help="--grouped: rows per group, a multiple of 128 (default %(default)s)")
    p.add_argument("--in-features", type=int, default=V4_FLASH_GROUPED[3], help="--grouped: in (default %(default)s)")
    p.add_argument("--kernels", nargs="+", choices=("dot", "gemv", "mma"), default=("dot", "gemv", "mma"),
                   help="--sweep: the kernels whose variants are timed (the current pick always is)")
    p.add_argument("--tokens", type=int, nargs="+",
                   help="N values (default: 1 2 4 8 16 for --sweep, 1 4 16 for --grouped)")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.rows % BLOCK or args.groups < 1 or min(args.tokens or [1]) < 1:
        raise SystemExit(f"--rows must be a multiple of {BLOCK}, --groups and --tokens positive")
    bench_start()
    grouped = ("wo_a" if (args.groups, args.rows, args.in_features) == V4_FLASH_GROUPED[1:] else "grouped",
               args.groups, args.rows, args.in_features)
    if args.sweep:
        sweep(tokens=args.tokens or (1, 2, 4, 8, 16), kernels=args.kernels)
    if args.sweep_prefill:
        sweep_prefill()
    if not (args.sweep or args.sweep_prefill or args.grouped):
        bench()
    if args.grouped or not (args.sweep or args.sweep_prefill):
        bench_grouped(shape=grouped, tokens=args.tokens or (1, 4, 16))


if __name__ == "__main__":
    main()
