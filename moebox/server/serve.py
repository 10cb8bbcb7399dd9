"""`moebox serve`: start the HTTP server at once, load the model behind it, then serve.

/health answers 503 with the loader's latest log line while loading and 200 when ready. A loading failure
that is the user's to fix (a bad path, an impossible memory plan, a read-only store) is printed as one line and
ends the process with status 2, within seconds for the checks that run before any weight is read.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from moebox.errors import MoeboxError
from moebox.runtime.speculative import add_flags, from_flags

if TYPE_CHECKING:
    from moebox.server.app import ServerState

log = logging.getLogger("moebox")


class _ProgressHandler(logging.Handler):
    """Mirror the loader's log lines into /health while the model loads."""

    def __init__(self, state: ServerState) -> None:
        super().__init__(logging.INFO)
        self.state = state

    def emit(self, record: logging.LogRecord) -> None:
        if self.state.llm is None:
            self.state.progress = record.getMessage().splitlines()[0][:200]


def generation_defaults(model_dir: Path) -> dict[str, float]:
    """Sampling defaults the checkpoint ships in generation_config.json (temperature, top_p, top_k)."""
    try:
        cfg = json.loads((model_dir / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}
    return {k: cfg[k] for k in ("temperature", "top_p", "top_k") if isinstance(cfg.get(k), (int, float))}


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="model directory (default: the built-in demo model, written on first use)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="model id clients use (default: the directory name)")
    p.add_argument("--api-key", default=os.environ.get("MOEBOX_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $MOEBOX_API_KEY, else none)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=8, help="sequences decoded together (cache slots)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per step (prefill chunk)")
    p.add_argument("--max-waiting", type=int, default=64, help="queued requests beyond which requests get 503")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8", "model"))
    p.add_argument("--experts", default="native", choices=("native", "w2"))
    p.add_argument("--store", default=None, help="plane store directory for --experts w2")
    p.add_argument("--memory", default=None, help="memory budget for the plan, e.g. 121.7GiB (default: available)")
    p.add_argument("--seed", type=int, default=0)
    add_flags(p)
    p.add_argument("--enforce-eager", action="store_true",
                   help="run decode steps eagerly instead of replaying CUDA graphs (--device cuda)")


def run(args: argparse.Namespace) -> int:
    import uvicorn                                  # here, not at import: `moebox --help`, `train` and `bench`
    from moebox.server.app import ServerState, create_app   # run on machines without the server's packages
    from moebox import LLM
    from moebox.demo import demo_model_dir

    model = Path(args.model) if args.model else demo_model_dir()
    name = args.served_model_name or ("moebox-demo" if args.model is None else model.resolve().name)
    state = ServerState(name, api_key=args.api_key, defaults=generation_defaults(model))
    logging.getLogger("moebox").addHandler(_ProgressHandler(state))
    server = uvicorn.Server(uvicorn.Config(create_app(state), host=args.host, port=args.port, log_level="warning"))

    def load() -> None:
        try:
            llm = LLM(model, device=args.device, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                      max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=args.max_num_batched_tokens, max_waiting=args.max_waiting,
                      experts=args.experts, store_dir=args.store, memory=args.memory, seed=args.seed,
                      metrics=state.metrics, progress=False, cuda_graphs=not args.enforce_eager,
                      speculative_config=from_flags(args.speculative_config, args.mtp))
            if llm.tokenizer is None:
                raise MoeboxError(f"{model}: no tokenizer.json; the server needs the model's tokenizer")
            threading.Thread(target=llm.engine.run, name="moebox-engine", daemon=True).start()
            state.llm = llm
            log.info("ready: serving %r at http://%s:%d/v1 (max_model_len %d, %d sequences)", name, args.host,
                     args.port, llm.max_model_len, args.max_num_seqs)
        except MoeboxError as e:
            state.failed = str(e)
            print(f"moebox: error: {e}", file=sys.stderr)
            server.should_exit = True
        except Exception as e:              # a bug: keep the traceback, but do not leave a server that never loads
            state.failed = f"{type(e).__name__}: {e}"
            log.exception("loading failed")
            server.should_exit = True

    log.info("moebox serve: %s on http://%s:%d (loading %s)", name, args.host, args.port, model)
    threading.Thread(target=load, name="moebox-loader", daemon=True).start()
    server.run()
    if state.llm is not None:
        state.llm.engine.stop()
    return 2 if state.failed else 0
