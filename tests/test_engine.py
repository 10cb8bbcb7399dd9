"""The continuous-batching engine on the tiny model: chunked prefill, forced continuations, penalties,
admission control and cancellation."""

from __future__ import annotations

import pytest
import torch

from moebox.runtime.engine import Engine, Event, QueueFull, Request, apply_penalties
from moebox.runtime.loader import load_model
from moebox.runtime.sampler import SamplingParams


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return load_model(tiny_ckpt, kv_cache_dtype="model", progress=False)[0]


def run(engine: Engine, reqs: list[Request]) -> dict[str, list[Event]]:
    events: dict[str, list[Event]] = {r.id: [] for r in reqs}
    for r in reqs:
        r.on_event = events[r.id].append
        engine.submit(r)
    while engine.has_work():
        engine.step()
    return events


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


def tokens(events: list[Event]) -> list[int]:
    return [t for e in events for t in e.token_ids]


def test_chunked_prefill_gives_the_same_tokens(model):
    prompt = list(range(3, 120))
    whole = Engine(model, None, max_num_seqs=2, max_model_len=256, max_num_batched_tokens=512)
    chunked = Engine(model, None, max_num_seqs=2, max_model_len=256, max_num_batched_tokens=7)
    a = run(whole, [Request("a", prompt, greedy(12), print)])["a"]
    b = run(chunked, [Request("b", prompt, greedy(12), print)])["b"]
    assert tokens(a) == tokens(b) and len(tokens(a)) == 12
    assert a[-1].finish_reason == "length" and a[-1].prompt_tokens == len(prompt)


def test_forced_continuation_replaces_samples(model):
    engine = Engine(model, None, max_num_seqs=1, max_model_len=128)
    forced = [7, 8, 9]
    req = Request("f", [0, 5, 6], greedy(6), print, force_after="", forced_ids=forced)
    out = tokens(run(engine, [req])["f"])
    assert out[:3] == forced and len(out) == 6


def test_penalties_follow_the_openai_definition_and_change_the_choice():
    logits = torch.tensor([3.0, 2.5, 0.0, 2.2])
    penalized = apply_penalties(logits, [0, 0, 1], presence=0.5, frequency=0.4)
    assert torch.allclose(penalized, torch.tensor([3.0 - 0.5 - 0.8, 2.5 - 0.5 - 0.4, 0.0, 2.2]))
    assert logits.argmax() == 0 and penalized.argmax() == 3       # the repeated tokens lose to an unseen one


def test_forced_continuation_after_a_text_trigger(tiny_ckpt, model):
    """The path tool_choice required/named takes in thinking mode: once the text contains the trigger, the
    forced tokens follow."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tiny_ckpt / "tokenizer.json"))
    prompt = [0, 40, 41, 42]
    free = run(Engine(model, tok, max_num_seqs=1, max_model_len=128), [Request("a", prompt, greedy(8), print)])
    free_ids = tokens(free["a"])
    texts = [""]                                          # the text the engine had after each token
    for e in free["a"]:
        texts.append(texts[-1] + e.text)
    first = next(k for k in range(1, 6) if texts[k])     # the first token after which some text exists
    forced = [7, 8, 9]
    req = Request("b", prompt, greedy(8), print, force_after=texts[first], forced_ids=forced)
    got = tokens(run(Engine(model, tok, max_num_seqs=1, max_model_len=128), [req])["b"])
    assert got[:first] == free_ids[:first] and got[first:first + 3] == forced


def test_queue_bound_and_cancellation_free_everything(model):
    engine = Engine(model, None, max_num_seqs=1, max_model_len=128, max_waiting=3)
    seen: list[Event] = []
    reqs = [Request(f"r{i}", [0, 5, 6], greedy(50), seen.append) for i in range(3)]
    for r in reqs:
        engine.submit(r)
    with pytest.raises(QueueFull):
        engine.submit(Request("overflow", [0, 5], greedy(5), seen.append))
    engine.step()                                         # r0 holds the only slot, r1 and r2 wait
    assert engine.slots_in_use == 1
    for r in reqs:
        engine.cancel(r.id)
    engine.step()
    assert engine.slots_in_use == 0 and not engine.has_work()
    assert engine.metrics.finished.labels(reason="cancelled")._value.get() == 3   # waiting ones count too
    assert all(e.finish_reason is None for e in seen)    # a cancelled request gets no further events
