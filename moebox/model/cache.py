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


class KVCache:
    def __init__(self, cfg: ModelConfig, num_slots: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", spec_slack: int = 0) -> None:
        self.num_slots, self.max_len, self.spec_slack = num_slots, max_len, spec_slack
        self.window_ring = cfg.sliding_window + spec_slack
        d, di = cfg.head_dim, cfg.index_head_dim
        kinds = list(cfg.attn_types) + [SLIDING] * cfg.num_mtp_layers
        ratios = list(cfg.compress_ratios) + [0] * cfg.num_mtp_layers
        self.layers: list[LayerCache] = []
        for kind, ratio in zip(kinds, ratios):
            lc = LayerCache(window=torch.zeros(num_slots, self.window_ring, d, dtype=dtype, device=device))
            if kind != SLIDING:
                n_entries = -(-max_len // ratio)
                overlap = kind == CSA
                ring = (2 if overlap else 1) * ratio + spec_slack
                width = (2 if overlap else 1) * d
                lc.entries = torch.zeros(num_slots, n_entries, d, dtype=dtype, device=device)
                lc.raw_kv = torch.zeros(num_slots, ring, width, dtype=torch.float32, device=device)
                lc.raw_gate = torch.zeros_like(lc.raw_kv)
                if overlap:
                    lc.index_keys = torch.zeros(num_slots, n_entries, di, dtype=dtype, device=device)
                    lc.index_raw_kv = torch.zeros(num_slots, ring, 2 * di, dtype=torch.float32, device=device)
                    lc.index_raw_gate = torch.zeros_like(lc.index_raw_kv)
            self.layers.append(lc)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for lc in self.layers for t in vars(lc).values() if t is not None)


def ring_read(ring: torch.Tensor, slot: int, positions: torch.Tensor) -> torch.Tensor:
    return ring[slot, positions % ring.shape[1]]


def ring_write(ring: torch.Tensor, slot: int, positions: torch.Tensor, values: torch.Tensor) -> None:
    """Store rows for `positions`; only the newest ring-length rows can survive, so write just those."""
    keep = min(positions.numel(), ring.shape[1])
    ring[slot, positions[-keep:] % ring.shape[1]] = values[-keep:].to(ring.dtype)
