"""Plain decoding one step ahead (engine/loop.py, depth 2), forced on a CPU (the default on CUDA only): the same
tokens as the loop that reads every token before the next step (greedy: Hugging Face's; sampled: the
same seed's draws), stops at EOS and max_new_tokens, stats, both caches and the fixed-shape passes."""

from __future__ import annotations

import pytest
import torch

from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.queued_acceptance import QueuedAcceptance
from spechead.inference.sampling import SamplingParams, make_generator, pick

from ..test_generator import plain_greedy

PROMPTS = [[5, 9, 2, 7], [11, 3], list(range(20, 45))]


@pytest.fixture(scope="module")
def model(tiny_llama):
    m = tiny_llama(96, layers=2, hidden=32, seed=4)
    m.generation_config.eos_token_id = None
    return m


def both(model, **options) -> tuple[SpeculativeGenerator, SpeculativeGenerator]:
    """(one step ahead, token by token) over the same target."""
    ahead, stepwise = (SpeculativeGenerator(model, None, None, **options) for _ in range(2))
    ahead.ahead, stepwise.ahead = True, False
    return ahead, stepwise


@pytest.mark.parametrize("options", [{}, {"compile": "eager"}], ids=["eager", "fixed_shapes"])
def test_greedy_ahead_equals_huggingface_and_stops_at_max_new_tokens(model, options):
    ahead, stepwise = both(model, **options)
    assert not SpeculativeGenerator(model, None, None).ahead  # a CPU's default: token by token
    for prompt in PROMPTS:
        for n in (1, 2, 17):
            out = ahead.generate(input_ids=prompt, max_new_tokens=n)
            assert out.token_ids == plain_greedy(model, prompt, n) == stepwise.generate(
                input_ids=prompt, max_new_tokens=n).token_ids  # fmt: skip
            assert out.stats.new_tokens == n and out.stats.accept_lengths == [1] * (n - 1)
            assert out.stats.verify_time > 0 or n == 1


def test_an_eos_stops_ahead_where_it_stops_token_by_token(model):
    ahead, stepwise = both(model)
    prompt = PROMPTS[0]
    full = plain_greedy(model, prompt, 24)
    for at in (0, 1, 5):  # the root (the prefill's token) is an EOS, the second token, a later one
        for gen in (ahead, stepwise):
            gen.eos = {full[at]}
        out = ahead.generate(input_ids=prompt, max_new_tokens=24)
        first = full.index(full[at])  # (an earlier copy of that token stops first)
        assert (
            out.token_ids
            == full[: first + 1]
            == stepwise.generate(input_ids=prompt, max_new_tokens=24).token_ids
        )
        assert len(out.stats.accept_lengths) == first
        # the next decode starts over (the step computed after the EOS is never kept)
        assert ahead.generate(input_ids=PROMPTS[1], max_new_tokens=6).token_ids == plain_greedy(
            model, PROMPTS[1], 6
        )


@pytest.mark.parametrize("params", [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 10},
                                    {"temperature": 1.0, "top_p": 0.8}])  # fmt: skip
def test_sampled_ahead_draws_what_token_by_token_draws_with_the_seed(model, params):
    ahead, stepwise = both(model)
    for seed in range(4):
        for prompt in PROMPTS[:2]:
            kw = {"input_ids": prompt, "max_new_tokens": 20, "seed": seed, **params}
            assert ahead.generate(**kw).token_ids == stepwise.generate(**kw).token_ids


def test_queued_plain_steps_draw_what_pick_draws():
    """A queued plain step's next token per row is `pick`'s: the argmax, or one draw with the row's
    generator (one uniform a step); greedy and sampled rows may mix."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))  # [B, V]
    tokens = torch.tensor([[1], [2], [3]])  # [B, 1]
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_k=7), SamplingParams(temperature=1.0)]
    for seed in range(20):
        gens = [make_generator(seed + b) for b in range(3)]
        accs = QueuedAcceptance.plain(tokens, logits, params, gens, 1).result()
        want = [pick(logits[b], params[b], make_generator(seed + b)) for b in range(3)]
        assert [a.next_token for a in accs] == want
        assert [a.path for a in accs] == [[0]] * 3 and [a.path_tokens for a in accs] == [[1], [2], [3]]


def test_a_queued_plain_step_padded_to_a_wider_commit_repeats_its_root():
    """A commit of width P > 1 (a drafter's queued commit) reads a plain step's path [B, P]: node 0, then
    its last node (the root) repeated, so the padded copies move the root onto itself."""
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))  # [B, V]
    queued = QueuedAcceptance.plain(torch.tensor([[4], [9]]), logits, [SamplingParams()] * 2, [None, None], 3)
    assert queued.path.tolist() == [[0, 0, 0], [0, 0, 0]] and queued.k.tolist() == [1, 1]


def test_logits_without_a_finite_mass_after_the_prefill_raise_one_clear_error(tiny_llama):
    """A NaN pass (here: every embedding but the prompt's token is NaN, so the second step's logits are)
    draws id V on the device: queued ahead, the next step's input is clamped into the vocabulary (no
    index error), and the host's read of V raises the same ValueError as token-by-token decoding."""
    target = tiny_llama(96, layers=1, hidden=32, seed=4)
    target.generation_config.eos_token_id = None
    with torch.no_grad():
        target.get_input_embeddings().weight[torch.arange(96) != 5] = float("nan")
    ahead, stepwise = both(target)
    for gen in (ahead, stepwise):
        with pytest.raises(ValueError, match="positive finite mass"):
            gen.generate(input_ids=[5], max_new_tokens=6, seed=0, temperature=1.0)
