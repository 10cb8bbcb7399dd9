"""Peak host memory of `moebox pack` against the bound of issue B: < 2 x the largest shard + 1 GiB.

Writes a synthetic checkpoint (unless it exists), packs it in a fresh child process (what `moebox pack` runs)
which reports its own peak RSS (VmHWM; ru_maxrss would include the parent's memory at fork). Example, the
>= 4 GiB run recorded in docs/benchmarks.md:
    python bench/pack_memory.py --preset flash --layers 1 --workdir /tmp/packmem
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

GiB = 2**30


@dataclass
class PackMemory:
    checkpoint_bytes: int
    largest_shard_bytes: int
    peak_rss_bytes: int
    bound_bytes: int
    seconds: float

    @property
    def ok(self) -> bool:
        return self.peak_rss_bytes < self.bound_bytes


def measure(model: Path, store: Path) -> PackMemory:
    shards = list(model.glob("*.safetensors"))
    largest = max(p.stat().st_size for p in shards)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", CHILD.format(model=str(model), store=str(store))], capture_output=True,
                       text=True)
    if r.returncode != 0:
        raise RuntimeError(f"pack failed: {r.stderr}")
    *summary, peak = r.stdout.strip().splitlines()
    print("\n".join(summary))
    return PackMemory(sum(p.stat().st_size for p in shards), largest, int(peak), 2 * largest + GiB,
                      time.perf_counter() - t0)


CHILD = """
from moebox.store.pack import pack, prepare_store
from moebox.weights.checkpoint import Checkpoint
ckpt = Checkpoint({model!r})
ckpt.validate()
summary = pack(ckpt, prepare_store(ckpt, {store!r}), progress=False)
print("\\n".join(summary.lines()))
print(summary.peak_rss_bytes)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="flash")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and store afterwards")
    args = ap.parse_args()
    work = Path(args.workdir)
    model, store = work / f"{args.preset}-{args.layers}", work / "store"
    if not (model / "config.json").exists():          # in a child too, so this process stays small
        shutil.rmtree(model, ignore_errors=True)
        cmd = [sys.executable, "-m", "moebox.cli", "synth", "--preset", args.preset, "--out", str(model)]
        subprocess.run(cmd + (["--layers", str(args.layers)] if args.layers else []), check=True)
    shutil.rmtree(store, ignore_errors=True)
    r = measure(model, store)
    print(json.dumps({**asdict(r), "ok": r.ok}, indent=1))
    print(f"checkpoint {r.checkpoint_bytes / GiB:.2f} GiB, largest shard {r.largest_shard_bytes / GiB:.2f} GiB, "
          f"peak RSS {r.peak_rss_bytes / GiB:.2f} GiB < bound {r.bound_bytes / GiB:.2f} GiB: {r.ok}, "
          f"{r.seconds:.0f} s")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    sys.exit(0 if r.ok else 1)


if __name__ == "__main__":
    main()
