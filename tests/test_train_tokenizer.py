"""The trained BPE tokenizer: V4 special tokens at fixed ids and unsplit, exact round trips, real merges."""

from __future__ import annotations

import pytest

from moebox.errors import ConfigError
from moebox.train.tokenizer import train_tokenizer
from moebox.weights.tokenizer import BOS, EOS, SPECIAL_TOKENS, build_tokenizer

CORPUS = [
    f"{BOS}<｜User｜>What is {a} + {b}?<｜Assistant｜><think>{a} plus {b} is {a + b}.</think>The answer is {a + b}.{EOS}"
    for a in range(40) for b in range(0, 40, 7)
] + ["def add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"\n    return a + b\n"] * 20


def test_special_tokens_keep_their_ids_and_stay_whole():
    tok = train_tokenizer(CORPUS, 600)
    for i, (text, _) in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(text) == i
        assert tok.encode(f"x{text}y", add_special_tokens=False).ids.count(i) == 1
    ids = tok.encode(CORPUS[0], add_special_tokens=False).ids
    assert ids[0] == 0 and ids[-1] == 1


@pytest.mark.parametrize("text", [CORPUS[5], "héllo wörld ✓ 日本語 \t\n  spaces", "｜DSML｜ not special here"])
def test_round_trip_is_exact(text):
    tok = train_tokenizer(CORPUS, 600)
    assert tok.decode(tok.encode(text, add_special_tokens=False).ids, skip_special_tokens=False) == text


def test_merges_shorten_the_corpus_and_training_is_deterministic():
    tok = train_tokenizer(CORPUS, 600)
    assert 270 + 40 < tok.get_vocab_size() <= 600   # merges were learned (never of digits), within the bound
    assert tok.to_str() == train_tokenizer(CORPUS, 600).to_str()
    byte_tok = build_tokenizer(600)
    trained = sum(len(tok.encode(t, add_special_tokens=False).ids) for t in CORPUS)
    bytes_only = sum(len(byte_tok.encode(t, add_special_tokens=False).ids) for t in CORPUS)
    assert trained < 0.65 * bytes_only      # a corpus of sums: its digits stay one token each


def test_every_digit_is_its_own_token():
    tok = train_tokenizer(CORPUS, 600)
    enc = tok.encode("What is 1234 + 56? 1290", add_special_tokens=False)
    digits = [t for t in enc.tokens if any(c.isdigit() for c in t)]
    assert digits == list("1234") + list("56") + list("1290")


def test_too_small_vocab_is_refused():
    with pytest.raises(ConfigError, match="at least 270"):
        train_tokenizer(CORPUS, 100)
