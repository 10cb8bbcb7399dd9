"""The offline API (`LLM.generate` / `LLM.logits`) on the tiny synthetic checkpoint.

References are computed independently of the generation loop: greedy decoding by argmax over full
cache-less forwards (`llm.logits`) of the growing sequence, and the tokenizer's own decode.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moebox import LLM, SamplingParams
from moebox.errors import MoeboxError

N = 12


@pytest.fixture(scope="module")
def llm(tiny_ckpt: Path) -> LLM:
    return LLM(tiny_ckpt, progress=False)


def argmax_decode(llm: LLM, prompt: list[int], n: int, stop_at: set[int] = frozenset()) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        t = int(llm.logits(ids)[-1].argmax())
        ids.append(t)
        if t in stop_at:
            break
    return ids[len(prompt):]


GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
PROMPTS = [[0, 17, 99, 230, 5, 61, 200, 44, 45, 46, 47, 300, 12, 13, 19, 250, 251, 7, 8, 9, 10],   # 21 > window 8
           [0, 5],
           [0, 250, 40, 41, 42, 43, 44],
           [0, 77, 78, 79, 80, 81, 82, 83, 84, 85, 86, 87, 88]]


@pytest.fixture(scope="module")
def alone(llm: LLM) -> list[list[int]]:
    """Greedy output of each prompt generated on its own."""
    return [llm.generate(p, GREEDY)[0].token_ids for p in PROMPTS]


def test_greedy_equals_argmax_of_full_forwards(llm, alone):
    for p, got in zip(PROMPTS[:2], alone[:2]):
        assert got == argmax_decode(llm, p, N)


def test_string_and_token_prompts(llm):
    text = "Hello, moebox!"
    ids = llm.encode(text)
    assert ids[0] == llm.config.bos_token_id and len(ids) > 2
    assert llm.tokenizer.decode(ids, skip_special_tokens=True) == text
    out_s = llm.generate(text, GREEDY)[0]
    out_i = llm.generate([ids], GREEDY)[0]
    assert out_s.prompt == text and out_i.prompt is None
    assert out_s.prompt_token_ids == out_i.prompt_token_ids == ids
    assert out_s.token_ids == out_i.token_ids == argmax_decode(llm, ids, N)
    for o in (out_s, out_i):
        assert len(o.token_ids) == N and o.outputs[0].finish_reason == "length"
        assert o.text == o.outputs[0].text == llm.tokenizer.decode(o.token_ids, skip_special_tokens=True)
    # a BOS already present is not doubled
    assert llm.encode(llm.tokenizer.decode([0], skip_special_tokens=False) + text) == ids


def test_batch_gives_the_same_greedy_tokens_as_alone(llm, alone):
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == alone
    assert [o.prompt_token_ids for o in outs] == PROMPTS
    # order of the batch does not matter either
    rev = llm.generate(PROMPTS[::-1], GREEDY)
    assert [o.token_ids for o in rev] == alone[::-1]


def test_waves_beyond_max_num_seqs(tiny_ckpt, alone):
    small = LLM(tiny_ckpt, progress=False, max_num_seqs=3)
    prompts = PROMPTS + PROMPTS[:3]             # 7 prompts: waves of 3, 3, 1 reusing cache slots
    outs = small.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == alone + alone[:3]


def test_mixed_max_tokens_in_one_batch(llm, alone):
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (3, N, 1, 7)]
    outs = llm.generate(PROMPTS, params)
    for o, a, p in zip(outs, alone, params):
        assert o.token_ids == a[:p.max_tokens] and o.outputs[0].finish_reason == "length"


def test_seed_determinism(llm):
    p = PROMPTS[2]
    a = llm.generate(p, SamplingParams(temperature=1.0, seed=11, max_tokens=N, ignore_eos=True))[0].token_ids
    b = llm.generate(p, SamplingParams(temperature=1.0, seed=11, max_tokens=N, ignore_eos=True))[0].token_ids
    c = llm.generate(p, SamplingParams(temperature=1.0, seed=12, max_tokens=N, ignore_eos=True))[0].token_ids
    assert a == b and a != c
    # same seed in one batch: each request has its own generator, so both rows are equal to the lone run
    both = llm.generate([p, p], SamplingParams(temperature=1.0, seed=11, max_tokens=N, ignore_eos=True))
    assert both[0].token_ids == both[1].token_ids == a


def test_top_k_1_is_greedy(llm, alone):
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, top_k=1, seed=3, max_tokens=N, ignore_eos=True))
    assert out[0].token_ids == alone[0]


def test_max_tokens_finishes_with_length(llm, alone):
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert out.token_ids == alone[1][:4] and out.outputs[0].finish_reason == "length"


def test_stop_string_truncates_text(llm):
    prompt = PROMPTS[0]
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    text = full.text
    # a short printable ASCII piece from the middle of the greedy text
    starts = [i for i in range(3, len(text) - 2) if text[i:i + 2].isascii() and text[i:i + 2].isprintable()]
    assert starts, repr(text)
    stop = text[starts[0]:starts[0] + 2]
    cut = text.find(stop)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                              stop=["never-in-output", stop]))[0]
    assert out.outputs[0].finish_reason == "stop"
    assert out.text == text[:cut] and stop not in out.text
    k = len(out.token_ids)
    assert out.token_ids == full.token_ids[:k] and k < 30
    dec = lambda ids: llm.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    assert stop in dec(out.token_ids) and stop not in dec(out.token_ids[:-1])   # stopped at the first chance


def test_stop_token_ids(llm, alone):
    target = alone[0][5]
    first = alone[0].index(target)
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=N, ignore_eos=True,
                                                  stop_token_ids=[target]))[0]
    assert out.token_ids == alone[0][:first + 1]
    assert out.outputs[0].finish_reason == "stop"
    assert out.text == llm.tokenizer.decode(out.token_ids[:-1], skip_special_tokens=True)


def test_eos_stops_unless_ignore_eos(tiny_copy, alone):
    """Declare a token the greedy output reaches as EOS (config.json), then it must stop there."""
    eos = alone[0][4]
    first = alone[0].index(eos)
    cfg_path = tiny_copy / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["eos_token_id"] = eos
    cfg_path.write_text(json.dumps(cfg))
    llm = LLM(tiny_copy, progress=False)
    assert eos in llm.config.eos_token_ids
    stopped = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=N))[0]
    assert stopped.token_ids == alone[0][:first + 1] and stopped.outputs[0].finish_reason == "stop"
    ignored = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=N, ignore_eos=True))[0]
    assert ignored.token_ids == alone[0] and ignored.outputs[0].finish_reason == "length"


def test_logits_shape_and_consistency(llm):
    ids = PROMPTS[0]
    full = llm.logits(ids)
    assert full.shape == (len(ids), llm.config.vocab_size) and full.dtype == torch.float32
    # causal: logits of a prefix equal the first rows of the full sequence's logits
    assert torch.allclose(llm.logits(ids[:9]), full[:9], atol=1e-4)


@pytest.mark.parametrize("prompt, params, match", [
    ([[]], None, "empty prompt"),
    ([[0, 5, 320]], None, "token id 320 is outside the vocabulary"),
    ([[0, -1]], None, "token id -1 is outside the vocabulary"),
    ([[0] * 30], SamplingParams(max_tokens=3), "exceeds max_model_len 32"),
    ([[0, 1], [0, 2]], [SamplingParams()], "2 prompts but 1 sampling params"),
])
def test_request_errors(tiny_ckpt, prompt, params, match):
    llm = LLM(tiny_ckpt, progress=False, max_model_len=32, max_num_seqs=2)
    with pytest.raises(MoeboxError, match=match):
        llm.generate(prompt, params)
    # the boundary itself is allowed: 29 + 3 == 32
    assert len(llm.generate([[0] * 29], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids) == 3
    with pytest.raises(MoeboxError, match="outside the vocabulary"):
        llm.logits([0, 320])


@pytest.mark.parametrize("kwargs, match", [
    (dict(kv_cache_dtype="int4"), "kv_cache_dtype='int4' is not supported"),
    (dict(dtype="int8"), "dtype='int8' is not supported"),
    (dict(max_model_len=10 ** 6), "exceeds the model's max_position_embeddings"),
])
def test_constructor_errors(tiny_ckpt, kwargs, match):
    with pytest.raises(MoeboxError, match=match):
        LLM(tiny_ckpt, progress=False, **kwargs)
