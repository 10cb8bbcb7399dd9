"""`moebox train`: corpus -> tokenizer -> DeepSeek-V4 (with MTP) -> official-layout checkpoint, resumable.

One run directory holds everything a run makes, each step skipped when its output exists, so a killed run
continues where it stopped and a finished one is reproducible from the repo alone:
  corpus/          `moebox.train.data.write_corpus` (train / heldout / eval JSONL)
  tokenizer.json   BPE trained on the train split (`moebox.train.tokenizer`), the preset's vocab size
  config.json      the preset's official-dialect config
  state.pt         parameters, AdamW state, step and data cursor, written atomically every `save_every` steps
  model/           the export (`moebox.train.export`) after the last step: what `moebox serve` loads
Training runs the serving model code (`moebox.train.model`): each step packs whole documents (each one a segment
from position 0, so they never attend to each other) up to `batch_tokens`, and minimises the next-token loss
plus `mtp_weight` x the MTP next-next-token loss. AdamW with linear warm-up and cosine decay to 10%, gradient
clipping at 1.0, bf16 autocast on CUDA. Documents come in a per-epoch permutation drawn from the seed; the cursor
in state.pt makes a resumed run see the same batches as an uninterrupted one (bit-identical on the CPU).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer
from tqdm import tqdm

from moebox.config import parse_config
from moebox.errors import MoeboxError
from moebox.train.data import write_corpus
from moebox.train.export import export_checkpoint
from moebox.train.model import init_params, losses, trainable_model
from moebox.train.tokenizer import train_tokenizer
from moebox.weights.synth import preset_config

log = logging.getLogger("moebox")


@dataclass
class TrainSettings:
    preset: str = "demo"
    steps: int = 2000
    batch_tokens: int = 16384
    max_doc_tokens: int = 1024       # longer documents are cut (the demo's prompts are far shorter)
    lr: float = 3e-3
    warmup: int = 100
    weight_decay: float = 0.1
    mtp_weight: float = 0.3
    seed: int = 0
    save_every: int = 200
    n_train: int = 20000             # corpus documents
    n_heldout: int = 2000
    n_eval_per_kind: int = 100


def _prepare(run: Path, s: TrainSettings, progress: bool) -> tuple[dict, Tokenizer, list[list[int]]]:
    """Corpus, tokenizer and config (made once, reused after), and the tokenized training documents."""
    corpus = run / "corpus"
    if not (corpus / "manifest.json").exists():
        log.info("writing the corpus to %s", corpus)
        write_corpus(corpus, seed=s.seed, n_train=s.n_train, n_heldout=s.n_heldout,
                     n_eval_per_kind=s.n_eval_per_kind)
    texts = [json.loads(line)["text"] for line in (corpus / "train.jsonl").read_text().splitlines()]
    raw_cfg = preset_config(s.preset)
    tok_path = run / "tokenizer.json"
    if tok_path.exists():
        tok = Tokenizer.from_file(str(tok_path))
    else:
        log.info("training a %d-token BPE tokenizer on %d documents", raw_cfg["vocab_size"], len(texts))
        tok = train_tokenizer(texts, raw_cfg["vocab_size"])
        tok.save(str(tok_path))
    raw_cfg["vocab_size"] = max(raw_cfg["vocab_size"], tok.get_vocab_size())
    cfg_path = run / "config.json"
    if not cfg_path.exists():
        cfg_path.write_text(json.dumps(raw_cfg, indent=2) + "\n")
    raw_cfg = json.loads(cfg_path.read_text())
    docs = [ids[:s.max_doc_tokens] for ids in
            (e.ids for e in tqdm(tok.encode_batch(texts, add_special_tokens=False), desc="tokenizing",
                                 unit="doc", disable=not progress, leave=False))
            if len(ids) >= 3]
    return raw_cfg, tok, docs


class _Batches:
    """Whole documents, in a per-epoch permutation of the seed, packed up to `batch_tokens` per step."""

    def __init__(self, docs: list[list[int]], batch_tokens: int, seed: int, epoch: int = 0, pos: int = 0) -> None:
        self.docs, self.batch_tokens, self.seed = docs, batch_tokens, seed
        self.epoch, self.pos = epoch, pos
        self._order = self._permutation()

    def _permutation(self) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(len(self.docs), generator=g).tolist()

    def next(self) -> list[list[int]]:
        batch, size = [], 0
        while not batch or size + len(self.docs[self._order[self.pos]]) <= self.batch_tokens:
            doc = self.docs[self._order[self.pos]]
            batch.append(doc)
            size += len(doc)
            self.pos += 1
            if self.pos == len(self._order):
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._permutation()
        return batch


def _lr_at(step: int, s: TrainSettings) -> float:
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    t = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def _save(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)                      # a kill mid-save leaves the previous state.pt intact


def train(run_dir: str | Path, s: TrainSettings, device: str = "cpu", progress: bool = True) -> Path:
    """Run (or resume) training in `run_dir`; returns the exported model directory."""
    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    settings_path = run / "settings.json"
    if settings_path.exists() and json.loads(settings_path.read_text()) != asdict(s):
        raise MoeboxError(f"{run}: was started with other settings ({settings_path}); use a new --run-dir or "
                          f"the same flags")
    settings_path.write_text(json.dumps(asdict(s), indent=2) + "\n")
    raw_cfg, tok, docs = _prepare(run, s, progress)
    cfg = parse_config(raw_cfg, source=str(run / "config.json"))
    params = init_params(cfg, seed=s.seed, device=device)
    learned = {n: p for n, p in params.items() if isinstance(p, torch.nn.Parameter)}
    opt = torch.optim.AdamW(list(learned.values()), lr=s.lr, betas=(0.9, 0.95), weight_decay=s.weight_decay)
    step, batches = 0, _Batches(docs, s.batch_tokens, s.seed)
    state_path = run / "state.pt"
    if state_path.exists():
        state = torch.load(state_path, map_location=device)
        with torch.no_grad():
            for n, p in learned.items():
                p.copy_(state["params"][n])
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
        batches = _Batches(docs, s.batch_tokens, s.seed, state["epoch"], state["pos"])
        log.info("resuming %s at step %d of %d", run, step, s.steps)
    model = trainable_model(cfg, params)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda") else nullcontext()
    bar = tqdm(total=s.steps, initial=step, desc="training", unit="step", disable=not progress)
    t0, tokens = time.perf_counter(), 0
    while step < s.steps:
        seqs = batches.next()
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, s)
        with autocast:
            main, mtp = losses(model, seqs, device)
        loss = main + s.mtp_weight * mtp
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(learned.values()), 1.0)
        opt.step()
        step += 1
        tokens += sum(len(q) for q in seqs)
        bar.update(1)
        bar.set_postfix(loss=f"{main.item():.3f}", mtp=f"{mtp.item():.3f}",
                        tok_s=f"{tokens / (time.perf_counter() - t0):.0f}")
        if step % s.save_every == 0 or step == s.steps:
            _save(state_path, {"params": {n: p.detach() for n, p in learned.items()}, "optimizer": opt.state_dict(),
                               "step": step, "epoch": batches.epoch, "pos": batches.pos})
            log.info("step %d: loss %.4f, mtp %.4f (saved %s)", step, main.item(), mtp.item(), state_path)
    bar.close()
    out = run / "model"
    if not out.exists():                       # export next to it, then rename: never a half-written model/
        tmp = run / "model.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        export_checkpoint(tmp, raw_cfg, params, tok, progress=progress)
        os.replace(tmp, out)
        log.info("exported the trained model to %s", out)
    return out
