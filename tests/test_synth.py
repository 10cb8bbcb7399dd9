"""Synthetic checkpoints: deterministic bytes, the official layout, values that exercise the model, the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from moebox.cli import main
from moebox.config import parse_config
from moebox.weights.checkpoint import Checkpoint
from moebox.weights.formats import QuantTensor
from moebox.weights.schema import official_schema
from moebox.weights.synth import plan_shards, preset_config, write_synthetic


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_same_seed_same_bytes_different_seed_different(tiny_ckpt: Path, tmp_path: Path) -> None:
    again = _files(write_synthetic(tmp_path / "a", "tiny", seed=0, progress=False))
    assert again == _files(tiny_ckpt)
    other = _files(write_synthetic(tmp_path / "b", "tiny", seed=1, progress=False))
    assert other.keys() == again.keys()
    shards = [n for n in again if n.startswith("model-")]
    assert all(other[n] != again[n] for n in shards)
    assert other["config.json"] == again["config.json"]


def test_tiny_layout(tiny_ckpt: Path) -> None:
    raw = json.loads((tiny_ckpt / "config.json").read_text())
    assert raw["compress_ratios"] == [0, 4, 8, 4, 8, 0, 0] and raw["num_hash_layers"] == 2
    assert raw["quantization_config"]["scale_fmt"] == "ue8m0" and raw["expert_dtype"] == "fp4"
    cfg = parse_config(raw)
    assert cfg.attn_types == ("sliding", "csa", "hca", "csa", "hca", "sliding") and cfg.num_mtp_layers == 1
    index = json.loads((tiny_ckpt / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and all((tiny_ckpt / s).is_file() for s in shards)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tiny_ckpt / name).is_file()
    # a layer never straddles two shards at the tiny size
    for i in range(cfg.num_layers):
        assert len({f for n, f in index["weight_map"].items() if n.startswith(f"layers.{i}.")}) == 1


def test_values_exercise_the_model(tiny_ckpt: Path) -> None:
    ckpt = Checkpoint(tiny_ckpt)
    cfg = ckpt.config
    get = lambda n: (lambda t: t.dequantize() if isinstance(t, QuantTensor) else t.float())(ckpt.get(n))  # noqa: E731
    for name in ckpt.names():
        assert torch.isfinite(get(name)).all(), name
    for name in ("layers.0.attn.attn_sink", "layers.1.attn.compressor.ape", "layers.0.hc_attn_base",
                 "layers.2.ffn.gate.bias", "layers.1.attn.indexer.compressor.ape"):
        assert get(name).std() > 0.05, name                                     # not a zero init
    assert (get("layers.0.attn_norm.weight") - 1).abs().max() > 0.01
    wq_b = get("layers.0.attn.wq_b.weight")
    assert abs(wq_b.std().item() * math.sqrt(wq_b.shape[1]) - 1) < 0.15       # N(0, 1/fan_in)
    # shared-expert pre-activations of a RMS-normed input stay well under swiglu_limit
    x = torch.randn(256, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    x = x / x.pow(2).mean(-1, keepdim=True).sqrt() * get("layers.2.ffn_norm.weight")
    pre = x @ get("layers.2.ffn.shared_experts.w1.weight").T
    assert pre.abs().max() < cfg.swiglu_limit and pre.std() > 0.3
    tid2eid = ckpt.get("layers.0.ffn.gate.tid2eid")
    assert tid2eid.unique().numel() == cfg.n_routed_experts


def test_presets_and_shard_plan() -> None:
    flash = parse_config(preset_config("flash", layers=4))
    assert flash.compress_ratios == (0, 0, 4, 128) and flash.hash_layers == (True, True, True, False)
    assert flash.num_mtp_layers == 1 and flash.hidden_size == 4096 and flash.vocab_size == 129280
    full = preset_config("flash")
    assert full["num_hidden_layers"] == 43 and len(full["compress_ratios"]) == 44
    limit = 2048 * 2**20
    shards = plan_shards(flash, limit)
    assert sum(len(s) for s in shards) == len(official_schema(flash))
    assert all(sum(t.stored_nbytes() for t in s) <= limit for s in shards)    # about one shard in memory
    small = parse_config(preset_config("small"))
    small_bytes = sum(s.stored_nbytes() for s in official_schema(small).values())
    assert 100 * 2**20 < small_bytes < 600 * 2**20


def test_cli_synth_then_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "two"
    assert main(["synth", "--preset", "tiny", "--out", str(out), "--seed", "3", "--layers", "2"]) == 0
    assert main(["check", str(out)]) == 0
    summary = capsys.readouterr().out
    assert "layout official" in summary and "2 layers" in summary
    assert main(["synth", "--preset", "tiny", "--out", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err
