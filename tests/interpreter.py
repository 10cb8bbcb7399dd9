"""Run a kernel check script under Triton's CPU interpreter (TRITON_INTERPRET is read at import, hence a
subprocess). The script prints one line `RESULT <json list of cases>`; each case has `same_buffer`, `finite`,
`rel` and `ref_norm`, and may carry its own `tol`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_in_interpreter(script: str) -> str:
    """Run `script` (its argv[1]: the repo root) under the interpreter; its stdout, after asserting it exited 0."""
    proc = subprocess.run([sys.executable, "-c", script, str(ROOT)], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def check_in_interpreter(script: str, default_tol: float = 1e-5) -> None:
    t0 = time.monotonic()
    stdout = run_in_interpreter(script)
    line = next(ln for ln in stdout.splitlines() if ln.startswith("RESULT "))
    results = json.loads(line[len("RESULT "):])
    print(f"interpreter check: {len(results)} cases in {time.monotonic() - t0:.1f} s")
    for r in results:
        assert r["same_buffer"] and r["finite"], r
        assert r["ref_norm"] > 0 and r["rel"] < r.get("tol", default_tol), r


def count_calls(module, name: str) -> list:
    """Replace module.name by a wrapper that appends to the returned list on each call: a script's proof that
    its kernel really ran (the model paths fall back to torch silently)."""
    calls: list = []
    real = getattr(module, name)
    setattr(module, name, lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


def tiny_model():
    """(config, model) of the `tiny` preset with synthetic weights, fp32 on the CPU, without MTP: the model the
    interpreter scripts run through their kernels."""
    import torch

    from moebox.bench.synthetic import synthetic_weights
    from moebox.config import parse_config
    from moebox.model.deepseek_v4 import DeepseekV4
    from moebox.weights.synth import preset_config
    cfg = parse_config(preset_config("tiny"))
    return cfg, DeepseekV4(cfg, synthetic_weights(cfg, "cpu", progress=False).pop, qat=False, dtype=torch.float32,
                           load_mtp=False)


def tiny_decode_logits(model, cfg, steps: int, cache_len: int = 64):
    """The tiny model's logits [steps, 2, vocab] over `steps` (<= 26) decode steps of two sequences (after
    prefilling 20 and 3 tokens) on a fresh cache: the run an interpreter script repeats with its kernel switched
    on and off. The router and key store kernels, on by default, stay off unless the script sets their switches
    (their own scripts do): run by the interpreter in every decode step they cost a script ~10 s."""
    import torch

    from moebox.model.batch import DecodeBatch, FlatBatch
    for switch in ("MOEBOX_ROUTER_KERNEL", "MOEBOX_KEYS_KERNEL"):
        os.environ.setdefault(switch, "0")
    ids = torch.randint(2, cfg.vocab_size, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    cache = model.new_cache(3, cache_len, "cpu")
    model.forward(FlatBatch.build([(1, 0, ids[:20]), (2, 0, ids[30:33])], "cpu"), cache)
    t = torch.tensor
    return torch.stack([model.forward(DecodeBatch(t([ids[20 + i], ids[33 + i]]), t([20 + i, 3 + i]), t([1, 2])),
                                      cache).logits for i in range(steps)])


def switch_result(model, cfg, switch: str, steps: int) -> dict:
    """A script's result row for the tiny model's `steps` decode steps with MOEBOX_<switch> = "1" (the kernel)
    against "0" (the torch path), in the form `check_in_interpreter` reads."""
    runs = {}
    for flag in ("1", "0"):
        os.environ[switch] = flag
        runs[flag] = tiny_decode_logits(model, cfg, steps)
    got, ref = runs["1"], runs["0"]
    return dict(case="tiny model decode", same_buffer=True, finite=bool(got.isfinite().all()),
                rel=float((got - ref).norm() / ref.norm()), ref_norm=float(ref.norm()))
