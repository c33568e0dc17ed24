"""Right padding and masks of the Collator on known features."""

from __future__ import annotations

import pytest
import torch

from spechead.data.collate import Collator

FEATURES = [
    {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]},
    {"input_ids": [8], "loss_mask": [1]},
]


def test_right_pads_to_the_longest():
    batch = Collator(pad_token_id=0)(FEATURES)
    assert set(batch) == {"input_ids", "attention_mask", "loss_mask"}
    assert all(t.dtype == torch.long and t.shape == (2, 3) for t in batch.values())
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]


def test_pad_to_multiple_of_and_pad_id():
    batch = Collator(pad_token_id=9, pad_to_multiple_of=4)(FEATURES)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 9], [8, 9, 9, 9]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1, 0], [1, 0, 0, 0]]
    assert Collator(pad_token_id=9, pad_to_multiple_of=4)([FEATURES[1]] * 2)["input_ids"].shape == (2, 4)
    # already a multiple: no extra padding
    assert Collator(pad_token_id=9, pad_to_multiple_of=3)(FEATURES)["input_ids"].shape == (2, 3)


def test_accepts_tensors_and_ignores_extra_keys():
    feats = [
        {"input_ids": torch.tensor(f["input_ids"]), "loss_mask": torch.tensor(f["loss_mask"]), "id": i}
        for i, f in enumerate(FEATURES)
    ]
    assert Collator(pad_token_id=0)(feats)["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]


def test_rejects_bad_batches():
    with pytest.raises(ValueError, match="empty batch"):
        Collator(pad_token_id=0)([])
    with pytest.raises(ValueError, match="lengths differ"):
        Collator(pad_token_id=0)([{"input_ids": [1, 2], "loss_mask": [1]}])
