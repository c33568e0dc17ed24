"""Batch > 1 with the target's passes compiled (batch_graphs.py): fixed physical rows, tree buckets, a
cache kept across calls. Traced by dynamo without code generation (backend "eager") on the CPU: every
row equals its batch-1 output (== HF greedy) with mixed prompt lengths, per-row max_new_tokens and a
row stopping at EOS inside a tree while the others go on; later calls reuse the runner. (On a
position-sensitive target: test_batch.py; as replayed CUDA graphs: test_graph_replay.py; on a GPU:
test_cuda.py.)"""

from __future__ import annotations

import pytest
import torch

from spechead.inference.batch_graphs import CompiledBatchRunner, batch_capacity
from spechead.inference.generator import SpeculativeGenerator

from .test_batch import MAX_NEW, PROMPTS, make_drafter
from .test_generator import plain_greedy


@pytest.fixture(scope="module")
def setup(tiny_llama, chatml_tokenizer):
    model = tiny_llama(len(chatml_tokenizer), layers=2, hidden=32, seed=3)
    model.generation_config.eos_token_id = None
    return model, chatml_tokenizer


def test_capacity_is_the_next_power_of_two() -> None:
    assert [batch_capacity(b) for b in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 16]


@pytest.mark.parametrize("kind", ["plain", "medusa", "eagle_dynamic", "eagle3_static"])
def test_compiled_batch_equals_batch1_and_hf(setup, kind) -> None:
    model, tok = setup
    torch._dynamo.reset()
    gen = SpeculativeGenerator(model, tok, make_drafter(model, kind), compile="eager")
    eos = plain_greedy(model, PROMPTS[0], MAX_NEW[0])[6]  # row 0 stops early, inside a tree
    gen.eos = {eos}
    batch = gen.generate_batch(input_ids=PROMPTS, max_new_tokens=MAX_NEW)
    (runner,) = gen._batch_runners.values()
    assert isinstance(runner, CompiledBatchRunner) and runner.capacity == 4
    for b, (prompt, n) in enumerate(zip(PROMPTS, MAX_NEW)):
        assert batch[b].token_ids == plain_greedy(model, prompt, n, eos=eos), (kind, b)
    assert len(batch[0].token_ids) == 7 and batch[0].token_ids[-1] == eos
    # three rows of the same capacity later: the same runner (its cache, its graphs), still lossless
    again = gen.generate_batch(input_ids=PROMPTS[1:], max_new_tokens=MAX_NEW[1:])
    assert list(gen._batch_runners.values()) == [runner]
    for b, (prompt, n) in enumerate(zip(PROMPTS[1:], MAX_NEW[1:])):
        assert again[b].token_ids == plain_greedy(model, prompt, n, eos=eos), (kind, b)


def test_a_longer_batch_grows_the_kept_runner(tiny_llama, chatml_tokenizer) -> None:
    model = tiny_llama(len(chatml_tokenizer), layers=1, hidden=32, seed=3)
    model.config.max_position_embeddings = 2048  # (rotary positions are computed, not tabled)
    tok = chatml_tokenizer
    gen = SpeculativeGenerator(model, tok, None, compile="eager")
    gen.eos = set()
    gen.generate_batch(input_ids=PROMPTS[:2], max_new_tokens=4)
    (small,) = gen._batch_runners.values()
    long_prompt = [3 + i % 50 for i in range(1000)]  # past the first runner's 1024 slots with 40 new
    out = gen.generate_batch(input_ids=[long_prompt, PROMPTS[1]], max_new_tokens=[40, 6])
    (grown,) = gen._batch_runners.values()
    assert grown is not small and grown.max_length >= 1040
    assert out[0].token_ids == plain_greedy(model, long_prompt, 40)
    assert out[1].token_ids == plain_greedy(model, PROMPTS[1], 6)


def test_the_fixed_shape_batch_verify_gives_the_eager_passes_outputs(setup) -> None:
    """Numbers, not tokens (a tiny random target's greedy tokens barely feel a wrong position): the
    compiled runner ("graphs": the passes as captured) gives the eager batch runner's logits, states and
    ancestors for rows of mixed lengths, trees padded to buckets, commits and a row leaving."""
    from spechead.inference.batch import BatchRunner

    model, _ = setup
    prompts = [torch.arange(5, 5 + n) for n in (7, 3, 12)]
    eager = BatchRunner(model, (1,), max_length=64)
    fixed = CompiledBatchRunner(model, (1,), max_length=64, capacity=4, compile="graphs")
    for runner in (eager, fixed):
        runner.prefill(prompts)
    passes = [  # tokens [B, N], parents [B, N], accepted paths, rows kept after
        (
            [[7, 8, 9], [3, 4, 5], [6, 7, 8]],
            [[-1, 0, 0], [-1, 0, 1], [-1, 0, 0]],
            [[0, 2], [0, 1, 2], [0]],
            [2, 0],
        ),
        ([[4, 5, 6, 7, 8], [9, 9, 8, 7, 6]], [[-1, 0, 1, 1, 3], [-1, 0, 0, 2, 2]], [[0, 1, 3], [0, 2]], None),
        ([[5, 6], [7, 8]], [[-1, 0], [-1, 0]], [[0], [0, 1]], None),  # after the kept rows' commits
    ]
    for tokens, parents, paths, keep in passes:
        tokens, parents = torch.tensor(tokens), torch.tensor(parents)
        (ref, ref_hidden), (out, hidden) = [r.verify(tokens, parents) for r in (eager, fixed)]
        assert out.shape == ref.shape and torch.allclose(out, ref, atol=1e-6), (out - ref).abs().max()
        assert torch.allclose(hidden[1], ref_hidden[1], atol=1e-6)
        assert torch.equal(fixed.last_ancestors, eager.last_ancestors)
        for runner in (eager, fixed):
            runner.commit(paths)
            if keep is not None:
                runner.keep(keep)
