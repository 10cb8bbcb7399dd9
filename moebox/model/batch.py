"""A flat token batch: prefill chunks, decode steps and speculative verification are the same call.

Tokens of several sequences lie back to back; each sequence contributes one contiguous `Segment` with
consecutive positions, and its cache slot holds positions 0..start-1 already. No padding, no left padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Segment:
    slot: int      # cache slot of the sequence
    offset: int    # index of its first token in the flat batch
    length: int
    start: int     # absolute position of its first token

    @property
    def rows(self) -> slice:
        return slice(self.offset, self.offset + self.length)

    @property
    def end(self) -> int:
        """Position of the last token."""
        return self.start + self.length - 1


@dataclass
class FlatBatch:
    tokens: torch.Tensor      # [N] long
    positions: torch.Tensor   # [N] long
    segments: list[Segment]

    @classmethod
    def build(cls, parts: list[tuple[int, int, list[int]]], device: torch.device | str = "cpu") -> "FlatBatch":
        """parts: (slot, start position, token ids) per sequence."""
        segments, tokens, positions, offset = [], [], [], 0
        for slot, start, ids in parts:
            if not ids:
                raise ValueError(f"slot {slot}: empty segment")
            segments.append(Segment(slot, offset, len(ids), start))
            tokens.extend(ids)
            positions.extend(range(start, start + len(ids)))
            offset += len(ids)
        return cls(torch.tensor(tokens, dtype=torch.long, device=device),
                   torch.tensor(positions, dtype=torch.long, device=device), segments)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    def uniform_length(self) -> int | None:
        """T when the segments are rows of one [B, T] block, each from position 0 (a training batch); else None."""
        t = self.segments[0].length
        ok = all(s.start == 0 and s.length == t and s.offset == i * t for i, s in enumerate(self.segments))
        return t if ok else None

    def last_rows(self) -> torch.Tensor:
        """Flat index of each segment's last token (where next-token logits come from)."""
        return torch.tensor([s.offset + s.length - 1 for s in self.segments], dtype=torch.long,
                            device=self.tokens.device)


@dataclass
class DecodeBatch:
    """One new token for each of B sequences, every index a device tensor: the shape-static step that a CUDA
    graph can capture (no Python value depends on positions or slots). Slot `slots[b]` holds positions
    0..positions[b]-1 already; padding rows of a captured graph point at a scratch slot."""

    tokens: torch.Tensor      # [B] long
    positions: torch.Tensor   # [B] long
    slots: torch.Tensor       # [B] long

    @staticmethod
    def rows(parts: list[tuple[int, int, list[int]]]) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """(tokens, positions, slots) on the host for parts as `FlatBatch.build`, every token a row: a verify
        step's rows of one sequence sit in one slot at consecutive positions."""
        slots, positions, tokens = zip(*((slot, start + i, t) for slot, start, ids in parts for i, t in enumerate(ids)))
        return tokens, positions, slots

    @classmethod
    def build(cls, parts: list[tuple[int, int, list[int]]], device: torch.device | str = "cpu") -> "DecodeBatch":
        return cls(*(torch.tensor(v, dtype=torch.long, device=device) for v in cls.rows(parts)))

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    def last_rows(self) -> torch.Tensor:
        return torch.arange(self.tokens.numel(), device=self.tokens.device)
