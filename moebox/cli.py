"""The `moebox` command line.

Subcommands register themselves in `COMMANDS` (name -> `Command`), so new ones (e.g. `generate`) plug in
without touching the dispatcher. A `MoeboxError` is the user's problem explained in one line: it is printed as
`moebox: error: <message>` with exit status 2 and no traceback; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass
from typing import Callable

from moebox.errors import MoeboxError


@dataclass(frozen=True)
class Command:
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Command] = {}


def register(name: str, command: Command) -> None:
    COMMANDS[name] = command


def _configure_synth(p: argparse.ArgumentParser) -> None:
    from moebox.weights.synth import PRESETS
    p.add_argument("--preset", required=True, choices=PRESETS, help="model size")
    p.add_argument("--out", required=True, help="output directory (must be new or empty)")
    p.add_argument("--seed", type=int, default=0, help="random seed (same seed -> same bytes)")
    p.add_argument("--layers", type=int, default=None, help="number of main layers (default: the preset's)")


def _run_synth(args: argparse.Namespace) -> int:
    from moebox.weights.synth import write_synthetic
    out = write_synthetic(args.out, args.preset, seed=args.seed, layers=args.layers)
    print(f"wrote synthetic {args.preset} checkpoint (seed {args.seed}) to {out}")
    return 0


def _configure_check(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model directory (config.json + safetensors)")


def _run_check(args: argparse.Namespace) -> int:
    from moebox.weights.checkpoint import Checkpoint
    ckpt = Checkpoint(args.model)
    ckpt.validate()
    cfg = ckpt.config
    kinds = ", ".join(f"{cfg.attn_types.count(k)} {k}" for k in ("sliding", "csa", "hca") if k in cfg.attn_types)
    mtp = ""
    if cfg.num_mtp_layers:
        mtp = f" + {cfg.num_mtp_layers} MTP" if ckpt.layout == "official" else " (no MTP weights: HF layout)"
    print(f"{args.model}: ok: layout {ckpt.layout}, {cfg.num_layers} layers ({kinds}){mtp}, "
          f"{len(ckpt.names())} tensors ({ckpt.num_stored()} stored), {ckpt.nbytes / 2**20:.1f} MiB "
          f"in {len(ckpt.files)} files")
    return 0


def _configure_generate(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="model directory (default: the built-in demo model, written on first use)")
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for several prompts)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8", "model"),
                   help="auto: follow the checkpoint (FP8 KV rounding for the official layout)")
    p.add_argument("--experts", default="native", choices=("native", "w2"),
                   help="routed experts at checkpoint precision, or as 2-bit planes from --store")
    p.add_argument("--store", default=None, help="plane store directory for --experts w2 (default: in the cache)")
    p.add_argument("--memory", default=None, help="memory budget for the plan, e.g. 121.7GiB (default: available)")
    from moebox.runtime.speculative import add_flags
    add_flags(p)


def _run_generate(args: argparse.Namespace) -> int:
    from moebox import LLM, SamplingParams
    from moebox.demo import demo_model_dir
    model = args.model or demo_model_dir()
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed)
    except ValueError as e:
        raise MoeboxError(f"sampling flags: {e}") from None
    from moebox.runtime.speculative import from_flags
    llm = LLM(model, device=args.device, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, experts=args.experts,
              store_dir=args.store, memory=args.memory,
              speculative_config=from_flags(args.speculative_config, args.mtp))
    for out in llm.generate(args.prompt, params):
        print(f"--- {out.prompt!r} -> {len(out.token_ids)} tokens ({out.outputs[0].finish_reason})")
        print(out.text)
    return 0


def _configure_plan(p: argparse.ArgumentParser) -> None:
    p.epilog = ("The defaults describe a long-context single-user deployment (w2 experts, 64K context, 1 sequence), "
                "not `moebox serve`'s defaults (native experts, 4096, 8 sequences): pass the flags you will serve "
                "with. `serve` prints its own plan at start.")
    p.add_argument("model", help="model directory (only its config.json is read)")
    p.add_argument("--memory", default=None, help="memory budget, e.g. 121.7GiB, 80GB, 512MiB "
                   "(default: MemAvailable of this machine)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length per sequence (default: 65536, capped at max_position_embeddings)")
    p.add_argument("--max-num-seqs", type=int, default=1, help="sequences served at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per forward step")
    p.add_argument("--experts", default="w2", choices=("w2", "native"),
                   help="routed experts as 2-bit planes (w2) or at checkpoint precision (native)")
    p.add_argument("--kv-dtype", default="bf16", choices=("bf16", "fp16", "fp32"), help="KV cache element type")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8", "model"),
                   help="fp8: DeepSeek's FP8 (nope) / bf16 (rope) / FP4 (index keys) cache layout")
    p.add_argument("--no-mtp", action="store_true", help="leave out the MTP block")


def _run_plan(args: argparse.Namespace) -> int:
    from moebox.config import load_config
    from moebox.runtime.dirs import check_model_dir
    from moebox.runtime.plan import available_memory, parse_size, plan_for
    memory = parse_size(args.memory, "--memory") if args.memory is not None else available_memory("cpu")
    cfg = load_config(check_model_dir(args.model))
    max_len = args.max_model_len or min(65536, cfg.max_position_embeddings)
    plan = plan_for(cfg, memory, max_len, args.max_num_seqs, args.max_num_batched_tokens, args.experts,
                    args.kv_dtype, not args.no_mtp, kv_layout="fp8" if args.kv_cache_dtype == "fp8" else "model")
    print(plan.table())
    plan.check()
    return 0


def _configure_serve(p: argparse.ArgumentParser) -> None:
    from moebox.server.serve import configure
    configure(p)


def _run_serve(args: argparse.Namespace) -> int:
    from moebox.server.serve import run
    return run(args)


register("serve", Command("serve an OpenAI-compatible API (default: the built-in demo model)", _configure_serve,
                          _run_serve))
register("generate", Command("generate text offline (no server)", _configure_generate, _run_generate))
register("plan", Command("memory plan from config.json alone: weights, KV cache, what fits", _configure_plan,
                         _run_plan))


def _configure_pack(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model directory (read-only is fine)")
    p.add_argument("--store", required=True, help="plane store directory (writable, outside the model directory)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _run_pack(args: argparse.Namespace) -> int:
    from moebox.store.pack import pack, prepare_store
    from moebox.weights.checkpoint import Checkpoint
    ckpt = Checkpoint(args.model)
    ckpt.validate()
    store = prepare_store(ckpt, args.store)
    summary = pack(ckpt, store, progress=not args.quiet)
    for line in summary.lines():
        print(line)
    return 0


register("pack", Command("pack the routed experts into a 2-bit plane store", _configure_pack, _run_pack))
register("synth", Command("write a deterministic synthetic checkpoint", _configure_synth, _run_synth))
register("check", Command("validate a checkpoint (config, index, headers, tensor schema)", _configure_check,
                          _run_check))



def _configure_bench(p: argparse.ArgumentParser) -> None:
    from moebox.bench.decode import configure
    configure(p)


def _run_bench(args: argparse.Namespace) -> int:
    from moebox.bench.decode import run
    return run(args)


register("bench", Command("decode/prefill speed of a full-size synthetic model against the device's bandwidth",
                          _configure_bench, _run_bench))



def _configure_train(p: argparse.ArgumentParser) -> None:
    from moebox.train.trainer import TrainSettings
    from moebox.weights.synth import PRESETS
    p.epilog = "Run the same command again to resume a stopped run (the settings must match)."
    p.add_argument("--run-dir", required=True, help="directory for the corpus, tokenizer, state and exported model")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--minutes", type=float, default=None,
                   help="train for this long instead of --steps (the count is fixed after 10 timed steps and saved)")
    p.add_argument("--pause-after-minutes", type=float, default=None,
                   help="save and stop after this long, without exporting; the same command resumes the run")
    defaults = TrainSettings()
    for field, value in vars(defaults).items():
        flag = "--" + field.replace("_", "-")
        if field == "preset":
            p.add_argument(flag, default=value, choices=PRESETS, help="model shapes (demo: the shipped model)")
        elif field == "precision":
            p.add_argument(flag, default=value, choices=("bf16", "fp32"), help="on CUDA: bf16 autocast or fp32")
        elif field == "config_overrides":
            p.add_argument(flag, default=value, help="JSON object of config.json keys over the preset's, e.g. "
                                                     "'{\"head_dim\": 256}'")
        elif field == "expert_qat":
            p.add_argument(flag, action="store_true", help="train the routed experts through FP4 rounding (QAT, as "
                                                           "the real model's were)")
        elif field == "gain_decay":
            p.add_argument(flag, type=float, default=value, help=f"weight decay of the 1-D tensors (norm gains, "
                                                                 f"attention sinks, mHC scales); default {value}")
        else:
            p.add_argument(flag, type=type(value), default=value, help=f"default {value}")


def _run_train(args: argparse.Namespace) -> int:
    from moebox.train.trainer import TrainSettings, train
    settings = TrainSettings(**{k: getattr(args, k) for k in vars(TrainSettings())})
    out = train(args.run_dir, settings, device=args.device,
                budget_s=None if args.minutes is None else args.minutes * 60,
                pause_s=None if args.pause_after_minutes is None else args.pause_after_minutes * 60)
    print(f"trained model: {out}" if out else f"paused: run the same command again to continue {args.run_dir}")
    return 0


register("train", Command("train a small DeepSeek-V4 (with MTP) on the built-in corpus and export it",
                          _configure_train, _run_train))



def _configure_eval(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model directory (e.g. a `moebox train` run's model/)")
    p.add_argument("--experts", nargs="+", default=["native", "w2"], choices=("native", "w2"),
                   help="expert formats to compare")
    p.add_argument("--store", default=None, help="plane store directory for w2 (default: in the cache)")
    p.add_argument("--n-per-kind", type=int, default=50, help="held-out items per kind")
    p.add_argument("--max-tokens", type=int, default=192, help="generation budget per chat item")
    p.add_argument("--mtp", type=int, nargs="*", default=[1, 2, 3], metavar="K",
                   help="also measure MTP draft acceptance at these k (none: skip)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))


def _run_eval(args: argparse.Namespace) -> int:
    from moebox.train.evaluate import run_eval
    print(run_eval(args.model, args.experts, args.n_per_kind, args.seed, args.device, args.store,
                   max_tokens=args.max_tokens, mtp_k=tuple(args.mtp)))
    return 0


register("eval", Command("held-out accuracy, tool-call validity and perplexity, native vs w2 experts",
                         _configure_eval, _run_eval))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moebox", description="DeepSeek-V4 MoE inference server")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, cmd in COMMANDS.items():
        cmd.configure(sub.add_parser(name, help=cmd.help, description=cmd.help))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s moebox %(levelname)s %(message)s")
    try:
        return COMMANDS[args.command].run(args)
    except MoeboxError as e:
        print(f"moebox: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("moebox: interrupted (finished work is kept; run the same command again to resume)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
