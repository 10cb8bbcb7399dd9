"""Per-sequence decode state, preallocated as pools indexed by slot.

Per layer and slot:
- `window`: ring of the last W (+ slack) K=V vectors, indexed by position mod ring length;
- compressed layers: `entries` (one per closed window) and a ring of the compressor's raw projections
  (`raw_kv`, `raw_gate`) for the positions an open window still needs;
- CSA layers also the indexer's keys and its own raw ring.
Every ring is `spec_slack` rows longer than it must be, so positions written by rejected speculative
tokens never overwrite a row that a later accepted token still reads: rolling back is then just
forgetting positions (the runtime lowers the sequence length); nothing has to be restored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moebox.config import CSA, SLIDING, ModelConfig


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
                 ) -> list[dict[str, tuple[tuple[int, ...], bool]]]:
    """Per layer: field -> (shape per slot, is fp32). The single description of the cache layout, used to
    allocate it and to plan memory before anything is allocated."""
    d, di = cfg.head_dim, cfg.index_head_dim
    n_mtp = cfg.num_mtp_layers if with_mtp else 0
    kinds = list(cfg.attn_types) + [SLIDING] * n_mtp
    ratios = list(cfg.compress_ratios) + [0] * n_mtp
    layers = []
    for kind, ratio in zip(kinds, ratios):
        shapes = {"window": ((cfg.sliding_window + spec_slack, d), False)}
        if kind != SLIDING:
            n_entries = -(-max_len // ratio)
            overlap = kind == CSA
            ring = (2 if overlap else 1) * ratio + spec_slack
            width = (2 if overlap else 1) * d
            shapes.update(entries=((n_entries, d), False), raw_kv=((ring, width), True), raw_gate=((ring, width), True))
            if overlap:
                shapes.update(index_keys=((n_entries, di), False), index_raw_kv=((ring, 2 * di), True),
                              index_raw_gate=((ring, 2 * di), True))
        layers.append(shapes)
    return layers


def cache_bytes_per_slot(cfg: ModelConfig, max_len: int, dtype: torch.dtype, spec_slack: int = 0,
                         with_mtp: bool = True) -> int:
    item = torch.tensor([], dtype=dtype).element_size()
    total = 0
    for shapes in layer_shapes(cfg, max_len, spec_slack, with_mtp):
        for shape, fp32 in shapes.values():
            n = 1
            for x in shape:
                n *= x
            total += n * (4 if fp32 else item)
    return total


class KVCache:
    def __init__(self, cfg: ModelConfig, num_slots: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", spec_slack: int = 0, with_mtp: bool = True) -> None:
        self.num_slots, self.max_len, self.spec_slack = num_slots, max_len, spec_slack
        self.layers = [
            LayerCache(**{name: torch.zeros((num_slots, *shape), dtype=torch.float32 if fp32 else dtype,
                                            device=device)
                          for name, (shape, fp32) in shapes.items()})
            for shapes in layer_shapes(cfg, max_len, spec_slack, with_mtp)]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for lc in self.layers for t in vars(lc).values() if t is not None)


def ring_read(ring: torch.Tensor, slot: int, positions: torch.Tensor) -> torch.Tensor:
    return ring[slot, positions % ring.shape[1]]


def ring_write(ring: torch.Tensor, slot: int, positions: torch.Tensor, values: torch.Tensor) -> None:
    """Store rows for `positions`; only the newest ring-length rows can survive, so write just those."""
    keep = min(positions.numel(), ring.shape[1])
    ring[slot, positions[-keep:] % ring.shape[1]] = values[-keep:].to(ring.dtype)
