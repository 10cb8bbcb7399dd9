"""The lightning indexer's scores at decode in one Triton kernel (on by default; MOEBOX_INDEX_KERNEL=0 takes the
compiled torch function). On the H200 (fourteenth session, `python -m moebox.ops.triton.index_scores`): 2.7 / 2.9 /
4.0 us against torch's 10.9 / 12.4 / 22.3 at batch 1 and 1K / 4K / 16K entries, 34.5 against 284 at batch 16 and 16K;
a decode step at 64K context, batch 16: 29.5 -> 24.5 ms.

What it computes (= `moebox.model.decode_attention.index_scores`, the torch reference): per sequence b of a
decode batch, over its slot's whole compressed key table K = index_keys[slot[b]] [E, dI],
    scores[b, e] = sum_h relu(qi[b, h] . K[e]) * wi[b, h] * scale     (fp32; -inf where not valid[b, e]).

Why: the compiled torch function is four launches a CSA layer at batch 1 on the H200 (eleventh session's
timeline: the gather of the slot's keys 1.8 us, cuBLAS's fp32 GEMM on widened copies 4.9 us, the relu / weights /
mask 1.8 us, a copy 1.0 us) for 256 KB of keys at 4K context; at 64K context (16 384 entries a sequence) it
widens 4 MB of keys a sequence to fp32 and writes the [B, 64, E] products out and back. Here each key row is
read once from the table, scored against all heads with one tensor-core dot, and only [B, E] is written.

Kernel `_index_scores_kernel`, grid (B, E / BLOCK_E): program (b, j) loads qi[b] [H, dI] and the valid rows of
its BLOCK_E entries (invalid ones are not read: an unwritten row may hold anything, NaN included), takes
s = qi K^T [H, BLOCK_E] with tl.dot (q's dtype, fp32 accumulation: bf16 / fp16 products are exact in fp32, so
only the summation order differs from the reference's fp32 einsum; fp32 inputs use "ieee" FMA), then the
relu, the head weights and the sum over heads in registers. H and dI are padded to powers of two >= 16 (the
MMA's smallest tile) with masks. With `rope` the kernel loads the raw qi and rotates it (`rope_tile`), which
spares a decode step the `query_rope` launch before it.

Bounds (`supported`): qi [B, H, dI] bf16/fp16/fp32 with unit stride on dI, wi [B, H] float, index_keys a plain
[S, E, dI] tensor of qi's dtype with unit stride on dI (not the FP8 cache's row objects), slot [B] int32/int64,
valid [B, E] bool, H <= 128, dI <= 256; CUDA tensors, or CPU ones under TRITON_INTERPRET=1 (fp32/fp16: the
interpreter's bf16 dot is wrong). `moebox.model.decode_attention.index_select` takes the kernel where
`supported` says so, else (or where it fails to build, or with MOEBOX_INDEX_KERNEL=0) the torch function.
CUDA graphs: the output from torch.empty, one launch, no host sync.
"""

from __future__ import annotations

import torch

from moebox.ops.triton.rope import rope_tile, rope_tile_fits
from moebox.ops.triton.runtime import HAVE_TRITON, cdiv, next_pow2, pdl_args, pdl_start, plain_tensor, tl, triton

BLOCK_E = 64   # entries a program: 16 programs a sequence at 4K context, 256 at 64K

if HAVE_TRITON:
    @triton.jit
    def _index_scores_kernel(q_ptr, w_ptr, k_ptr, slot_ptr, v_ptr, out_ptr, pos_ptr, inv_ptr, scale, H, E, D,
                             stride_qb, stride_qh, stride_wb, stride_ks, stride_ke, stride_vb, stride_ob,
                             H_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_E: tl.constexpr, RD: tl.constexpr,
                             PRECISE: tl.constexpr, PDL: tl.constexpr):
        """RD > 0: qi is the raw product, its trailing RD channels rotated here (`rope_tile`)."""
        pdl_start(PDL)
        b = tl.program_id(0)
        offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
        offs_h = tl.arange(0, H_PAD)
        offs_d = tl.arange(0, D_PAD)
        mh = offs_h < H
        md = offs_d < D
        valid = tl.load(v_ptr + b * stride_vb + offs_e, mask=offs_e < E, other=0) != 0
        if RD:
            q = rope_tile(q_ptr + b * stride_qb + offs_h[:, None] * stride_qh, mh, inv_ptr,
                          tl.load(pos_ptr + b).to(tl.float32), 0.0, D, D_PAD, RD, False, PRECISE)
        else:
            q = tl.load(q_ptr + b * stride_qb + offs_h[:, None] * stride_qh + offs_d[None, :],
                        mask=mh[:, None] & md[None, :], other=0.0)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        k = tl.load(k_ptr + slot * stride_ks + offs_e.to(tl.int64)[:, None] * stride_ke + offs_d[None, :],
                    mask=valid[:, None] & md[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee", out_dtype=tl.float32)            # [H_PAD, BLOCK_E]
        w = tl.load(w_ptr + b * stride_wb + offs_h, mask=mh, other=0.0).to(tl.float32) * scale
        score = tl.sum(tl.maximum(s, 0.0) * w[:, None], axis=0)
        tl.store(out_ptr + b * stride_ob + offs_e, tl.where(valid, score, float("-inf")), mask=offs_e < E)


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def supported(qi: torch.Tensor, wi: torch.Tensor, index_keys: object, slot: torch.Tensor,
              valid: torch.Tensor) -> bool:
    """Whether `index_scores_triton` takes these arguments (the module doc's Bounds)."""
    if not (HAVE_TRITON and plain_tensor(qi, 3) and plain_tensor(index_keys, 3) and plain_tensor(wi, 2)
            and plain_tensor(valid, 2) and plain_tensor(slot, 1)):
        return False
    b, h, d = qi.shape
    return (qi.dtype in _DTYPES and index_keys.dtype == qi.dtype and wi.is_floating_point()
            and valid.dtype == torch.bool and slot.dtype in (torch.int32, torch.int64)
            and tuple(wi.shape) == (b, h) and index_keys.shape[2] == d
            and tuple(valid.shape) == (b, index_keys.shape[1])
            and slot.shape[0] == b and h <= 128 and d <= 256 and qi.stride(2) == 1 and index_keys.stride(2) == 1
            and qi.device == index_keys.device == wi.device == valid.device == slot.device)


def index_scores_triton(qi: torch.Tensor, wi: torch.Tensor, scale: float, index_keys: torch.Tensor,
                        slot: torch.Tensor, valid: torch.Tensor, out: torch.Tensor | None = None,
                        rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The scores [B, E] fp32 (or filled into `out`, every element written); arguments as `supported` says.
    `rope` = (positions [B], inv_freq): qi is the raw product and the kernel scores `apply_rope(qi, positions,
    inv_freq)` (`query_rope`'s qi; `rope_tile_fits` must hold)."""
    if not supported(qi, wi, index_keys, slot, valid) or (rope is not None and not rope_tile_fits(qi, *rope)):
        raise ValueError("index_scores_triton: unsupported arguments (see the module doc's Bounds): qi "
                         f"{tuple(qi.shape)} {qi.dtype}, wi {tuple(wi.shape)}, keys "
                         f"{getattr(index_keys, 'shape', None)} {getattr(index_keys, 'dtype', None)}, slot "
                         f"{tuple(slot.shape)}, valid {tuple(valid.shape)}, rope "
                         f"{None if rope is None else (tuple(rope[0].shape), rope[1].numel())}")
    b, h, d = qi.shape
    e = index_keys.shape[1]
    if out is None:
        out = torch.empty((b, e), dtype=torch.float32, device=qi.device)
    elif tuple(out.shape) != (b, e) or out.dtype != torch.float32 or (e > 1 and out.stride(1) != 1):
        raise ValueError(f"out must be [{b}, {e}] fp32 with unit column stride, got {tuple(out.shape)} {out.dtype}")
    if b == 0 or e == 0:
        return out
    v = valid if valid.stride(1) == 1 else valid.contiguous()
    wi = wi if wi.stride(1) == 1 else wi.contiguous()
    pos, inv = (slot, wi) if rope is None else (rope[0].contiguous(), rope[1].float().contiguous())
    _index_scores_kernel[(b, cdiv(e, BLOCK_E))](
        qi, wi, index_keys, slot, v.view(torch.uint8), out, pos, inv, float(scale), h, e, d,
        qi.stride(0), qi.stride(1), wi.stride(0), index_keys.stride(0), index_keys.stride(1), v.stride(0),
        out.stride(0), H_PAD=max(16, next_pow2(h)), D_PAD=max(16, next_pow2(d)), BLOCK_E=BLOCK_E,
        RD=0 if rope is None else 2 * rope[1].numel(), PRECISE=qi.is_cuda, num_warps=4,
        **pdl_args(qi, _index_scores_kernel))
    return out


# ----------------------------------------------------------------------------------------------- bench
def random_inputs(batch: int, entries: int, heads: int = 64, dim: int = 128, dtype: torch.dtype = torch.bfloat16,
                  slots: int | None = None, device: torch.device | str = "cuda", seed: int = 0) -> dict:
    """V4-Flash-shaped indexer inputs (64 heads of 128): a key table of `slots` slots (default batch), sequence
    b on slot b, every entry valid but the last (the decode step's scratch row)."""
    g = torch.Generator(device=device).manual_seed(seed)
    slots = slots or batch
    valid = torch.ones((batch, entries), dtype=torch.bool, device=device)
    valid[:, -1] = False
    return dict(qi=torch.randn((batch, heads, dim), generator=g, device=device).to(dtype),
                wi=torch.randn((batch, heads), generator=g, device=device).to(dtype), scale=dim ** -0.5 * heads ** -0.5,
                index_keys=torch.randn((slots, entries, dim), generator=g, device=device).to(dtype),
                slot=torch.arange(batch, device=device), valid=valid)


def bench(batches: tuple[int, ...] = (1, 4, 16), entries: tuple[int, ...] = (1025, 4097, 16385)) -> None:
    """The kernel against the compiled torch function at V4-Flash shapes, CUDA-graph replay, key tables cycled
    past L2 (`python -m moebox.ops.triton.index_scores`)."""
    from moebox.model.decode_attention import index_scores
    from moebox.ops.triton.runtime import bench_start, graph_us, rel_err
    bench_start()
    print(f"{'B':>3s} {'entries':>7s} {'copies':>6s} | {'kernel us':>9s} | {'torch us':>8s} | rel err")
    for e in entries:
        for b in batches:
            copies = max(2, min(64, (192 << 20) // (b * e * 128 * 2)))
            inp = random_inputs(b, e, slots=b * copies)
            slots = [torch.arange(i * b, (i + 1) * b, device="cuda") for i in range(copies)]
            q, w, scale, keys, valid = (inp[k] for k in ("qi", "wi", "scale", "index_keys", "valid"))
            got = index_scores_triton(q, w, scale, keys, slots[0], valid)
            ref = index_scores(q, w, scale, keys, slots[0], valid)
            err = rel_err(torch.nan_to_num(got, neginf=0.0), torch.nan_to_num(ref, neginf=0.0))
            us = graph_us([lambda s=s: index_scores_triton(q, w, scale, keys, s, valid) for s in slots])
            us_ref = graph_us([lambda s=s: index_scores(q, w, scale, keys, s, valid) for s in slots])
            print(f"{b:3d} {e:7d} {copies:6d} | {us:9.2f} | {us_ref:8.2f} | {err:.1e}", flush=True)
            del inp, q, w, keys, valid
            torch.cuda.empty_cache()


if __name__ == "__main__":  # python -m moebox.ops.triton.index_scores
    bench()
