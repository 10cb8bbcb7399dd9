"""FP8 e4m3 x 128x128-block-scaled dense linear on the GPU: y = x W^T, one Triton kernel for decode and prefill.

    y[n, o] = sum_kb  2^(s[o // 128, kb] - 127) * sum_{k in block kb} W8[o, k] * x[n, k]

W8 is the float8_e4m3fn weight [out, in] and s its E8M0 scale bytes [ceil(out/128), ceil(in/128)], as
`moebox.weights.formats.QuantTensor("fp8", ...)` keeps them (`quant_fp8_block` makes them). The weight is never
widened in memory: each program loads FP8 tiles and converts them in registers. `fp8_linear_reference` is the
torch reference (dequantize to fp32, F.linear in fp32, cast back to x's dtype) with the same signature;
`fp8_linear` dispatches (Triton for CUDA tensors when triton imports, the reference elsewhere).

One kernel, `_fp8_linear_kernel`, whose tiling adapts (`pick_config`), rather than a separate GEMV:
  - Orientation: the program computes acc[BLOCK_O, BLOCK_N] = W8_tile [BLOCK_O, 128] @ x_tile^T [128, BLOCK_N]
    with tl.dot, so the operand converted in registers (FP8 -> bf16, exact: e4m3 fits bf16) is the A operand,
    which Hopper's wgmma may take from registers, and x (already bf16) is the B operand, which it takes from
    shared memory. The scale of the 128x128 block is one E8M0 byte per output row and K step, applied ONCE
    per 128 columns to the fp32 partial: acc += dot(W8, x^T) * 2^(s-127) (the byte is placed straight in the
    fp32 exponent field; scale bytes 1..254 are exact, 0 flushes to 0, 255 gives inf).
    BLOCK_K is 128 = the scale block, so each K step reads a [BLOCK_O, 128] FP8 tile: 128 contiguous bytes per
    row, full cache lines, 16-byte vector loads, with num_stages of them in flight (Triton pipelines the loads
    of a dot operand through shared memory with async copies).
  - Decode (N <= 16): BLOCK_N = 16 (the smallest dot tile; rows past N re-read row N-1 of x, from L1/L2),
    BLOCK_O = 16 or 32 output rows per program, and split-K when the output is too short to give every SM a
    few programs (wkv 512 rows would be 32 programs of 16 rows on 132 SMs): grid (1, out/BLOCK_O, SPLIT) with
    each split covering a contiguous range of K blocks, fp32 partials in a [SPLIT, N, out] scratch, then
    `_split_sum_kernel` adds them in a fixed order (deterministic, no atomics, no zeroing) and writes `out` in
    x's dtype. Why tl.dot for N = 1 as well: the tensor cores make N = 1..16 cost the same as N = 1, the
    per-block scale stays one multiply per 128 columns of the fp32 partial, and one code path serves both
    regimes; a decode call is bounded by the weight bytes, and the dot's extra work (16 padded rows) is far
    below the SMs' issue rate. A CUDA-core GEMV (no shared-memory round trip) for N = 1 is the alternative if
    the bench shows the dot path short of the copy bandwidth.
  - Prefill (N > 16): BLOCK_N = 64 or 128, BLOCK_O = 128, 8 warps, grid (N-blocks, out-blocks) with the N block
    on axis 0 (fastest varying), so the programs running together share one weight tile and it is read from
    DRAM about once; split-K again only when the grid would not fill the SMs.
  - x fp32: two bf16 terms per x tile (hi = bf16(x), lo = bf16(x - hi)), two dots into the same fp32
    accumulator; W8 is exact in bf16, so the products keep ~16 mantissa bits of x (rel. error ~1e-5), at twice
    the MMA work. x bf16 / fp16: one dot in x's dtype (e4m3 is exact in fp16 too).
  - Masks: out and in need not be multiples of 128 (or of the tiles). Tile rows past out / N are clamped to
    the last row (loaded, never stored), so the full K blocks load with no mask: 16-byte vector loads that
    Triton's pipeliner turns into async copies whenever the row strides are multiples of 16 (a mask along K
    makes the vector width hang on what the compiler can prove about `in`; an sm_90 build with no
    divisibility hints pipelined nothing). The partial last K block, if any, is a separate masked step.
    Stores are masked with (n < N) & (o < out); every element of `out` is written exactly once.
  - The FP8 -> bf16 conversion (SASS of the sm_90 build, compiled on CPU with triton 3.9): per weight 1/2
    F2FP.F16.E4M3 (two at a time), 1 F2F.BF16.F16 (one at a time, on the narrow conversion pipe, ~16/clk/SM
    by the CUDA guide's table for type conversions: ~4.2e12 weights/s on 132 SMs, about the DRAM rate) and
    1/2 PRMT; loads are LDGSTS.128 (async, pipelined), the MMA is HMMA.16816 (decode tiles) or HGMMA
    (prefill, 128x128). So decode may be co-limited by that F2F. `Fp8Config(bf16_as_fp16=True)` dots in fp16
    instead (e4m3 -> f16 is 1/2 F2FP per weight, nothing else; x converted per tile, |x| > 65504 becomes inf,
    so only for normed activations): the sweep times both. A bit-trick conversion (e4m3 bits shifted into
    bf16 = value * 2^-120, exact for subnormals too, fixed by one packed bf16 multiply) is the next step if
    the F2F shows up.
  - Triton's CPU interpreter computes bf16 dots wrongly (seen with triton 3.9), so under TRITON_INTERPRET=1 the
    fp32-x path uses fp16 terms (`Fp8Config.split_dtype`); fp16 x runs the GPU's single-dot path unchanged.

Bytes and the bandwidth to approach. A decode call reads out*in bytes of FP8 plus out*in/16384 bytes of
scales (0.006%), plus x and y (N*(in+out)*2 bytes, negligible), so it should approach the device copy
bandwidth (~4.3 TB/s on the H200, read+written bytes of a device copy, KINDS.md). The V4-Flash dense shapes
(out x in), their FP8 bytes and the time at 4.3 TB/s:
    wq_a          1024 x 4096    4.19 MB    0.98 us
    wq_b         32768 x 1024   33.55 MB    7.80 us
    wkv            512 x 4096    2.10 MB    0.49 us
    wo_b          4096 x 8192   33.55 MB    7.80 us
    shared w1/w3  2048 x 4096    8.39 MB    1.95 us each
    shared w2     4096 x 2048    8.39 MB    1.95 us
    e_proj/h_proj 4096 x 4096   16.78 MB    3.90 us   (MTP)
The big ones (wq_b, wo_b, e/h_proj) can get near the bandwidth; wkv and wq_a are ~0.5-1 us of bytes, below a
kernel's ramp-up and tail (a few us standalone, ~1-2 us inside a CUDA graph), so they are latency-bound: the
fix there is fewer launches (one call over wq_a and wkv concatenated, since they read the same x), not a
faster kernel. Prefill (N = 2048) is compute-bound: 2*N*out*in FLOP against the bf16 tensor-core rate
(~790 TFLOP/s measured on random data here, KINDS.md).

`bench` (and `python -m moebox.ops.triton.fp8_linear [--sweep]`) times these shapes at N = 1, 4, 16 (GB/s of
weight bytes vs the measured copy bandwidth, cold L2) and N = 2048 (TFLOP/s), next to cuBLAS bf16 F.linear on
the dense bf16 weight, and replays the decode calls in a CUDA graph that cycles over enough weight copies to
miss L2 (as consecutive layers do).

CUDA graphs: a call allocates only `out` (when None) and the split-K scratch with torch.empty (graph-safe with
the caching allocator) and launches 1 kernel (2 with split-K); no host sync, no data-dependent shapes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Sequence

import torch
import torch.nn.functional as F

from moebox.weights.formats import QuantTensor

from moebox.ops.triton.runtime import HAVE_TRITON, tl, triton  # noqa: F401 - Triton is optional

BLOCK = 128  # the FP8 scale block, both dimensions; also the kernel's K step

# (name, out, in): the V4-Flash dense weights a decode step reads through this kernel
V4_FLASH_SHAPES: tuple[tuple[str, int, int], ...] = (
    ("wq_a", 1024, 4096), ("wq_b", 32768, 1024), ("wkv", 512, 4096), ("wo_b", 4096, 8192),
    ("shared_w1", 2048, 4096), ("shared_w2", 4096, 2048), ("e_proj", 4096, 4096))


@dataclass(frozen=True)
class Fp8Config:
    """Tiles: BLOCK_N tokens x BLOCK_O output rows per program (K step fixed at 128); split_k programs share
    the K range of one tile (0 = pick from the grid size); split_dtype: the dot dtype of fp32 x's two terms."""

    block_n: int = 16
    block_o: int = 32
    split_k: int = 0
    num_warps: int = 4
    num_stages: int = 4
    split_dtype: str = "bf16"
    bf16_as_fp16: bool = False   # bf16 x: convert x to fp16 in the kernel and dot in fp16 (experimental, see doc)


_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # an H200's count; only the interpreter gets here
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def pick_config(n: int, out_features: int, in_features: int, x_dtype: torch.dtype = torch.bfloat16,
                sms: int = 132) -> Fp8Config:
    """The default tiling for a call (split_k resolved): decode tiles for N <= 16, GEMM tiles above."""
    if n <= 16:
        cfg = Fp8Config(block_n=16, block_o=32 if out_features >= 2048 else 16, num_warps=4, num_stages=4)
    else:
        block_n = 64 if (n <= 64 or x_dtype == torch.float32) else 128
        cfg = Fp8Config(block_n=block_n, block_o=128, num_warps=8 if block_n == 128 else 4, num_stages=3)
    return resolve_split(cfg, n, out_features, in_features, sms)


def resolve_split(cfg: Fp8Config, n: int, out_features: int, in_features: int, sms: int = 132) -> Fp8Config:
    """cfg with split_k 0 replaced by the automatic split for its tiles: enough programs for a few per SM
    (decode, N <= 16: 4 per SM, each at least 4 K steps long) or one wave (prefill: at least 8 K steps each)."""
    if cfg.split_k:
        return cfg
    kb = -(-in_features // BLOCK)
    target, min_steps = (4 * sms, 4) if n <= 16 else (sms, 8)
    tiles = -(-n // cfg.block_n) * -(-out_features // cfg.block_o)
    split = max(1, min(-(-target // tiles), kb // min_steps))
    return replace(cfg, split_k=_even_split(kb, split))


def _even_split(kb: int, split: int) -> int:
    """The split count that gives every split the same number of K blocks (the last may be shorter)."""
    split = max(1, min(split, kb))
    return -(-kb // -(-kb // split))


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
    def _fp8_linear_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, OUT, IN, KB_PER_SPLIT,
                           stride_xn, stride_wo, stride_so, stride_yn, stride_ys,
                           BLOCK_N: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr,
                           X_TERMS: tl.constexpr, DOT_DTYPE: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_o = tl.program_id(1)
        pid_k = tl.program_id(2)
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
    def _split_sum_kernel(ws_ptr, y_ptr, OUT, stride_ws, stride_yn, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
        """y[n, :] = sum over the SPLIT fp32 partials ws[s, n, :], in order, cast to y's dtype."""
        n = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = offs < OUT
        row = n.to(tl.int64) * OUT + offs
        acc = tl.load(ws_ptr + row, mask=m, other=0.0)
        for s in tl.static_range(1, SPLIT):
            acc += tl.load(ws_ptr + s * stride_ws + row, mask=m, other=0.0)
        tl.store(y_ptr + n.to(tl.int64) * stride_yn + offs, acc.to(y_ptr.dtype.element_ty), mask=m)

    _DOT_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
    _SPLIT_DTYPES = {"bf16": tl.bfloat16, "fp16": tl.float16}


# ---------------------------------------------------------------------------------------------- wrappers
def _check(x: torch.Tensor, w: QuantTensor) -> tuple[int, int, int]:
    if not isinstance(w, QuantTensor) or w.kind != "fp8":
        raise TypeError("w must be a QuantTensor of kind 'fp8'")
    if tuple(w.block) != (BLOCK, BLOCK):
        raise ValueError(f"only {BLOCK}x{BLOCK} scale blocks are supported, got {w.block}")
    if x.dim() != 2:
        raise ValueError(f"x must be [N, in], got {tuple(x.shape)}")
    out_f, in_f = w.data.shape
    if x.shape[1] != in_f:
        raise ValueError(f"x has {x.shape[1]} features, the weight {in_f}")
    want = (-(-out_f // BLOCK), -(-in_f // BLOCK))
    if tuple(w.scale.shape) != want:
        raise ValueError(f"scale must be {want}, got {tuple(w.scale.shape)}")
    return x.shape[0], out_f, in_f


def _out(x: torch.Tensor, out: torch.Tensor | None, n: int, out_f: int) -> torch.Tensor:
    if out is None:
        return torch.empty((n, out_f), dtype=x.dtype, device=x.device)
    if tuple(out.shape) != (n, out_f) or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"out must be [{n}, {out_f}] {x.dtype} on {x.device}, got {tuple(out.shape)} {out.dtype}")
    if n and out_f > 1 and out.stride(1) != 1:
        raise ValueError("out must have contiguous rows")
    return out


def fp8_linear_triton(x: torch.Tensor, w: QuantTensor, out: torch.Tensor | None = None,
                      config: Fp8Config | None = None) -> torch.Tensor:
    """The Triton path. x [N, in] bf16/fp16/fp32 (any row stride), w QuantTensor fp8 (data [out, in] e4m3 with
    contiguous rows, scale E8M0 [ceil(out/128), ceil(in/128)]); returns (or fills, every element) `out`
    [N, out] in x's dtype. `config` overrides the tiling (split_k 0 = automatic). Runs on CUDA, or on CPU
    tensors under TRITON_INTERPRET=1."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed")
    n, out_f, in_f = _check(x, w)
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be bf16, fp16 or fp32, got {x.dtype}")
    out = _out(x, out, n, out_f)
    if n == 0 or out_f == 0:
        return out
    if in_f == 0:
        return out.zero_()
    data = w.data if w.data.stride(1) == 1 else w.data.contiguous()
    scale = w.scale if w.scale.dtype == torch.uint8 else w.scale.view(torch.uint8)
    if scale.stride(-1) != 1:
        scale = scale.contiguous()
    if x.stride(1) != 1:
        x = x.contiguous()
    sms = _num_sms(x.device)
    cfg = pick_config(n, out_f, in_f, x.dtype, sms) if config is None else resolve_split(config, n, out_f, in_f, sms)
    kb = -(-in_f // BLOCK)
    split = _even_split(kb, cfg.split_k)
    kb_per_split = -(-kb // split)
    if x.dtype == torch.float32:
        terms = 2
        split_dtype = "fp16" if _interpreting() else cfg.split_dtype  # the interpreter's bf16 dot is wrong
        dot_dtype = _SPLIT_DTYPES[split_dtype]
    else:
        terms = 1
        dot_dtype = tl.float16 if (cfg.bf16_as_fp16 and x.dtype == torch.bfloat16) else _DOT_DTYPES[x.dtype]
    if split == 1:
        y, stride_yn, stride_ys = out, out.stride(0), 0
    else:
        y = torch.empty((split, n, out_f), dtype=torch.float32, device=x.device)
        stride_yn, stride_ys = out_f, n * out_f
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(out_f, cfg.block_o), split)
    _fp8_linear_kernel[grid](
        x, data, scale, y, n, out_f, in_f, kb_per_split,
        x.stride(0), data.stride(0), scale.stride(0), stride_yn, stride_ys,
        BLOCK_N=cfg.block_n, BLOCK_O=cfg.block_o, BLOCK_K=BLOCK, X_TERMS=terms, DOT_DTYPE=dot_dtype,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split > 1:
        sum_block = min(1024, triton.next_power_of_2(out_f))
        _split_sum_kernel[(n, triton.cdiv(out_f, sum_block))](
            y, out, out_f, stride_ys, out.stride(0), SPLIT=split, BLOCK=sum_block, num_warps=4)
    return out


def fp8_linear_reference(x: torch.Tensor, w: QuantTensor, out: torch.Tensor | None = None,
                         config: Fp8Config | None = None) -> torch.Tensor:
    """The torch reference: dequantize w to fp32, F.linear in fp32, cast back to x's dtype (same arguments)."""
    n, out_f, _ = _check(x, w)
    y = F.linear(x.float(), w.dequantize(torch.float32)).to(x.dtype)
    if out is not None:
        return _out(x, out, n, out_f).copy_(y)
    return y


def fp8_linear(x: torch.Tensor, w: QuantTensor, out: torch.Tensor | None = None,
               config: Fp8Config | None = None) -> torch.Tensor:
    """Dispatcher: the Triton kernel for CUDA tensors (when triton imports), the torch reference elsewhere."""
    fn = fp8_linear_triton if (x.is_cuda and HAVE_TRITON) else fp8_linear_reference
    return fn(x, w, out=out, config=config)


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


def _graph_ms(fn_per_copy, copies: int) -> float:
    """Per-call time of `copies` calls captured in one CUDA graph (each on its own weight copy), replayed."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(copies):
            fn_per_copy(i)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn_per_copy(i)
    ms = triton.testing.do_bench(graph.replay, warmup=10, rep=200)
    return ms / copies


def bench(device: str | torch.device = "cuda", shapes: Sequence[tuple[str, int, int]] = V4_FLASH_SHAPES,
          tokens: Sequence[int] = (1, 4, 16), prefill: Sequence[int] = (2048,), dtype: torch.dtype = torch.bfloat16,
          config: Fp8Config | None = None, graph: bool = True, cublas: bool = True,
          l2_miss_bytes: int = 256 << 20, copy_gbs: float | None = None) -> list[dict]:
    """Time fp8_linear on the V4-Flash dense shapes with triton.testing.do_bench (L2 flushed before each rep):
    decode N in `tokens` as GB/s of FP8 weight bytes (and the fraction of the measured copy bandwidth), prefill
    N in `prefill` as TFLOP/s; cuBLAS bf16 F.linear on the same shapes for comparison; with `graph`, the decode
    calls replayed from a CUDA graph over enough weight copies (>= l2_miss_bytes) that each call misses L2.
    Prints and returns one row per (shape, N)."""
    device = torch.device(device)
    if copy_gbs is None:
        copy_gbs = copy_bandwidth(device)
    print(f"device copy bandwidth {copy_gbs:.0f} GB/s (read + written); x {dtype}; "
          f"config {'auto' if config is None else config}", flush=True)
    rows = []
    for name, out_f, in_f in shapes:
        w = random_fp8_weight(out_f, in_f, device=device, seed=out_f + in_f)
        wb = w.dequantize(dtype) if cublas else None  # cuBLAS on the dense weight in x's dtype
        wbytes = w.nbytes
        for n in tuple(tokens) + tuple(prefill):
            x = torch.randn((n, in_f), device=device, dtype=dtype)
            out = torch.empty((n, out_f), device=device, dtype=dtype)
            sms = _num_sms(device)
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
                copies = max(1, min(128, -(-l2_miss_bytes // wbytes)))
                ws = [w] + [QuantTensor("fp8", w.data.clone(), w.scale.clone(), w.block) for _ in range(copies - 1)]
                ms_g = _graph_ms(lambda i: fp8_linear_triton(x, ws[i], out=out, config=cfg), copies)
                row.update(ms_graph=ms_g, GB_s_graph=wbytes / ms_g / 1e6, graph_copies=copies)
                del ws
            rows.append(row)
            if decode:
                g = (f" | graph {row['ms_graph'] * 1e3:7.2f} us {row['GB_s_graph']:7.0f} GB/s "
                     f"{row['GB_s_graph'] / copy_gbs:5.1%}") if "ms_graph" in row else ""
                c = (f" | cuBLAS {str(dtype)[6:]} {row['ms_cublas'] * 1e3:7.2f} us {row['cublas_GB_s']:7.0f} GB/s"
                     if cublas else "")
                print(f"{name:10s} {out_f:5d}x{in_f:<5d} N={n:<4d} {ms * 1e3:7.2f} us {row['GB/s']:7.0f} GB/s "
                      f"{row['GB/s'] / copy_gbs:5.1%} of copy{g}{c}  split={cfg.split_k}", flush=True)
            else:
                c = (f" | cuBLAS {str(dtype)[6:]} {row['ms_cublas'] * 1e3:8.1f} us "
                     f"{row['cublas_TFLOP_s']:6.1f} TFLOP/s" if cublas else "")
                print(f"{name:10s} {out_f:5d}x{in_f:<5d} N={n:<4d} {ms * 1e3:8.1f} us "
                      f"{row['TFLOP/s']:6.1f} TFLOP/s{c}  tiles={cfg.block_n}x{cfg.block_o} split={cfg.split_k}",
                      flush=True)
        del w, wb
        torch.cuda.empty_cache()
    for r in rows:
        r["copy_GB/s"] = copy_gbs
    return rows


def sweep(device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16) -> None:
    """Decode and prefill tilings around the defaults (no graphs, no cuBLAS): which to make the default."""
    copy_gbs = copy_bandwidth(device)
    for n in (1, 16):
        for block_o in (16, 32, 64):
            for warps, stages in ((2, 4), (4, 3), (4, 4), (4, 6), (8, 4)):
                for split, fp16 in ((0, False), (1, False), (0, True)):
                    for name, out_f, in_f in V4_FLASH_SHAPES:
                        cfg = Fp8Config(16, block_o, split, warps, stages, bf16_as_fp16=fp16)  # split 0: auto
                        print(f"-- N={n} {cfg}", end=": ")
                        _try(lambda: bench(device, shapes=((name, out_f, in_f),), tokens=(n,), prefill=(),
                                           dtype=dtype, config=cfg, graph=False, cublas=False, copy_gbs=copy_gbs))
    for block_n, block_o, warps, stages in ((64, 128, 4, 3), (128, 128, 8, 3), (128, 128, 8, 4), (128, 64, 4, 4),
                                            (64, 256, 8, 3), (128, 256, 8, 3)):
        cfg = Fp8Config(block_n, block_o, 0, warps, stages)
        print(f"-- prefill {cfg}")
        _try(lambda: bench(device, tokens=(), prefill=(2048,), dtype=dtype, config=cfg, graph=False, cublas=False,
                           copy_gbs=copy_gbs))


def _try(fn) -> None:
    """Run one sweep point; a tiling that does not compile or fit (shared memory) is reported, not fatal."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - e.g. triton's OutOfResources
        print(f"   failed: {type(e).__name__}: {str(e)[:200]}", flush=True)


if __name__ == "__main__":  # python -m moebox.ops.triton.fp8_linear [--sweep]
    import sys
    print(f"torch {torch.__version__}, triton {triton.__version__ if HAVE_TRITON else None}, "
          f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA'}")
    bench()
    if "--sweep" in sys.argv:
        sweep()
