"""A one-warp emulator of the few PTX instructions the kernels' inline asm uses (moebox/ops/triton/w2_moe.py,
fp8_mma.py, bench/bitplane_gate_up.py): the tests run the asm text itself on the CPU, with mma.sync.m16n8k16's
and m16n8k256 b1's fragments laid out as the PTX ISA defines them (lane = 4 * groupID + threadID_in_group) and
conversions done by numpy/torch, so a wrong register, fragment slot or byte order in the asm fails a test without
a GPU."""

from __future__ import annotations

import numpy as np
import torch

_M32 = 0xFFFFFFFF


def f32(v: int) -> float:
    return float(np.array([v], dtype=np.uint32).view(np.float32)[0])


def f32_bits(f: float) -> int:
    return int(np.array([f], dtype=np.float32).view(np.uint32)[0])


def _pair(v: int, kind: str) -> tuple[float, float]:
    """The two 16-bit halves of v as floats (low half first): "bf16" or "f16"."""
    if kind == "bf16":
        return tuple(f32((v >> s & 0xFFFF) << 16) for s in (0, 16))
    return tuple(float(h) for h in np.array([v & 0xFFFF, v >> 16], dtype=np.uint16).view(np.float16))


def _signed(v: int) -> int:
    return v - (1 << 32) if v >> 31 else v


def _c_slots(g: int, t: int) -> tuple[tuple[int, int], ...]:
    """(row, column) of the accumulator's four registers in lane 4 g + t (both mma shapes)."""
    return (g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)


def _bmma(d: list[str], a: list[str], b: list[str], c: list[str], regs: list[dict]) -> None:
    """m16n8k256 b1 and.popc: D = C + popc(A row & B column), K as 8 chunks of 32 bits. Lane (g, t) holds A chunk t
    of rows g, g + 8 in a0, a1 and chunk t + 4 in a2, a3, B chunks t and t + 4 of column g in b0, b1 (the bits of
    a chunk in the same order in A and B, so AND-popc pairs the chunks' words whole)."""
    A, B = np.zeros((16, 8), dtype=np.int64), np.zeros((8, 8), dtype=np.int64)
    for lane, r in enumerate(regs):
        g, t = lane >> 2, lane & 3
        for q, (row, chunk) in enumerate(((g, t), (g + 8, t), (g, t + 4), (g + 8, t + 4))):
            A[row, chunk] = r[a[q]]
        B[g, t], B[g, t + 4] = r[b[0]], r[b[1]]
    for lane, r in enumerate(regs):
        for q, (row, col) in enumerate(_c_slots(lane >> 2, lane & 3)):
            popc = sum(bin(int(A[row, j]) & int(B[col, j])).count("1") for j in range(8))
            r[d[q]] = (_signed(r[c[q]]) + popc) & _M32


def _mma(op: str, rest: str, regs: list[dict]) -> None:
    groups = [grp.replace("{", "").split(",") for grp in rest.split("}")[:4]]
    d, a, b, c = ([x.strip(", ") for x in grp if x.strip(", ")] for grp in groups)
    if op == "mma.sync.aligned.m16n8k256.row.col.s32.b1.b1.s32.and.popc":
        return _bmma(d, a, b, c, regs)
    kind = {"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32": "bf16",
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32": "f16"}[op]
    A, B, C = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
    for lane, r in enumerate(regs):
        g, t = lane >> 2, lane & 3
        for q, (row, k0) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))):
            A[row, k0:k0 + 2] = _pair(r[a[q]], kind)
        for q, k0 in enumerate((2 * t, 2 * t + 8)):
            B[k0:k0 + 2, g] = _pair(r[b[q]], kind)
        for q, (row, col) in enumerate(_c_slots(g, t)):
            C[row, col] = f32(r[c[q]])
    D = (A @ B + C).astype(np.float32)
    for lane, r in enumerate(regs):
        for q, (row, col) in enumerate(_c_slots(lane >> 2, lane & 3)):
            r[d[q]] = f32_bits(D[row, col])


def _scalar(op: str, v: list[int]) -> int:
    if op in ("mov.b32", "mov.f32"):
        return v[0]
    if op == "shr.b32":
        return v[0] >> v[1]
    if op == "shl.b32":
        return v[0] << v[1]
    if op == "and.b32":
        return v[0] & v[1]
    if op in ("mul.lo.u32", "mad.lo.u32", "mad.lo.s32"):   # the low 32 bits: the same for signed operands
        return v[0] * v[1] + (v[2] if len(v) > 2 else 0)
    if op == "setp.lt.s32":
        return int(_signed(v[0]) < _signed(v[1]))
    if op == "setp.ne.s32":
        return int(v[0] != v[1])
    if op == "selp.b32":
        return v[0] if v[2] else v[1]
    if op == "cvt.rn.f32.s32":
        return f32_bits(float(_signed(v[0])))
    if op == "fma.rn.f32":   # one rounding of the float64 result: exact where the product and sum fit 53 bits
        return f32_bits(f32(v[0]) * f32(v[1]) + f32(v[2]))
    if op == "lop3.b32":
        assert v[3] == 0xEA
        return (v[0] & v[1]) | v[2]
    if op == "prmt.b32":   # default mode: selector nibbles 0-3 pick bytes of {b, a} (a = bytes 0-3)
        assert not v[2] & 0x8888, "sign-replicate mode is not used"
        src = v[0] | (v[1] << 32)
        return sum(((src >> (8 * ((v[2] >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))
    if op == "add.rn.f16x2":   # IEEE half additions (numpy rounds the exact sum once)
        a, b = (np.array([x & 0xFFFF, x >> 16], dtype=np.uint16).view(np.float16) for x in v)
        h = (a + b).view(np.uint16)
        return int(h[0]) | (int(h[1]) << 16)
    if op == "cvt.rn.f16x2.f32":   # a -> high half, b -> low half
        hi, lo = (int(np.array([f32(x)], dtype=np.float32).astype(np.float16).view(np.uint16)[0]) for x in v)
        return (hi << 16) | lo
    if op == "cvt.rn.f16x2.e4m3x2":   # byte 0 -> low half, byte 1 -> high half
        h = torch.tensor([v[0] & 0xFF, v[0] >> 8], dtype=torch.uint8).view(torch.float8_e4m3fn).float().half()
        h = h.view(torch.int16).numpy().view(np.uint16)
        return int(h[0]) | (int(h[1]) << 16)
    raise AssertionError(f"unexpected instruction {op}")


def run_warp(asm: str, inputs: list[list[int]], first_in: int, outputs: int) -> list[list[int]]:
    """Execute `asm` for one warp: inputs[lane] = the operands $first_in.., returns outputs[lane] = $0..
    $outputs-1."""
    regs = [{f"${first_in + i}": v for i, v in enumerate(lane)} for lane in inputs]
    body = asm.replace("{ ", "{\n").replace("; ", ";\n").replace(" }", "\n}")
    for line in body.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        pred = None
        if op.startswith("@"):   # a predicated instruction runs in the lanes whose predicate register is set
            pred, (op, rest) = op[1:], rest.split(None, 1)
        if op.startswith("mma.sync"):
            _mma(op, rest, regs)
            continue
        args = [x.strip() for x in rest.split(",")]
        for r in regs:
            if pred is not None and not r[pred]:
                continue
            if op == "mov.b32" and args[0].startswith("{"):   # unpack into two 16-bit registers
                v = r[args[2]]
                r[args[0][1:]], r[args[1][:-1]] = v & 0xFFFF, v >> 16
                continue
            if op == "mov.b32" and args[1].startswith("{"):   # pack two 16-bit registers (low half first)
                r[args[0]] = r[args[1][1:]] | (r[args[2][:-1]] << 16)
                continue
            v = [0 if x == "0f00000000" else int(x, 0) if x[0].isdigit() or x[0] == "-" else r[x]
                 for x in args[1:]]
            r[args[0]] = _scalar(op, v) & _M32
    return [[r[f"${i}"] for i in range(outputs)] for r in regs]
