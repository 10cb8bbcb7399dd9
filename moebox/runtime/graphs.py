"""Decode steps replayed from CUDA graphs: one capture per batch size, the whole model forward in each.

At batch 1-16 a decode step launches thousands of small kernels; eagerly, Python and launch latency cost more
than the weight reads themselves. A graph replays them all with one CPU call. The captured forward is the
shape-static `DecodeBatch` path, so only the input buffers change between replays: a call with n sequences
runs the smallest captured size >= n, and the spare rows point at a scratch cache slot that no sequence owns.

Needs every kernel of the step to be capturable (no host sync): the Triton FP8 and w2 kernels are; the torch
reference for routed experts (native FP4 experts) is not, so `supported` says no for such a model.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import torch

from moebox.model.batch import DecodeBatch
from moebox.model.cache import KVCache
from moebox.model.deepseek_v4 import DeepseekV4, ForwardOutput
from moebox.model.moe import DECODE_TOKENS
from moebox.ops.cuda_graphs import capture

log = logging.getLogger("moebox")

BATCH_SIZES = (1, 2, 4, 8, 16)


def batch_sizes_for(max_rows: int) -> list[int]:
    """The captured sizes: powers of two below max_rows, and max_rows itself, at most DECODE_TOKENS (above it
    the routed experts leave the fused kernels for the torch path, which syncs with the host). Steps with more
    rows run eagerly."""
    top = min(max_rows, DECODE_TOKENS)
    return sorted({b for b in BATCH_SIZES if b < top} | {top})


def supported(model: DeepseekV4, device: torch.device) -> str | None:
    """None when the decode step of `model` can be captured on `device`, else the reason it cannot."""
    if device.type != "cuda":
        return "not a CUDA device"
    if any(layer.ffn.layer_planes is None for layer in model.layers):
        return "routed experts are not w2 planes (the native-expert path syncs with the host)"
    return None


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    batch: DecodeBatch
    out: ForwardOutput


class DecodeGraphs:
    @torch.no_grad()
    def __init__(self, model: DeepseekV4, cache: KVCache, scratch_slot: int, batch_sizes: Sequence[int]) -> None:
        """Capture the decode step for each size; `scratch_slot` is a cache slot that no sequence uses."""
        self.scratch_slot = scratch_slot
        self._graphs: dict[int, _Captured] = {}
        device = model.embed.device
        pool = None
        for b in sorted(batch_sizes, reverse=True):         # largest first: the smaller ones reuse its pool
            batch = DecodeBatch(torch.zeros(b, dtype=torch.long, device=device),
                                torch.zeros(b, dtype=torch.long, device=device),
                                torch.full((b,), scratch_slot, dtype=torch.long, device=device))
            graph, out = capture(lambda: model.forward(batch, cache), pool=pool, warmup=2)
            pool = graph.pool()
            self._graphs[b] = _Captured(graph, batch, out)
            log.info("captured the decode step for batch %d", b)

    @property
    def batch_sizes(self) -> list[int]:
        return sorted(self._graphs)

    def fits(self, rows: int) -> bool:
        return rows <= self.batch_sizes[-1]

    def run(self, tokens: Sequence[int], positions: Sequence[int], slots: Sequence[int]) -> ForwardOutput:
        """The step's logits [n, vocab] and final residuals [n, hc, H] for n rows (one token each; a sequence may
        have several consecutive rows, as a speculative verify step does): views into the graph's outputs, valid
        until the next replay."""
        n = len(tokens)
        size = next((b for b in self.batch_sizes if b >= n), None)
        if size is None:
            raise ValueError(f"{n} rows exceed the largest captured batch {self.batch_sizes[-1]}")
        cap = self._graphs[size]
        pad = size - n
        host = torch.tensor([list(tokens) + [0] * pad, list(positions) + [0] * pad,
                             list(slots) + [self.scratch_slot] * pad], dtype=torch.long)
        for dst, src in zip((cap.batch.tokens, cap.batch.positions, cap.batch.slots), host):
            dst.copy_(src, non_blocking=True)
        cap.graph.replay()
        return ForwardOutput(cap.out.logits[:n], cap.out.hidden[:n])
