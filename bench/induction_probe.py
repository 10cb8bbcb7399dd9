"""Does a model copy? Next-token loss on runs of random tokens, each run followed by itself once.

A model with an induction (copy) mechanism predicts the repeat far better than the first run; one without it
pays the same on both. Names and numbers in the demo's answers are copies from the prompt, so this is the skill
they need (docs/benchmarks.md, fifth session). From the repo root: python -m bench.induction_probe [MODEL_DIR]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from moebox.demo import demo_model_dir
from moebox.runtime.llm import LLM


def repeat_losses(llm: LLM, run_len: int, trials: int, seed: int) -> tuple[float, float]:
    """Mean loss (nats) over tokens 2..L of the first run and of its repeat (the first token of each is
    unpredictable)."""
    g = torch.Generator().manual_seed(seed)
    vocab = llm.config.vocab_size
    lo, hi = vocab // 8, vocab - 1                       # clear of the special and byte tokens
    first, repeat = [], []
    for _ in range(trials):
        run = torch.randint(lo, hi, (run_len,), generator=g).tolist()
        ids = [llm.config.bos_token_id, *run, *run]
        logp = F.log_softmax(llm.logits(ids).float(), dim=-1)
        nll = -logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        first.append(nll[1:run_len].mean())
        repeat.append(nll[run_len + 1:2 * run_len].mean())
    return float(torch.stack(first).mean()), float(torch.stack(repeat).mean())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default=None, help="model directory (default: the built-in demo)")
    p.add_argument("--lengths", type=int, nargs="+", default=[8, 24, 48])
    p.add_argument("--trials", type=int, default=6)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    llm = LLM(args.model or demo_model_dir(), device=args.device)
    print("| run length | first run (nats) | repeat (nats) |\n|---|---|---|")
    for n in args.lengths:
        a, b = repeat_losses(llm, n, args.trials, seed=n)
        print(f"| {n} | {a:.2f} | {b:.2f} |")


if __name__ == "__main__":
    main()
