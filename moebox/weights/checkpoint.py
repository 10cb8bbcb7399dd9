"""A lazy, validating index over a DeepSeek-V4 safetensors checkpoint in either layout.

Opening a 160 GB checkpoint must cost only its headers: we read each shard's 8-byte length + JSON header and
nothing else until a tensor is asked for. Both the official layout and an HF `save_pretrained` copy are served
under the official (canonical) names, so the model code has one naming to deal with. Everything a damaged or
mismatched download can get wrong becomes a one-line `CheckpointError` naming the tensor, the file and the fix.
"""

from __future__ import annotations

import json
import logging
import struct
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open

from moebox.config import ModelConfig, parse_config, read_raw_config
from moebox.errors import CheckpointError
from moebox.weights.draft_head import MTP_TENSOR, inspect_draft_head
from moebox.weights.formats import QuantTensor
from moebox.weights.hf import HF_DOWN, HF_GATE_UP, hf_to_official_name
from moebox.weights.schema import official_schema, scale_name, tensor_group

log = logging.getLogger("moebox")

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_DTYPE_BYTES = {"F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BOOL": 1, "BF16": 2, "F16": 2,
                "I16": 2, "F32": 4, "I32": 4, "F64": 8, "I64": 8}
_INT_DTYPES = ("I8", "I16", "I32", "I64", "U8")


@dataclass(frozen=True)
class _Entry:
    """One tensor as a shard header describes it."""

    file: Path
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class _Source:
    """Where a canonical tensor comes from: an on-disk tensor, optionally one expert/rows of a stacked one."""

    raw: str
    scale: str | None = None
    expert: int | None = None
    rows: slice | None = None


def _read_header(path: Path) -> tuple[int, dict[str, dict]]:
    """(data start offset, header dict) of a safetensors file, reading only the header bytes."""
    try:
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: {len(head)} bytes, too short to be a safetensors file; re-download it")
            (n,) = struct.unpack("<Q", head)
            size = path.stat().st_size
            if 8 + n > size:
                raise CheckpointError(f"{path}: truncated: header says it is {n} bytes but the file has only "
                                      f"{size} bytes; re-download it")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{path}: header is not valid JSON, not a safetensors file; re-download it") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object, not a safetensors file; re-download it")
    header.pop("__metadata__", None)
    for name, info in header.items():
        if not (isinstance(info, dict) and isinstance(info.get("dtype"), str) and isinstance(info.get("shape"), list)
                and isinstance(info.get("data_offsets"), list) and len(info["data_offsets"]) == 2):
            raise CheckpointError(f"{path}: header entry for tensor '{name}' is malformed (needs dtype, shape and "
                                  f"data_offsets); re-download it")
    return 8 + n, header


class Checkpoint:
    """Lazy view of `model_dir` (config.json + safetensors), keyed by canonical official tensor names."""

    def __init__(self, model_dir: str | Path) -> None:
        self.dir = Path(model_dir)
        raw_config = read_raw_config(self.dir)
        self.config: ModelConfig = parse_config(raw_config, source=str(self.dir / "config.json"))
        self._entries: dict[str, _Entry] = {}
        self._file_end: dict[Path, int] = {}     # byte where each shard's tensor data should end
        self._verified: set[Path] = set()
        self._load_headers()
        raw = self._entries
        self.layout = "hf" if any(n.startswith("model.") or n == "lm_head.weight" for n in raw) else "official"
        self.draft_head = inspect_draft_head(raw_config, raw)
        if self.draft_head.kind == "dspark":     # serve the main model; the head is set aside, never half-read
            log.warning("%s: %s; moebox runs MTP heads only, so the model is served without it", self.dir,
                        self.draft_head.evidence)
            self._entries = {n: e for n, e in raw.items() if not MTP_TENSOR.match(n)}
            self.config = replace(self.config, num_mtp_layers=0)
        self._sources, self._unknown = self._map_sources()

    # ---------------------------------------------------------------- index
    def _load_headers(self) -> None:
        index_path = self.dir / INDEX_FILE
        if index_path.exists():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise CheckpointError(f"{index_path}: not a valid index (needs a JSON 'weight_map' object); "
                                      f"re-download it") from None
            files = sorted(set(weight_map.values()))
        elif (self.dir / SINGLE_FILE).exists():
            weight_map, files = None, [SINGLE_FILE]
        else:
            raise CheckpointError(f"{self.dir}: no {INDEX_FILE} or {SINGLE_FILE}; point moebox at a directory "
                                  f"holding the safetensors weights")
        headers: dict[str, dict[str, dict]] = {}
        for fname in files:
            path = self.dir / fname
            if not path.is_file():
                raise CheckpointError(f"{fname}: listed in {INDEX_FILE} but not found in {self.dir}; "
                                      f"download the missing shard")
            start, headers[fname] = _read_header(path)
            self._file_end[path] = start + max((info["data_offsets"][1] for info in headers[fname].values()), default=0)
            for name, info in headers[fname].items():
                self._entries[name] = _Entry(path, info["dtype"], tuple(info["shape"]))
        if weight_map is not None:
            for name, fname in weight_map.items():
                if name not in headers[fname]:
                    raise CheckpointError(f"tensor '{name}': {INDEX_FILE} maps it to {fname}, but that shard has no "
                                          f"such tensor; the index and shards are from different downloads, "
                                          f"re-download {fname}")

    def _map_sources(self) -> tuple[dict[str, _Source], list[str]]:
        """Canonical name -> source, plus the on-disk names that map to nothing we know."""
        sources: dict[str, _Source] = {}
        unknown: list[str] = []
        if self.layout == "official":
            for name in self._entries:
                if name.endswith(".scale"):
                    continue
                sname = scale_name(name)
                sources[name] = _Source(name, sname if sname in self._entries else None)
            return sources, [n for n in self._entries if not _known_official(n)]
        I = self.config.moe_intermediate_size
        for hf, entry in self._entries.items():
            layer, _, rest = hf.removeprefix("model.layers.").partition(".")
            if hf.startswith("model.layers.") and rest in (HF_GATE_UP, HF_DOWN):
                for e in range(entry.shape[0]):
                    p = f"layers.{layer}.ffn.experts.{e}."
                    if rest == HF_DOWN:
                        sources[p + "w2.weight"] = _Source(hf, expert=e)
                    else:
                        sources[p + "w1.weight"] = _Source(hf, expert=e, rows=slice(0, I))
                        sources[p + "w3.weight"] = _Source(hf, expert=e, rows=slice(I, 2 * I))
                continue
            name = hf_to_official_name(hf)
            if name is None:
                unknown.append(hf)
            elif not name.endswith(".scale"):
                stem = hf.removesuffix(".weight")
                scale = next((s for s in (stem + ".weight_scale_inv", stem + ".scale") if s in self._entries), None)
                sources[name] = _Source(hf, scale)
        return sources, unknown

    # ---------------------------------------------------------------- queries
    def names(self) -> list[str]:
        """Canonical official names of the tensors this checkpoint holds (scales are part of their weight)."""
        return sorted(self._sources)

    @property
    def files(self) -> list[Path]:
        return sorted(self._file_end)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data (from the headers)."""
        return sum(_nbytes(e) for e in self._entries.values())

    def num_stored(self) -> int:
        """On-disk tensor count (scales included)."""
        return len(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        """Logical (dequantized) shape of a canonical tensor, from the headers."""
        src = self._source(name)
        entry = self._entries[src.raw]
        if src.expert is not None:
            rows = entry.shape[1] if src.rows is None else src.rows.stop - src.rows.start
            return (rows, *entry.shape[2:])
        if entry.dtype == "I8" and src.scale is not None:
            return (entry.shape[0], entry.shape[1] * 2)
        return entry.shape

    def _source(self, name: str) -> _Source:
        src = self._sources.get(name)
        if src is None:
            raise CheckpointError(f"tensor '{name}': not in the {self.layout} checkpoint at {self.dir}; "
                                  f"the checkpoint is incomplete or config.json belongs to another model")
        return src

    def _check_length(self, path: Path) -> None:
        if path in self._verified:
            return
        end, size = self._file_end[path], path.stat().st_size
        if size < end:
            raise CheckpointError(f"{path.name}: truncated: its header says {end} bytes but the file has {size} "
                                  f"bytes (in {self.dir}); re-download {path.name}")
        self._verified.add(path)

    def _read(self, raw: str, src: _Source | None = None) -> torch.Tensor:
        entry = self._entries[raw]
        self._check_length(entry.file)
        with safe_open(str(entry.file), framework="pt") as f:
            if src is not None and src.expert is not None:
                return f.get_slice(raw)[src.expert, src.rows or slice(None)]
            return f.get_tensor(raw)

    def get(self, name: str) -> torch.Tensor | QuantTensor:
        """A tensor by canonical name: FP8/FP4 weights as `QuantTensor`, `tid2eid` as int64, others as stored."""
        src = self._source(name)
        t = self._read(src.raw, src)
        if src.scale is not None:
            kind = {"F8_E4M3": "fp8", "I8": "fp4"}.get(self._entries[src.raw].dtype)
            if kind is None:
                raise CheckpointError(f"tensor '{src.raw}' in {self._entries[src.raw].file.name}: has a block scale "
                                      f"but dtype {self._entries[src.raw].dtype}; expected F8_E4M3 or I8 (FP4)")
            quant = self.config.quant
            block = quant.weight_block_size if quant else (128, 128)
            return QuantTensor(kind, t, self._read(src.scale), block)
        if name.endswith(".tid2eid"):
            return t.to(torch.int64)
        return t

    # ---------------------------------------------------------------- validation
    def validate(self) -> None:
        """Check files are complete and every tensor the config implies is present with the right shape/dtype."""
        for path in self.files:
            self._check_length(path)
        if self._unknown:
            raw = self._unknown[0]
            raise CheckpointError(f"tensor '{raw}' in {self._entries[raw].file.name}: unknown tensor group (not a "
                                  f"DeepSeek-V4 {self.layout}-layout tensor name); is this checkpoint for another "
                                  f"model or revision?")
        for spec in official_schema(self.config).values():
            if self.layout == "hf" and spec.name.startswith("mtp."):
                continue  # transformers has no MTP block
            if self.layout == "official":
                for raw, dtypes, shape in spec.stored():
                    self._expect(raw, shape, dtypes)
            else:
                self._expect_logical(spec.name, spec.shape, spec.kind)

    def _missing(self, name: str) -> CheckpointError:
        return CheckpointError(f"tensor '{name}': missing from the checkpoint in {self.dir}, but config.json "
                               f"implies it; the download is incomplete or config.json belongs to another model")

    def _expect(self, raw: str, shape: tuple[int, ...], dtypes: tuple[str, ...]) -> None:
        entry = self._entries.get(raw)
        if entry is None:
            raise self._missing(raw)
        if entry.shape != shape:
            raise CheckpointError(f"tensor '{raw}' in {entry.file.name}: shape mismatch: expected {list(shape)} "
                                  f"from config.json, found {list(entry.shape)}; config.json and weights disagree")
        if entry.dtype not in dtypes:
            raise CheckpointError(f"tensor '{raw}' in {entry.file.name}: dtype {entry.dtype}, expected "
                                  f"{' or '.join(dtypes)}; config.json and weights disagree")

    def _expect_logical(self, name: str, shape: tuple[int, ...], kind: str) -> None:
        if name not in self._sources:
            raise self._missing(name)
        found = self.shape(name)
        entry = self._entries[self._sources[name].raw]
        if found != shape:
            raise CheckpointError(f"tensor '{name}' (stored as '{self._sources[name].raw}' in {entry.file.name}): "
                                  f"shape mismatch: expected {list(shape)} from config.json, found {list(found)}; "
                                  f"config.json and weights disagree")
        if (kind == "int") != (entry.dtype in _INT_DTYPES and self._sources[name].scale is None):
            raise CheckpointError(f"tensor '{name}' in {entry.file.name}: dtype {entry.dtype} does not fit a "
                                  f"{kind} tensor; config.json and weights disagree")


def _known_official(name: str) -> bool:
    try:
        tensor_group(name)
    except CheckpointError:
        return False
    return True


def _nbytes(entry: _Entry) -> int:
    n = _DTYPE_BYTES.get(entry.dtype, 1)
    for d in entry.shape:
        n *= d
    return n
