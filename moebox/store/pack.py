"""Packing a checkpoint's routed experts into a plane store, streaming with bounded memory.

One expert tensor at a time is read from its shard, converted to 2-bit planes and written to its slot; a
layer is committed (fdatasync + sidecar) when all its experts are written. Host memory therefore holds one
expert's source tensors and planes at a time, whatever the model size, and an interrupted pack resumes at
the first incomplete layer.
"""

from __future__ import annotations

import hashlib
import logging
import contextlib
import resource
import signal
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from moebox.quant.w2 import ErrorStats, W2Tensor, error_stats, from_float, from_fp4
from moebox.store.plane_store import EXPERT_TENSORS, PlaneStore, StoreShape
from moebox.weights.checkpoint import Checkpoint
from moebox.weights.formats import QuantTensor

log = logging.getLogger("moebox")

# small dense tensors whose bytes enter the checkpoint identity: any fine-tune changes them, and together
# they are a few MB even for V4-Flash
_IDENTITY_SUFFIXES = ("norm.weight", "attn_sink", "ffn.gate.bias", "hc_head_base", "hc_attn_base", "hc_ffn_base")


def checkpoint_identity(ckpt: Checkpoint) -> str:
    """sha256 of config.json, every shard's name, size and header, and the bytes of the small dense tensors.

    Reads no expert bytes (so a warm start never touches them) yet tells apart two checkpoints with the same
    shapes but different weights."""
    h = hashlib.sha256((ckpt.dir / "config.json").read_bytes())
    for path in ckpt.files:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            h.update(path.name.encode() + b"\0" + str(path.stat().st_size).encode() + b"\0" + f.read(n))
    for name in ckpt.names():
        if name.endswith(_IDENTITY_SUFFIXES):
            t = ckpt.get(name)
            assert isinstance(t, torch.Tensor)
            h.update(name.encode() + t.contiguous().view(torch.uint8).flatten().numpy().tobytes())
    return "sha256:" + h.hexdigest()


def expert_layers(ckpt: Checkpoint) -> list[str]:
    """Name prefixes of the MoE blocks whose routed experts the store holds: main layers, then MTP blocks."""
    cfg = ckpt.config
    prefixes = [f"layers.{i}.ffn.experts." for i in range(cfg.num_layers)]
    names = set(ckpt.names())
    prefixes += [f"mtp.{j}.ffn.experts." for j in range(cfg.num_mtp_layers) if f"mtp.{j}.ffn.experts.0.w1.weight" in names]
    return prefixes


def open_store(ckpt: Checkpoint, store_dir: str | Path, identity: str | None = None) -> PlaneStore:
    """The store for `ckpt` in `store_dir`; pass `identity` when it is already known (computing it reads the
    checkpoint's small dense tensors)."""
    cfg = ckpt.config
    shape = StoreShape(layers=len(expert_layers(ckpt)), experts=cfg.n_routed_experts, hidden=cfg.hidden_size,
                       intermediate=cfg.moe_intermediate_size)
    return PlaneStore(store_dir, shape, identity or checkpoint_identity(ckpt))


def prepare_store(ckpt: Checkpoint, store_dir: str | Path | None, identity: str | None = None) -> PlaneStore:
    """The store for `ckpt`, after the checks that must pass before any work: a store that still needs
    layers must be a writable directory outside the model directory with room for them. A complete store
    is only read (a read-only mount is fine). Without `store_dir`, a directory per checkpoint in the cache."""
    from moebox.demo import cache_root
    from moebox.runtime.dirs import check_store_dir
    identity = identity or checkpoint_identity(ckpt)
    if store_dir is None:
        store_dir = cache_root() / "stores" / identity.removeprefix("sha256:")[:16]
    store = open_store(ckpt, store_dir, identity)
    missing = store.missing_layers()
    if missing:
        check_store_dir(store_dir, ckpt.dir, len(missing) * store.shape.layer_bytes)
    return store


def to_planes(src: torch.Tensor | QuantTensor) -> W2Tensor:
    if isinstance(src, QuantTensor) and src.kind == "fp4":
        return from_fp4(src.data, src.scale)
    return from_float(src.dequantize(torch.float32) if isinstance(src, QuantTensor) else src.float())


@dataclass
class PackSummary:
    layers_packed: list[int]
    layers_reused: list[int]
    bytes_read: int
    bytes_written: int
    bits_per_weight: float
    seconds: float
    peak_rss_bytes: int
    errors: list[ErrorStats] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = [f"packed {len(self.layers_packed)} layer(s), reused {len(self.layers_reused)} complete layer(s)",
               f"{self.bytes_read / 2**30:.3f} GiB of experts read, {self.bytes_written / 2**30:.3f} GiB of planes "
               f"written at {self.bits_per_weight:.2f} bits/weight in {self.seconds:.1f} s "
               f"({self.bytes_read / max(self.seconds, 1e-9) / 1e9:.2f} GB/s read)",
               f"peak RSS {self.peak_rss_bytes / 2**30:.2f} GiB"]
        if self.errors:
            rel = [e.rel_rmse for e in self.errors]
            cos = [e.cosine for e in self.errors]
            out.append(f"error vs source over {len(self.errors)} sampled tensors: relative RMS mean "
                       f"{sum(rel) / len(rel):.4f} max {max(rel):.4f}, cosine min {min(cos):.4f}")
        return out


def peak_rss_bytes() -> int:
    """This process's peak resident memory. VmHWM, not ru_maxrss: ru_maxrss survives exec, so a process started
    from a big parent would report the parent's size."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@contextlib.contextmanager
def interrupt_between_steps() -> Iterator[Callable[[], None]]:
    """Ctrl-C raised only where the caller says it is safe. A KeyboardInterrupt that lands inside torch or
    safetensors can come out as an unrelated error (torch turns one during tensor construction into a
    ValueError), so SIGINT is recorded and the yielded check raises it between experts; a second Ctrl-C
    interrupts at once. Outside the main thread signals cannot be handled and nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    asked = threading.Event()

    def on_sigint(signum: int, frame: object) -> None:
        if asked.is_set():
            raise KeyboardInterrupt
        asked.set()
        log.info("interrupt: stopping after the current expert (Ctrl-C again to stop now)")

    def check() -> None:
        if asked.is_set():
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield check
    finally:
        signal.signal(signal.SIGINT, previous)


def pack(ckpt: Checkpoint, store: PlaneStore, *, progress: bool = True, stats_every: int = 16) -> PackSummary:
    """Write every missing layer of `store` from `ckpt`. Error statistics (planes vs the source values) are
    taken on every `stats_every`-th expert, enough to see a broken conversion without doubling the work."""
    t0 = time.perf_counter()
    reused = store.complete_layers
    prefixes = expert_layers(ckpt)
    todo = store.missing_layers()
    if reused:
        log.info("plane store %s: %d of %d layers already complete, packing %d", store.path, len(reused),
                 store.shape.layers, len(todo))
    E = store.shape.experts
    errors: list[ErrorStats] = []
    written = read = 0
    with store.writer() as w, interrupt_between_steps() as check_interrupt:
        todo = store.missing_layers()            # the writer may have reset a stale store
        bar = tqdm(total=len(todo) * E, unit="expert", disable=not progress, smoothing=0.1)
        for layer in todo:
            bar.set_description(f"pack layer {layer + 1}/{store.shape.layers}", refresh=False)
            for e in range(E):
                check_interrupt()
                planes = []
                for t in EXPERT_TENSORS:
                    src = ckpt.get(f"{prefixes[layer]}{e}.{t}.weight")
                    read += src.nbytes if isinstance(src, QuantTensor) else src.numel() * src.element_size()
                    p = to_planes(src)
                    if e % stats_every == layer % stats_every:
                        ref = src.dequantize(torch.float32) if isinstance(src, QuantTensor) else src.float()
                        errors.append(error_stats(ref, p.dequantize(torch.float32)))
                    planes.append(p)
                w.write_expert(layer, e, tuple(planes))  # type: ignore[arg-type]
                written += store.shape.slot_bytes
                bar.update(1)
                bar.set_postfix_str(f"read {read / max(time.perf_counter() - t0, 1e-9) / 1e9:.2f} GB/s", refresh=False)
            w.commit_layer(layer)
            log.debug("plane store %s: layer %d complete", store.path, layer)
        bar.close()
    return PackSummary(layers_packed=todo, layers_reused=reused, bytes_read=read, bytes_written=written,
                       bits_per_weight=store.shape.slot_bytes * 8 / (3 * store.shape.hidden * store.shape.intermediate),
                       seconds=time.perf_counter() - t0,
                       peak_rss_bytes=peak_rss_bytes(), errors=errors)
