"""Which kernels a decode step spends its time in, for several `--timeline` files side by side.

A step's time at one batch size against another (batch 2 costs 1.7 ms more than batch 1 on the H200 while its
floor grows by 0.43 ms: twenty-second session, docs/benchmarks.md) or with a switch on and off is easiest to
place by kernel: this sums each kernel's launches and busy time per file (names cut at the argument list) and
prints them as one table, ordered by each kernel's largest time in any file. Under PDL a kernel's time includes its wait
for the one before it (it starts early), so compare PDL-on files with each other.

    python -m bench.timeline_kernels runs/gpu/tl-b1.tsv runs/gpu/tl-b2.tsv [--top 30]
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Sequence

from moebox.bench.decode import read_timeline


def kernel_totals(rows: Sequence[dict]) -> dict[str, tuple[int, float]]:
    """{kernel name without its arguments: (launches, busy us)} of one step's rows (name, dur_us)."""
    count: Counter[str] = Counter()
    busy: Counter[str] = Counter()
    for r in rows:
        name = r["name"].split("(")[0].strip()
        count[name] += 1
        busy[name] += float(r["dur_us"])
    return {name: (count[name], busy[name]) for name in count}


def table(totals: Sequence[dict[str, tuple[int, float]]], labels: Sequence[str], top: int) -> str:
    """Markdown rows: kernel, then launches / us for each file, ordered by the kernel's largest us in any file."""
    names = sorted({n for t in totals for n in t}, key=lambda n: -max(t.get(n, (0, 0.0))[1] for t in totals))
    lines = ["| kernel | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for name in names[:top]:
        cells = [f"{t[name][0]} / {t[name][1]:.1f}" if name in t else "-" for t in totals]
        lines.append(f"| {name[:60]} | " + " | ".join(cells) + " |")
    lines.append("| all | " + " | ".join(f"{sum(v[1] for v in t.values()):.1f}" for t in totals) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="timeline files (`moebox bench decode --timeline FILE`)")
    parser.add_argument("--top", type=int, default=30, help="kernels shown (default 30)")
    args = parser.parse_args(argv)
    print(table([kernel_totals(read_timeline(path)) for path in args.paths], args.paths, args.top))


if __name__ == "__main__":
    main()
