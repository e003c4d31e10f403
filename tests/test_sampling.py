"""sampling.py: logits -> probs on hand-computed examples, seeded sampling, parameter validation."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import DEVICE
from specdec.config import SamplingParams
from specdec.errors import UserError
from specdec.sampling import logits_to_probs, make_generator, sample

PROBS = [0.5, 0.3, 0.15, 0.05]  # a distribution whose kept sets are easy to work out by hand


def log_probs(probs: list[float]) -> torch.Tensor:
    """[V] logits whose softmax is `probs`."""
    return torch.tensor(probs, device=DEVICE).log()


def assert_probs(actual: torch.Tensor, expected: list[float]) -> None:
    assert torch.allclose(actual, torch.tensor(expected, device=actual.device), atol=1e-6), actual


def test_temperature_one_is_softmax():
    logits = torch.tensor([0.0, math.log(2), math.log(4)], device=DEVICE)
    assert_probs(logits_to_probs(logits, SamplingParams(temperature=1.0)), [1 / 7, 2 / 7, 4 / 7])


def test_temperature_divides_logits():
    logits = torch.tensor([0.0, math.log(2), math.log(4)], device=DEVICE)  # at T=2: weights 1, sqrt(2), 2
    total = 3 + math.sqrt(2)
    probs = logits_to_probs(logits, SamplingParams(temperature=2.0))
    assert_probs(probs, [1 / total, math.sqrt(2) / total, 2 / total])


def test_greedy_is_one_hot_at_the_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [3.0, 0.0, 0.0, 0.0]], device=DEVICE)  # [B, V]
    probs = logits_to_probs(logits, SamplingParams(temperature=0.0, top_k=2, top_p=0.5))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([1.0, 3.0, 2.0, 0.0], device=DEVICE)
    e1, e2 = math.exp(3.0), math.exp(2.0)
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert_probs(probs, [0.0, e1 / (e1 + e2), e2 / (e1 + e2), 0.0])


def test_top_k_larger_than_vocab_keeps_everything():
    logits = log_probs(PROBS)
    assert_probs(logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=100)), PROBS)


@pytest.mark.parametrize(
    "top_p, expected",
    [
        (0.45, [1.0, 0.0, 0.0, 0.0]),  # the top token alone reaches 0.45
        (0.75, [0.625, 0.375, 0.0, 0.0]),  # 0.5 < 0.75 <= 0.8: two tokens
        (0.9, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),  # 0.8 < 0.9 <= 0.95: three tokens
        (1.0, PROBS),
    ],
)
def test_top_p_keeps_the_smallest_set_reaching_top_p(top_p, expected):
    assert_probs(logits_to_probs(log_probs(PROBS), SamplingParams(temperature=1.0, top_p=top_p)), expected)


def test_top_p_applies_after_temperature():
    """top_p filters the tempered distribution: at T=2 these logits give PROBS (two tokens reach 0.6);
    untempered they are sharper (the top token alone has 0.25 / 0.365 = 0.68 >= 0.6)."""
    logits = log_probs(PROBS) * 2
    assert_probs(logits_to_probs(logits, SamplingParams(temperature=2.0, top_p=0.6)), [0.625, 0.375, 0.0, 0.0])
    assert_probs(logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.6)), [1.0, 0.0, 0.0, 0.0])


@pytest.mark.parametrize(
    "min_p, expected",
    [
        (0.2, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),  # threshold 0.1
        (0.5, [0.625, 0.375, 0.0, 0.0]),  # threshold 0.25
        (0.9, [1.0, 0.0, 0.0, 0.0]),  # threshold 0.45
    ],
)
def test_min_p_drops_tokens_below_a_fraction_of_the_top(min_p, expected):
    assert_probs(logits_to_probs(log_probs(PROBS), SamplingParams(temperature=1.0, min_p=min_p)), expected)


def test_filters_combine():
    logits = log_probs([0.4, 0.3, 0.2, 0.06, 0.04])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=4, top_p=0.85, min_p=0.6))
    # top_k=4 drops 0.04; renormalised top 3 carry 0.9/0.96 = 0.9375 >= 0.85, the top 2 only 0.729;
    # min_p keeps tokens >= 0.6 * max, i.e. 0.4 and 0.3.
    assert_probs(probs, [4 / 7, 3 / 7, 0.0, 0.0, 0.0])


def test_batched_logits_are_filtered_per_row():
    logits = torch.stack([log_probs(PROBS), log_probs(PROBS[::-1])])[:, None]  # [B=2, T=1, V]
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.75))  # [B, T, V]
    assert probs.shape == (2, 1, 4)
    assert_probs(probs[:, 0], [[0.625, 0.375, 0.0, 0.0], [0.0, 0.0, 0.375, 0.625]])


def test_sample_is_reproducible_with_the_same_seed():
    probs = torch.full((64, 10), 0.1, device=DEVICE)  # [B, V]
    first = sample(probs, make_generator(7, DEVICE))
    assert torch.equal(first, sample(probs, make_generator(7, DEVICE)))
    assert not torch.equal(first, sample(probs, make_generator(8, DEVICE)))


def test_sample_never_draws_a_zero_probability_token():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5]], device=DEVICE).expand(1000, 4)  # [B, V]
    tokens = sample(probs, make_generator(0, DEVICE))  # [B]
    assert tokens.shape == (1000,)
    assert set(tokens.tolist()) == {1, 3}


def test_sample_keeps_leading_dims():
    probs = torch.full((2, 3, 5), 0.2, device=DEVICE)  # [B, T, V]
    assert sample(probs, make_generator(0, DEVICE)).shape == (2, 3)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=-0.1),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_p=-0.2),
        dict(top_k=-1),
        dict(min_p=-0.1),
        dict(min_p=1.0),
    ],
)
def test_invalid_sampling_params_raise_user_error(kwargs):
    with pytest.raises(UserError):
        SamplingParams(**kwargs)


def test_boundary_sampling_params_are_valid():
    params = SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0)
    assert params.greedy
    assert not SamplingParams(temperature=0.5, top_p=1e-6, min_p=0.99).greedy
