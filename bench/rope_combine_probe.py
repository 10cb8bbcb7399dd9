"""Why does the inverse RoPE in the attention's combine lose at batch 1 when the kernels say it should win?

At batch 4-16 a V4-Flash decode step gains from rotating the attention output back inside the combine kernel
(one launch fewer a layer), and the attention kernels alone agree at batch 1 (CSA 15.88 us with a separate
inverse RoPE against 13.83 with it in the combine). Yet the batch-1 step loses 0.4 ms with it, and only with PDL
(5.06 -> 5.46 ms; without PDL 5.90 -> 5.84): in the step's timeline the two output products after the combine
(wo_a, wo_b) end 9 us later a layer (twenty-first session, docs/benchmarks.md). A guess: the combine lets its
dependent launch at its start, so wo_a's programs sit beside it. This times the chain attention -> wo_a (grouped
FP8) -> wo_b (FP8) as CUDA-graph replays on distinct slots (keys past L2, every key visible: `replay_inputs`)
with the inverse RoPE after the attention (the Triton kernel at batch 1-3), in its combine, and in its combine
with the dependent's launch held to the combine's end (MOEBOX_COMBINE_HOLD=1); PDL on (the default) and off.
The guess held (twenty-second session, H200, PDL on, batch 1): CSA 42.99 / 43.92 / 35.59 us, HCA 37.67 / 40.86 /
32.48; the held combine is now the default (`attend_triton`).

    python -m bench.rope_combine_probe       # CUDA only; `bash bench/gpu_session.sh ropeprobe`
"""

from __future__ import annotations

import os

import torch

from moebox.ops.linear import grouped_linear, linear
from moebox.ops.rope import inverse_rope, rope_inv_freq
from moebox.ops.triton import decode_attention as da
from moebox.ops.triton.fp8_linear import random_fp8_weight
from moebox.ops.triton.runtime import graph_us, versions

HEADS, HEAD_DIM, GROUPS, O_RANK, HIDDEN = 64, 512, 8, 1024, 4096     # V4-Flash's attention output side
VARIANTS = (("after", "0", False), ("in combine", "0", True), ("in combine, held", "1", True))


def chain_us(kind: str, b: int, device: torch.device) -> list[float]:
    """us a call of the three variants' chains (`VARIANTS`) under the current MOEBOX_PDL."""
    args, slots = da.replay_inputs(kind, b, device)
    rope = (torch.randint(0, 4096, (b,), device=device), rope_inv_freq(64, 10000.0, None).to(device))
    wo_a = random_fp8_weight(GROUPS * O_RANK, HEADS * HEAD_DIM // GROUPS, device, seed=1)
    wo_b = random_fp8_weight(HIDDEN, GROUPS * O_RANK, device, seed=2)

    def chain(slot: torch.Tensor, inside: bool) -> torch.Tensor:
        out = da.attend_triton(slot=slot, **args, rope=rope) if inside else inverse_rope(
            da.attend_triton(slot=slot, **args), *rope)
        o = grouped_linear(out.reshape(b, GROUPS, -1), wo_a, GROUPS)
        return linear(o.flatten(1), wo_b)

    us = []
    for _, hold, inside in VARIANTS:
        os.environ["MOEBOX_COMBINE_HOLD"] = hold          # read as the graph is captured
        us.append(graph_us([lambda s=s, i=inside: chain(s, i) for s in slots]))
    os.environ.pop("MOEBOX_COMBINE_HOLD")
    return us


def main() -> None:
    print(versions())
    device = torch.device("cuda")
    print("attention -> wo_a -> wo_b, us a call: " + " | ".join(name for name, _, _ in VARIANTS))
    for pdl in ("1", "0"):
        os.environ["MOEBOX_PDL"] = pdl
        for kind in ("csa", "hca"):
            for b in (1, 2, 8):
                us = chain_us(kind, b, device)
                print(f"PDL {pdl} {kind} B={b}: " + " | ".join(f"{u:6.2f}" for u in us), flush=True)
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
