"""Draft vocabulary: frequencies on loss-masked tokens, top-Vd selection, mapping round trips."""

from __future__ import annotations

import pytest
import torch

from spechead.heads import load_head
from spechead.heads.eagle3 import Eagle3Config, Eagle3Head
from spechead.training.draft_vocab import (
    build_draft_vocab,
    draft_to_target,
    target_to_draft,
    token_frequencies,
)
from spechead.training.errors import TrainError

V = 10


def test_token_frequencies_count_loss_masked_tokens_only() -> None:
    examples = [
        {"input_ids": [1, 2, 2, 3], "loss_mask": [0, 1, 1, 1]},  # token 1 is a prompt token
        {"input_ids": torch.tensor([[4, 4], [2, 9]]), "loss_mask": torch.tensor([[1, 1], [1, 0]])},
    ]
    counts = token_frequencies(examples, V)
    assert counts.dtype == torch.long and counts.tolist() == [0, 0, 3, 1, 2, 0, 0, 0, 0, 0]
    # Several datasets (iterables of examples) add up.
    assert torch.equal(
        token_frequencies([examples, examples[:1]], V), counts + token_frequencies(examples[:1], V)
    )
    with pytest.raises(TrainError, match="outside the target vocabulary"):
        token_frequencies([{"input_ids": [V], "loss_mask": [1]}], V)
    with pytest.raises(TrainError, match="differ in length"):
        token_frequencies([{"input_ids": [1, 2], "loss_mask": [1]}], V)


def test_build_draft_vocab_top_tokens_ties_and_coverage() -> None:
    freqs = torch.tensor([0, 5, 1, 5, 0, 9, 1, 0, 0, 0])
    d2t, t2d, coverage = build_draft_vocab(freqs, 4)
    chosen = torch.arange(4) + d2t
    assert chosen.tolist() == [1, 2, 3, 5]  # 9, 5, 5, then the tie 1 vs 1 goes to the lower id 2
    assert t2d.nonzero().squeeze(-1).tolist() == [1, 2, 3, 5] and t2d.dtype == torch.bool
    assert coverage == pytest.approx(20 / 21)


def test_build_draft_vocab_fills_with_lowest_unused_ids_and_identity() -> None:
    freqs = torch.zeros(V, dtype=torch.long)
    freqs[7] = 3
    d2t, t2d, coverage = build_draft_vocab(freqs, 3)
    assert (torch.arange(3) + d2t).tolist() == [0, 1, 7] and coverage == 1.0
    d2t, t2d, _ = build_draft_vocab(freqs, V)
    assert torch.equal(d2t, torch.zeros(V, dtype=torch.long)) and bool(t2d.all())


def test_build_draft_vocab_errors_name_the_setting() -> None:
    with pytest.raises(TrainError, match="head.draft_vocab_size"):
        build_draft_vocab(torch.ones(V, dtype=torch.long), V + 1)
    with pytest.raises(TrainError, match="head.draft_vocab_size"):
        build_draft_vocab(torch.ones(V, dtype=torch.long), 0)
    with pytest.raises(TrainError, match="no loss-masked tokens"):
        build_draft_vocab(torch.zeros(V, dtype=torch.long), 3)


def test_round_trip_and_head_save_load(tiny_llama, tmp_path) -> None:
    freqs = torch.tensor([3, 0, 8, 1, 0, 2, 2, 0, 5, 4, 7, 0])
    d2t, t2d, _ = build_draft_vocab(freqs, 6)
    in_vocab = t2d.nonzero().squeeze(-1)
    assert torch.equal(draft_to_target(target_to_draft(in_vocab, t2d), d2t), in_vocab)
    assert torch.equal(target_to_draft(draft_to_target(torch.arange(6), d2t), t2d), torch.arange(6))
    assert (target_to_draft((~t2d).nonzero().squeeze(-1), t2d) == -1).all()

    target = tiny_llama(12, layers=4, hidden=32)
    head = Eagle3Head(Eagle3Config.from_target(target.config, draft_vocab_size=6)).set_draft_vocab(d2t, t2d)
    head.save_pretrained(tmp_path)
    loaded = load_head(tmp_path)
    assert torch.equal(loaded.d2t, d2t) and torch.equal(loaded.t2d, t2d)
    assert torch.equal(loaded.draft_to_target(torch.arange(6)), in_vocab)
