"""The torch reference sampler on small hand-made logits: each filter against its definition."""

from __future__ import annotations

import math

import pytest
import torch

from moebox.runtime.sampler import SamplingParams, filtered_logits, sample_token

NEG = float("-inf")


def kept(x: torch.Tensor) -> list[int]:
    return [i for i, v in enumerate(x.tolist()) if v != NEG]


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs])


def test_temperature_divides_logits():
    x = torch.tensor([1.0, -2.0, 0.5, 3.0])
    out = filtered_logits(x, SamplingParams(temperature=0.5))
    assert torch.allclose(out, torch.tensor([2.0, -4.0, 1.0, 6.0]))
    # softmax of the result sharpens: probability of the max rises above its temperature-1 value
    p1 = torch.softmax(x, 0)[3]
    p05 = torch.softmax(out, 0)[3]
    assert p05 > p1


def test_top_k_keeps_the_k_largest():
    x = torch.tensor([0.1, 2.0, -1.0, 1.5, 0.3, 3.0])
    assert kept(filtered_logits(x, SamplingParams(top_k=3))) == [1, 3, 5]
    assert kept(filtered_logits(x, SamplingParams(top_k=1))) == [5]
    for off in (0, -1, 6, 100):   # off, or not smaller than the vocab: nothing masked
        assert kept(filtered_logits(x, SamplingParams(top_k=off))) == list(range(6))
    # kept values are unchanged (only masking, no renormalisation of logits)
    out = filtered_logits(x, SamplingParams(top_k=3, temperature=2.0))
    assert torch.allclose(out[[1, 3, 5]], x[[1, 3, 5]] / 2)


def test_top_p_keeps_smallest_prefix_reaching_mass():
    # probabilities 0.4, 0.3, 0.2, 0.1 placed out of order
    probs = [0.2, 0.4, 0.1, 0.3]
    x = logits_of(probs)
    cases = {0.35: [1],              # 0.4 alone reaches 0.35
             0.4 - 1e-3: [1],
             0.5: [1, 3],           # 0.4 < 0.5 <= 0.7
             0.69: [1, 3],
             0.71: [0, 1, 3],       # 0.7 < 0.71 <= 0.9
             0.95: [0, 1, 2, 3],
             1.0: [0, 1, 2, 3]}
    for top_p, expect in cases.items():
        assert kept(filtered_logits(x, SamplingParams(top_p=top_p))) == expect, top_p


def test_min_p_is_relative_to_the_max_probability():
    probs = [0.5, 0.26, 0.2, 0.04]
    x = logits_of(probs)
    # threshold = min_p * 0.5
    assert kept(filtered_logits(x, SamplingParams(min_p=0.5))) == [0, 1]          # 0.25: drops 0.2, 0.04
    assert kept(filtered_logits(x, SamplingParams(min_p=0.3))) == [0, 1, 2]       # 0.15
    assert kept(filtered_logits(x, SamplingParams(min_p=0.07))) == [0, 1, 2, 3]   # 0.035
    assert kept(filtered_logits(x, SamplingParams(min_p=1.0))) == [0]


def test_filters_compose_in_order_top_k_min_p_top_p():
    probs = [0.35, 0.25, 0.2, 0.12, 0.08]
    x = logits_of(probs)
    # top_k=4 renormalises to 0.35/0.92 .. ; min_p 0.4 of 0.380 -> 0.152 drops 0.12/0.92=0.130;
    # then top_p 0.6 over 0.35/0.8, 0.25/0.8, 0.2/0.8 = 0.4375, 0.3125, 0.25 -> keeps the first two
    p = SamplingParams(top_k=4, min_p=0.4, top_p=0.6)
    assert kept(filtered_logits(x, p)) == [0, 1]


def test_greedy_and_top_k_1_pick_argmax():
    x = torch.tensor([0.3, 1.2, 4.0, -1.0, 3.9])
    g = torch.Generator().manual_seed(0)
    assert sample_token(x, SamplingParams(temperature=0), None) == 2
    assert all(sample_token(x, SamplingParams(top_k=1), g) == 2 for _ in range(50))


def test_sampling_never_draws_filtered_tokens():
    x = torch.tensor([2.0, 1.9, 1.8, -5.0, 1.7])
    g = torch.Generator().manual_seed(1)
    draws = {sample_token(x, SamplingParams(top_k=2), g) for _ in range(300)}
    assert draws == {0, 1}


def test_temperature_1_samples_softmax_probabilities():
    """Pearson chi-square of 4000 draws against softmax(logits); fixed generator, so deterministic."""
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    x = probs.log() + 0.7          # a shift must not matter
    g = torch.Generator().manual_seed(1234)
    n = 4000
    counts = torch.zeros(4)
    for _ in range(n):
        counts[sample_token(x, SamplingParams(temperature=1.0), g)] += 1
    expected = probs * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.27, (counts, chi2)       # 3 dof, p = 0.001
    # and the test has teeth: the same counts are far from a uniform or a temperature-2 distribution
    for wrong in (torch.full((4,), 0.25), torch.softmax(x / 2, 0)):
        e = wrong * n
        assert float(((counts - e) ** 2 / e).sum()) > 50


def test_temperature_2_samples_flattened_distribution():
    x = torch.tensor([0.1, 0.2, 0.3, 0.4]).log()
    target = torch.softmax(x / 2, 0)
    g = torch.Generator().manual_seed(7)
    n = 4000
    counts = torch.bincount(torch.tensor([sample_token(x, SamplingParams(temperature=2.0), g) for _ in range(n)]),
                            minlength=4).float()
    chi2 = float(((counts - target * n) ** 2 / (target * n)).sum())
    assert chi2 < 16.27, (counts, chi2)


@pytest.mark.parametrize("kwargs, word", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.1), "min_p"),
])
def test_sampling_params_validation(kwargs, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams(**kwargs)


def test_sampling_params_stop_normalisation():
    assert SamplingParams(stop="ab").stop == ["ab"]
    assert SamplingParams(stop=["", "x"]).stop == ["x"]
    assert SamplingParams().stop == []
