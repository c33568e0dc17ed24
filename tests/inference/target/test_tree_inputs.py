"""The tree inputs built on the device (ancestors, masks, positions) equal the Python oracles'
(tests/inference/trees.py), and the batched greedy acceptance over them equals the per-tree walk."""

from __future__ import annotations

import pytest
import torch

from spechead.inference.acceptance import greedy_accept
from spechead.inference.queued_acceptance import QueuedAcceptance
from spechead.inference.tree import TokenTree, ancestors_on_device, tree_inputs_on_device

from ..trees import ancestor_mask, depths
from .test_runner import random_tree


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 17, 40])
def test_device_tree_inputs_equal_python_ones(n):
    for seed in range(3):
        parents = random_tree(n, seed).parents
        anc = ancestors_on_device(parents[None])[0]
        assert torch.equal(anc, ancestor_mask(parents))
        mask, positions, _ = tree_inputs_on_device(parents[None], 7, torch.float32)
        assert mask.shape == (1, 1, n, 7 + n) and (mask[..., :7] == 0).all()  # the prefix: visible
        assert torch.equal(mask[0, 0, :, 7:] == 0, ancestor_mask(parents))  # the tree: ancestors + self
        assert torch.equal(positions[0], depths(parents) + 7)


def test_the_device_greedy_rule_equals_greedy_accept():
    g = torch.Generator().manual_seed(0)
    for seed in range(30):
        tree = random_tree(1 + seed % 13, seed)
        logits = torch.randn(tree.size, 6, generator=g)
        tree = TokenTree(tree.tokens % 6, tree.parents)
        if seed % 2:  # make many nodes match their parent's argmax
            best = logits.argmax(-1)
            tree = TokenTree(torch.cat([tree.tokens[:1], best[tree.parents[1:]]]), tree.parents)
        anc = ancestors_on_device(tree.parents[None])
        got = QueuedAcceptance.greedy(tree.tokens[None], tree.parents[None], anc, logits[None]).result()[0]
        assert got == greedy_accept(tree, logits)
        assert got.path_tokens == tree.tokens[got.path].tolist()  # brought back in the same transfer
