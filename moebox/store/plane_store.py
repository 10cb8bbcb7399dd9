"""The plane store: a directory holding the 2-bit routed experts of one (checkpoint, quantizer) pair.

Layout (format version 1):
- `experts.bin`: one fixed-stride slot per (layer, expert) at offset (layer * E + expert) * stride; a slot is
  [w1 codes | w1 scales | w3 codes | w3 scales | w2 codes | w2 scales] (w2.py's layout), zero-padded to a
  multiple of 4 KiB. Layers 0..L-1 are the main layers, L.. the MTP blocks.
- `store.json`: the sidecar: format version, quantizer and checkpoint identity, shapes, layers complete.
  Nothing time-dependent, so two runs that write the same layers produce the same bytes.
- `store.lock`: held (flock, exclusive) by the one process writing.

Writes go layer by layer: pwrite the layer's slots, fdatasync, then replace the sidecar atomically (tmp file,
fsync, rename, fsync dir). A crash at any point leaves a valid store of the layers listed as complete; the
next run resumes. A sidecar that disagrees in anything (version, quantizer, checkpoint, shapes) is never
trusted: the store is reset and rebuilt.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import torch

from moebox.errors import MoeboxError
from moebox.quant.w2 import BITS_PER_WEIGHT, W2Tensor

log = logging.getLogger("moebox")

FORMAT = "moebox-plane-store"
FORMAT_VERSION = 1
QUANTIZER = {"name": "w2-sign-symmetric", "version": 1, "bits_per_weight": BITS_PER_WEIGHT}
SIDECAR, DATA, LOCK = "store.json", "experts.bin", "store.lock"
ALIGN = 4096
EXPERT_TENSORS = ("w1", "w3", "w2")


@dataclass(frozen=True)
class StoreShape:
    layers: int          # main layers + MTP layers
    experts: int
    hidden: int
    intermediate: int

    def tensor_shape(self, name: str) -> tuple[int, int]:
        return (self.hidden, self.intermediate) if name == "w2" else (self.intermediate, self.hidden)

    @property
    def tensor_bytes(self) -> int:
        """Codes + scales of one [I, H] matrix at 2.25 bits/weight."""
        n = self.hidden * self.intermediate
        return n // 4 + n // 32

    @property
    def slot_bytes(self) -> int:
        return 3 * self.tensor_bytes

    @property
    def stride(self) -> int:
        return -(-self.slot_bytes // ALIGN) * ALIGN

    @property
    def layer_bytes(self) -> int:
        return self.experts * self.stride

    @property
    def total_bytes(self) -> int:
        return self.layers * self.layer_bytes


def slot_views(buf: torch.Tensor, shape: StoreShape) -> tuple[W2Tensor, W2Tensor, W2Tensor]:
    """Zero-copy W2Tensor views of one slot's bytes (uint8 [>= slot_bytes])."""
    out, off = [], 0
    for name in EXPERT_TENSORS:
        rows, cols = shape.tensor_shape(name)
        n_codes, n_scales = rows * cols // 4, rows * cols // 32
        codes = buf[off:off + n_codes].view(rows, cols // 4)
        scales = buf[off + n_codes:off + n_codes + n_scales].view(torch.float8_e8m0fnu).view(rows, cols // 32)
        out.append(W2Tensor(codes, scales))
        off += n_codes + n_scales
    return tuple(out)  # type: ignore[return-value]


def slot_buffers(planes: tuple[W2Tensor, W2Tensor, W2Tensor], shape: StoreShape) -> list[memoryview]:
    """The slot's byte ranges in order, without copying (the stride padding stays as written by ftruncate)."""
    parts = []
    for t in planes:
        for x in (t.codes, t.scales.view(torch.uint8)):
            parts.append(memoryview(x.detach().cpu().contiguous().numpy()).cast("B"))
    assert sum(len(p) for p in parts) == shape.slot_bytes
    return parts


class PlaneStore:
    def __init__(self, path: str | Path, shape: StoreShape, checkpoint_id: str) -> None:
        self.path = Path(path)
        self.shape = shape
        self.checkpoint_id = checkpoint_id
        self._complete = self._read_complete_layers()

    # ------------------------------------------------------------------ sidecar
    def _expected_sidecar(self, complete: list[int]) -> dict:
        return {"format": FORMAT, "format_version": FORMAT_VERSION, "quantizer": QUANTIZER,
                "checkpoint": self.checkpoint_id,
                "shape": {**asdict(self.shape), "tensors": list(EXPERT_TENSORS), "slot_bytes": self.shape.slot_bytes,
                          "stride": self.shape.stride},
                "layers_complete": complete}

    def _read_complete_layers(self) -> list[int]:
        """Layers the sidecar lists as complete, or [] (with the reason logged) when anything disagrees."""
        side = self.path / SIDECAR
        if not side.exists():
            return []
        try:
            found = json.loads(side.read_text())
            complete = sorted(int(x) for x in found.get("layers_complete", []))
        except (OSError, ValueError, TypeError, AttributeError) as e:
            log.warning("plane store %s: unreadable sidecar (%s); rebuilding", self.path, e)
            return []
        expected = self._expected_sidecar(complete)
        for key in ("format", "format_version", "quantizer", "checkpoint", "shape"):
            if found.get(key) != expected[key]:
                log.warning("plane store %s: %s differs (store has %r, need %r); rebuilding", self.path, key,
                            found.get(key), expected[key])
                return []
        data = self.path / DATA
        if not data.exists() or data.stat().st_size != self.shape.total_bytes or \
                any(not 0 <= x < self.shape.layers for x in complete):
            log.warning("plane store %s: data file missing or of the wrong size; rebuilding", self.path)
            return []
        return complete

    @property
    def complete_layers(self) -> list[int]:
        return list(self._complete)

    def missing_layers(self) -> list[int]:
        done = set(self._complete)
        return [i for i in range(self.shape.layers) if i not in done]

    # ------------------------------------------------------------------ writing
    @contextmanager
    def writer(self) -> Iterator["_Writer"]:
        """Exclusive write access; (re)initializes the data file when the store is new or stale."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            lock_fd = os.open(self.path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise MoeboxError(f"plane store {self.path}: cannot write there ({e.strerror}); pass a writable "
                              f"--store directory") from None
        try:
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise MoeboxError(f"plane store {self.path}: another process is writing it; wait for it to "
                                  f"finish or use another --store directory") from None
            self._complete = self._read_complete_layers()     # re-read under the lock
            w = _Writer(self)
            try:
                if not self._complete:
                    w.reset()
                yield w
            finally:
                w.close()
        finally:
            os.close(lock_fd)

    def _write_sidecar(self) -> None:
        tmp = self.path / (SIDECAR + ".tmp")
        data = json.dumps(self._expected_sidecar(sorted(self._complete)), indent=1, sort_keys=True) + "\n"
        with open(tmp, "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path / SIDECAR)
        dir_fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    # ------------------------------------------------------------------ reading
    def read_layer(self, layer: int) -> torch.Tensor:
        """All slots of a complete layer as one uint8 tensor [experts, stride] (one positional read)."""
        if layer not in self._complete:
            raise MoeboxError(f"plane store {self.path}: layer {layer} is not complete; run `moebox pack`")
        n = self.shape.layer_bytes
        buf = bytearray(n)
        with open(self.path / DATA, "rb", buffering=0) as f:
            got = f.readinto(memoryview(buf)) if f.seek(layer * n) == layer * n else 0
        if got != n:
            raise MoeboxError(f"plane store {self.path}: short read of layer {layer}; the data file is damaged, "
                              f"delete {self.path} and pack again")
        return torch.frombuffer(buf, dtype=torch.uint8).view(self.shape.experts, self.shape.stride)

    def expert_planes(self, layer_buf: torch.Tensor, expert: int) -> tuple[W2Tensor, W2Tensor, W2Tensor]:
        return slot_views(layer_buf[expert], self.shape)


class _Writer:
    def __init__(self, store: PlaneStore) -> None:
        self.store = store
        self.fd = os.open(store.path / DATA, os.O_RDWR | os.O_CREAT, 0o644)

    def reset(self) -> None:
        """Start over: an empty sidecar first (so a crash never pairs old layers with new data), then a
        zero-filled data file of the final size."""
        s = self.store
        s._complete = []
        s._write_sidecar()
        os.ftruncate(self.fd, 0)
        os.ftruncate(self.fd, s.shape.total_bytes)

    def write_expert(self, layer: int, expert: int, planes: tuple[W2Tensor, W2Tensor, W2Tensor]) -> None:
        s = self.store
        offset = layer * s.shape.layer_bytes + expert * s.shape.stride
        for part in slot_buffers(planes, s.shape):
            while part:
                n = os.pwrite(self.fd, part, offset)
                part, offset = part[n:], offset + n

    def commit_layer(self, layer: int) -> None:
        """Make the layer's slots durable, then list it as complete."""
        os.fdatasync(self.fd)
        s = self.store
        s._complete = sorted(set(s._complete) | {layer})
        s._write_sidecar()

    def close(self) -> None:
        os.close(self.fd)
