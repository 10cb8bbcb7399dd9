"""`moebox train` end to end on the tiny preset: a run killed with SIGKILL resumes to the very weights of an
uninterrupted run, and its export serves."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from moebox.train.trainer import TrainSettings, train

SETTINGS = TrainSettings(preset="tiny", steps=8, batch_tokens=300, max_doc_tokens=160, save_every=1, warmup=2,
                         n_train=60, n_heldout=8, n_eval_per_kind=2)
FLAGS = [f"--{k.replace('_', '-')}={v}" for k, v in vars(SETTINGS).items()]


def _cli(run: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "moebox.cli", "train", "--run-dir", str(run), *FLAGS],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _params(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "state.pt")["params"]


def test_killed_training_resumes_to_the_uninterrupted_weights(tmp_path):
    whole = tmp_path / "whole"
    train(whole, SETTINGS, progress=False)

    run = tmp_path / "killed"
    proc = _cli(run)
    deadline = time.time() + 240
    while not (run / "state.pt").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    stopped_at = torch.load(run / "state.pt")["step"]
    assert 1 <= stopped_at < SETTINGS.steps and not (run / "model").exists()

    resumed = _cli(run)
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-2000:]
    assert f"resuming {run} at step {stopped_at}" in err
    a, b = _params(whole), _params(run)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    from moebox import LLM, SamplingParams
    out = LLM(run / "model", progress=False).generate([[0, 5, 6]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_other_settings_in_the_same_run_dir_are_refused(tmp_path):
    from dataclasses import replace

    import pytest

    from moebox.errors import MoeboxError
    small = replace(SETTINGS, steps=1)
    train(tmp_path, small, progress=False)
    with pytest.raises(MoeboxError, match="other settings"):
        train(tmp_path, replace(small, lr=1e-4), progress=False)
