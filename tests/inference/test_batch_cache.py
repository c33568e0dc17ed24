"""The batch KV cache: every layer's keys and values live in one buffer [L, 2, B, kv, S_max, D] when they
share a shape, so a commit (each row's accepted path moved into place after its own prefix) is one gather
and a row drop moves the later rows up in place; layers of several shapes keep their own buffers and
give the same results."""

from __future__ import annotations

import pytest
import torch

from spechead.inference.batch import BatchRunner, BatchSlotCache

LAYERS, S_MAX = 3, 16
LENGTHS = [3, 5, 4]  # committed positions of rows 0, 1, 2 before the tree entries


def filled(runner: BatchRunner, dims: list[int]) -> BatchSlotCache:
    """A cache whose slot s of row b in layer i holds key 1000 b + 100 i + s (values: minus that), for
    layers of head dims `dims`, installed in `runner` with LENGTHS committed."""
    cache = BatchSlotCache(LAYERS, 3, S_MAX)
    cache.write_slots, cache.view_length = torch.arange(S_MAX).expand(3, S_MAX), S_MAX
    for i, dim in enumerate(dims):
        slot = torch.arange(S_MAX, dtype=torch.float32)[None, None, :, None]
        keys = (slot + 100 * i + 1000 * torch.arange(3.0)[:, None, None, None]).expand(3, 2, S_MAX, dim)
        cache.layers[i].update(keys.clone(), -keys.clone())
    runner.cache, runner.lengths = cache, torch.tensor(LENGTHS)
    return cache


def slots(cache: BatchSlotCache, row: int, length: int, first_row: int) -> list[list[int]]:
    """Per layer: the slot each of `row`'s first `length` entries was written at (`first_row`: the row's
    index when it was written); its values are checked to match."""
    out = []
    for i, layer in enumerate(cache.slot_layers):
        keys = layer.keys[row, 0, :length, 0]  # [length]
        assert torch.equal(layer.values[row, :, :length], -layer.keys[row, :, :length])
        out.append([int(x) - 100 * i - 1000 * first_row for x in keys.tolist()])
    return out


@pytest.mark.parametrize("dims", [[4, 4, 4], [4, 6, 4]], ids=["one-buffer", "own-buffers"])
def test_commit_and_row_drops_move_every_layer(tiny_llama, dims):
    runner = BatchRunner(tiny_llama(64, layers=2, hidden=32), (), max_length=S_MAX)
    cache = filled(runner, dims)
    shared = cache.shared_storage()
    assert (shared is not None) == (len(set(dims)) == 1)
    if shared is not None:  # every layer's keys and values are views of the one buffer
        assert shared.shape == (LAYERS, 2, 3, 2, S_MAX, 4)
        assert all(
            layer.keys.data_ptr() == shared[i, 0].data_ptr() for i, layer in enumerate(cache.slot_layers)
        )
    runner.commit([[0, 2], [0, 1, 3], [0]])  # row 0: tree slots 3, 5 kept; row 1: 5, 6, 8; row 2: 4
    assert runner.lengths.tolist() == [5, 8, 5]
    assert slots(cache, 0, 5, 0) == [[0, 1, 2, 3, 5]] * LAYERS
    assert slots(cache, 1, 8, 1) == [[0, 1, 2, 3, 4, 5, 6, 8]] * LAYERS
    assert slots(cache, 2, 5, 2) == [[0, 1, 2, 3, 4]] * LAYERS
    runner.keep([0, 2])  # row 1 finished: rows 0 and 2 go on untouched, row 2 now as row 1
    assert runner.lengths.tolist() == [5, 5] and cache.batch == 2
    assert all(layer.keys.shape[0] == 2 for layer in cache.slot_layers)
    assert slots(cache, 0, 5, 0) == [[0, 1, 2, 3, 5]] * LAYERS
    assert slots(cache, 1, 5, 2) == [[0, 1, 2, 3, 4]] * LAYERS
    assert (cache.shared_storage() is not None) == (shared is not None)
    cache.grow(40)  # reallocated: the entries stay (one buffer again when they share a shape)
    assert (cache.shared_storage() is not None) == (shared is not None)
    assert all(layer.keys.shape[2] == 40 for layer in cache.slot_layers)
    assert slots(cache, 1, 5, 2) == [[0, 1, 2, 3, 4]] * LAYERS


def test_length_groups_bound_the_padding():
    from spechead.inference.batch import length_groups

    assert length_groups([5, 5, 5]) == [[0, 1, 2]]
    assert length_groups([]) == []
    lengths = [28, 23, 54, 18, 23, 155, 23, 19]
    groups = length_groups(lengths)
    assert sorted(b for g in groups for b in g) == list(range(len(lengths)))  # every row once
    assert groups[0] == [5]  # the long outlier alone: the short rows do not pay for it
    for group in groups:
        real = sum(lengths[b] for b in group)
        assert len(group) * max(lengths[b] for b in group) <= 1.25 * real
    assert length_groups(lengths, waste=10.0) == [sorted(range(8), key=lambda b: -lengths[b])]
    assert [len(g) for g in length_groups([4] * 10)] == [8, 2]  # at most 8 rows a group


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_prefill_in_padded_groups_equals_each_row_alone(tiny_llama, kind):
    """Rows prefilled together (right-padded to the group's longest) get the logits, hidden states and
    K/V of their prompt prefilled alone: the padding never reaches a real token. Llama, and Qwen2 and
    Mistral with sliding windows (wider than the prompts) for other architectures' masks."""
    from spechead.inference.batch import length_groups

    from .test_runner import _sliding

    model = tiny_llama(64, layers=2, hidden=32, seed=2) if kind == "llama" else _sliding(kind, 24)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 64, (n,), generator=g) for n in (9, 7, 8, 2)]  # 9, 7, 8 in one group
    together = BatchRunner(model, (0, 1), max_length=32)
    logits, hidden = together.prefill(prompts)
    assert [len(group) for group in length_groups([p.numel() for p in prompts])] == [3, 1]
    for b, ids in enumerate(prompts):
        alone = BatchRunner(model, (0, 1), max_length=32)
        row_logits, row_hidden = alone.prefill([ids])
        torch.testing.assert_close(logits[b], row_logits[0], rtol=0, atol=1e-5)
        for layer in (0, 1):
            torch.testing.assert_close(hidden[b][layer], row_hidden[0][layer], rtol=0, atol=1e-5)
        assert together.cache is not None and alone.cache is not None
        for mine, theirs in zip(together.cache.slot_layers, alone.cache.slot_layers):
            t = ids.numel()
            torch.testing.assert_close(mine.keys[b, :, :t], theirs.keys[0, :, :t], rtol=0, atol=1e-5)
            torch.testing.assert_close(mine.values[b, :, :t], theirs.values[0, :, :t], rtol=0, atol=1e-5)
