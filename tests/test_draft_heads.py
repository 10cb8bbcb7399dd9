"""Draft heads moebox does not run are named, not crashed on: a DSpark head (the 0731 revision), a missing head
and a head whose shapes do not fit each give one clear message that says what was found and the options; the
main model of a DSpark checkpoint still loads and serves."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moebox.errors import MoeboxError
from moebox.runtime.speculative import SpeculativeConfig, draft_source
from moebox.weights.checkpoint import INDEX_FILE, Checkpoint
from moebox.weights.synth import write_synthetic

MTP_ONLY = ("e_proj.", "h_proj.", "enorm.", "hnorm.")


def _rewrite(ckpt: Path, keep, extra: dict[str, torch.Tensor], config_update: dict) -> Path:
    """Rewrite a checkpoint in place: drop tensors `keep` rejects, add `extra` in a new shard, update config."""
    index = json.loads((ckpt / INDEX_FILE).read_text())
    for fname in sorted(set(index["weight_map"].values())):
        tensors = load_file(str(ckpt / fname))
        kept = {n: t for n, t in tensors.items() if keep(n)}
        if len(kept) != len(tensors):
            save_file(kept, str(ckpt / fname), metadata={"format": "pt"})
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if keep(n)}
    if extra:
        save_file(extra, str(ckpt / "model-extra.safetensors"), metadata={"format": "pt"})
        index["weight_map"].update({n: "model-extra.safetensors" for n in extra})
    (ckpt / INDEX_FILE).write_text(json.dumps(index))
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, **config_update}))
    return ckpt


def dspark(ckpt: Path) -> Path:
    h = json.loads((ckpt / "config.json").read_text())["hidden_size"]
    extra = {"mtp.0.main_proj.weight": torch.zeros(h, 3 * h, dtype=torch.bfloat16),
             "mtp.0.main_norm.weight": torch.ones(h, dtype=torch.bfloat16),
             "mtp.0.markov_head.markov_w1.weight": torch.zeros(320, 16, dtype=torch.bfloat16),
             "mtp.0.confidence_head.proj.weight": torch.zeros(1, h + 16, dtype=torch.bfloat16)}
    return _rewrite(ckpt, lambda n: not (n.startswith("mtp.0.") and n[6:].startswith(MTP_ONLY)), extra,
                    {"dspark_block_size": 5, "dspark_markov_rank": 16})


def test_a_dspark_checkpoint_serves_without_its_head_and_names_it(tiny_copy, caplog):
    ckpt = dspark(tiny_copy)
    with caplog.at_level(logging.WARNING, logger="moebox"):
        opened = Checkpoint(ckpt)
    opened.validate()                                          # the main model is complete
    assert "DSpark" in caplog.text and opened.config.num_mtp_layers == 0
    from moebox import LLM, SamplingParams
    out = LLM(ckpt, progress=False).generate([[0, 5, 6]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    with pytest.raises(MoeboxError) as err:
        draft_source(opened, SpeculativeConfig.parse('{"method": "deepseek_mtp", "num_speculative_tokens": 2}'))
    msg = str(err.value)
    assert "DSpark" in msg and "dspark_block_size" in msg and "mtp.0.confidence_head" in msg
    assert "run without speculation" in msg and '"model"' in msg


def test_a_compatible_separate_head_is_taken_from_its_directory(tiny_copy, tiny_ckpt):
    main = Checkpoint(dspark(tiny_copy))
    src = draft_source(main, SpeculativeConfig(model=str(tiny_ckpt)))
    assert src.dir == tiny_ckpt and src.get("mtp.0.e_proj.weight") is not None


def test_a_missing_head_is_named(tiny_copy):
    ckpt = _rewrite(tiny_copy, lambda n: not n.startswith("mtp."), {}, {"num_nextn_predict_layers": 0})
    with pytest.raises(MoeboxError, match=r"no draft head \(no mtp\.\* tensors\).*Options: run without"):
        draft_source(Checkpoint(ckpt), SpeculativeConfig())


def test_a_head_of_another_model_is_named_with_both_shapes(tiny_ckpt, tmp_path):
    other = write_synthetic(tmp_path / "demo", "demo", progress=False)
    with pytest.raises(MoeboxError) as err:
        draft_source(Checkpoint(tiny_ckpt), SpeculativeConfig(model=str(other)))
    assert re.search(r"does not match the main model .*: mtp\.0\.\S+ is \[\d+(, \d+)?\], the main model needs "
                     r"\[\d+(, \d+)?\]\. Options: run without speculation", str(err.value))


@pytest.mark.parametrize("text,match", [
    ("{method: mtp}", "invalid JSON"),
    ('{"method": "eagle"}', "not supported"),
    ('{"num_speculative_tokens": 0}', "from 1 to 8"),
    ('{"num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}', "unknown key 'draft_tensor_parallel_size'"),
])
def test_bad_speculative_configs_say_what_is_wrong(text, match):
    with pytest.raises(MoeboxError, match=match):
        SpeculativeConfig.parse(text)


def test_the_cli_says_it_in_one_line(tiny_copy):
    import subprocess
    import sys
    ckpt = dspark(tiny_copy)
    out = subprocess.run([sys.executable, "-m", "moebox.cli", "generate", str(ckpt), "--prompt", "hi", "--mtp", "2"],
                         capture_output=True, text=True, timeout=120)
    lines = [line for line in out.stderr.splitlines() if line.startswith("moebox: error:")]
    assert out.returncode == 2 and len(lines) == 1 and "Traceback" not in out.stderr
    assert "DSpark" in lines[0] and "run without speculation" in lines[0]
    ok = subprocess.run([sys.executable, "-m", "moebox.cli", "generate", str(ckpt), "--prompt", "hi",
                         "--max-tokens", "3"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr[-1000:]                 # without speculation the model serves
