"""`moebox bench spec`: MTP speculative decoding against plain decoding on a real model, per concurrency.

For each concurrency c the same held-out chat prompts (the demo corpus's eval split, greedy) run through an
`LLM` with `max_num_seqs=c`, once plain and once with `--mtp K` under the adaptive policy (what `serve --mtp K`
runs), after a warm-up pass (compilation, CUDA graphs). It reports, in the format of the field notes' table:
aggregate output tok/s, tok/s per slot (aggregate / c), and for MTP the draft acceptance and the tokens each
verify step emitted. Whether MTP ever loses (the policy's promise) is read off the speedup column.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

from moebox.bench.decode import table


@dataclass
class SpecRow:
    concurrency: int
    plain: float              # aggregate output tok/s
    mtp: float
    acceptance: float         # accepted / drafted
    per_step: float           # tokens per verify step (bonus token included)

    def cells(self) -> list[str]:
        c = self.concurrency
        return [str(c), f"{self.plain:.1f}", f"{self.mtp:.1f}", f"{self.plain / c:.1f}", f"{self.mtp / c:.1f}",
                f"{self.mtp / self.plain:.2f}x", f"{self.acceptance:.2f}", f"{self.per_step:.2f}"]


HEADER = ["concurrency", "plain tok/s", "MTP tok/s", "plain per slot", "MTP per slot", "MTP speedup",
          "draft acceptance", "tokens per verify step"]


def measure(model: str | Path, device: str, concurrency: int, k: int, prompts: list[list[int]], max_tokens: int
            ) -> tuple[float, tuple[float, float, float]]:
    """(aggregate output tok/s, (verify steps, drafted, accepted) in the timed pass) for one setting."""
    from moebox import LLM, SamplingParams
    spec = {"num_speculative_tokens": k} if k else None
    llm = LLM(model, device=device, max_num_seqs=concurrency, speculative_config=spec, progress=False)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    llm.generate(prompts[:concurrency], params)                       # warm-up: compile, graphs, first probes
    before = llm.engine.metrics.spec_counts()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True, desc=f"c={concurrency} {'MTP k=%d' % k if k else 'plain'}")
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    after = llm.engine.metrics.spec_counts()
    return tokens / seconds, tuple(a - b for a, b in zip(after, before))  # type: ignore[return-value]


def bench_spec(model: str | Path, device: str, concurrency: list[int], k: int, requests: int, max_tokens: int,
               seed: int = 0) -> list[SpecRow]:
    from tokenizers import Tokenizer

    from moebox.train.data import CHAT_KINDS, eval_records
    from moebox.train.evaluate import chat_prompts
    tok = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    records = eval_records(seed, -(-requests // len(CHAT_KINDS)), kinds=CHAT_KINDS)[:requests]
    prompts = chat_prompts(tok, records)
    rows = []
    for c in concurrency:
        plain, _ = measure(model, device, c, 0, prompts, max_tokens)
        mtp, (steps, drafted, accepted) = measure(model, device, c, k, prompts, max_tokens)
        rows.append(SpecRow(c, plain, mtp, accepted / max(drafted, 1), 1 + accepted / max(steps, 1)))
    return rows


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model directory with an MTP head (default: the built-in demo)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4], help="max_num_seqs values")
    p.add_argument("--mtp", type=int, default=2, metavar="K", help="drafts per step (the policy may lower it)")
    p.add_argument("--requests", type=int, default=24, help="held-out chat prompts per setting")
    p.add_argument("--max-tokens", type=int, default=128)


def run(args: argparse.Namespace) -> int:
    from moebox.demo import demo_model_dir
    from moebox.errors import MoeboxError
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise MoeboxError("--device cuda but no CUDA device is available; use --device cpu")
    model = args.model or demo_model_dir()
    rows = bench_spec(model, args.device, args.concurrency, args.mtp, args.requests, args.max_tokens)
    print(f"MTP k={args.mtp} vs plain, {model}, {args.device}, {args.requests} greedy requests of up to "
          f"{args.max_tokens} tokens")
    print(table(HEADER, [r.cells() for r in rows]))
    return 0
