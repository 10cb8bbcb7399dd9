"""The offline API: `LLM(model=...)`, `generate(prompts, SamplingParams)` and `logits(token_ids)`.

`generate` drives the same continuous-batching engine the server uses, on the caller's thread: prompts wait
for a free cache slot, prefill in chunks, and decode together in one flat batch per step.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Sequence

import torch
from tokenizers import Tokenizer
from tqdm import tqdm

from moebox.config import load_config
from moebox.errors import MoeboxError
from moebox.model.batch import FlatBatch
from moebox.runtime.dirs import check_model_dir
from moebox.runtime.engine import Engine, Event, Request
from moebox.runtime.loader import load_model
from moebox.runtime.metrics import EngineMetrics
from moebox.runtime.plan import available_memory, parse_size, plan_for
from moebox.runtime.sampler import SamplingParams
from moebox.runtime.speculative import SpeculativeConfig, draft_source
from moebox.weights.checkpoint import Checkpoint

log = logging.getLogger("moebox")

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


@dataclass
class CompletionOutput:
    token_ids: list[int]
    text: str
    finish_reason: str          # "stop" (EOS / stop string / stop token) or "length"


@dataclass
class RequestOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise MoeboxError(f"dtype={dtype!r} is not supported; use one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


class LLM:
    def __init__(self, model: str | Path, *, device: str = "cpu", dtype: str | torch.dtype | None = None,
                 kv_cache_dtype: str = "auto", max_model_len: int | None = None, max_num_seqs: int = 8,
                 seed: int = 0, load_mtp: bool = False, progress: bool = True, memory: int | str | None = None,
                 experts: str = "native", store_dir: str | Path | None = None,
                 max_num_batched_tokens: int = 2048, max_waiting: int = 1 << 30,
                 metrics: EngineMetrics | None = None, cuda_graphs: bool = True,
                 speculative_config: str | dict | None = None) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise MoeboxError("device='cuda' but no CUDA device is available; use device='cpu'")
        self.dtype = resolve_dtype(dtype, self.device)
        # Before any weight is read: a readable model dir and a plan that fits (fails in seconds, with numbers).
        cfg = load_config(check_model_dir(model))
        plan_len = max_model_len or min(cfg.max_position_embeddings, 4096)
        budget = parse_size(memory, "memory") if memory is not None else available_memory(self.device)
        self.plan = plan_for(cfg, budget, plan_len, max_num_seqs, max_num_batched_tokens, experts=experts,
                             kv_dtype=self.dtype, kv_layout="fp8" if kv_cache_dtype == "fp8" else "model",
                             with_mtp=load_mtp)
        log.info("%s", self.plan.table())
        self.plan.check()
        spec = SpeculativeConfig.parse(speculative_config) if speculative_config is not None else None
        draft = draft_source(Checkpoint(model), spec) if spec else None       # a bad head fails here, in seconds
        self.model, self.checkpoint = load_model(model, device=self.device, dtype=self.dtype,
                                                 kv_cache_dtype=kv_cache_dtype, load_mtp=load_mtp or spec is not None,
                                                 experts=experts, store_dir=store_dir, progress=progress,
                                                 draft=draft)
        self.config = self.model.cfg
        self.max_model_len = plan_len            # plan_for has checked it against max_position_embeddings
        self.max_num_seqs = max_num_seqs
        tok_path = Path(model) / "tokenizer.json"
        self.tokenizer = Tokenizer.from_file(str(tok_path)) if tok_path.exists() else None
        self.engine = Engine(self.model, self.tokenizer, max_num_seqs=max_num_seqs, max_model_len=self.max_model_len,
                             max_num_batched_tokens=max_num_batched_tokens, max_waiting=max_waiting,
                             device=self.device, seed=seed, metrics=metrics, cuda_graphs=cuda_graphs,
                             num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
                             adaptive_speculation=spec.adaptive if spec else True)
        self.cache = self.engine.cache

    # ------------------------------------------------------------------ tokens
    def encode(self, text: str) -> list[int]:
        """Token ids of a prompt, starting with BOS (added unless the text already starts with it)."""
        if self.tokenizer is None:
            raise MoeboxError(f"{self.checkpoint.dir}: no tokenizer.json; pass token-id lists instead of strings")
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        bos = self.config.bos_token_id
        return ids if ids[:1] == [bos] else [bos] + ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    # ------------------------------------------------------------------ analysis
    @torch.inference_mode()
    def logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Full-sequence next-token logits [len, vocab] (fp32) for one token sequence, without a cache."""
        ids = self.engine.check_prompt(list(token_ids), 0)
        batch = FlatBatch.build([(0, 0, ids)], self.device)
        return self.model.forward(batch, None, logits_rows=torch.arange(len(ids), device=self.device)).logits

    # ------------------------------------------------------------------ generation
    @torch.inference_mode()
    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = False, desc: str = "generating") -> list[RequestOutput]:
        """Run every prompt to completion through the continuous-batching engine (on this thread); `use_tqdm`
        shows finished requests and output tokens/s (vLLM's flag)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else \
            [sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise MoeboxError(f"{len(prompts)} prompts but {len(params)} sampling params")
        outputs: list[CompletionOutput] = []
        reqs = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
            out = CompletionOutput([], "", "length")
            outputs.append(out)
            reqs.append(Request(f"offline-{uuid.uuid4().hex}-{i}", self.engine.check_prompt(ids, p.max_tokens), p,
                                partial(_collect, out)))
        bar = tqdm(total=len(reqs), desc=desc, unit="req", disable=not use_tqdm)
        started = time.perf_counter()
        try:
            for req in reqs:
                self.engine.submit(req)
            while self.engine.has_work():
                self.engine.step()
                if use_tqdm:
                    tokens = sum(len(o.token_ids) for o in outputs)
                    bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - started):.0f}", refresh=False)
                    bar.update(sum(r.finish_reason is not None for r in reqs) - bar.n)
        except BaseException:                      # leave the engine clean for the next call
            for req in reqs:
                self.engine.cancel(req.id)
            self.engine.step()
            raise
        finally:
            bar.close()
        return [RequestOutput(p if isinstance(p, str) else None, r.prompt_ids, [o])
                for p, r, o in zip(prompts, reqs, outputs)]


def _collect(out: CompletionOutput, event: Event) -> None:
    out.token_ids.extend(event.token_ids)
    out.text += event.text
    if event.finish_reason:
        out.finish_reason = event.finish_reason
