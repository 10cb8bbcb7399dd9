"""`moebox pack` and `LLM(experts="w2")` end to end: read-only model dirs work; a read-only store, a store
inside the model dir, a disk too small each stop in seconds with one clear line; a complete store is
served from a read-only mount; packing stays within its memory bound."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from bench.pack_memory import measure
from moebox.weights.synth import write_synthetic
from tests.mounts import in_namespace, needs_unshare

PACK = [sys.executable, "-m", "moebox.cli", "pack"]


def pack_argv(model: Path, store: Path) -> str:
    return " ".join([*PACK, str(model), "--store", str(store), "--quiet"])


def one_line_error(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moebox: error: "), r.stderr
    return lines[0]


def test_store_inside_the_model_dir_is_refused(tiny_ckpt):
    t0 = time.time()
    r = subprocess.run([*PACK, str(tiny_ckpt), "--store", str(tiny_ckpt / "planes")], capture_output=True, text=True)
    assert "inside the model directory" in one_line_error(r)
    assert not (tiny_ckpt / "planes").exists() and time.time() - t0 < 30


@needs_unshare
def test_read_only_model_dir_packs_and_serves(tiny_ckpt, tmp_path):
    ro = tmp_path / "ro-model"
    ro.mkdir()
    store = tmp_path / "store"
    mounts = f"mount --bind {tiny_ckpt} {ro}\nmount -o remount,bind,ro {ro}"
    r = in_namespace(mounts, f"import subprocess, sys; sys.exit(subprocess.call({pack_argv(ro, store).split()!r}))")
    assert r.returncode == 0, r.stdout + r.stderr
    assert (store / "store.json").exists()


@needs_unshare
def test_read_only_store_stops_with_one_line(tiny_ckpt, tmp_path):
    src, ro = tmp_path / "src", tmp_path / "ro"
    src.mkdir()
    ro.mkdir()
    mounts = f"mount --bind {src} {ro}\nmount -o remount,bind,ro {ro}"
    t0 = time.time()
    r = in_namespace(mounts, f"import subprocess, sys; sys.exit(subprocess.call({pack_argv(tiny_ckpt, ro).split()!r}))")
    assert "read-only file system" in one_line_error(r) and time.time() - t0 < 30


@needs_unshare
def test_complete_store_is_served_from_a_read_only_mount(tiny_ckpt, tmp_path):
    store, ro = tmp_path / "store", tmp_path / "ro-store"
    ro.mkdir()
    assert subprocess.run(pack_argv(tiny_ckpt, store).split(), capture_output=True).returncode == 0
    mounts = f"mount --bind {store} {ro}\nmount -o remount,bind,ro {ro}"
    r = in_namespace(mounts, f"""
        from moebox import LLM
        llm = LLM({str(tiny_ckpt)!r}, experts="w2", store_dir={str(ro)!r}, progress=False)
        print("OK", llm.logits([0, 5, 6]).shape[0])
    """)
    assert r.returncode == 0 and r.stdout.strip() == "OK 3", r.stdout + r.stderr


@needs_unshare
def test_disk_too_small_stops_before_writing(tmp_path):
    model = write_synthetic(tmp_path / "small", "small", seed=0, layers=1, progress=False)
    disk = tmp_path / "disk"
    disk.mkdir()
    r = in_namespace(f"mount -t tmpfs -o size=1m tmpfs {disk}",
                     f"import subprocess, sys; sys.exit(subprocess.call({pack_argv(model, disk / 's').split()!r}))")
    assert "free but the expert planes need" in one_line_error(r)


def test_pack_memory_stays_bounded(tmp_path):
    """CI-sized run of bench/pack_memory.py (the >= 4 GiB run is in docs/benchmarks.md)."""
    model = write_synthetic(tmp_path / "m", "small", seed=0, layers=2, shard_size_mb=16, progress=False)
    r = measure(model, tmp_path / "store")
    print(f"\npack peak RSS {r.peak_rss_bytes / 2**30:.2f} GiB, largest shard {r.largest_shard_bytes / 2**20:.0f} MiB")
    assert r.ok
