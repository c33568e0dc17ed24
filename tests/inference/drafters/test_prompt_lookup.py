"""Prompt lookup: the continuation of the LONGEST suffix n-gram seen before, its MOST RECENT earlier
occurrence, and the drafter's history (prompt, then every emitted token once)."""

from __future__ import annotations

import pytest
import torch

from spechead.inference.drafters.prompt_lookup import PromptLookupDrafter, lookup
from spechead.inference.sampling import SamplingParams


def test_the_longest_suffix_ngram_wins():
    """Suffix [1, 2, 3] occurred at the start (followed by 9, 5): that beats the more recent 1-gram [3]."""
    tokens = [1, 2, 3, 9, 5, 3, 7, 1, 2, 3]
    assert lookup(tokens, max_ngram=3, min_ngram=1, num_draft=4) == [9, 5, 3, 7]
    assert lookup(tokens, max_ngram=1, min_ngram=1, num_draft=2) == [7, 1]  # 1-grams only: [3] at 5
    assert lookup([1, 2, 3, 4], max_ngram=3, min_ngram=1, num_draft=4) == []  # no n-gram repeats


def test_the_most_recent_occurrence_wins():
    """[4] occurred at 0 (then 8) and at 2 (then 6): the later one is the continuation."""
    assert lookup([4, 8, 4, 6, 4], max_ngram=1, min_ngram=1, num_draft=2) == [6, 4]
    assert lookup([4, 8, 4, 6, 4], max_ngram=2, min_ngram=2, num_draft=2) == []  # [6, 4] never before


def test_the_drafter_lists_every_emitted_token_once():
    """accept(tokens = root + accepted drafts, next_root) appends the drafts and the next root: the root
    is listed already, so the history is exactly the sequence and its n-grams are the sequence's."""
    drafter = PromptLookupDrafter(max_ngram=2, min_ngram=1, num_draft=3)
    drafter.start(torch.tensor([5, 6, 7, 5]), {}, 6)
    assert drafter.tokens == [5, 6, 7, 5, 6]
    draft = drafter.propose(6, SamplingParams(), None)  # suffix [5, 6] at 0: then 7, 5, 6
    assert draft.tree.tokens.tolist() == [6, 7, 5, 6] and draft.tree.parents.tolist() == [-1, 0, 1, 2]
    drafter.accept(torch.tensor([6, 7]), {}, 8)
    assert drafter.tokens == [5, 6, 7, 5, 6, 7, 8]
    assert drafter.propose(8, SamplingParams(), None).tree.tokens.tolist() == [8]  # 8 is new: no draft


def test_a_drafter_without_a_tree_of_ranks_is_never_given_another_tree():
    """Only heads (`tunes_tree`) swap their static tree; `with_tree` on another drafter says so."""
    drafter = PromptLookupDrafter()
    assert not drafter.tunes_tree
    with pytest.raises(NotImplementedError, match="PromptLookupDrafter has no tree of ranks"):
        drafter.with_tree([[0]])
