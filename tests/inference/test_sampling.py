"""SamplingParams validation and the target distribution (temperature, top-k, top-p)."""

from __future__ import annotations

import pytest
import torch

from spechead.inference.sampling import SamplingParams, make_generator, sample, target_probs


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_params_validation_names_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_is_greedy():
    assert SamplingParams().is_greedy
    assert not SamplingParams(temperature=0.7).is_greedy


def test_greedy_is_one_hot_argmax():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 1.0, 2.0, 0.0]])
    probs = target_probs(logits, SamplingParams())
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))


def test_temperature_scaling_fp32():
    logits = torch.tensor([0.0, 1.0, 2.0], dtype=torch.bfloat16)
    probs = target_probs(logits, SamplingParams(temperature=0.5))
    assert probs.dtype == torch.float32
    assert torch.allclose(probs, torch.softmax(torch.tensor([0.0, 2.0, 4.0]), -1))
    assert torch.allclose(
        target_probs(logits, SamplingParams(temperature=1.0)), torch.softmax(logits.float(), -1)
    )


def test_top_k():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [4.0, 0.0, 0.0, 0.0]])  # [2, V]
    probs = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (probs[0] > 0).tolist() == [False, True, False, True]
    assert torch.allclose(probs[0, [1, 3]], torch.softmax(torch.tensor([3.0, 2.0]), -1))
    assert torch.allclose(probs.sum(-1), torch.ones(2))
    # ties at the k-th value are kept; top_k >= V is off
    assert (probs[1] > 0).sum() == 4
    assert torch.allclose(target_probs(logits, SamplingParams(1.0, top_k=10)), torch.softmax(logits, -1))


def test_top_p_smallest_set_and_at_least_argmax():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = p.log()
    keep = lambda top_p: (target_probs(logits, SamplingParams(1.0, top_p=top_p)) > 0).tolist()  # noqa: E731
    assert keep(0.5) == [True, False, False, False]  # mass 0.5 >= 0.5
    assert keep(0.6) == [True, True, False, False]
    assert keep(0.8) == [True, True, False, False]
    assert keep(0.81) == [True, True, True, False]
    assert keep(1e-6) == [True, False, False, False]  # always at least the argmax
    assert keep(1.0) == [True, True, True, True]
    probs = target_probs(logits, SamplingParams(1.0, top_p=0.7))
    assert torch.allclose(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))


def test_top_k_then_top_p_batched():
    logits = torch.randn(3, 5, 50, generator=torch.Generator().manual_seed(0))  # [..., V]
    probs = target_probs(logits, SamplingParams(temperature=0.8, top_k=10, top_p=0.9))
    assert probs.shape == logits.shape
    assert torch.allclose(probs.sum(-1), torch.ones(3, 5))
    assert ((probs > 0).sum(-1) <= 10).all() and ((probs > 0).sum(-1) >= 1).all()


def test_sample_follows_probs_and_seed():
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    g = make_generator(0)
    draws = torch.tensor([sample(probs, g) for _ in range(4000)])
    freq = torch.bincount(draws, minlength=4).float() / 4000
    assert freq[1] == 0 and (freq - probs).abs().max() < 0.03
    a = [sample(probs, make_generator(7)) for _ in range(3)]
    assert a == [sample(probs, make_generator(7)) for _ in range(3)]
    assert make_generator(None) is None
