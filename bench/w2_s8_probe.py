"""Would an exact s8 gate-up loop beat the bf16 one? A timing probe for a design question, not a kernel of moebox.

The routed experts' gate-up (`moebox.ops.triton.w2_moe._gate_up_mma_kernel`) makes 2 bf16 weights a PRMT and is
bound by its instruction issue at batch 4-16 (docs/benchmarks.md, sixteenth to nineteenth sessions). The
alternative: `mma.sync.m16n8k32.s8` with 4 weights a PRMT from a constant table and the group's scale applied after
the mma, which needs the planes relaid so each mma covers one scale group per row (lane t's word i = quarter t of
groups 2i and 2i + 1) and x as s8 terms. Its loop has 37% fewer integer ALU ops but 17% more instructions (each s32
result is read as a float through the accumulator's magic 0x4B400000, then one FFMA with the group's 2^s and one
FADD). Which of the two bounds the loop decides whether the relayout is worth building, and timing decides that.

Here both loops stream the same random planes at the V4-Flash gate-up shape (H 4096, I 2048, k 6, random routing,
planes missing L2 as in a 43-layer step, CUDA-graph replay): the production kernel alone (the default tiling) and
the s8 loop on the same prefetch-1 skeleton. Timing only: the s8 kernel reads the stored layout as if relaid and
x as random s8 terms, so its output is not gate-up's (it is written, so nothing is optimised away).

    python -m bench.w2_s8_probe --sass           # the two loops' sm_90 SASS, on any machine (no GPU)
    python -m bench.w2_s8_probe --tokens 1 4 8   # on CUDA: us a call of each kernel
"""

from __future__ import annotations

import argparse

import torch

from moebox.ops.triton import w2_moe
from moebox.ops.triton.runtime import bench_start, build_sm90, graph_us, loop_sass, tl, triton

H, I, E, K = 4096, 2048, 256, 6
LUT = 0x0401FFFC                      # s8 bytes of the levels -4, -1, 1, 4 (codes 0..3)
_ALU = ("PRMT", "LOP3", "SHF", "IADD3", "LEA", "ISETP", "SEL", "VIMNMX")


def s8_asm() -> str:
    """PTX for one lane's 16-word K tile (8 mmas, one scale group each): $0..$7 acc out (slot 4 c + k: chain c
    = group parity, D register k), $8.. codes (slot 4 rho + i: word i of row g + 8 rho), $16.. scale words
    (slot 4 rho + i: the row's word i % 2 of its 8 tile bytes), $24.. / $32.. x (b0 / b1 of mma 4 rho + i),
    $40.. acc in."""
    codes, scales, xa, xb, acc = 8, 16, 24, 32, 40
    asm = ["{", ".reg .b32 e0, o0, e1, o1, t, a<4>, d<4>, L, M, sg, sh;", ".reg .f32 v, ng, nh, fg, fh, c<8>;",
           f"mov.b32 L, {LUT};", "mov.b32 M, 0x4B400000;"]
    asm += [f"mov.b32 c{k}, ${acc + k};" for k in range(8)]
    for i in range(4):
        c0, c1 = f"${codes + i}", f"${codes + 4 + i}"
        asm += [f"and.b32 e0, {c0}, 0x33333333;", f"shr.b32 t, {c0}, 2;", "and.b32 o0, t, 0x33333333;",
                f"and.b32 e1, {c1}, 0x33333333;", f"shr.b32 t, {c1}, 2;", "and.b32 o1, t, 0x33333333;"]
        for hh in range(2):
            j = 2 * i + hh
            if hh:
                asm += [f"shr.b32 {r}, {r}, 16;" for r in ("e0", "o0", "e1", "o1")]
            asm += ["prmt.b32 a0, L, L, e0;", "prmt.b32 a1, L, L, e1;", "prmt.b32 a2, L, L, o0;",
                    "prmt.b32 a3, L, L, o1;",
                    "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {d0, d1, d2, d3}, {a0, a1, a2, a3}, "
                    f"{{${xa + j}, ${xb + j}}}, {{M, M, M, M}};"]
            sel = 0x4440 | (j % 4)   # byte j % 4 of the scale word, zero-extended
            asm += [f"prmt.b32 sg, ${scales + j // 4}, 0, {sel};", f"prmt.b32 sh, ${scales + 4 + j // 4}, 0, {sel};",
                    "mul.lo.u32 sg, sg, 8388608;", "mul.lo.u32 sh, sh, 8388608;", "mov.b32 fg, sg;",
                    "mov.b32 fh, sh;", "mul.f32 ng, fg, 0fCB400000;", "mul.f32 nh, fh, 0fCB400000;"]
            for k in range(4):
                s, n = ("fg", "ng") if k < 2 else ("fh", "nh")
                slot = 4 * (j % 2) + k
                asm += [f"mov.b32 v, d{k};", f"fma.rn.f32 v, v, {s}, {n};", f"add.f32 c{slot}, c{slot}, v;"]
    asm += [f"mov.b32 ${k}, c{k};" for k in range(8)] + ["}"]
    return "\n".join(asm)


_S8_ASM = tl.constexpr(s8_asm())
_CONSTRAINTS = tl.constexpr(",".join(["=r"] * 8 + ["r"] * 40))


@triton.jit
def _s8_dot(cw, sw, xa, xb, acc):
    out = tl.inline_asm_elementwise(_S8_ASM, _CONSTRAINTS, [cw, sw, xa, xb, acc.to(tl.int32, bitcast=True)],
                                    dtype=tl.int32, is_pure=True, pack=8)
    return out.to(tl.float32, bitcast=True)


@triton.jit
def _tiles(w1c_ptr, w1s_ptr, w3c_ptr, w3s_ptr, c_row, s_row, u, LAST: tl.constexpr):
    """Codes and scale words of K tile u (clamped to the last) of w1 and w3, and the tile's first code word."""
    wb = tl.minimum(u, LAST) * 16
    return (tl.load(w1c_ptr + c_row + wb), tl.load(w1s_ptr + s_row + wb // 8),
            tl.load(w3c_ptr + c_row + wb), tl.load(w3s_ptr + s_row + wb // 8), wb)


@triton.jit
def _gate_up_s8_kernel(xq_ptr, ids_ptr, w1c_ptr, w1s_ptr, w3c_ptr, w3s_ptr, y_ptr, c_expert_stride,
                       s_expert_stride, HW: tl.constexpr, IB: tl.constexpr, S: tl.constexpr):
    """grid (pairs, I / 16), S warps splitting the K tiles, prefetch 1, as the production gate-up; writes
    gate * up of its 16 rows (not gate-up's h: see the module doc)."""
    p = tl.program_id(0)
    rb = tl.program_id(1)
    e = tl.load(ids_ptr + p).to(tl.int64)
    r2 = tl.arange(0, 16 * S)[:, None]
    w = tl.arange(0, 16)[None, :]
    g, sp, rho = r2 % 8, (r2 // 8) % S, r2 // (8 * S)
    row = 16 * rb + 8 * rho + g
    c_row = e * c_expert_stride + row.to(tl.int64) * HW + w
    s_row = e * s_expert_stride + row * (HW // 8) + w % 2
    x_row = xq_ptr + g * (HW * 4) + 16 * (w // 4) + w % 4
    LAST: tl.constexpr = HW // 16 - 1
    acc_g = tl.zeros((16 * S, 16), dtype=tl.float32)
    acc_u = tl.zeros((16 * S, 16), dtype=tl.float32)
    c1, s1, c3, s3, wb = _tiles(w1c_ptr, w1s_ptr, w3c_ptr, w3s_ptr, c_row, s_row, sp, LAST)
    for u0 in tl.range(0, LAST + 1, S):
        n1, m1, n3, m3, nb = _tiles(w1c_ptr, w1s_ptr, w3c_ptr, w3s_ptr, c_row, s_row, u0 + S + sp, LAST)
        xa = tl.load(x_row + wb * 4)
        xb = tl.load(x_row + wb * 4 + 8)
        acc_g = _s8_dot(c1, s1, xa, xb, acc_g)
        acc_u = _s8_dot(c3, s3, xa, xb, acc_u)
        c1, s1, c3, s3, wb = n1, m1, n3, m3, nb
    y = tl.sum(acc_g * acc_u, axis=1)
    tl.store(y_ptr + (p * IB + rb) * (16 * S) + tl.arange(0, 16 * S), y)


def _s8_sig() -> dict[str, str]:
    return dict(xq_ptr="*i32", ids_ptr="*i64", w1c_ptr="*i32", w1s_ptr="*i32", w3c_ptr="*i32", w3s_ptr="*i32",
                y_ptr="*fp32", c_expert_stride="i32", s_expert_stride="i32")


def sass(split: int) -> None:
    """Print both loops' sm_90 SASS counts (instructions a weight: a lane handles 256 a loop iteration)."""
    sig = _s8_sig()
    built = build_sm90(_gate_up_s8_kernel, sig, dict(HW=H // 16, IB=I // 16, S=split), list(sig),
                       num_warps=split, num_stages=1)
    ops, regs, spills, _ = loop_sass(built.asm["cubin"])
    rows = [("exact s8", ops, regs, spills)]
    r = w2_moe.sass_report("gate_up", split, w2_moe.DEFAULT_CONFIG.prefetch)
    rows.append(("bf16 (production)", r["loop_ops"], r["registers"], r["spills"]))
    for name, ops, regs, spills in rows:
        alu = sum(v for op, v in ops.items() if op in _ALU)
        top = ", ".join(f"{op} {v}" for op, v in list(ops.items())[:10])
        print(f"{name:18s} split {split}: {sum(ops.values()) / 256:.2f} instructions a weight, integer ALU {alu}, "
              f"{regs} registers, {spills} B spilled | {top}", flush=True)


def time_calls(tokens: list[int], split: int, rep: int = 100) -> None:
    """us a call of the production gate-up kernel and of the s8 loop, same planes and routings."""
    bench_start()
    dev = torch.device("cuda")
    w13c, w13s, _, _ = w2_moe.random_planes(E, H, I, device=dev)
    w1c, w3c = (c.view(torch.int32) for c in (w13c[:, :I], w13c[:, I:]))
    w1s, w3s = (s.view(torch.uint8) for s in (w13s[:, :I], w13s[:, I:]))
    per_expert = 2 * (H * I // 4 + H * I // 32)   # w1 + w3 plane bytes
    cfg = w2_moe.DEFAULT_CONFIG
    print(f"{'N':>3s} {'calls':>5s} {'bf16 us':>8s} {'s8 us':>8s}", flush=True)
    for n in tokens:
        calls = max(2, -(-(256 << 20) // (n * K * per_expert)))
        routes = [w2_moe.random_routing(n, E, K, device=dev, seed=1000 * n + i) for i in range(calls)]
        x = torch.randn((n, H), device=dev, dtype=torch.bfloat16)
        xp = w2_moe._pack_x(x, w2_moe._empty_packed(x))
        hp = torch.empty((n * K, 2, I // 16, 8), dtype=torch.int32, device=dev)
        xq = torch.randint(-2**31, 2**31 - 1, (8, H // 4 + 64), dtype=torch.int32, device=dev)
        y = torch.empty((n * K, I * split), dtype=torch.float32, device=dev)
        flat = [(ids.reshape(-1).contiguous(), rw.reshape(-1).contiguous()) for ids, rw in routes]

        def bf16(ids: torch.Tensor, rw: torch.Tensor) -> None:
            w2_moe._gate_up_mma_kernel[(n * K, I // 16)](
                xp, ids, rw, w1c, w1s, w3c, w3s, hp.view(torch.int16), w1c.stride(0), w1s.stride(0), 10.0,
                I=I, HW=H // 16, K=K, TX=1, TH=2, HAS_LIMIT=True, S=cfg.gate_split, PREFETCH=cfg.prefetch,
                USE_ASM=True, PDL=False, num_warps=cfg.gate_split, num_stages=1)

        def s8(ids: torch.Tensor, rw: torch.Tensor) -> None:
            _gate_up_s8_kernel[(n * K, I // 16)](
                xq, ids, w1c, w1s.view(torch.int32), w3c, w3s.view(torch.int32), y, w1c.stride(0),
                w1s.stride(0) // 4, HW=H // 16, IB=I // 16, S=split, num_warps=split, num_stages=1)

        times = [graph_us([lambda a=a: fn(*a) for a in flat], rep) for fn in (bf16, s8)]
        print(f"{n:3d} {calls:5d} {times[0]:8.1f} {times[1]:8.1f}", flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sass", action="store_true", help="print the loops' sm_90 SASS counts (no GPU needed)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--split", type=int, default=w2_moe.DEFAULT_CONFIG.gate_split, help="warps a program")
    args = p.parse_args(argv)
    if args.sass:
        sass(args.split)
    else:
        time_calls(args.tokens, args.split)


if __name__ == "__main__":
    main()
