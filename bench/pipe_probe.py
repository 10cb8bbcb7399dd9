"""Issue rates of the integer and conversion instructions a 2-bit dequant can be built from (sm_90).

The routed-expert kernels are bound by their dequant's integer ops (PRMT, LOP3, SHF: ~0.5 issued a cycle a
scheduler, the ALU pipe's rate). A cheaper dequant needs ops on another pipe, e.g. the hardware e4m3 -> f16x2
conversion (`cvt.rn.f16x2.e4m3x2`, F2FP in SASS) or bf16x2 FMAs. This measures, per SM and cycle, how many warp
instructions of each kind issue when a kernel does nothing else (8 independent chains a thread), alone and
paired: if a pair runs at the sum of the two rates, they use different pipes. Then mixes in the proportions of the
gate-up loop's SASS, as it is and with some of its shifts moved to other pipes (docs/benchmarks.md, twenty-fourth
session, has the H200's numbers). The tensor-core steps (bf16, s8 and b1 mma.sync) say what a dequant that
moves work onto the tensor cores can issue beside the ALU and FMA pipes.

    python -m bench.pipe_probe          # CUDA only; prints warp instructions / cycle / SM
"""

from __future__ import annotations

from typing import Sequence

import torch

from moebox.ops.triton.runtime import HAVE_TRITON, build_sm90, loop_sass, tl, triton

REPEAT = 16          # ops of each kind per chain and asm block
ITERS = 256          # asm blocks in a row (a loop): a launch runs ~1 ms, far above Python's launch cost
ELEMS = 8            # independent chains a thread, 4 interleaved in each asm block
WARPS = 4            # a program's; 16 programs an SM fill its 64 warp slots
BLOCK = 32 * WARPS * ELEMS

OPS = {   # one step of a chain on the 32-bit register {r} (read and written)
    "lop3": "lop3.b32 {r}, {r}, 0x33333333, 0x40404040, 0xEA;",
    "shf": "shf.r.wrap.b32 {r}, {r}, {r}, 3;",
    "prmt": "prmt.b32 {r}, {r}, 0x76543210, {r};",
    "cvt_e4m3": "{{ .reg .b16 lo, hi; mov.b32 {{lo, hi}}, {r}; cvt.rn.f16x2.e4m3x2 {r}, lo; }}",
    "hfma2_bf16": "fma.rn.bf16x2 {r}, {r}, k1, k2;",
    "hfma2_f16": "fma.rn.f16x2 {r}, {r}, k3, k2;",
    "imad": "mad.lo.u32 {r}, {r}, {r}, k2;",
    # a right shift by 16 as the high word of a product with 2^16 (a run-time value: a literal 2^16 becomes SHF)
    "imad_hi": "mul.hi.u32 {r}, {r}, $8;",
    "imad_wide": "{{ .reg .b64 w; mul.wide.u32 w, {r}, $8; mov.b64 {{t0, {r}}}, w; }}",
    # an f16x2 add whose operand takes the high half twice (.H1_H1), one HADD2 in SASS: w2_moe's selector_fma adds -0,
    # but a chain of those is idempotent, so here it adds ~1 (alone, ptxas packs two chains' equal halves into one
    # HADD2: read its rate from the pair with LOP3)
    "hadd2_h1": "{{ .reg .b16 lo, hi; mov.b32 {{lo, hi}}, {r}; mov.b32 {r}, {{hi, hi}}; add.rn.f16x2 {r}, {r}, k3; }}",
    # int32 -> fp32 (I2FP in sm_90 SASS): what folding an integer mma's results into a float sum costs per result
    "i2f": "cvt.rn.f32.s32 {r}, {r};",
    # tensor-core steps: one mma on all four registers as its accumulators (so a block is one chain of them; 64 warps
    # an SM keep 128 chains in flight), A and B from the constants. bf16 (what the expert kernels issue), s8, and
    # b1 AND-popc, which sm_90 builds as one native BMMA (s4 it emulates with two IMMAs and conversions)
    "hmma": "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{$0, $1, $2, $3}}, {{k1, k1, k1, k1}}, {{k1, k1}}, "
            "{{$0, $1, $2, $3}};",
    "imma": "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {{$0, $1, $2, $3}}, {{k1, k2, k3, k1}}, {{k2, k3}}, "
            "{{$0, $1, $2, $3}};",
    "bmma": "mma.sync.aligned.m16n8k256.row.col.s32.b1.b1.s32.and.popc {{$0, $1, $2, $3}}, {{k1, k2, k3, k1}}, "
            "{{k2, k3}}, {{$0, $1, $2, $3}};",
}
PAIRS = [("lop3", "hadd2_h1"), ("prmt", "cvt_e4m3"), ("lop3", "cvt_e4m3"), ("lop3", "hfma2_bf16"),
         ("prmt", "hfma2_f16"), ("lop3", "imad"), ("lop3", "imad_hi"), ("prmt", "imad_hi"), ("lop3", "imad_wide"),
         ("hmma", "prmt"), ("bmma", "imad"), ("bmma", "lop3"), ("lop3", "i2f"), ("imad", "i2f")]
# the gate-up loop's mix (sm_90 SASS of an iteration: PRMT 135, SHF 92, LOP3 80, IMAD 76, i.e. ~8:5:5:4); the
# same with 4 or 2 of the 5 shifts (its 64 `>> 16`) as IMAD.HI; and with 4 as the swizzled HADD2 (selector_fma):
# the time a mix of 22 ops takes, in cycles an SM
MIXES = {"unpack": ["prmt"] * 8 + ["shf"] * 5 + ["lop3"] * 5 + ["imad"] * 4,
         "unpack_hi": ["prmt"] * 8 + ["shf"] + ["imad_hi"] * 4 + ["lop3"] * 5 + ["imad"] * 4,
         "unpack_hi2": ["prmt"] * 8 + ["shf"] * 3 + ["imad_hi"] * 2 + ["lop3"] * 5 + ["imad"] * 4,
         "unpack_hadd2": ["prmt", "hadd2_h1"] * 4 + ["prmt"] * 4 + ["shf"] + ["lop3"] * 5 + ["imad"] * 4}


if HAVE_TRITON:
    @triton.jit
    def _chain_kernel(out_ptr, mult_ptr, ASM: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = offs.to(tl.int32) * 40503 + 12345
        mult = tl.load(mult_ptr + offs * 0)      # 2^16, unknown to the compiler
        for _ in range(ITERS):
            x = tl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,r,r,r,r,r,r,r,r", [x, mult], dtype=tl.int32,
                                          is_pure=True, pack=4)
        tl.store(out_ptr + offs, x)


def _asm(ops: Sequence[str]) -> str:
    """$0..$3 = $4..$7, then the steps of `ops` (names in OPS) in turn on the 4 registers round-robin (4
    independent chains); k1..k3: constants the FMAs take (bf16 / f16 ~1.0, a tiny addend); $8: 2^16 from memory."""
    steps = [OPS[o] for o in ops]
    head = ("{ .reg .b32 k1, k2, k3, t0; mov.b32 k1, 0x3F813F81; mov.b32 k2, 0x00010001; mov.b32 k3, 0x3C013C01;"
            " mov.b32 $0, $4; mov.b32 $1, $5; mov.b32 $2, $6; mov.b32 $3, $7;")
    body = [steps[i % len(steps)].format(r=f"${j}") for i in range(REPEAT * len(steps)) for j in range(4)]
    return "\n".join([head] + body + ["}"])


def clock_hz() -> tuple[float, str]:
    """The SM clock torch reports (`clock_rate`, kHz, where this torch has it), else the H200's boost clock."""
    khz = getattr(torch.cuda.get_device_properties(0), "clock_rate", None)
    return (khz * 1e3, "reported") if khz else (1.98e9, "assumed: the H200's boost clock")


def sass_ops(ops: Sequence[str]) -> tuple[dict[str, int], int, bool]:
    """(op counts of the loop body, spill bytes, whether there is a loop) of the chain kernel for `ops`, built for
    sm_90 on any machine (no GPU needed): what `rate` times."""
    k = build_sm90(_chain_kernel, {"out_ptr": "*i32", "mult_ptr": "*i32"},
                   {"ASM": _asm(ops), "BLOCK": BLOCK, "ITERS": ITERS}, ["out_ptr", "mult_ptr"], num_warps=WARPS)
    counts, _, spills, looped = loop_sass(k.asm["cubin"])
    return counts, spills, looped


def rate(ops: Sequence[str]) -> float:
    """Warp instructions of the chains of `ops` issued per SM and cycle (at `clock_hz`)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    programs = 16 * sms
    out = torch.empty(programs * BLOCK, dtype=torch.int32, device="cuda")
    mult = torch.full((1,), 1 << 16, dtype=torch.int32, device="cuda")
    asm = _asm(ops)
    run = lambda: _chain_kernel[(programs,)](out, mult, ASM=asm, BLOCK=BLOCK, ITERS=ITERS,  # noqa: E731
                                             num_warps=WARPS)
    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        run()
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / 5
    warp_instr = programs * WARPS * ELEMS * REPEAT * ITERS * len(ops)   # ELEMS / 4 blocks of 4 chains a thread
    return warp_instr / seconds / clock_hz()[0] / sms


def main() -> None:
    hz, source = clock_hz()
    print(f"{torch.cuda.get_device_name()}, clock {hz / 1e9:.2f} GHz ({source})")
    print("| instructions | warp instr / cycle / SM |\n|---|---|")
    for ops in [[name] for name in OPS] + [list(pair) for pair in PAIRS]:
        print(f"| {'+'.join(ops)} | {rate(ops):.2f} |", flush=True)
    print("\n| mix of 22 warp instructions | warp instr / cycle / SM | cycles a warp-mix / SM |\n|---|---|---|")
    for name, ops in MIXES.items():
        r = rate(ops)
        print(f"| {name} | {r:.2f} | {len(ops) / r:.2f} |", flush=True)


if __name__ == "__main__":
    main()
