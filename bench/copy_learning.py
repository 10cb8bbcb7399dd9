"""Can a config learn to copy? Train it briefly on runs of random tokens, each followed by itself, and watch the loss.

The trained demos do not copy names from the prompt (bench/induction_probe.py; docs/benchmarks.md, sixth session).
This separates the architecture from the data: the task below can only be learnt by copying (an induction head),
so a config whose repeat loss stays near ln(alphabet) cannot copy at this size, whatever the corpus. The variant
"llama" is the control: a plain transformer (HF `LlamaForCausalLM`) with the preset's width, depth and heads, to
show how many steps copying takes where nothing caps attention. Runs on the CPU in minutes with a cut preset:
    python -m bench.copy_learning --layers 2 --variants llama '{}' '{"head_dim": 256, "qk_rope_head_dim": 32}'
"""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Callable

import torch
import torch.nn.functional as F

from moebox.config import parse_config
from moebox.model.batch import FlatBatch
from moebox.train.model import init_params, trainable_model
from moebox.weights.synth import preset_config


def copy_rows(g: torch.Generator, rows: int, run_len: int, alphabet: int, first_id: int, bos: int,
              pairs: int = 1) -> torch.Tensor:
    """[rows, 1 + 2 run_len pairs]: BOS, then `pairs` times a run of random ids from `alphabet` ids at
    `first_id` followed by the same run again."""
    run = torch.randint(first_id, first_id + alphabet, (rows, pairs, 1, run_len), generator=g)
    return torch.cat([torch.full((rows, 1), bos), run.expand(-1, -1, 2, -1).flatten(1)], dim=1)


def v4_logits(model, device: str) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(seqs: torch.Tensor) -> torch.Tensor:
        batch = FlatBatch.build([(i, 0, s.tolist()) for i, s in enumerate(seqs)], device)
        return model.forward(batch, None, logits_rows=torch.arange(batch.num_tokens, device=device)).logits
    return run


def losses_by_half(logits_of: Callable[[torch.Tensor], torch.Tensor], seqs: torch.Tensor, run_len: int
                   ) -> tuple[torch.Tensor, float, float]:
    """(training loss over both runs, mean loss on the first run, on the repeat), first token of each left out."""
    logits = logits_of(seqs)
    n = seqs.shape[1]
    nll = F.cross_entropy(logits.view(len(seqs), n, -1)[:, :-1].flatten(0, 1), seqs[:, 1:].flatten(),
                          reduction="none").view(len(seqs), -1, 2, run_len)        # [row, pair, run, token]
    first, repeat = nll[:, :, 0, 1:], nll[:, :, 1, 1:]               # predicting tokens 2..L of each run
    return nll[:, :, :, 1:].mean(), first.mean().item(), repeat.mean().item()


def llama_control(raw: dict, seed: int, device: str) -> tuple[Callable[[torch.Tensor], torch.Tensor], list[torch.Tensor]]:
    """A plain transformer of the preset's width, depth, heads and head size; its FFN as wide as the routed
    experts plus the shared one."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"], num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=raw["num_attention_heads"], num_key_value_heads=1, head_dim=raw["head_dim"],
        intermediate_size=raw["moe_intermediate_size"] * (raw["num_experts_per_tok"] + raw["n_shared_experts"]),
        max_position_embeddings=4096)).to(device)
    return (lambda seqs: model(input_ids=seqs).logits.flatten(0, 1)), list(model.parameters())


def train_variant(preset: str, layers: int, variant: str, steps: int, rows: int, run_len: int, pairs: int,
                  alphabet: int, lr: float, seed: int, report_every: int, device: str
                  ) -> list[tuple[int, float, float]]:
    raw = preset_config(preset, layers)
    if variant == "llama":
        logits_of, learned = llama_control(raw, seed, device)
    else:
        cfg = parse_config({**raw, **json.loads(variant)}, source="copy_learning")
        params = init_params(cfg, seed=seed, device=device)
        logits_of = v4_logits(trainable_model(cfg, params), device)
        learned = [p for p in params.values() if isinstance(p, torch.nn.Parameter)]
    opt = torch.optim.AdamW(learned, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    first_id = raw["vocab_size"] // 8
    out = []
    for step in range(1, steps + 1):
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, step / 20)
        loss, first, repeat = losses_by_half(logits_of, copy_rows(g, rows, run_len, alphabet, first_id,
                                                                   raw["bos_token_id"], pairs).to(device), run_len)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(learned, 1.0)
        opt.step()
        if step % report_every == 0 or step == steps:
            out.append((step, first, repeat))
            print(f"  step {step}: first run {first:.2f}, repeat {repeat:.2f} nats", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="demo")
    p.add_argument("--layers", type=int, default=2, help="the preset's first N layers")
    p.add_argument("--variants", nargs="+", default=["llama", "{}"],
                   help="'llama' (the control) or JSON objects of config keys over the preset's")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--run-len", type=int, default=16)
    p.add_argument("--pairs", type=int, default=1, help="run + repeat pairs per row (longer rows)")
    p.add_argument("--alphabet", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cuda: the training path as `moebox train` runs it there "
                   "(compiled), to compare with the CPU's curve")
    p.add_argument("--report-every", type=int, default=50)
    args = p.parse_args()
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True          # as `moebox train` runs fp32 on CUDA
    results = []
    for text in args.variants:
        print(f"variant {text} (uniform guessing: {math.log(args.alphabet):.2f} nats)", flush=True)
        t0 = time.perf_counter()
        curve = train_variant(args.preset, args.layers, text, args.steps, args.rows, args.run_len,
                              args.pairs, args.alphabet, args.lr, args.seed, args.report_every,
                              args.device)
        results.append((text, curve[-1], time.perf_counter() - t0))
    print(f"\n| variant | steps | first run (nats) | repeat (nats) | s |\n|---|---|---|---|---|")
    for text, (step, first, repeat), secs in results:
        print(f"| `{text}` | {step} | {first:.2f} | {repeat:.2f} | {secs:.0f} |")


if __name__ == "__main__":
    main()
