"""How long a decode step's main stream waits for attention's key branch, from `--timeline` files.

In a step the main stream rotates its queries (`_query_rope_kernel`) and then needs the key branch's work (the
stored keys, the compressors' entries) for the indexer's scores (CSA layers) or the attention itself (HCA,
sliding). The twentieth session's batch-1 timeline (docs/benchmarks.md) showed the wait from the end of the
query RoPE to the start of that next kernel at 12.4 us a CSA layer and 7.7 us in the others. This prints it per
layer kind and in total for each file, so that the key-branch switches (MOEBOX_EARLY_FORK, MOEBOX_SIDE_PRIORITY,
MOEBOX_KEYS_KERNEL) can be judged on where they act, beside the step time.

It also prints the median time from each attention combine's start to the end of the second product after it on
its stream (the output projections wo_a and wo_b): the twenty-first session found the batch-1 loss of the
inverse RoPE in the combine (MOEBOX_ATTENTION_ROPE=1) there, and only with PDL.

    python -m bench.timeline_waits runs/gpu/timeline-*.tsv
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from moebox.bench.decode import read_timeline

QUERY_ROPE = "_query_rope_kernel"
CSA_NEXT = "_index_scores_kernel"                   # the indexer reads the new index keys
ATTENTION = "attend"                                # the fused kernel, or the compiled torch path
COMBINE = "_combine_kernel"                         # the decode attention's last kernel
PRODUCT = "_fp8_gemv_kernel"


@dataclass
class Waits:
    csa: list[float]
    other: list[float]

    def line(self, name: str) -> str:
        def part(label: str, v: list[float]) -> str:
            return f"{label} {len(v)} layers, {sum(v) / len(v):.1f} us each" if v else f"{label} none"
        return f"{name}: {part('CSA', self.csa)}; {part('others', self.other)}; {sum(self.csa + self.other):.0f} us"


def key_branch_waits(rows: Sequence[dict]) -> Waits:
    """The waits of one step's kernels (`kernel_timeline` rows: start_us, dur_us, name), in start order."""
    rows = sorted(rows, key=lambda r: float(r["start_us"]))
    waits = Waits([], [])
    for i, r in enumerate(rows):
        if QUERY_ROPE not in r["name"]:
            continue
        end = float(r["start_us"]) + float(r["dur_us"])
        nxt = next((x for x in rows[i + 1:] if CSA_NEXT in x["name"] or ATTENTION in x["name"]), None)
        if nxt is not None:
            (waits.csa if CSA_NEXT in nxt["name"] else waits.other).append(max(0.0, float(nxt["start_us"]) - end))
    return waits


def output_spans(rows: Sequence[dict], products: int = 2) -> list[float]:
    """Per attention combine: us from its start to the end of the `products`-th FP8 product after it on the
    same stream (combines without that many are left out)."""
    rows = sorted(rows, key=lambda r: float(r["start_us"]))
    spans = []
    for i, r in enumerate(rows):
        if COMBINE not in r["name"]:
            continue
        after = [x for x in rows[i + 1:] if PRODUCT in x["name"] and x["stream"] == r["stream"]][:products]
        if len(after) == products:
            spans.append(float(after[-1]["start_us"]) + float(after[-1]["dur_us"]) - float(r["start_us"]))
    return spans


def main(paths: Sequence[str]) -> None:
    for path in paths:
        rows = read_timeline(path)
        spans = output_spans(rows)
        median = f"{statistics.median(spans):.1f} us" if spans else "none"
        print(f"{key_branch_waits(rows).line(path)}; attention combine to its 2nd product's end: {median}")


if __name__ == "__main__":
    main(sys.argv[1:])
