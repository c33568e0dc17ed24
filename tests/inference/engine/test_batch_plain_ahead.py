"""Plain batched decoding one step ahead (engine/loop.py, depth 2), forced on a CPU (the default on CUDA
only): every row's tokens equal the token-by-token batch loop's and Hugging Face's (greedy) or the same
seeds' draws (sampled), with mixed prompt lengths, per-row max_new_tokens and a row stopping at an EOS
while the others go on; rows leave the batch at the step they should."""

from __future__ import annotations

import pytest

from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.target.runner import TargetRunner

from ..test_generator import plain_greedy

PROMPTS = [[7, 9, 11, 13, 15, 17, 19, 21, 23], [40], list(range(5, 19)), [33, 34, 35]]
MAX_NEW = [14, 1, 20, 2]


@pytest.fixture(scope="module")
def setup(tiny_llama, chatml_tokenizer):
    model = tiny_llama(len(chatml_tokenizer), layers=2, hidden=32, seed=3)
    model.generation_config.eos_token_id = None
    return model, chatml_tokenizer


def both(model, tok, **options) -> tuple[SpeculativeGenerator, SpeculativeGenerator]:
    """(one step ahead, token by token) plain batch decoding over the same target."""
    ahead, stepwise = (SpeculativeGenerator(model, tok, None, cache="static", **options) for _ in range(2))
    ahead.ahead, stepwise.ahead = True, False
    return ahead, stepwise


def step_batches(monkeypatch, runner_cls) -> list[int]:
    """The batch size of every verify of `runner_cls` from now on (a spy)."""
    sizes, verify = [], runner_cls.verify

    def spy(self, tokens, parents):
        sizes.append(tokens.shape[0])
        return verify(self, tokens, parents)

    monkeypatch.setattr(runner_cls, "verify", spy)
    return sizes


@pytest.mark.parametrize("compile", [False, "eager"])  # "eager": the fixed-shape batch passes, traced
def test_greedy_rows_ahead_equal_token_by_token_and_huggingface(setup, compile, monkeypatch):
    model, tok = setup
    ahead, stepwise = both(model, tok, compile=compile)
    assert not SpeculativeGenerator(model, tok, None).ahead  # a CPU's default: token by token
    sizes = step_batches(monkeypatch, TargetRunner)  # (eager or with fixed rows: the one runner)
    out = ahead.generate_batch(input_ids=PROMPTS, max_new_tokens=MAX_NEW)
    steps = list(sizes)
    ref = stepwise.generate_batch(input_ids=PROMPTS, max_new_tokens=MAX_NEW)
    for b, (prompt, n) in enumerate(zip(PROMPTS, MAX_NEW)):
        assert out[b].token_ids == ref[b].token_ids == plain_greedy(model, prompt, n), b
        assert out[b].stats.new_tokens == n and out[b].stats.accept_lengths == [1] * (n - 1)
    # a row out of max_new_tokens leaves before a step it does not need: step s holds the rows that
    # want a token s (rows 0, 2, 3 at step 1; 0 and 2 to step 13; row 2 alone to step 19)
    assert steps == [3] + [2] * 12 + [1] * 6


def test_an_eos_row_leaves_one_step_late_while_the_others_go_on(setup, monkeypatch):
    model, tok = setup
    ahead, stepwise = both(model, tok)
    eos = plain_greedy(model, PROMPTS[0], MAX_NEW[0])[6]
    ahead.eos = stepwise.eos = {eos}
    sizes = step_batches(monkeypatch, TargetRunner)
    out = ahead.generate_batch(input_ids=PROMPTS, max_new_tokens=MAX_NEW)
    steps = list(sizes)
    ref = stepwise.generate_batch(input_ids=PROMPTS, max_new_tokens=MAX_NEW)
    for b, (prompt, n) in enumerate(zip(PROMPTS, MAX_NEW)):
        assert out[b].token_ids == ref[b].token_ids == plain_greedy(model, prompt, n, eos=eos), b
        assert out[b].stats.accept_lengths == [1] * (len(out[b].token_ids) - 1)
    first = out[0].token_ids.index(eos)  # (an earlier copy of the token stops first)
    assert out[0].token_ids[-1] == eos and len(out[0].token_ids) == first + 1
    assert len(out[2].token_ids) == 20 or eos in out[2].token_ids  # the others went on
    # row 0's EOS (token `first`) is read after step first + 1 was queued: that step is its last
    late = sum(1 for s in range(1, 20) if s <= first + 1)
    assert steps[:late] == [3] + [2] * (late - 1) and set(steps[late:]) <= {1}


def test_a_stream_of_rows_ahead_joins_to_each_rows_text(setup):
    model, tok = setup
    ahead, _ = both(model, tok)
    texts = ["" for _ in PROMPTS]
    for row, piece in ahead.stream_batch(input_ids=PROMPTS, max_new_tokens=MAX_NEW):
        texts[row] += piece
    assert texts == [r.text for r in ahead.generate_batch(input_ids=PROMPTS, max_new_tokens=MAX_NEW)]


@pytest.mark.parametrize("compile", [False, "eager"])
@pytest.mark.parametrize("params", [{"temperature": 0.9, "top_k": 20}, {"temperature": 1.0, "top_p": 0.8}])
def test_sampled_rows_ahead_draw_what_token_by_token_draws(setup, compile, params):
    """Each row's own generator: the token-by-token batch's draws (host and device acceptance alike) and
    the row's batch-1 draws with its seed."""
    model, tok = setup
    ahead, stepwise = both(model, tok, compile=compile)
    kw = {"input_ids": PROMPTS, "max_new_tokens": MAX_NEW, "seed": [11, 12, 13, 14], **params}
    out = ahead.generate_batch(**kw)
    host = stepwise.generate_batch(**kw)
    stepwise.device_accept = True  # the accelerator's acceptance (rule A as tensor ops), on the CPU
    device = stepwise.generate_batch(**kw)
    for b, prompt in enumerate(PROMPTS):
        alone = ahead.generate(input_ids=prompt, max_new_tokens=MAX_NEW[b], seed=kw["seed"][b], **params)
        assert out[b].token_ids == host[b].token_ids == device[b].token_ids == alone.token_ids, b
