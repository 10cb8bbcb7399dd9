"""Damaged or mismatched checkpoints: each failure is one clear line (exit 2) naming the file/tensor, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moebox.cli import main

INDEX = "model.safetensors.index.json"


def _check(path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moebox: error: ") and err.count("\n") == 1 and "Traceback" not in err
    return err


def _index(ckpt: Path) -> dict:
    return json.loads((ckpt / INDEX).read_text())


def _shard_of(ckpt: Path, name: str) -> Path:
    return ckpt / _index(ckpt)["weight_map"][name]


def _edit_shard(ckpt: Path, name: str, edit) -> Path:
    shard = _shard_of(ckpt, name)
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})
    return shard


def test_truncated_shard_in_subprocess(tiny_copy: Path) -> None:
    shard = sorted(tiny_copy.glob("model-*.safetensors"))[2]
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    proc = subprocess.run([sys.executable, "-m", "moebox.cli", "check", str(tiny_copy)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1
    assert f"{shard.name}: truncated" in proc.stderr and f"{len(data) - 100} bytes" in proc.stderr


def test_missing_shard(tiny_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shard = sorted(tiny_copy.glob("model-*.safetensors"))[1]
    shard.unlink()
    err = _check(tiny_copy, capsys)
    assert f"{shard.name}: listed in {INDEX} but not found in {tiny_copy}" in err


@pytest.mark.parametrize("key,value,needle", [
    ("layer_types", ["sliding_attention", "linear_attention"] + ["sliding_attention"] * 4, "linear_attention"),
    ("compress_ratios", [0, 4, -1, 4, 8, 0, 0], "compress_ratios[2]"),
])
def test_unknown_attention_type(tiny_copy: Path, capsys: pytest.CaptureFixture[str], key: str, value: list,
                                needle: str) -> None:
    raw = json.loads((tiny_copy / "config.json").read_text())
    raw[key] = value
    (tiny_copy / "config.json").write_text(json.dumps(raw))
    err = _check(tiny_copy, capsys)
    assert needle in err and "config.json" in err


def test_index_names_tensor_the_shard_lacks(tiny_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    index = _index(tiny_copy)
    name = "layers.4.attn.wkv.weight"
    wrong = next(f for f in sorted(set(index["weight_map"].values())) if f != index["weight_map"][name])
    index["weight_map"][name] = wrong
    (tiny_copy / INDEX).write_text(json.dumps(index))
    err = _check(tiny_copy, capsys)
    assert f"tensor '{name}'" in err and wrong in err


def test_shape_mismatch(tiny_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    name = "layers.3.attn.attn_sink"
    shard = _edit_shard(tiny_copy, name, lambda t: t.__setitem__(name, torch.zeros(5)))
    err = _check(tiny_copy, capsys)
    assert f"tensor '{name}' in {shard.name}: shape mismatch: expected [4]" in err and "found [5]" in err


def test_unknown_tensor_group(tiny_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    name = "layers.0.attn.wq_a.weight"
    extra = "layers.0.attn.lora_adapter.weight"
    shard = _edit_shard(tiny_copy, name, lambda t: t.__setitem__(extra, torch.zeros(2)))
    index = _index(tiny_copy)
    index["weight_map"][extra] = shard.name
    (tiny_copy / INDEX).write_text(json.dumps(index))
    err = _check(tiny_copy, capsys)
    assert f"tensor '{extra}' in {shard.name}: unknown tensor group" in err


def test_missing_tensor(tiny_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    name = "layers.2.attn.compressor.wgate.weight"
    _edit_shard(tiny_copy, name, lambda t: t.pop(name))
    index = _index(tiny_copy)
    del index["weight_map"][name]
    (tiny_copy / INDEX).write_text(json.dumps(index))
    err = _check(tiny_copy, capsys)
    assert f"tensor '{name}': missing" in err


def test_garbage_header(tiny_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shard = sorted(tiny_copy.glob("model-*.safetensors"))[0]
    shard.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!" + b"\x00" * 64)
    err = _check(tiny_copy, capsys)
    assert shard.name in err and "not valid JSON" in err
