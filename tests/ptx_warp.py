"""A one-warp emulator of the few PTX instructions the kernels' inline asm uses (moebox/ops/triton/w2_moe.py,
fp8_mma.py): the tests run the asm text itself on the CPU, with mma.sync.m16n8k16's fragments laid out as
the PTX ISA defines them (lane = 4 * groupID + threadID_in_group) and conversions done by numpy/torch, so a
wrong register, fragment slot or byte order in the asm fails a test without a GPU."""

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


def _mma(op: str, rest: str, regs: list[dict]) -> None:
    kind = {"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32": "bf16",
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32": "f16"}[op]
    groups = [grp.replace("{", "").split(",") for grp in rest.split("}")[:4]]
    d, a, b, c = ([x.strip(", ") for x in grp if x.strip(", ")] for grp in groups)
    A, B, C = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
    c_slots = lambda g, t: ((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1))   # noqa: E731
    for lane, r in enumerate(regs):
        g, t = lane >> 2, lane & 3
        for q, (row, k0) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))):
            A[row, k0:k0 + 2] = _pair(r[a[q]], kind)
        for q, k0 in enumerate((2 * t, 2 * t + 8)):
            B[k0:k0 + 2, g] = _pair(r[b[q]], kind)
        for q, (row, col) in enumerate(c_slots(g, t)):
            C[row, col] = f32(r[c[q]])
    D = (A @ B + C).astype(np.float32)
    for lane, r in enumerate(regs):
        for q, (row, col) in enumerate(c_slots(lane >> 2, lane & 3)):
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
    if op in ("mul.lo.u32", "mad.lo.u32"):
        return v[0] * v[1] + (v[2] if len(v) > 2 else 0)
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
        if op.startswith("mma.sync"):
            _mma(op, rest, regs)
            continue
        args = [x.strip() for x in rest.split(",")]
        for r in regs:
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
