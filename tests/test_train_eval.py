"""`moebox eval`: the scorer reads completions as the server does; the command runs native vs w2 end to end."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from moebox.train.data import CHAT_KINDS, eval_records
from moebox.train.evaluate import copy_similarity, score

RECORDS = eval_records(0, 6, kinds=CHAT_KINDS)


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: r.kind)
def test_reference_completions_score_correct(record):
    got = score(record, record.completion)
    assert got.correct and got.valid


def _tail(text: str) -> tuple[str, str]:
    """(text before the answer's last part, the last part): the content after </think> if any."""
    cut = text.rfind("</think>") + len("</think>") if "</think>" in text else 0
    return text[:cut], text[cut:]


@pytest.mark.parametrize("record", [r for r in RECORDS if r.kind in ("arith", "count", "multi_turn")][:6],
                         ids=lambda r: r.kind)
def test_a_wrong_number_is_wrong(record):
    head, tail = _tail(record.completion)
    wrong = re.sub(r"-?\d+(?!.*\d)", str(record.answer + 1), tail, flags=re.S)
    assert not score(record, head + wrong).correct


def test_tool_calls_wrong_arguments_and_broken_calls():
    record = next(r for r in RECORDS if r.kind == "tool_call")
    name, value = next((k, v) for k, v in record.arguments.items() if isinstance(v, str))
    wrong = record.completion.replace(f'"{name}" string="true">{value}<', f'"{name}" string="true">Zzz<')
    assert wrong != record.completion
    got = score(record, wrong)
    assert got.valid and not got.correct
    line = re.search(rf'<｜DSML｜parameter name="{name}"[^\n]*\n', record.completion).group(0)
    assert not score(record, record.completion.replace(line, "")).valid       # a required argument left out
    assert not score(record, "I will not call anything.<｜end▁of▁sentence｜>").valid


def test_tool_answer_must_quote_the_fact():
    record = next(r for r in RECORDS if r.kind == "tool_answer")
    assert not score(record, record.completion.replace(record.fact, "something")).correct


def test_copy_must_be_exact():
    record = next(r for r in RECORDS if r.kind == "copy")
    assert not score(record, record.completion.replace(record.fact, record.fact + " and more")).correct
    assert not score(record, record.completion.replace(record.fact, record.fact.split()[0])).correct


def test_copy_similarity_gives_credit_for_part_of_the_text():
    record = next(r for r in RECORDS if r.kind == "copy")
    first = record.fact.split()[0]
    assert copy_similarity(record, record.completion) == 1.0
    half = copy_similarity(record, record.completion.replace(record.fact, first))
    assert 0 < half < 1
    assert copy_similarity(record, record.completion.replace(record.fact, "")) == 0.0


def test_eval_cli_compares_native_and_w2(tiny_ckpt, tmp_path):
    out = subprocess.run([sys.executable, "-m", "moebox.cli", "eval", str(tiny_ckpt), "--n-per-kind", "1",
                          "--max-tokens", "8", "--store", str(tmp_path / "store"), "--mtp", "2"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in out.stdout.splitlines() if line.startswith("| ") and not line.startswith("| metric")}
    for name in ("arith accuracy", "tool_call correct", "tool_call valid", "code perplexity", "prose perplexity"):
        native, w2 = (float(v) for v in rows[name])
        assert native >= 0 and w2 >= 0
    for native_or_w2 in rows["MTP k=2 mean accepted length"]:
        assert 1 <= float(native_or_w2) <= 3
    assert 0 <= float(rows["top-1 agreement w2 vs native"][0]) <= 1
    assert float(rows["KL native to w2 per token"][0]) >= 0
