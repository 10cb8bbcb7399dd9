"""Cold vs warm start of `LLM(..., experts="w2", store_dir=...)`: the first start packs the plane store, later
starts only read it. Each start runs in a fresh process and times the `LLM(...)` call (interpreter and torch
import excluded: ~2 s that no store can save); the numbers go to docs/benchmarks.md.
    python bench/warm_start.py --preset small --workdir /tmp/warm
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

START = """
import time
from moebox import LLM
t0 = time.perf_counter()
LLM({model!r}, experts="w2", store_dir={store!r}, progress=False)
print(time.perf_counter() - t0)
"""


def start_seconds(model: Path, store: Path) -> float:
    r = subprocess.run([sys.executable, "-c", START.format(model=str(model), store=str(store))], check=True,
                       capture_output=True, text=True)
    return float(r.stdout.split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--warm-runs", type=int, default=3)
    args = ap.parse_args()
    from moebox.weights.synth import write_synthetic
    work = Path(args.workdir)
    model, store = work / "model", work / "store"
    if not (model / "config.json").exists():
        shutil.rmtree(model, ignore_errors=True)
        write_synthetic(model, args.preset, seed=0, layers=args.layers, progress=False)
    shutil.rmtree(store, ignore_errors=True)
    cold = start_seconds(model, store)
    warm = min(start_seconds(model, store) for _ in range(args.warm_runs))
    print(f"{args.preset}: cold start {cold:.2f} s (packs the store), warm start {warm:.2f} s "
          f"(best of {args.warm_runs}), {cold / warm:.1f}x")


if __name__ == "__main__":
    main()
