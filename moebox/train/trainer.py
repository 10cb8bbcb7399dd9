"""`moebox train`: corpus -> tokenizer -> DeepSeek-V4 (with MTP) -> official-layout checkpoint, resumable.

One run directory holds everything a run makes, each step skipped when its output exists, so a killed run
continues where it stopped and a finished one is reproducible from the repo alone:
  corpus/          `moebox.train.data.write_corpus` (train / heldout / eval JSONL)
  tokenizer.json   BPE trained on the train split (`moebox.train.tokenizer`), the preset's vocab size
  config.json      the preset's official-dialect config, with `config_overrides` (a JSON object) applied
  state.pt         parameters, AdamW state, step and data cursor, written atomically every `save_every` steps
  model/           the export (`moebox.train.export`) after the last step: what `moebox serve` loads
Training runs the serving model code (`moebox.train.model`): documents are concatenated (each starts with BOS)
and cut into rows of `seq_len` tokens, `batch_tokens // seq_len` rows a step, each row one segment from
position 0. Equal rows from position 0 take the model's batched cache-free attention (`Attention._fresh`), so a
step costs the same number of kernel launches for 2 rows or 32: launches, not FLOPs, bound a step of a model
this small on a GPU. Each step minimises the next-token loss plus `mtp_weight` x the MTP next-next-token loss.
AdamW with linear warm-up and cosine decay to 10%, gradient clipping at 1.0. `gain_decay` is the weight decay of
the 1-D tensors (norm gains, attention sinks, mHC scales). Those gains cap how sharp attention can get: V4
normalises each query head with no gain, so a key's `kv_norm` gain times sqrt(head_dim) bounds an attention logit.
On CUDA `precision` fp32 (the default) runs TF32 matmuls: at the demo's size a step is bound by kernel launches,
not FLOPs, and the bf16-autocast step did not finish compiling within a 4-minute probe on the H200. Documents
come in a per-epoch permutation drawn from the seed; the cursor in state.pt makes a resumed run see the same
batches as an uninterrupted one (bit-identical on the CPU).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
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
    steps: int = 2000                # None while a time budget (`train(budget_s=...)`) has not fixed it yet
    batch_tokens: int = 16384
    seq_len: int = 2048              # tokens per packed row
    lr: float = 3e-3
    warmup: int = 100
    weight_decay: float = 0.1
    gain_decay: float = 0.1          # weight decay of 1-D tensors; 0 exempts them
    mtp_weight: float = 0.3
    seed: int = 0
    precision: str = "fp32"          # CUDA: fp32 with TF32 matmuls, or bf16 autocast; the CPU always runs fp32
    save_every: int = 200
    n_train: int = 20000             # corpus documents
    n_heldout: int = 2000
    n_eval_per_kind: int = 100
    config_overrides: str = ""       # JSON object of config.json keys over the preset's, e.g. '{"head_dim": 256}'
    expert_qat: bool = False         # routed experts seen through FP4 in the forward (train.model.FP4FakeQuant)


def model_config(s: TrainSettings) -> dict:
    """The preset's config with `config_overrides` applied, checked by the config parser (before any work)."""
    raw = preset_config(s.preset)
    if s.config_overrides:
        try:
            overrides = json.loads(s.config_overrides)
        except json.JSONDecodeError as e:
            raise MoeboxError(f"--config-overrides is not JSON ({e}); give an object such as '{{\"head_dim\": 256}}'")
        if not isinstance(overrides, dict):
            raise MoeboxError(f"--config-overrides must be a JSON object of config.json keys, not {overrides!r}")
        unknown = sorted(set(overrides) - set(raw))
        if unknown:
            raise MoeboxError(f"--config-overrides: {unknown} are not keys of the {s.preset!r} preset's config "
                              f"(keys: {sorted(raw)})")
        raw.update(overrides)
    parse_config(raw, source="--preset with --config-overrides")
    return raw


def _prepare(run: Path, s: TrainSettings, raw_cfg: dict, progress: bool) -> tuple[dict, Tokenizer, list[list[int]]]:
    """Corpus, tokenizer and config (made once, reused after; `raw_cfg` is `model_config(s)`), and the tokenized
    training documents."""
    corpus = run / "corpus"
    if not (corpus / "manifest.json").exists():
        log.info("writing the corpus to %s", corpus)
        write_corpus(corpus, seed=s.seed, n_train=s.n_train, n_heldout=s.n_heldout,
                     n_eval_per_kind=s.n_eval_per_kind)
    texts = [json.loads(line)["text"] for line in (corpus / "train.jsonl").read_text().splitlines()]
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
    wanted, raw_cfg = raw_cfg, json.loads(cfg_path.read_text())
    differ = sorted(k for k in json.loads(s.config_overrides or "{}") if raw_cfg.get(k) != wanted[k])
    if differ:
        raise MoeboxError(f"{cfg_path} has other values of {differ} than --config-overrides; remove it (the "
                          f"corpus and tokenizer can stay) or use a new --run-dir")
    docs = [e.ids for e in tqdm(tok.encode_batch(texts, add_special_tokens=False), desc="tokenizing",
                                unit="doc", disable=not progress, leave=False) if e.ids]
    return raw_cfg, tok, docs


class _Batches:
    """Documents in a per-epoch permutation of the seed, concatenated and cut into `rows` rows of `seq_len`
    tokens; (epoch, pos, offset) is the cursor: the document being read and how far into it."""

    def __init__(self, docs: list[list[int]], seq_len: int, rows: int, seed: int, epoch: int = 0, pos: int = 0,
                 offset: int = 0) -> None:
        self.docs, self.seq_len, self.rows, self.seed = docs, seq_len, rows, seed
        self.epoch, self.pos, self.offset = epoch, pos, offset
        self._order = self._permutation()

    def _permutation(self) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(len(self.docs), generator=g).tolist()

    def next(self) -> list[list[int]]:
        out = []
        for _ in range(self.rows):
            row: list[int] = []
            while len(row) < self.seq_len:
                doc = self.docs[self._order[self.pos]]
                take = doc[self.offset:self.offset + self.seq_len - len(row)]
                row += take
                self.offset += len(take)
                if self.offset == len(doc):
                    self.pos, self.offset = self.pos + 1, 0
                    if self.pos == len(self._order):
                        self.epoch, self.pos = self.epoch + 1, 0
                        self._order = self._permutation()
            out.append(row)
        return out


def _lr_at(step: int, s: TrainSettings) -> float:
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    t = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def _save(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)                      # a kill mid-save leaves the previous state.pt intact


def train(run_dir: str | Path, s: TrainSettings, device: str = "cpu", progress: bool = True,
          budget_s: float | None = None, pause_s: float | None = None) -> Path | None:
    """Run (or resume) training in `run_dir`; returns the exported model directory, or None when paused.

    `budget_s`: instead of `s.steps`, train as many steps as fit in this many seconds from now. The step
    count is fixed from the speed of steps 5..10 (before the learning-rate warm-up ends, so the schedule is
    whole) and written to settings.json: `--steps` with that number reproduces the run, and a resumed run
    keeps it. `pause_s`: save the state and stop (without exporting) once this many seconds have passed, so a
    run longer than one sitting (a device call is capped at 10 minutes) goes on where it stopped when resumed;
    the schedule is the run's, so the result equals an uninterrupted run's."""
    started = time.perf_counter()
    raw_cfg = model_config(s)                # a bad --config-overrides fails before anything is written
    if device.startswith("cuda") and not torch.cuda.is_available():   # before minutes of corpus writing
        raise MoeboxError("--device cuda, but torch sees no CUDA device on this machine; use --device cpu or "
                          "a CUDA build of torch on a GPU machine")
    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    settings_path = run / "settings.json"
    saved = json.loads(settings_path.read_text()) if settings_path.exists() else None
    if saved is not None:                    # a run from before a setting existed had its default
        saved = {**asdict(TrainSettings()), **saved}
    if budget_s is not None:
        if s.warmup < 10:
            raise MoeboxError(f"--minutes needs --warmup >= 10 (got {s.warmup}): the step count is fixed after "
                              f"10 timed steps, inside the warm-up")
        if saved is not None and saved["steps"] is not None:     # resumed: the count was fixed when it started
            s, budget_s = replace(s, steps=saved["steps"]), None
        else:
            s = replace(s, steps=None)  # type: ignore[arg-type]
    if saved is not None and saved != asdict(s):
        raise MoeboxError(f"{run}: was started with other settings ({settings_path}); use a new --run-dir or "
                          f"the same flags")
    settings_path.write_text(json.dumps(asdict(s), indent=2) + "\n")
    raw_cfg, tok, docs = _prepare(run, s, raw_cfg, progress)
    cfg = parse_config(raw_cfg, source=str(run / "config.json"))
    params = init_params(cfg, seed=s.seed, device=device)
    learned = {n: p for n, p in params.items() if isinstance(p, torch.nn.Parameter)}
    opt = torch.optim.AdamW([
        {"params": [p for p in learned.values() if p.dim() > 1], "weight_decay": s.weight_decay},
        {"params": [p for p in learned.values() if p.dim() <= 1], "weight_decay": s.gain_decay},
    ], lr=s.lr, betas=(0.9, 0.95))
    if s.seq_len < 3 or s.batch_tokens < s.seq_len:
        raise MoeboxError(f"--seq-len {s.seq_len} must be >= 3 and at most --batch-tokens {s.batch_tokens}")
    rows = s.batch_tokens // s.seq_len
    step, batches = 0, _Batches(docs, s.seq_len, rows, s.seed)
    state_path = run / "state.pt"
    if state_path.exists():
        state = torch.load(state_path, map_location=device)
        with torch.no_grad():
            for n, p in learned.items():
                p.copy_(state["params"][n])
        if len(state["optimizer"]["param_groups"]) != len(opt.param_groups):
            raise MoeboxError(f"{state_path} was written by an older moebox (one AdamW parameter group, before "
                              f"--gain-decay); finish it with that version or start a new --run-dir")
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
        batches = _Batches(docs, s.seq_len, rows, s.seed, state["epoch"], state["pos"], state["offset"])
        log.info("resuming %s at step %d of %s", run, step, s.steps or "a count fixed by the time budget")
    model = trainable_model(cfg, params, expert_qat=s.expert_qat)
    cuda = device.startswith("cuda")
    torch.backends.cuda.matmul.allow_tf32 = cuda and s.precision == "fp32"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda and s.precision == "bf16" else nullcontext()
    bar = tqdm(total=s.steps, initial=step, desc="training", unit="step", disable=not progress)
    t0, tokens, first = time.perf_counter(), 0, step
    warm = None                                # (time, step) after the first steps' compilation and warm-up
    while s.steps is None or step < s.steps:
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
        if step == first + 5:
            warm = (time.perf_counter(), step)
        if s.steps is None and step == first + 10:
            now = time.perf_counter()
            per_step = (now - warm[0]) / (step - warm[1])
            s = replace(s, steps=max(step + 1, step + int((budget_s - (now - started)) / per_step)))
            settings_path.write_text(json.dumps(asdict(s), indent=2) + "\n")
            bar.total = s.steps
            log.info("time budget %.0f s at %.3f s/step: %d steps (--steps %d reproduces this run)", budget_s,
                     per_step, s.steps, s.steps)
        bar.set_postfix(loss=f"{main.item():.3f}", mtp=f"{mtp.item():.3f}",
                        tok_s=f"{tokens / (time.perf_counter() - t0):.0f}")
        pausing = pause_s is not None and time.perf_counter() - started > pause_s and step != s.steps
        if step % s.save_every == 0 or step == s.steps or pausing:
            _save(state_path, {"params": {n: p.detach() for n, p in learned.items()}, "optimizer": opt.state_dict(),
                               "step": step, "epoch": batches.epoch, "pos": batches.pos,
                               "offset": batches.offset})
            log.info("step %d: loss %.4f, mtp %.4f (saved %s)", step, main.item(), mtp.item(), state_path)
        if pausing:
            break
    bar.close()
    if warm is not None and step > warm[1]:
        per_step = (time.perf_counter() - warm[0]) / (step - warm[1])
        log.info("trained steps %d..%d: %.3f s/step after warm-up (%.0f tok/s)", first, step, per_step,
                 rows * s.seq_len / per_step)
    if step != s.steps:
        log.info("paused at step %d of %d: run the same command again to go on", step, s.steps)
        return None
    out = run / "model"
    if not out.exists():                       # export next to it, then rename: never a half-written model/
        tmp = run / "model.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        export_checkpoint(tmp, raw_cfg, params, tok, progress=progress)
        os.replace(tmp, out)
        log.info("exported the trained model to %s", out)
    return out
