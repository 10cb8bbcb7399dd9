"""Per-request sampling parameters and the torch reference sampler."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                 # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True     # in the returned text; the chat server keeps them (</think>, DSML)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        if self.seed is not None:
            self.seed %= 2**64                  # any integer is a seed; torch takes 64 bits
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")


def filtered_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, min-p and top-p masks (masked entries -inf). logits: [V] fp32."""
    x = logits.float() / p.temperature
    if p.top_k > 0 and p.top_k < x.numel():
        kth = x.topk(p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if p.min_p > 0:
        x = x.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        probs = torch.softmax(x, dim=-1)
    if p.top_p < 1:
        sorted_p, order = probs.sort(descending=True)
        cum = sorted_p.cumsum(0)
        drop_sorted = cum - sorted_p >= p.top_p           # keep the smallest prefix reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def token_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a sampled token is drawn from (temperature > 0), on the CPU: [V] fp32."""
    return torch.softmax(filtered_logits(logits, p), dim=-1).cpu()


def sample_token(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    if p.temperature == 0:
        return int(logits.argmax())
    return int(torch.multinomial(token_probs(logits, p), 1, generator=generator))


def verify_draft(target: torch.Tensor, draft_probs: torch.Tensor, draft: int,
                 generator: torch.Generator | None) -> int:
    """Speculative sampling's step for one drafted token (Leviathan et al. 2023, Chen et al. 2023): keep the draft
    with probability min(1, p(d)/q(d)), else draw from the residual max(0, p - q), renormalised. Whatever q
    is, the token returned is distributed exactly as p (`target`); a rejected draft never comes back, since the
    residual is 0 wherever q >= p. target, draft_probs: [V] on the CPU; `draft` was drawn from draft_probs."""
    pd, qd = float(target[draft]), float(draft_probs[draft])
    if qd > 0 and float(torch.rand((), generator=generator)) * qd < pd:
        return draft
    residual = (target - draft_probs).clamp(min=0)
    if float(residual.sum()) <= 0:          # p == q up to rounding: any draft would have been kept
        return draft
    return int(torch.multinomial(residual, 1, generator=generator))
