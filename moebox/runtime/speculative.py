"""Speculative decoding settings and the draft head they name, checked before any weight is read.

Users know vLLM's spelling, `--speculative-config '{"method": "deepseek_mtp", "model": DIR,
"num_speculative_tokens": k}'`, so moebox takes the same dict. The head comes from the main checkpoint's
`mtp.0.*` or from `model` (a standalone MTP-head directory sharing the main model's embedding and head). A head
moebox cannot run (DSpark), a missing one, or one whose shapes do not fit the main model is one clear error at
start that says what was found and what to do instead; never a KeyError halfway through loading.

Verification accepts a draft when it equals the token the request's own sampler picks from the verified row
(greedy, penalties, forced tokens, sampling), one sampler call per emitted token, in order, each from the row of
a verified prefix: greedy and seeded requests get exactly the tokens plain decoding gives, unseeded sampling
keeps its distribution. (Rejection sampling would accept more drafts at high temperature; it is not built.)
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

from moebox.errors import MoeboxError
from moebox.model.batch import DecodeBatch, FlatBatch
from moebox.model.cache import KVCache
from moebox.model.deepseek_v4 import DeepseekV4
from moebox.runtime.sampler import SamplingParams, token_probs
from moebox.weights.checkpoint import Checkpoint
from moebox.weights.schema import official_schema

METHODS = ("deepseek_mtp", "mtp")
MAX_SPECULATIVE_TOKENS = 8
OPTIONS = ("run without speculation (leave out the speculative config), or set \"model\" to a directory with a "
           "compatible 1-layer MTP head (mtp.0.* tensors, as in the original DeepSeek-V4-Flash release)")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "deepseek_mtp"
    model: str | None = None
    num_speculative_tokens: int = 1
    adaptive: bool = True      # moebox's own key: False verifies k drafts every step (measuring acceptance)

    @classmethod
    def parse(cls, value: str | dict[str, Any]) -> "SpeculativeConfig":
        """From the JSON text of --speculative-config or the same dict; errors name the key and the fix."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise MoeboxError(f"--speculative-config: invalid JSON ({e.msg} at column {e.colno}); e.g. "
                                  f"'{{\"method\": \"deepseek_mtp\", \"num_speculative_tokens\": 2}}'") from None
        if not isinstance(value, dict):
            raise MoeboxError("--speculative-config: expected a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise MoeboxError(f"--speculative-config: unknown key {unknown[0]!r}; known keys: {', '.join(sorted(known))}")
        spec = cls(**value)
        if spec.method not in METHODS:
            raise MoeboxError(f"--speculative-config: method {spec.method!r} is not supported; moebox drafts with "
                              f"DeepSeek's MTP head: \"deepseek_mtp\"")
        if not isinstance(spec.adaptive, bool):
            raise MoeboxError(f"--speculative-config: adaptive must be true or false, got {spec.adaptive!r}")
        k = spec.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise MoeboxError(f"--speculative-config: num_speculative_tokens must be an integer from 1 to "
                              f"{MAX_SPECULATIVE_TOKENS}, got {k!r}")
        return spec


def add_flags(p) -> None:
    """--speculative-config / --mtp on a CLI parser (serve, generate)."""
    p.add_argument("--speculative-config", default=None,
                   help='MTP speculative decoding, vLLM\'s spelling: \'{"method": "deepseek_mtp", '
                        '"num_speculative_tokens": 2, "model": DIR}\' (model: a separate MTP head; optional)')
    p.add_argument("--mtp", type=int, default=None, metavar="K",
                   help="shorthand for --speculative-config with K drafted tokens from the checkpoint's MTP head")


def from_flags(speculative_config: str | None, mtp: int | None) -> str | dict | None:
    if speculative_config is not None and mtp is not None:
        raise MoeboxError("--mtp and --speculative-config both given; use one (--mtp K is "
                          "'{\"num_speculative_tokens\": K}')")
    return speculative_config if mtp is None else {"num_speculative_tokens": mtp}


def draft_source(main: Checkpoint, spec: SpeculativeConfig) -> Checkpoint:
    """The checkpoint whose `mtp.0.*` tensors will draft, checked against the main model's shapes (headers only)."""
    src = main if spec.model is None else Checkpoint(Path(spec.model))
    head = src.draft_head
    if not head.runnable:
        raise MoeboxError(f"{src.dir}: found {head.evidence}; moebox drafts with MTP heads only. Options: {OPTIONS}")
    names = set(src.names())
    for name, want in official_schema(replace(main.config, num_mtp_layers=1)).items():
        if not name.startswith("mtp.0."):
            continue
        if name not in names:
            raise MoeboxError(f"{src.dir}: the MTP head is incomplete: {name} is missing. Options: {OPTIONS}")
        got = src.shape(name)
        if tuple(got) != tuple(want.shape):
            raise MoeboxError(f"{src.dir}: the MTP head does not match the main model {main.dir}: {name} is "
                              f"{list(got)}, the main model needs {list(want.shape)}. Options: {OPTIONS}")
    return src


@dataclass
class DraftWork:
    """Rows the main model just verified for one sequence, to be written into the MTP layer's cache, and how
    many tokens to draft after them."""

    slot: int
    start: int                 # position of the first row
    hidden: torch.Tensor       # [n, hc, H] the main model's final residuals at positions start..start+n-1
    next_tokens: list[int]     # the token at position p+1 for each row p
    k: int                     # drafts wanted after the last row (0: only write the rows)
    params: SamplingParams | None = None       # temperature > 0: drafts are sampled from the head's q
    generator: torch.Generator | None = None


@dataclass
class Drafts:
    tokens: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] | None = None    # per draft, the q it was sampled from ([V], CPU); None: greedy


class MTPDrafter:
    """Drafts with DeepSeek's MTP block: the row at position t reads the main residual at t and token t+1 and
    predicts token t+2; drafts after the first chain the block's own residual (vLLM's convention). Greedy
    requests get the head's argmax; sampling requests a sample of its distribution q under the request's own
    temperature/top-k/top-p, and q, which verification needs (`sampler.verify_draft`). Chained rows
    are written at positions the next call overwrites with verified rows first, so rejected drafts leave
    nothing behind (the MTP window ring has the cache's speculative slack)."""

    def __init__(self, model: DeepseekV4, cache: KVCache, shape_static: bool | None = None) -> None:
        """`shape_static` (default: on CUDA) runs the MTP block as a `DecodeBatch`, one row per token: the decode
        step's fused functions and kernels instead of eager per-sequence segments. On the CPU there is nothing
        to fuse and the segments measured ~5% faster (demo, concurrency 1)."""
        self.model, self.cache = model, cache
        static = model.embed.is_cuda if shape_static is None else shape_static
        self.build = DecodeBatch.build if static else FlatBatch.build

    def run(self, work: list[DraftWork]) -> list[Drafts]:
        if not work:
            return []
        device = work[0].hidden.device
        batch = self.build([(w.slot, w.start, w.next_tokens) for w in work], device)
        live = [i for i, w in enumerate(work) if w.k >= 1]
        last_rows = torch.tensor(list(itertools.accumulate(len(w.next_tokens) for w in work)), device=device) - 1
        # logits only where a draft is wanted: with k = 0 (the policy's "drafting off") the block runs for its
        # cache alone, without the head (the lm head is ~10% of a V4-Flash step's bytes)
        out = self.model.mtp_forward(torch.cat([w.hidden for w in work]), batch, self.cache,
                                     logits_rows=last_rows[torch.tensor(live, dtype=torch.long, device=device)])
        drafts = [Drafts(probs=[] if w.params is not None and w.params.temperature > 0 else None) for w in work]
        last = out.hidden[last_rows]
        state = {i: (work[i].start + len(work[i].next_tokens), last[i]) for i in live}   # next row, residual
        self._draw(list(zip(live, out.logits)), work, drafts)
        depth = 1
        while live := [i for i in live if work[i].k > depth]:
            chain = self.build([(work[i].slot, state[i][0], [drafts[i].tokens[-1]]) for i in live], device)
            o = self.model.mtp_forward(torch.stack([state[i][1] for i in live]), chain, self.cache)
            self._draw(list(zip(live, o.logits)), work, drafts)
            for j, i in enumerate(live):
                state[i] = (state[i][0] + 1, o.hidden[j])
            depth += 1
        return drafts

    @staticmethod
    def _draw(rows: list[tuple[int, torch.Tensor]], work: list[DraftWork], drafts: list[Drafts]) -> None:
        """One more draft per sequence: the argmax (greedy requests) or a sample of q, kept for verification."""
        greedy = [i for i, _ in rows if drafts[i].probs is None]
        if greedy:
            top = torch.stack([lg for i, lg in rows if drafts[i].probs is None]).argmax(-1).tolist()
            for i, tok in zip(greedy, top):
                drafts[i].tokens.append(tok)
        for i, logits in rows:
            if drafts[i].probs is not None:
                q = token_probs(logits, work[i].params)
                drafts[i].tokens.append(int(torch.multinomial(q, 1, generator=work[i].generator)))
                drafts[i].probs.append(q)


def batch_bucket(n: int) -> int:
    """Decode batch sizes grouped by powers of two: 1, 2, 3-4 -> 4, 5-8 -> 8, ..."""
    return 1 << max(0, n - 1).bit_length()


class SpecPolicy:
    """How many drafts to verify per step, from measured speed: never slower than not drafting.

    Whether drafting pays depends on acceptance (the text, the request) and on what a k+1-token verify step costs
    against a 1-token step at this batch size (the hardware; the reference setup loses 5% at 4 sequences). Both
    are in one number the engine can measure: tokens emitted per second over decode-only steps. The policy keeps
    an average of it per (batch-size bucket, k), tries every k once per bucket, then uses the best, and re-tries
    another k every `probe_every` steps of a bucket, so it follows acceptance as the text changes."""

    def __init__(self, k_max: int, probe_every: int = 64, smoothing: float = 0.25, adaptive: bool = True) -> None:
        self.k_max, self.probe_every, self.smoothing, self.adaptive = k_max, probe_every, smoothing, adaptive
        self.rate: dict[tuple[int, int], float] = {}      # (bucket, k) -> tokens/s
        self.steps: dict[int, int] = {}

    def choose(self, n_seqs: int) -> int:
        if not self.adaptive:
            return self.k_max
        bucket = batch_bucket(n_seqs)
        untried = [k for k in range(self.k_max, -1, -1) if (bucket, k) not in self.rate]
        if untried:
            return untried[0]
        best = max(range(self.k_max + 1), key=lambda k: self.rate[bucket, k])
        step = self.steps.get(bucket, 0)
        if step and step % self.probe_every == 0:         # re-measure the others in turn
            others = [k for k in range(self.k_max + 1) if k != best]
            return others[(step // self.probe_every - 1) % len(others)]
        return best

    def observe(self, n_seqs: int, k: int, tokens: int, seconds: float) -> None:
        bucket = batch_bucket(n_seqs)
        self.steps[bucket] = self.steps.get(bucket, 0) + 1
        rate = tokens / max(seconds, 1e-9)
        old = self.rate.get((bucket, k))
        self.rate[bucket, k] = rate if old is None else old + self.smoothing * (rate - old)
