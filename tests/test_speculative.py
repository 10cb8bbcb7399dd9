"""MTP speculative decoding: the same tokens as plain decoding (greedy and seeded sampling), with drafts both
rejected (random tiny model) and accepted (a tiny model trained to repeat a text), across compressor windows."""

from __future__ import annotations

import pytest
import torch

from moebox import LLM, SamplingParams
from moebox.config import parse_config
from moebox.train.export import export_checkpoint
from moebox.train.model import init_params, losses, trainable_model
from moebox.weights.synth import preset_config
from moebox.weights.tokenizer import build_tokenizer

PROMPTS = [[0] + list(range(40, 75)), [0, 9, 8, 7], [0] + [17, 23] * 12]


def _generate(model, spec: dict | None, params: SamplingParams, prompts=PROMPTS) -> tuple[list[list[int]], LLM]:
    llm = LLM(model, kv_cache_dtype="model", max_num_seqs=4, speculative_config=spec, progress=False)
    return [r.outputs[0].token_ids for r in llm.generate(prompts, params)], llm


@pytest.fixture(scope="module")
def repeating_model(tmp_path_factory):
    """A tiny model trained until it (and its MTP head) continue a fixed token cycle: drafts get accepted."""
    raw = preset_config("tiny")
    cfg = parse_config(raw)
    torch.manual_seed(0)
    params = init_params(cfg, seed=0)
    model = trainable_model(cfg, params)
    opt = torch.optim.AdamW([p for p in params.values() if isinstance(p, torch.nn.Parameter)], lr=3e-3)
    cycle = [0] + [30 + (i % 11) for i in range(90)]
    for _ in range(40):
        main, mtp = losses(model, [cycle])
        opt.zero_grad()
        (main + mtp).backward()
        opt.step()
    return export_checkpoint(tmp_path_factory.mktemp("rep") / "ckpt", raw, params, build_tokenizer(cfg.vocab_size),
                             shard_mb=1.0, progress=False)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_tokens_equal_plain_decoding_with_rejections(tiny_ckpt, k):
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain, _ = _generate(tiny_ckpt, None, greedy)
    spec, llm = _generate(tiny_ckpt, {"num_speculative_tokens": k}, greedy)
    assert spec == plain
    assert llm.engine.metrics.spec_drafted._value.get() > 0


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_tokens_equal_plain_decoding_with_acceptances(repeating_model, k):
    greedy = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    prompts = [[0, 30, 31, 32, 33], [0] + [30 + (i % 11) for i in range(40)]]
    plain, _ = _generate(repeating_model, None, greedy, prompts)
    spec, llm = _generate(repeating_model, {"num_speculative_tokens": k}, greedy, prompts)
    assert spec == plain
    drafted, accepted = (c._value.get() for c in (llm.engine.metrics.spec_drafted, llm.engine.metrics.spec_accepted))
    print(f"\nk={k}: accepted {accepted:.0f} of {drafted:.0f} drafts")
    assert accepted >= 0.5 * drafted > 0
    reg = llm.engine.metrics.registry
    by_position = [reg.get_sample_value("moebox_spec_accepted_at_position_total", {"position": str(i + 1)}) or 0
                   for i in range(k)]
    assert sum(by_position) == accepted and by_position == sorted(by_position, reverse=True)


def test_seeded_speculative_sampling_is_reproducible(repeating_model):
    """Drafts are sampled with the request's generator, so a seed fixes the whole output (not the same tokens
    as plain decoding, which draws from the generator in another order: the distribution is what is equal)."""
    params = SamplingParams(max_tokens=40, temperature=0.8, seed=7, ignore_eos=True)
    spec = {"num_speculative_tokens": 2, "adaptive": False}
    first, llm = _generate(repeating_model, spec, params)
    assert llm.engine.metrics.spec_accepted._value.get() > 0
    assert _generate(repeating_model, spec, params)[0] == first
    assert _generate(repeating_model, spec, SamplingParams(max_tokens=40, temperature=0.8, seed=8,
                                                             ignore_eos=True))[0] != first


def test_the_accept_or_resample_step_yields_the_target_distribution():
    """verify_draft with a draft drawn from q returns tokens distributed as p, for a q far from p, and keeps the
    draft at the rate sum_x min(p(x), q(x)) that speculative sampling promises."""
    from moebox.runtime.sampler import verify_draft
    p = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    q = torch.tensor([0.1, 0.2, 0.3, 0.2, 0.2])
    g = torch.Generator().manual_seed(0)
    n, kept, counts = 20000, 0, torch.zeros(5)
    for d in torch.multinomial(q, n, replacement=True, generator=g).tolist():
        t = verify_draft(p, q, d, g)
        kept += t == d
        counts[t] += 1
    expected = p * n
    stat = (((counts - expected) ** 2)[p > 0] / expected[p > 0]).sum()
    p_value = float(torch.special.gammaincc(torch.tensor(1.5, dtype=torch.float64), stat.double() / 2))   # df 3
    print(f"\ncounts {counts.tolist()}, chi-square p = {p_value:.3f}, kept {kept / n:.3f}")
    assert counts[4] == 0 and p_value > 0.001
    assert abs(kept / n - float(torch.minimum(p, q).sum())) < 0.015


def test_a_separate_head_directory_drafts_for_a_dspark_checkpoint(tiny_copy, tiny_ckpt):
    """The 0731 situation: the main checkpoint carries DSpark, the MTP head comes from the original release."""
    from tests.test_draft_heads import dspark
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    plain, _ = _generate(tiny_ckpt, None, greedy)
    spec, llm = _generate(dspark(tiny_copy), {"model": str(tiny_ckpt), "num_speculative_tokens": 2}, greedy)
    assert spec == plain and llm.engine.metrics.spec_drafted._value.get() > 0


def test_the_policy_keeps_the_faster_k_per_batch_size():
    """Measured tokens/s decide: drafting where it pays (batch 1 here), not where it loses (batch 4, as in the
    reference setup); every k is tried first, and the losers are re-measured every probe_every steps."""
    from moebox.runtime.speculative import SpecPolicy
    policy = SpecPolicy(k_max=2, probe_every=8)
    speed = {(1, 0): 20.0, (1, 1): 30.0, (1, 2): 34.0, (4, 0): 80.0, (4, 1): 70.0, (4, 2): 60.0}  # tokens/s
    chosen = {1: [], 4: []}
    for _ in range(40):
        for n in (1, 4):
            k = policy.choose(n)
            chosen[n].append(k)
            policy.observe(n, k, tokens=int(speed[n, k]), seconds=1.0)
    assert chosen[1][:3] == [2, 1, 0] and chosen[4][:3] == [2, 1, 0]        # exploration
    assert chosen[1].count(2) >= 32 and chosen[4].count(0) >= 32
    assert set(chosen[1][3:]) == {0, 1, 2}                                    # probes revisit the others
    speed[1, 0] = 100.0                                       # the text changed: drafting stopped paying
    later = []
    for _ in range(40):
        k = policy.choose(1)
        later.append(k)
        policy.observe(1, k, tokens=int(speed[1, k]), seconds=1.0)
    assert later[-16:].count(0) >= 14                         # follows it, probes aside


def test_the_engine_feeds_the_policy(tiny_ckpt):
    _, llm = _generate(tiny_ckpt, {"num_speculative_tokens": 2},
                       SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), PROMPTS[:1])
    rates = llm.engine.spec_policy.rate
    assert {(1, k) for k in range(3)} <= set(rates) and all(r > 0 for r in rates.values())


def _chi_square_p(a: list[int], b: list[int]) -> float:
    """p-value of the two-sample chi-square test that a and b come from one distribution (categories with fewer
    than 10 samples in total pooled into one)."""
    from collections import Counter
    ca, cb = Counter(a), Counter(b)
    cats = sorted(set(ca) | set(cb))
    big = [c for c in cats if ca[c] + cb[c] >= 10]
    rows = [(ca[c], cb[c]) for c in big] + [(sum(ca[c] for c in cats if c not in big),
                                             sum(cb[c] for c in cats if c not in big))]
    rows = [r for r in rows if sum(r)]
    na, nb = len(a), len(b)
    stat = sum((x - (x + y) * na / (na + nb)) ** 2 / ((x + y) * na / (na + nb)) +
               (y - (x + y) * nb / (na + nb)) ** 2 / ((x + y) * nb / (na + nb)) for x, y in rows)
    df = len(rows) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def test_unseeded_sampling_keeps_its_distribution(repeating_model):
    """The third token (verified from a draft row when the first draft is accepted) has the same distribution with
    and without speculation, by a chi-square test over 400 samples each; a shifted distribution fails it."""
    params = SamplingParams(max_tokens=3, temperature=1.5, ignore_eos=True)
    prompts = [[0, 30, 31, 32, 33]] * 400
    samples = {}
    for name, spec in (("plain", None), ("mtp", {"num_speculative_tokens": 2, "adaptive": False})):
        outs, llm = _generate(repeating_model, spec, params, prompts)
        samples[name] = [o[2] for o in outs]
    assert llm.engine.metrics.spec_accepted._value.get() > 100          # draft rows really produced tokens
    p = _chi_square_p(samples["plain"], samples["mtp"])
    print(f"\nchi-square p = {p:.3f} ({len(set(samples['plain']))} distinct third tokens)")
    assert p > 0.001
    shifted = [t if i % 3 else samples["plain"][0] for i, t in enumerate(samples["plain"])]
    assert _chi_square_p(samples["mtp"], shifted) < 0.001              # the test can tell distributions apart


@pytest.fixture(scope="module")
def demo_chat_prompts() -> tuple[object, list[list[int]]]:
    """The shipped (trained) demo and three held-out chat prompts: tool declarations (hundreds of tokens),
    arithmetic (a few), multi-turn."""
    from moebox.demo import demo_model_dir
    from moebox.train.data import eval_records
    from moebox.train.evaluate import chat_prompts
    from tokenizers import Tokenizer
    model = demo_model_dir()
    records = eval_records(seed=1, n_per_kind=1, kinds=("tool_call", "arith", "multi_turn"))
    return model, chat_prompts(Tokenizer.from_file(str(model / "tokenizer.json")), records)


# past the window (64) and many compressor windows (4 and 16) while drafting
DEMO_GREEDY = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def demo_plain(demo_chat_prompts) -> list[list[int]]:
    """Plain greedy decoding of the demo prompts, the tokens every speculative run below must reproduce."""
    model, prompts = demo_chat_prompts
    return _generate(model, None, DEMO_GREEDY, prompts)[0]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_tokens_equal_plain_decoding_on_the_trained_demo(demo_chat_prompts, demo_plain, k):
    """Issue E on issue G's model: real drafts, mostly accepted and sometimes not, so both the accept path and
    the rollback of every cache a rejected draft touched are exercised on text the model knows."""
    model, prompts = demo_chat_prompts
    spec, llm = _generate(model, {"num_speculative_tokens": k, "adaptive": False}, DEMO_GREEDY, prompts)
    assert spec == demo_plain
    drafted, accepted = (c._value.get() for c in (llm.engine.metrics.spec_drafted, llm.engine.metrics.spec_accepted))
    print(f"\ndemo, k={k}: accepted {accepted:.0f} of {drafted:.0f} drafts")
    assert 0.3 * drafted < accepted < drafted               # both outcomes happen


def test_the_shape_static_drafter_drafts_what_the_segment_drafter_does(demo_chat_prompts, demo_plain):
    """The MTP block as a DecodeBatch (the CUDA default) and as per-sequence segments (the CPU default) draft the
    same tokens on the trained demo: the same counts of drafted and accepted tokens, and plain decoding's output
    (greedy tokens do not depend on max_tokens: the first 40 of the 64-token run)."""
    from moebox.runtime.speculative import MTPDrafter
    model, prompts = demo_chat_prompts
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = [p[:greedy.max_tokens] for p in demo_plain]
    counts = []
    for shape_static in (False, True):
        llm = LLM(model, kv_cache_dtype="model", max_num_seqs=4, progress=False,
                  speculative_config={"num_speculative_tokens": 2, "adaptive": False})
        llm.engine.drafter = MTPDrafter(llm.engine.model, llm.engine.cache, shape_static=shape_static)
        assert [r.outputs[0].token_ids for r in llm.generate(prompts, greedy)] == plain
        counts.append(llm.engine.metrics.spec_counts())
    print(f"\n(steps, drafted, accepted) segments {counts[0]}, shape-static {counts[1]}")
    assert counts[0] == counts[1] and counts[0][2] > 0
