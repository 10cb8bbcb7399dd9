"""`moebox train` end to end on the tiny preset: a run killed with SIGKILL resumes to the very weights of an
uninterrupted run, and its export serves."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from moebox.train.trainer import TrainSettings, _Batches, train

SETTINGS = TrainSettings(preset="tiny", steps=8, batch_tokens=300, seq_len=150, save_every=1, warmup=2,
                         n_train=60, n_heldout=8, n_eval_per_kind=2)
FLAGS = [f"--{k.replace('_', '-')}" + ("" if isinstance(v, bool) else f"={v}") for k, v in vars(SETTINGS).items()
         if v is not False]                     # a boolean setting is a switch: given when true


def _cli(run: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "moebox.cli", "train", "--run-dir", str(run), *FLAGS, *extra],
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


def test_a_paused_run_exports_nothing_and_resumes_to_the_uninterrupted_weights(tmp_path):
    """--pause-after-minutes: a run longer than one device call stops cleanly (state saved, no model) and the
    same command finishes it with the weights of a run that never stopped."""
    whole = tmp_path / "whole"
    train(whole, SETTINGS, progress=False)
    run = tmp_path / "paused"
    paused = _cli(run, "--pause-after-minutes", "0")
    out, err = paused.communicate(timeout=300)
    assert paused.returncode == 0 and "paused" in out, err[-2000:]
    assert torch.load(run / "state.pt")["step"] == 1 and not (run / "model").exists()
    assert train(run, SETTINGS, progress=False) == run / "model"
    a, b = _params(whole), _params(run)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_other_settings_in_the_same_run_dir_are_refused(tmp_path):
    from dataclasses import replace


    from moebox.errors import MoeboxError
    small = replace(SETTINGS, steps=1)
    train(tmp_path, small, progress=False)
    with pytest.raises(MoeboxError, match="other settings"):
        train(tmp_path, replace(small, lr=1e-4), progress=False)


def test_packed_rows_are_the_permuted_documents_back_to_back_and_resume_mid_document():
    docs = [[d] * n for d, n in enumerate([5, 1, 7, 3, 9, 2])]
    batches = _Batches(docs, seq_len=4, rows=3, seed=1)
    first = batches.next()
    assert [len(r) for r in first] == [4, 4, 4]
    order = batches._permutation()                 # epoch 0's order (the cursor is still in epoch 0)
    stream = [t for i in order for t in docs[i]]
    assert sum(first, []) == stream[:12]
    cursor = (batches.epoch, batches.pos, batches.offset)
    assert cursor[2] > 0, "the case should stop inside a document"
    resumed = _Batches(docs, 4, 3, 1, *cursor)
    later = [batches.next() for _ in range(4)]     # runs past the epoch's end into a new permutation
    assert batches.epoch == 2                      # 60 tokens read from epochs of 27
    assert [resumed.next() for _ in range(4)] == later


def test_a_time_budget_fixes_the_step_count_and_a_rerun_keeps_it(tmp_path):
    from dataclasses import replace
    import json
    s = replace(SETTINGS, warmup=10, save_every=100)
    out = train(tmp_path, s, progress=False, budget_s=3.0)
    steps = json.loads((tmp_path / "settings.json").read_text())["steps"]
    assert isinstance(steps, int) and steps >= 11
    assert torch.load(tmp_path / "state.pt")["step"] == steps and (out / "config.json").exists()
    again = train(tmp_path, replace(s, steps=12345), progress=False, budget_s=1000.0)   # the saved count wins
    assert again == out and torch.load(tmp_path / "state.pt")["step"] == steps


def test_config_overrides_shape_the_exported_model_and_bad_ones_fail_before_any_work(tmp_path):
    import json
    from dataclasses import replace


    from moebox.errors import MoeboxError
    for bad, says in [("{head_dim: 32}", "not JSON"), ('["head_dim"]', "JSON object"),
                      ('{"head_dims": 32}', "not keys of the 'tiny' preset"), ('{"head_dim": -1}', "head_dim")]:
        run = tmp_path / "bad"
        with pytest.raises(MoeboxError, match=says):
            train(run, replace(SETTINGS, steps=1, config_overrides=bad), progress=False)
        assert not run.exists()                                     # nothing written, nothing to clean up

    s = replace(SETTINGS, steps=1, config_overrides='{"head_dim": 32, "sliding_window": 16}')
    out = train(tmp_path / "run", s, progress=False)
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["head_dim"], cfg["sliding_window"]) == (32, 16)
    from moebox import LLM, SamplingParams
    gen = LLM(out, progress=False).generate([[0, 5, 6]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(gen[0].outputs[0].token_ids) == 3

    # a run dir that already holds another config.json (a carried corpus, say) is refused, naming the file
    other = tmp_path / "carried"
    other.mkdir()
    (other / "config.json").write_text((tmp_path / "run" / "config.json").read_text())
    with pytest.raises(MoeboxError, match=r"config\.json has other values of \['head_dim'\]"):
        train(other, replace(s, config_overrides='{"head_dim": 16}'), progress=False)


def test_gain_decay_is_the_weight_decay_of_the_1d_tensors_alone(tmp_path):
    """After one step from the same start, runs that differ only in `gain_decay` hold the same matrices and
    different gains (AdamW's decay acts on each tensor by itself)."""
    from dataclasses import replace
    a = train(tmp_path / "a", replace(SETTINGS, steps=1), progress=False).parent
    b = train(tmp_path / "b", replace(SETTINGS, steps=1, gain_decay=0.0), progress=False).parent
    pa, pb = _params(a), _params(b)
    assert all(torch.equal(pa[k], pb[k]) for k in pa if pa[k].dim() > 1)
    # the indexer gets no gradient (its top-k is a selection), and AdamW leaves a tensor without one alone
    gains = [k for k in pa if pa[k].dim() == 1 and ".indexer." not in k]
    assert any(k.endswith("kv_norm.weight") for k in gains) and any(k.endswith("attn_sink") for k in gains)
    assert all(not torch.equal(pa[k], pb[k]) for k in gains)
    assert [g["weight_decay"] for g in torch.load(b / "state.pt")["optimizer"]["param_groups"]] == [0.1, 0.0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_cuda_without_a_gpu_fails_at_once_naming_the_flag(tmp_path):
    """`--device cuda` on a machine without CUDA must stop before the corpus (minutes at the demo's size)."""
    from moebox.errors import MoeboxError
    run = tmp_path / "run"
    with pytest.raises(MoeboxError, match="--device cuda"):
        train(run, SETTINGS, device="cuda", progress=False)
    assert not run.exists()
