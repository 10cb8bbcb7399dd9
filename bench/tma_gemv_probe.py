"""Does an FP8 GEMV fed by the TMA stream its weights faster at one token than the production GEMV?

At batch 1 every dense product lies on one line, time = ~2.3 us + bytes / 3.55 TB/s (fourteenth session), and the
same kernel read its weights from L2 no faster (thirteenth): the kernel's own load path, not DRAM, sets its
3.55 TB/s, ~84% of the copy rate. This GEMV loads [BLOCK_O, BLOCK_K] weight tiles with the TMA
(`TensorDescriptor`, a ring of NUM_STAGES shared-memory buffers kept in flight by Triton's pipeliner), so a
program keeps far more bytes in flight than its registers could hold. It times, on the V4-Flash decode shapes at
N = 1 (each call on its own weight copy, so every call misses L2, calls chained in one CUDA graph as in decode):
the production pick, the TMA GEMV over a grid of tilings, and the TMA kernel with no arithmetic (the load path's
ceiling).

    python -m bench.tma_gemv_probe [--quick]    # CUDA only; prints us a call and TB/s of weight bytes
"""

from __future__ import annotations

import argparse
import itertools
from typing import Sequence

import torch

from moebox.ops.triton.fp8_linear import (V4_FLASH_DECODE_SHAPES, _split_sum_kernel, copy_bandwidth,
                                          fp8_linear_triton, pick_config, random_fp8_weight)
from moebox.ops.triton.runtime import (HAVE_TRITON, each_copy, graph_us, num_sms, pdl_args, pdl_start, tl,
                                       triton)

if HAVE_TRITON:
    @triton.jit
    def _tma_gemv_kernel(x_ptr, w_desc, s_ptr, y_ptr, OUT, IN, STEPS_PER_SPLIT, stride_so, stride_ys,
                         BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                         MATH: tl.constexpr, PDL: tl.constexpr):
        """y[split, o] = sum over this split's K steps of w[o, k] * 2^(s - 127) * x[k], one token. BLOCK_O
        divides 128 (one scale row a tile), BLOCK_K is 128 or a multiple of it."""
        pdl_start(PDL)
        pid_o = tl.program_id(0)
        pid_k = tl.program_id(1)
        row0 = pid_o * BLOCK_O
        offs_k = tl.arange(0, BLOCK_K)
        step0 = pid_k * STEPS_PER_SPLIT
        step1 = tl.minimum(step0 + STEPS_PER_SPLIT, IN // BLOCK_K)
        acc = tl.zeros((BLOCK_O, BLOCK_K), dtype=tl.float32)
        s_row = s_ptr + (row0 // 128) * stride_so
        for step in tl.range(step0, step1, num_stages=NUM_STAGES):
            k0 = step * BLOCK_K
            w = w_desc.load([row0, k0])
            if MATH:
                x = tl.load(x_ptr + k0 + offs_k).to(tl.float32)
                sb = tl.load(s_row + (k0 + offs_k) // 128).to(tl.int32)
                xs = x * (sb << 23).to(tl.float32, bitcast=True)
                acc += w.to(tl.float32) * xs[None, :]
            else:
                acc += w.to(tl.float32)
        y = tl.sum(acc, axis=1)
        tl.store(y_ptr + pid_k * stride_ys + row0 + tl.arange(0, BLOCK_O), y)


def tma_gemv(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, block_o: int,
             block_k: int, stages: int, split: int, warps: int, math: bool = True,
             ws: torch.Tensor | None = None) -> torch.Tensor:
    """out[0] = x[0] @ w.T for one token (bf16 x, FP8 `data` [OUT, IN] with e8m0 `scale` bytes per 128 x 128
    block); with split > 1 the fp32 partials go to `ws` [split, OUT] and the production split-sum adds them."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    out_f, in_f = data.shape
    steps = in_f // block_k
    per = -(-steps // split)
    desc = TensorDescriptor.from_tensor(data, [block_o, block_k])
    y = out if split == 1 else ws
    _tma_gemv_kernel[(out_f // block_o, split)](
        x, desc, scale, y, out_f, in_f, per, scale.stride(0), out_f, BLOCK_O=block_o, BLOCK_K=block_k,
        NUM_STAGES=stages, MATH=math, num_warps=warps, num_stages=1, **pdl_args(x, _tma_gemv_kernel))
    if split > 1:
        _split_sum_kernel[(1, triton.cdiv(out_f, 1024))](
            ws, out, out_f, out_f, out_f * 1, out_f, 0, SPLIT=split, BLOCK=1024, num_warps=4,
            **pdl_args(x, _split_sum_kernel))
    return out


def tilings(out_f: int, in_f: int, sms: int, quick: bool) -> list[tuple[int, int, int, int, int]]:
    """(block_o, block_k, stages, split, warps) candidates: about 1-4 programs an SM."""
    found = []
    blocks_o = (16, 32, 64) if not quick else (32,)
    blocks_k = (128, 256) if not quick else (256,)
    for bo, bk, st, wp in itertools.product(blocks_o, blocks_k, (4, 6), (4, 8)):
        if in_f % bk or out_f % bo:
            continue
        tiles, steps = out_f // bo, in_f // bk
        for per_sm in (1, 2):
            split = max(1, min(steps // 2, -(-per_sm * sms // tiles)))
            split = -(-steps // -(-steps // split))
            cand = (bo, bk, st, split, wp)
            if cand not in found:
                found.append(cand)
    return found


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a few tilings (a smoke run)")
    p.add_argument("--shapes", nargs="*", default=None, help="names from V4_FLASH_DECODE_SHAPES")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    sms = num_sms(dev)
    copy = copy_bandwidth(dev)
    print(f"copy {copy:.0f} GB/s; {sms} SMs", flush=True)
    table = []
    for name, out_f, in_f in V4_FLASH_DECODE_SHAPES:
        if args.shapes and name not in args.shapes:
            continue
        w = random_fp8_weight(out_f, in_f, device=dev, seed=out_f + in_f)
        copies = max(2, min(64, -(-(256 << 20) // w.nbytes)))
        ws_w = [w] + [type(w)("fp8", w.data.clone(), w.scale.clone(), w.block) for _ in range(copies - 1)]
        x = torch.randn((1, in_f), device=dev, dtype=torch.bfloat16)
        out = torch.empty((1, out_f), device=dev, dtype=torch.bfloat16)
        ref = fp8_linear_triton(x, w).float()
        prod = graph_us(each_copy(lambda i: fp8_linear_triton(x, ws_w[i], out=out), copies), rep=100)
        mb = w.data.numel() / 1e6
        best = (prod, f"production {pick_config(1, out_f, in_f, sms=sms).label}")
        print(f"{name:14s} {mb:5.1f} MB production {prod:7.2f} us {mb / prod:5.2f} TB/s", flush=True)
        ws = torch.empty((64, out_f), device=dev, dtype=torch.float32)
        scales = [c.scale.view(torch.uint8) for c in ws_w]
        for bo, bk, st, split, wp in tilings(out_f, in_f, sms, args.quick):
            label = f"tma o{bo} k{bk} s{st} split{split} w{wp}"
            try:
                got = tma_gemv(x, w.data, scales[0], torch.empty_like(out), bo, bk, st, split, wp, ws=ws).float()
                err = ((got - ref).norm() / ref.norm()).item()
                t = graph_us(each_copy(lambda i: tma_gemv(x, ws_w[i].data, scales[i], out, bo, bk, st, split, wp,
                                                          ws=ws), copies), rep=50)
            except Exception as e:  # noqa: BLE001 - a tiling Triton cannot build here: report, go on
                print(f"  {label}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            print(f"  {label:34s} {t:7.2f} us {mb / t:5.2f} TB/s rel err {err:.1e}", flush=True)
            if err < 2e-2 and t < best[0]:
                best = (t, label, (bo, bk, st, split, wp))
        loads = float("nan")
        if len(best) == 3:   # the best TMA tiling with no arithmetic: the load path's own time
            bo, bk, st, split, wp = best[2]
            loads = graph_us(each_copy(lambda i: tma_gemv(x, ws_w[i].data, scales[i], out, bo, bk, st, split, wp,
                                                          math=False, ws=ws), copies), rep=50)
        table.append((name, mb, prod, best, loads))
        del ws_w, w
        torch.cuda.empty_cache()
    print("\nshape           MB    production us   best us  loads only us   best")
    for name, mb, prod, (t, label, *_), loads in table:
        print(f"{name:14s} {mb:5.1f} {prod:9.2f} {t:9.2f} {loads:9.2f}   {label}")


if __name__ == "__main__":
    main()
