"""Prompts of several rows prefilled in groups of similar lengths (right-padded to the group's longest):
each row gets the logits, hidden states and K/V of its prompt prefilled alone, and the groups bound the
padding."""

from __future__ import annotations

import pytest
import torch

from spechead.inference.target.prefill import length_groups
from spechead.inference.target.runner import TargetRunner

from .test_sliding_passes import _sliding


def test_length_groups_bound_the_padding():
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


@pytest.mark.parametrize("compile", [False, "graphs"], ids=["eager", "graphs"])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_prefill_in_padded_groups_equals_each_row_alone(tiny_llama, kind, compile):
    """Rows prefilled together (right-padded to the group's longest) get the logits, hidden states and
    K/V of their prompt prefilled alone (a batch of one, written straight into its row). Llama, and
    Qwen2 and Mistral with sliding windows (wider than the prompts) for other architectures' masks; the
    compiled runner's rows too (its idle fourth row left empty)."""
    model = tiny_llama(64, layers=2, hidden=32, seed=2) if kind == "llama" else _sliding(kind, 24)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 64, (n,), generator=g) for n in (9, 7, 8, 2)]  # 9, 7, 8 in one group
    together = TargetRunner(model, (0, 1), max_length=32, compile=compile)
    logits, hidden = together.prefill(prompts)
    assert [len(group) for group in length_groups([p.numel() for p in prompts])] == [3, 1]
    assert together.lengths == [9, 7, 8, 2]
    for b, ids in enumerate(prompts):
        alone = TargetRunner(model, (0, 1), max_length=32)
        row_logits, row_hidden = alone.prefill([ids])
        torch.testing.assert_close(logits[b], row_logits[0], rtol=0, atol=1e-5)
        for layer in (0, 1):
            torch.testing.assert_close(hidden[b][layer], row_hidden[0][layer], rtol=0, atol=1e-5)
        for mine, theirs in zip(together.cache.row_layers, alone.cache.row_layers):
            t = ids.numel()
            torch.testing.assert_close(mine.keys[b, :, :t], theirs.keys[0, :, :t], rtol=0, atol=1e-5)
            torch.testing.assert_close(mine.values[b, :, :t], theirs.values[0, :, :t], rtol=0, atol=1e-5)
