"""The continuous-batching engine: requests in, token events out, one flat-batch forward per step.

Each step the scheduler frees what finished or was cancelled, admits waiting requests into free cache slots,
and builds one flat batch: a decode token for every running sequence first, then prefill chunks of admitted
prompts within `max_num_batched_tokens` (chunked prefill). It samples where a sequence's prompt is complete
and reports tokens through each request's `on_event` callback. The engine owns the model and its cache; the
HTTP server only calls `submit`/`cancel` (thread-safe) and `run` runs the loop on its own thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch
from tokenizers import Tokenizer

from moebox.errors import MoeboxError
from moebox.model.batch import DecodeBatch, FlatBatch
from moebox.model.deepseek_v4 import DeepseekV4
from moebox.runtime import graphs
from moebox.runtime.metrics import EngineMetrics
from moebox.runtime.speculative import DraftWork, MTPDrafter, SpecPolicy
from moebox.runtime.sampler import SamplingParams, sample_token, token_probs, verify_draft

log = logging.getLogger("moebox")
LOG_EVERY_S = 10.0      # period of the speculative-decoding acceptance log line


class QueueFull(MoeboxError):
    """The waiting queue is at its bound: the client should retry later (HTTP 503)."""


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Event:
    """New output of one request: tokens since the last event, their text, and the finish when done."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class Request:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    on_event: Callable[[Event], None]
    logprobs: int | None = None          # None: off; k >= 0: the sampled token's logprob + top-k alternatives
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # forced continuation: once the output text contains `force_after` ("" = from the start), the next tokens
    # are `forced_ids` instead of samples (how tool_choice required/named opens a tool-call block)
    force_after: str | None = None
    forced_ids: list[int] = field(default_factory=list)
    # engine state
    slot: int = -1
    num_prefilled: int = 0
    out_ids: list[int] = field(default_factory=list)
    text: str = ""
    decoded: int = 0                     # output tokens whose text is in `text`
    emitted_chars: int = 0
    finish_reason: str | None = None
    cancelled: bool = False
    arrival: float = field(default_factory=time.perf_counter)
    last_token_time: float | None = None
    generator: torch.Generator | None = None
    pending_forced: deque[int] = field(default_factory=deque)
    drafts: list[int] = field(default_factory=list)      # MTP drafts to verify at the next step
    draft_probs: list[torch.Tensor] | None = None         # the q each draft was sampled from (None: greedy)

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.out_ids)

    def tokens(self, start: int, stop: int) -> list[int]:
        """Prompt-then-output tokens at positions start..stop-1, without joining the whole sequence."""
        p = len(self.prompt_ids)
        return self.prompt_ids[start:stop] + self.out_ids[max(0, start - p):max(0, stop - p)]

    @property
    def prefill_done(self) -> bool:
        return self.num_prefilled >= len(self.prompt_ids)


class Engine:
    def __init__(self, model: DeepseekV4, tokenizer: Tokenizer | None, *, max_num_seqs: int, max_model_len: int,
                 max_num_batched_tokens: int = 2048, max_waiting: int = 256, device: torch.device | str = "cpu",
                 seed: int = 0, metrics: EngineMetrics | None = None, cuda_graphs: bool = True,
                 num_speculative_tokens: int = 0, adaptive_speculation: bool = True) -> None:
        if max_num_batched_tokens < max_num_seqs:
            raise MoeboxError(f"--max-num-batched-tokens ({max_num_batched_tokens}) must be at least "
                              f"--max-num-seqs ({max_num_seqs}): every running sequence decodes one token per step")
        self.model, self.tokenizer = model, tokenizer
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.max_num_batched_tokens, self.max_waiting = max_num_batched_tokens, max_waiting
        self.device = torch.device(device)
        if num_speculative_tokens and not model.mtp:
            raise MoeboxError("speculative decoding needs the model's MTP head loaded (load_mtp)")
        self.spec_k = num_speculative_tokens
        why_eager = graphs.supported(model, self.device) if cuda_graphs else "cuda_graphs=False"
        # one more slot than sequences when decode steps replay graphs: the padding rows' scratch slot
        self.cache = model.new_cache(max_num_seqs + (why_eager is None), max_model_len, self.device,
                                     spec_slack=self.spec_k)
        self.drafter = MTPDrafter(model, self.cache) if self.spec_k else None
        self.spec_policy = SpecPolicy(self.spec_k, adaptive=adaptive_speculation) if self.spec_k else None
        self._drafted_k = 0                      # the k the policy chose for the drafts now pending
        self._spec_logged = time.perf_counter()
        self.graphs: graphs.DecodeGraphs | None = None
        if why_eager is None:
            self.graphs = graphs.DecodeGraphs(model, self.cache, max_num_seqs,
                                              graphs.batch_sizes_for(max_num_seqs * (1 + self.spec_k)))
        elif self.device.type == "cuda":
            log.info("decode steps run eagerly: %s", why_eager)
        self.eos_ids = set(model.cfg.eos_token_ids)
        self.metrics = metrics or EngineMetrics()
        self._generator = torch.Generator().manual_seed(seed)
        self._free_slots = list(range(max_num_seqs))[::-1]
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._by_id: dict[str, Request] = {}
        self._lock = threading.Condition()
        self._stopped = False

    # ------------------------------------------------------------------ client side (any thread)
    def check_prompt(self, ids: list[int], max_tokens: int) -> list[int]:
        """The prompt as ints, or a MoeboxError saying what is wrong with it."""
        ids = [int(i) for i in ids]
        vocab = self.model.cfg.vocab_size
        if not ids:
            raise MoeboxError("empty prompt: give at least one token")
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise MoeboxError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(ids) + max_tokens > self.max_model_len:
            raise MoeboxError(f"prompt of {len(ids)} tokens + max_tokens {max_tokens} exceeds max_model_len "
                              f"{self.max_model_len}")
        return ids

    def submit(self, req: Request) -> None:
        req.prompt_ids = self.check_prompt(req.prompt_ids, req.params.max_tokens)
        req.generator = torch.Generator().manual_seed(req.params.seed) if req.params.seed is not None else None
        if req.force_after == "":
            req.pending_forced.extend(req.forced_ids)
            req.force_after = None
        with self._lock:
            if req.id in self._by_id:
                raise MoeboxError(f"request id {req.id!r} is already in use")
            if len(self._waiting) >= self.max_waiting:
                self.metrics.rejected.inc()
                raise QueueFull(f"server busy: {len(self._waiting)} requests already waiting; retry later")
            self._waiting.append(req)
            self._by_id[req.id] = req
            self._update_gauges()
            self._lock.notify()

    def cancel(self, request_id: str) -> None:
        """Stop a request (client gone): its slot is freed at the next step; no more events are sent."""
        with self._lock:
            req = self._by_id.get(request_id)
            if req is None:
                return
            req.cancelled = True
            if req in self._waiting:           # never admitted: leave the queue now, so it frees queue room
                self._waiting.remove(req)
                self._finish(req, "cancelled")
            self._lock.notify()

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            self._lock.notify()

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._waiting or self._running)

    @property
    def slots_in_use(self) -> int:
        return self.max_num_seqs - len(self._free_slots)

    # ------------------------------------------------------------------ engine thread
    def run(self) -> None:
        """The engine loop (run it on its own thread); sleeps while there is nothing to do."""
        while True:
            with self._lock:
                while not self._stopped and not (self._waiting or self._running):
                    self._lock.wait()
                if self._stopped:
                    return
            try:
                self.step()
            except Exception:                      # a bug: fail the requests in flight, keep serving
                log.exception("engine step failed; failing the requests in this batch")
                with self._lock:
                    for req in list(self._running):
                        self._finish(req, "error")

    @torch.inference_mode()
    def step(self) -> bool:
        """One scheduling step. Returns False when there was nothing to run."""
        with self._lock:
            for req in [r for r in self._running if r.cancelled]:
                self._finish(req, "cancelled", notify=False)
            while self._waiting and self._free_slots:
                req = self._waiting.popleft()
                req.slot = self._free_slots.pop()
                self._running.append(req)
            self._update_gauges()
            batch_reqs = list(self._running)
        if not batch_reqs:
            return False

        started = time.perf_counter()
        parts, owners, decoding, budget = [], [], [], self.max_num_batched_tokens
        for req in batch_reqs:                     # decode first: running sequences never starve
            if req.prefill_done:
                parts.append((req.slot, req.length - 1, [req.out_ids[-1]] + req.drafts))
                owners.append(req)
                decoding.append(True)
                budget -= 1 + len(req.drafts)
        k_used = self._drafted_k
        for req in batch_reqs:
            if not req.prefill_done and budget > 0:
                n = min(len(req.prompt_ids) - req.num_prefilled, budget)
                parts.append((req.slot, req.num_prefilled, req.prompt_ids[req.num_prefilled:req.num_prefilled + n]))
                owners.append(req)
                decoding.append(False)
                req.num_prefilled += n
                budget -= n
                self.metrics.prompt_tokens.inc(n)
        decode_only = all(decoding)
        if decode_only:            # one token per row, every row's logits: the shape-static path (graphs on CUDA)
            rows = DecodeBatch.rows(parts)
            if self.graphs is not None and self.graphs.fits(len(rows[0])):
                out = self.graphs.run(*rows)
            else:
                out = self.model.forward(DecodeBatch.build(parts, self.device), self.cache)
        else:
            batch = FlatBatch.build(parts, self.device)
            # logits: every row of a decode part (its drafts are verified), the last row of a prefill chunk
            rows = [s.offset + i for s, dec in zip(batch.segments, decoding)
                    for i in (range(s.length) if dec else [s.length - 1])]
            out = self.model.forward(batch, self.cache, logits_rows=torch.tensor(rows, device=self.device))
        emitted = self._emit(owners, parts, decoding, out.logits, out.hidden if self.drafter else None)
        if self.spec_policy is not None and decode_only:     # decode-only steps measure the speed of k
            self.spec_policy.observe(len(parts), k_used, emitted, time.perf_counter() - started)
        return True

    def _emit(self, owners: list[Request], parts: list[tuple[int, int, list[int]]], decoding: list[bool],
              logits: torch.Tensor, hidden: torch.Tensor | None) -> int:
        """Turn one forward's logits into tokens and events: one sampled token per finished prefill, and per
        decode part the sampled tokens up to the first draft the sampler disagrees with. With a drafter, then
        write the verified rows into the MTP cache and draft for the next step. Returns the tokens emitted."""
        now, row, offset, total, work, drafting = time.perf_counter(), 0, 0, 0, [], []
        for req, (_, start, ids), dec in zip(owners, parts, decoding):
            n_rows = len(ids) if dec else 1
            emitted: list[int] = []
            if dec or req.prefill_done:
                for i in range(n_rows):
                    if req.cancelled:
                        break
                    q = req.draft_probs[i] if dec and req.draft_probs and i + 1 < len(ids) else None
                    event = self._advance(req, logits[row + i], now, (ids[i + 1], q) if q is not None else None)
                    emitted.append(req.out_ids[-1])
                    if event.finish_reason:
                        with self._lock:
                            self._finish(req, event.finish_reason, notify=False)
                    req.on_event(event)
                    if event.finish_reason or (i + 1 < len(ids) and emitted[-1] != ids[i + 1]):
                        break
            total += len(emitted)
            if dec and len(ids) > 1:
                self._count_drafts(ids[1:], emitted)
            row += n_rows
            if hidden is not None and req.finish_reason is None and not req.cancelled:
                verified = len(emitted) if dec else len(ids)     # rows whose input tokens were all right
                work.append(DraftWork(req.slot, start, hidden[offset:offset + verified],
                                      req.tokens(start + 1, start + 1 + verified),
                                      self._draft_budget(req) if req.prefill_done else 0,
                                      req.params, req.generator or self._generator))
                drafting.append(req)
            offset += len(ids)
        if work:
            self._drafted_k = self.spec_policy.choose(sum(req.prefill_done for req in drafting))
            for w in work:
                w.k = min(w.k, self._drafted_k)
        for req, drafts in zip(drafting, self.drafter.run(work) if work else []):
            req.drafts, req.draft_probs = drafts.tokens, drafts.probs
        return total

    def _count_drafts(self, drafts: list[int], emitted: list[int]) -> None:
        """Acceptance metrics of one verified part, and a log line every LOG_EVERY_S seconds."""
        m = self.metrics
        accepted = next((i for i, (d, t) in enumerate(zip(drafts, emitted)) if d != t), min(len(drafts), len(emitted)))
        m.spec_steps.inc()
        m.spec_drafted.inc(len(drafts))
        m.spec_accepted.inc(accepted)
        for i in range(accepted):
            m.spec_accepted_at.labels(position=str(i + 1)).inc()
        now = time.perf_counter()
        if now - self._spec_logged >= LOG_EVERY_S:
            self._spec_logged = now
            steps, drafted, kept = m.spec_counts()
            log.info("MTP: %.0f%% of %d drafts accepted, %.2f tokens per verify step", 100 * kept / drafted,
                     drafted, 1 + kept / steps)

    def _draft_budget(self, req: Request) -> int:
        """Drafts worth verifying next step: none past max_model_len or past the request's last token."""
        return max(0, min(self.spec_k, self.max_model_len - req.length, req.params.max_tokens - len(req.out_ids) - 1))

    # ------------------------------------------------------------------ sampling and output
    def _advance(self, req: Request, row: torch.Tensor, now: float,
                 draft: tuple[int, torch.Tensor] | None = None) -> Event:
        """Sample (or take the forced) next token, detokenize, apply stops. Touches only `req` (engine thread).
        `draft`: a sampled MTP draft for this position and the q it came from: speculative sampling keeps it or
        draws another token, distributed as a plain sample either way."""
        p = req.params
        if req.presence_penalty or req.frequency_penalty:
            row = apply_penalties(row, req.out_ids, req.presence_penalty, req.frequency_penalty)
        forced = bool(req.pending_forced)
        gen = req.generator or self._generator
        if forced:
            token = req.pending_forced.popleft()
        elif draft is not None and p.temperature > 0:
            token = verify_draft(token_probs(row, p), draft[1], draft[0], gen)
        else:
            token = sample_token(row, p, gen)
        lp = None
        if req.logprobs is not None:
            logp = torch.log_softmax(row.float(), dim=-1)
            top = logp.topk(req.logprobs) if req.logprobs else None
            lp = TokenLogprob(token, float(logp[token]),
                              list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else [])
        if req.last_token_time is None:
            self.metrics.ttft.observe(now - req.arrival)
        else:
            self.metrics.itl.observe(now - req.last_token_time)
        req.last_token_time = now
        req.out_ids.append(token)
        self.metrics.generation_tokens.inc()

        finish = None
        if not forced and ((token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids):
            finish = "stop"
        if self.tokenizer is not None:
            self._detokenize(req, req.out_ids[:-1] if finish else req.out_ids, final=finish is not None)
            if p.stop:
                hits = [req.text.find(s, max(0, req.emitted_chars - len(s))) for s in p.stop]
                hits = [h for h in hits if h >= 0]
                if hits:
                    req.text, finish = req.text[:min(hits)], "stop"
        if req.force_after and req.force_after in req.text:
            req.pending_forced.extend(req.forced_ids)
            req.force_after = None
        if finish is None and (len(req.out_ids) >= p.max_tokens or req.length >= self.max_model_len):
            finish = "length"
            if self.tokenizer is not None:
                self._detokenize(req, req.out_ids, final=True)
        hold = 0              # what could still become a stop string stays back until it is decided
        if finish is None:
            for s in p.stop:
                for k in range(min(len(s) - 1, len(req.text)), 0, -1):
                    if req.text.endswith(s[:k]):
                        hold = max(hold, k)
                        break
        upto = len(req.text) - hold
        delta = req.text[req.emitted_chars:upto] if upto > req.emitted_chars else ""
        req.emitted_chars = max(req.emitted_chars, upto)
        return Event([token], delta, [lp] if lp else [], finish, len(req.prompt_ids), len(req.out_ids))

    def _detokenize(self, req: Request, ids: list[int], final: bool) -> None:
        """Extend `req.text` with the text of ids[req.decoded:], decoding only a few tokens of context (not the
        whole output: that would cost O(n) per token). A tail that ends inside a UTF-8 character waits for the
        next token, unless `final`."""
        skip = req.params.skip_special_tokens
        start = max(0, req.decoded - 4)           # context, so byte-level pieces decode the same as in full
        prefix = self.tokenizer.decode(ids[start:req.decoded], skip_special_tokens=skip)
        full = self.tokenizer.decode(ids[start:], skip_special_tokens=skip)
        tail = full[len(prefix):] if full.startswith(prefix) else \
            self.tokenizer.decode(ids[req.decoded:], skip_special_tokens=skip)
        if final or not tail.endswith("\ufffd"):
            req.text += tail
            req.decoded = len(ids)

    def _update_gauges(self) -> None:
        """Queue, running and cache gauges from the current state (lock held): set wherever it changes, so they
        read true also while the loop sleeps with nothing to do."""
        self.metrics.waiting.set(len(self._waiting))
        self.metrics.running.set(len(self._running))
        self.metrics.cache_usage.set(self.slots_in_use / self.max_num_seqs)

    def _finish(self, req: Request, reason: str, notify: bool = True) -> None:
        """Free the slot and forget the request (lock held). Cancelled requests get no event."""
        req.finish_reason = reason
        if req in self._running:
            self._running.remove(req)
            self._free_slots.append(req.slot)
        self._by_id.pop(req.id, None)
        self.metrics.finished.labels(reason=reason).inc()
        self._update_gauges()
        if notify and reason != "cancelled":
            req.on_event(Event([], "", [], reason, len(req.prompt_ids), len(req.out_ids)))


def apply_penalties(logits: torch.Tensor, generated: list[int], presence: float, frequency: float) -> torch.Tensor:
    """OpenAI semantics over the tokens generated so far: logit -= presence * [count > 0] + frequency * count."""
    if not generated:
        return logits
    counts = torch.bincount(torch.tensor(generated, device=logits.device), minlength=logits.numel()).to(logits.dtype)
    return logits - presence * (counts > 0).to(logits.dtype) - frequency * counts
