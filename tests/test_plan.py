"""The memory plan: numbers against independent arithmetic, the `moebox plan` CLI, and LLM refusing a bad plan."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from moebox.config import parse_config
from moebox.errors import MoeboxError
from moebox.model.cache import KVCache
from moebox.runtime.plan import GiB, available_memory, parse_size, plan_for
from moebox.weights.synth import preset_config

FLASH = parse_config(preset_config("flash"), source="preset flash")
SPARK = parse_size("121.7GiB")


def flash(experts: str = "w2", memory: int = SPARK, **kw):
    args = dict(max_model_len=65536, max_num_seqs=1, max_num_batched_tokens=2048, experts=experts,
                kv_dtype="bf16", with_mtp=True)
    args.update(kw)
    return plan_for(FLASH, memory, **args)


def test_flash_weight_bytes_match_independent_arithmetic():
    w2, native = flash("w2"), flash("native")
    assert w2.expert_bytes == 43 * 256 * 3 * 2048 * 4096 * 2.25 / 8
    assert w2.expert_bytes / GiB == pytest.approx(72.5625)                      # field_notes §3: 72.6 GiB
    assert native.expert_bytes == 43 * 256 * 3 * 2048 * 4096 * 4.25 / 8       # FP4 + E8M0 per 32
    assert native.expert_bytes / 1e9 == pytest.approx(147, rel=0.01)            # deepseek_v4.md §6: 147 GB
    assert w2.dense_bytes == native.dense_bytes
    assert w2.dense_bytes / 1e9 == pytest.approx(8.8, rel=0.03)                 # §6: ~8.8 GB dense/embed/head
    # MTP: 256 experts + a sliding block + e/h_proj; §6: +3.6 GB at FP4
    assert native.mtp_expert_bytes == 256 * 3 * 2048 * 4096 * 4.25 / 8
    assert native.mtp_bytes / 1e9 == pytest.approx(3.6, rel=0.03)
    assert w2.mtp_expert_bytes == 256 * 3 * 2048 * 4096 * 2.25 / 8
    no_mtp = flash("w2", with_mtp=False)
    assert no_mtp.mtp_bytes == 0 and no_mtp.dense_bytes == w2.dense_bytes


def test_flash_kv_growth_matches_the_decode_state_table():
    p = flash("w2")
    assert p.kv_bytes_per_token == 21 * (512 + 128) * 2 / 4 + 20 * 512 * 2 / 128   # §3 bf16: 6880 B/token
    assert p.kv_bytes_per_seq / 1e6 == pytest.approx(457, rel=0.03)                # §3: 457 MB at 64K


def test_kv_bytes_per_slot_equals_the_allocated_cache():
    cfg = parse_config(preset_config("tiny"), source="preset tiny")
    for dtype, with_mtp, slack in ((torch.float32, True, 0), (torch.bfloat16, False, 3)):
        cache = KVCache(cfg, num_slots=3, max_len=100, dtype=dtype, spec_slack=slack, with_mtp=with_mtp)
        p = plan_for(cfg, GiB, 100, 3, 16, "native", dtype, with_mtp, spec_slack=slack)
        assert p.kv_bytes_per_seq == cache.nbytes() / 3
        assert p.kv_bytes == cache.nbytes()


def test_w2_fits_a_spark_native_does_not():
    w2, native = flash("w2"), flash("native")
    assert w2.fits and w2.check() is w2 and w2.kv_tokens_left > 1_000_000
    assert not native.fits and native.kv_tokens_left == 0
    with pytest.raises(MoeboxError, match=r"memory plan does not fit.*over by [0-9.]+ GiB.*--experts w2"):
        native.check()


def test_kv_tokens_left_grows_with_memory_and_is_consistent():
    a, b = flash("w2", memory=100 * GiB), flash("w2", memory=120 * GiB)
    assert b.kv_tokens_left > a.kv_tokens_left > 0
    assert b.kv_tokens_left - a.kv_tokens_left == pytest.approx(20 * GiB / a.kv_bytes_per_token, abs=2)


def test_overflow_advice_names_levers_that_really_fit():
    p = flash("w2", memory=90 * GiB, max_model_len=131072, max_num_seqs=16)
    assert not p.fits
    msg = str(pytest.raises(MoeboxError, p.check).value)
    assert "\n" not in msg and "--max-model-len" in msg and "--max-num-seqs" in msg
    n_len = int(msg.split("--max-model-len ")[1].split()[0])
    n_seqs = int(msg.split("--max-num-seqs ")[1].split()[0])
    assert flash("w2", memory=90 * GiB, max_model_len=n_len, max_num_seqs=16).fits
    assert flash("w2", memory=90 * GiB, max_model_len=131072, max_num_seqs=n_seqs).fits
    assert not flash("w2", memory=90 * GiB, max_model_len=131072, max_num_seqs=n_seqs + 1).fits


@pytest.mark.parametrize("text,expected", [("121.7GiB", int(121.7 * 2 ** 30)), ("80GB", 80 * 10 ** 9),
                                           ("512MiB", 512 * 2 ** 20), ("3 MB", 3 * 10 ** 6), ("12345", 12345),
                                           ("1e9", 10 ** 9), ("100bytes", 100), (4096, 4096)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["abc", "12XB", "", "-5GiB", "0", "GiB"])
def test_parse_size_errors_name_the_flag(text):
    with pytest.raises(MoeboxError, match="--memory"):
        parse_size(text)


def test_available_memory_cpu():
    assert 0 < available_memory("cpu") < 2 ** 50


# ---------------------------------------------------------------- CLI
@pytest.fixture(scope="module")
def flash_config_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("flash_cfg")
    (d / "config.json").write_text(json.dumps(preset_config("flash")))
    return d


def _plan(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    t = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "moebox.cli", "plan", *args], capture_output=True, text=True,
                       timeout=60)
    return r, time.monotonic() - t


def test_cli_plan_fits(flash_config_dir):
    r, dt = _plan(str(flash_config_dir), "--memory", "121.7GiB", "--max-model-len", "65536")
    assert r.returncode == 0, r.stderr
    assert "routed experts, w2" in r.stdout and "72.56 GiB" in r.stdout and "fits" in r.stdout
    assert "121.70 GiB" in r.stdout
    assert "Traceback" not in r.stderr and dt < 15


def test_cli_plan_overflow_is_one_line(flash_config_dir):
    r, dt = _plan(str(flash_config_dir), "--memory", "40GiB")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moebox: error: memory plan does not fit")
    assert "over by 46.25 GiB" in lines[0] and "Traceback" not in r.stderr and dt < 15


def test_cli_plan_native_suggests_w2(flash_config_dir):
    r, _ = _plan(str(flash_config_dir), "--memory", "121.7GiB", "--experts", "native")
    assert r.returncode == 2 and "--experts w2" in r.stderr and "Traceback" not in r.stderr


def test_cli_plan_bad_memory_names_the_flag(flash_config_dir):
    r, _ = _plan(str(flash_config_dir), "--memory", "abc")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["moebox: error: --memory 'abc': not a size; give e.g. 121.7GiB, "
                                             "80GB, 512MiB or a byte count"]


def test_cli_plan_missing_model_dir(tmp_path):
    r, _ = _plan(str(tmp_path / "nope"), "--memory", "10GiB")
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr


# ---------------------------------------------------------------- LLM
def test_llm_refuses_an_impossible_plan_before_loading(tiny_ckpt):
    from moebox import LLM
    t = time.monotonic()
    with pytest.raises(MoeboxError, match="memory plan does not fit.*budget is 0.00 GiB"):
        LLM(tiny_ckpt, memory="1MiB", progress=False)
    assert time.monotonic() - t < 5


def test_llm_logs_the_plan(tiny_ckpt, caplog):
    from moebox import LLM
    with caplog.at_level("INFO", logger="moebox"):
        llm = LLM(tiny_ckpt, progress=False, max_num_seqs=2)
    assert llm.plan.fits and "memory plan:" in caplog.text
    assert llm.plan.kv_bytes == llm.cache.nbytes()
