"""The compiled runner (fixed physical rows, trees padded to buckets, verify and commit as graphs): run as
the captured passes would run ("graphs" on a CPU: the fixed-shape functions themselves), it gives the eager
runner's logits, states and ancestors, pass after pass with commits between, for a batch of one
(capacity 1) and for rows of mixed lengths with a row leaving. Numbers, not tokens: a tiny random target's
greedy tokens barely feel a position off by one (logits move ~1e-3), these do. (As replayed graphs:
test_graph_replay.py; on a GPU: test_cuda.py.)"""

from __future__ import annotations

import pytest
import torch

from spechead.inference.target.runner import CUDA_BUCKETS, TargetRunner, batch_capacity


@pytest.fixture(scope="module")
def model(tiny_llama):
    return tiny_llama(64, layers=2, hidden=32, seed=3)


def test_capacity_is_the_next_power_of_two() -> None:
    assert [batch_capacity(b) for b in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 16]


def test_a_batch_of_ones_fixed_shape_verify_gives_the_eager_passes_outputs(model):
    prompt = torch.arange(5, 25)  # [20]
    eager = TargetRunner(model, (1,))
    fixed = TargetRunner(model, (1,), compile="graphs", buckets=CUDA_BUCKETS)
    for runner in (eager, fixed):
        runner.reserve([20], [40], 64)
        runner.prefill([prompt])
    assert fixed.capacity == 1 and fixed.static_shapes and not eager.static_shapes
    trees = [([[7, 8, 9]], [[-1, 0, 0]], [0, 2]), ([[3, 4, 5, 6, 7]], [[-1, 0, 1, 1, 3]], [0, 1, 3, 4])]
    trees.append(([[6]], [[-1]], [0]))
    for tokens, parents, path in trees:  # 3, 5 and 1 nodes: padded to buckets 4, 8 and 1
        (ref, ref_hidden), (out, hidden) = [
            r.verify(torch.tensor(tokens), torch.tensor(parents)) for r in (eager, fixed)
        ]
        assert out.shape == ref.shape and torch.allclose(out, ref, atol=1e-6), (out - ref).abs().max()
        assert torch.allclose(hidden[1], ref_hidden[1], atol=1e-6)
        assert torch.equal(fixed.last_ancestors, eager.last_ancestors)
        for runner in (eager, fixed):
            runner.commit([path])
    assert fixed.lengths == eager.lengths == [20 + 2 + 4 + 1]


def test_rows_fixed_shape_verify_gives_the_eager_passes_outputs(model) -> None:
    """Rows of mixed lengths, trees padded to buckets, commits and a row leaving (its physical row idle)."""
    prompts = [torch.arange(5, 5 + n) for n in (7, 3, 12)]
    eager = TargetRunner(model, (1,), max_length=64)
    fixed = TargetRunner(model, (1,), max_length=64, capacity=4, compile="graphs")
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
        ([[5], [7]], [[-1], [-1]], [[0], [0]], [1]),  # a plain step, then one row left
        ([[5, 6, 7]], [[-1, 0, 0]], [[0, 2]], None),
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
        assert fixed.lengths == eager.lengths
    assert fixed.rows == [0] and fixed.cache.lengths[1:] == [0, 0, 0]  # the others idle


def test_queued_commits_equal_commits(model) -> None:
    """commit_queued (device paths [B, P]: accepted nodes then the last repeated) + advance(K_b) leaves
    the rows as commit does."""
    prompts = [torch.arange(5, 12), torch.arange(20, 24)]
    runners = [TargetRunner(model, max_length=64, capacity=2, compile="graphs") for _ in range(2)]
    tokens, parents = torch.tensor([[7, 8, 9, 3], [3, 4, 5, 6]]), torch.tensor([[-1, 0, 0, 2], [-1, 0, 1, 1]])
    outs = []
    for i, runner in enumerate(runners):
        runner.prefill(prompts)
        runner.verify(tokens, parents)
        if i == 0:
            runner.commit([[0, 2, 3], [0, 3]])
        else:
            runner.commit_queued(torch.tensor([[0, 2, 3, 3], [0, 3, 3, 3]]))
            runner.advance([3, 2])
        outs.append(runner.verify(tokens, parents)[0])
    assert runners[0].lengths == runners[1].lengths == [10, 6]
    assert torch.equal(outs[0], outs[1])
    with pytest.raises(AssertionError, match="commit_queued needs compile="):
        eager = TargetRunner(model)
        eager.prefill(prompts)
        eager.commit_queued(torch.zeros(2, 1, dtype=torch.long))


def test_a_compiled_runners_rows_are_fixed_for_its_life(model) -> None:
    runner = TargetRunner(model, compile="graphs")
    runner.prefill([torch.arange(3), torch.arange(4), torch.arange(5)])
    assert runner.capacity == 4 and runner.cache.batch == 4
    runner.prefill([torch.arange(6)])  # fewer rows: the same physical rows, the others idle
    assert runner.cache.batch == 4 and runner.rows == [0] and runner.lengths == [6]
    with pytest.raises(ValueError, match="5 prompts > this runner's 4 rows"):
        runner.prefill([torch.arange(3)] * 5)
