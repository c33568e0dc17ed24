"""generate_batch with the target's passes compiled (the one runner with fixed physical rows, tree buckets,
a cache kept across calls; its passes against the eager ones: tests/inference/target/test_graphs.py).
Traced by dynamo without code generation (backend "eager") on the CPU: every row equals its batch-1
output (== HF greedy) with mixed prompt lengths, per-row max_new_tokens and a row stopping at EOS inside
a tree while the others go on; later calls reuse the runner. (On a position-sensitive target:
test_batch.py; as replayed CUDA graphs: test_graph_replay.py; on a GPU: test_cuda.py.)"""

from __future__ import annotations

import pytest
import torch

from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.target.runner import TargetRunner

from .test_batch import MAX_NEW, PROMPTS, make_drafter
from .test_generator import plain_greedy


@pytest.fixture(scope="module")
def setup(tiny_llama, chatml_tokenizer):
    model = tiny_llama(len(chatml_tokenizer), layers=2, hidden=32, seed=3)
    model.generation_config.eos_token_id = None
    return model, chatml_tokenizer


@pytest.mark.parametrize("kind", ["plain", "medusa", "eagle_dynamic", "eagle3_static"])
def test_compiled_batch_equals_batch1_and_hf(setup, kind) -> None:
    model, tok = setup
    torch._dynamo.reset()
    gen = SpeculativeGenerator(model, tok, make_drafter(model, kind), compile="eager")
    eos = plain_greedy(model, PROMPTS[0], MAX_NEW[0])[6]  # row 0 stops early, inside a tree
    gen.eos = {eos}
    batch = gen.generate_batch(input_ids=PROMPTS, max_new_tokens=MAX_NEW)
    (runner,) = gen._runners.values()
    assert isinstance(runner, TargetRunner) and runner.static_shapes and runner.capacity == 4
    for b, (prompt, n) in enumerate(zip(PROMPTS, MAX_NEW)):
        assert batch[b].token_ids == plain_greedy(model, prompt, n, eos=eos), (kind, b)
    assert len(batch[0].token_ids) == 7 and batch[0].token_ids[-1] == eos
    # three rows of the same capacity later: the same runner (its cache, its graphs), still lossless
    again = gen.generate_batch(input_ids=PROMPTS[1:], max_new_tokens=MAX_NEW[1:])
    assert list(gen._runners.values()) == [runner]
    for b, (prompt, n) in enumerate(zip(PROMPTS[1:], MAX_NEW[1:])):
        assert again[b].token_ids == plain_greedy(model, prompt, n, eos=eos), (kind, b)


def test_a_longer_batch_grows_the_kept_runner(tiny_llama, chatml_tokenizer) -> None:
    model = tiny_llama(len(chatml_tokenizer), layers=1, hidden=32, seed=3)
    model.config.max_position_embeddings = 2048  # (rotary positions are computed, not tabled)
    tok = chatml_tokenizer
    gen = SpeculativeGenerator(model, tok, None, compile="eager")
    gen.eos = set()
    gen.generate_batch(input_ids=PROMPTS[:2], max_new_tokens=4)
    (small,) = gen._runners.values()
    assert small.cache.max_length == 1024
    long_prompt = [3 + i % 50 for i in range(1000)]  # past the first runner's 1024 slots with 40 new
    out = gen.generate_batch(input_ids=[long_prompt, PROMPTS[1]], max_new_tokens=[40, 6])
    (grown,) = gen._runners.values()
    assert grown is small and grown.cache.max_length >= 1040  # the kept runner's cache grew
    assert out[0].token_ids == plain_greedy(model, long_prompt, 40)
    assert out[1].token_ids == plain_greedy(model, PROMPTS[1], 6)
