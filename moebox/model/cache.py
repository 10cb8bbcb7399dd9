"""Per-sequence decode state, preallocated as pools indexed by slot.

Per layer and slot:
- `window`: ring of the last W (+ slack) K=V vectors, indexed by position mod ring length;
- compressed layers: `entries` (one per closed window) and a ring of the compressor's raw projections
  (`raw_kv`, `raw_gate`) for the positions an open window still needs;
- CSA layers also the indexer's keys and its own raw ring.
Every ring is `spec_slack` rows longer than it must be, so positions written by rejected speculative
tokens never overwrite a row that a later accepted token still reads: rolling back is then just
forgetting positions (the runtime lowers the sequence length); nothing has to be restored.

With `kv_layout="fp8"` the K=V rows (windows, entries) use DeepSeek's FP8 layout (deepseek_v4.md §3: e4m3 nope
channels with one power-of-two scale per 64, bf16 rope channels) and the indexer keys FP4 (e2m1, one scale per
32): 584 + 68 bytes instead of 2 x (512 + 128) per entry in bf16. It is lossless for the nope channels and
index keys, which the QAT rounding already put on those grids; only the rope channels round to bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moebox.config import CSA, SLIDING, ModelConfig
from moebox.weights.formats import (FP4_BLOCK, FP4_MAX, FP8_MAX, fp4_codes_from_values, fp4_values_from_codes,
                                    pow2_exponent)

FP8_BLOCK = 64
KV_LAYOUTS = ("model", "fp8")


class _QuantRows:
    """Rows [slots, n, dim] stored quantized; indexed like a tensor with [slot, rows] keys (read: float32)."""

    dtype = torch.float32

    def __init__(self, shape: tuple[int, int, int]) -> None:
        self.shape = torch.Size(shape)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in vars(self).values() if isinstance(t, torch.Tensor))

    def round_trip(self, values: torch.Tensor) -> torch.Tensor:
        """values as a store-then-read gives them back (float32)."""
        return self._decode(*self._encode(values))


class FP8Rows(_QuantRows):
    def __init__(self, slots: int, n: int, dim: int, nope: int, device: torch.device | str) -> None:
        super().__init__((slots, n, dim))
        self.nope_dim = nope
        self.nope = torch.zeros(slots, n, nope, dtype=torch.float8_e4m3fn, device=device)
        self.exps = torch.zeros(slots, n, -(-nope // FP8_BLOCK), dtype=torch.int8, device=device)
        self.rope = torch.zeros(slots, n, dim - nope, dtype=torch.bfloat16, device=device)

    def _encode(self, values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        blocks = _blocks(values[..., :self.nope_dim].float(), FP8_BLOCK)
        e = pow2_exponent(blocks.abs().amax(-1, keepdim=True), FP8_MAX)
        nope = (blocks / torch.exp2(e)).flatten(-2)[..., :self.nope_dim].to(torch.float8_e4m3fn)
        return nope, e.squeeze(-1).to(torch.int8), values[..., self.nope_dim:].to(torch.bfloat16)

    def _decode(self, nope: torch.Tensor, exps: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        nope = _blocks(nope.float(), FP8_BLOCK) * torch.exp2(exps.float()).unsqueeze(-1)
        return torch.cat([nope.flatten(-2)[..., :self.nope_dim], rope.float()], dim=-1)

    def __setitem__(self, key, values: torch.Tensor) -> None:
        self.nope[key], self.exps[key], self.rope[key] = self._encode(values)

    def __getitem__(self, key) -> torch.Tensor:
        return self._decode(self.nope[key], self.exps[key], self.rope[key])


class FP4Rows(_QuantRows):
    def __init__(self, slots: int, n: int, dim: int, device: torch.device | str) -> None:
        super().__init__((slots, n, dim))
        self.codes = torch.zeros(slots, n, dim // 2, dtype=torch.uint8, device=device)
        self.exps = torch.zeros(slots, n, dim // FP4_BLOCK, dtype=torch.int8, device=device)

    def _encode(self, values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        blocks = _blocks(values.float(), FP4_BLOCK)
        e = pow2_exponent(blocks.abs().amax(-1, keepdim=True), FP4_MAX)
        codes = fp4_codes_from_values(blocks / torch.exp2(e)).flatten(-2)
        return codes[..., 0::2] | (codes[..., 1::2] << 4), e.squeeze(-1).to(torch.int8)

    def _decode(self, c: torch.Tensor, exps: torch.Tensor) -> torch.Tensor:
        vals = fp4_values_from_codes(torch.stack((c & 0xF, c >> 4), dim=-1).flatten(-2))
        return (_blocks(vals, FP4_BLOCK) * torch.exp2(exps.float()).unsqueeze(-1)).flatten(-2)

    def __setitem__(self, key, values: torch.Tensor) -> None:
        self.codes[key], self.exps[key] = self._encode(values)

    def __getitem__(self, key) -> torch.Tensor:
        return self._decode(self.codes[key], self.exps[key])


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """[..., d] -> [..., ceil(d/block), block], zero-padded (a partial last block scales as if alone)."""
    pad = -x.shape[-1] % block
    x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


@dataclass
class LayerCache:
    window: torch.Tensor                         # [S, Wr, d]
    entries: torch.Tensor | None = None          # [S, E, d]
    raw_kv: torch.Tensor | None = None           # [S, Rr, C] fp32
    raw_gate: torch.Tensor | None = None
    index_keys: torch.Tensor | None = None       # [S, E, dI]
    index_raw_kv: torch.Tensor | None = None     # [S, Rr, 2*dI] fp32
    index_raw_gate: torch.Tensor | None = None


def layer_shapes(cfg: ModelConfig, max_len: int, spec_slack: int, with_mtp: bool = True
                 ) -> list[dict[str, tuple[tuple[int, int], str]]]:
    """Per layer: field -> ((rows, dim) per slot, storage) with storage "kv" (K=V rows), "index" (indexer keys)
    or "fp32" (compressor state). The single description of the cache layout, used to allocate it and to plan
    memory before anything is allocated."""
    d, di = cfg.head_dim, cfg.index_head_dim
    n_mtp = cfg.num_mtp_layers if with_mtp else 0
    kinds = list(cfg.attn_types) + [SLIDING] * n_mtp
    ratios = list(cfg.compress_ratios) + [0] * n_mtp
    layers = []
    for kind, ratio in zip(kinds, ratios):
        shapes = {"window": ((cfg.sliding_window + spec_slack, d), "kv")}
        if kind != SLIDING:
            n_entries = -(-max_len // ratio) + 1        # + a scratch row for decode steps that close no window
            overlap = kind == CSA
            ring = (2 if overlap else 1) * ratio + spec_slack
            width = (2 if overlap else 1) * d
            shapes.update(entries=((n_entries, d), "kv"), raw_kv=((ring, width), "fp32"),
                          raw_gate=((ring, width), "fp32"))
            if overlap:
                shapes.update(index_keys=((n_entries, di), "index"), index_raw_kv=((ring, 2 * di), "fp32"),
                              index_raw_gate=((ring, 2 * di), "fp32"))
        layers.append(shapes)
    return layers


def _storage(storage: str, dim: int, kv_layout: str) -> str:
    """How a field is kept: "fp32", "fp8" (FP8Rows), "fp4" (FP4Rows) or "model" (the model dtype). Index keys
    whose dim is not a multiple of the FP4 block (tiny test configs only) stay in the model dtype."""
    if storage == "fp32" or kv_layout == "model":
        return "fp32" if storage == "fp32" else "model"
    if storage == "kv":
        return "fp8"
    return "fp4" if dim % FP4_BLOCK == 0 else "model"


def _row_bytes(dim: int, kind: str, dtype: torch.dtype, nope: int) -> int:
    if kind == "fp32":
        return 4 * dim
    if kind == "fp8":
        return nope + -(-nope // FP8_BLOCK) + 2 * (dim - nope)
    if kind == "fp4":
        return dim // 2 + dim // FP4_BLOCK
    return dim * torch.tensor([], dtype=dtype).element_size()


def cache_bytes_per_slot(cfg: ModelConfig, max_len: int, dtype: torch.dtype, spec_slack: int = 0,
                         with_mtp: bool = True, kv_layout: str = "model") -> int:
    return sum(rows * _row_bytes(dim, _storage(storage, dim, kv_layout), dtype, cfg.nope_head_dim)
               for shapes in layer_shapes(cfg, max_len, spec_slack, with_mtp)
               for (rows, dim), storage in shapes.values())


class KVCache:
    def __init__(self, cfg: ModelConfig, num_slots: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", spec_slack: int = 0, with_mtp: bool = True,
                 kv_layout: str = "model") -> None:
        if kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
        self.num_slots, self.max_len, self.spec_slack = num_slots, max_len, spec_slack

        def alloc(rows: int, dim: int, storage: str):
            kind = _storage(storage, dim, kv_layout)
            if kind == "fp8":
                return FP8Rows(num_slots, rows, dim, cfg.nope_head_dim, device)
            if kind == "fp4":
                return FP4Rows(num_slots, rows, dim, device)
            return torch.zeros(num_slots, rows, dim, dtype=torch.float32 if kind == "fp32" else dtype, device=device)

        self.layers = [LayerCache(**{name: alloc(rows, dim, storage) for name, ((rows, dim), storage) in shapes.items()})
                       for shapes in layer_shapes(cfg, max_len, spec_slack, with_mtp)]

    def nbytes(self) -> int:
        return sum(t.nbytes if isinstance(t, _QuantRows) else t.numel() * t.element_size()
                   for lc in self.layers for t in vars(lc).values() if t is not None)


def as_stored(store: torch.Tensor | _QuantRows, values: torch.Tensor) -> torch.Tensor:
    """values rounded as `store` keeps them, in values' dtype: what reading them back would give."""
    rounded = store.round_trip(values) if isinstance(store, _QuantRows) else values.to(store.dtype)
    return rounded.to(values.dtype)


def ring_read(ring: torch.Tensor, slot: int, positions: torch.Tensor) -> torch.Tensor:
    return ring[slot, positions % ring.shape[1]]


def ring_write(ring: torch.Tensor, slot: int, positions: torch.Tensor, values: torch.Tensor) -> None:
    """Store rows for `positions`; only the newest ring-length rows can survive, so write just those."""
    keep = min(positions.numel(), ring.shape[1])
    ring[slot, positions[-keep:] % ring.shape[1]] = values[-keep:].to(ring.dtype)
