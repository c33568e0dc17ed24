"""EAGLE-3 draft vocabulary: the most frequent target tokens on loss-masked positions.

d2t (Vd,) long holds offsets (target_id = draft_id + d2t[draft_id]); t2d (V,) bool marks the target
tokens in the draft vocab. Draft ids follow target-id order, as in published EAGLE-3 heads.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from spechead.heads.eagle3 import draft_to_target, target_to_draft
from spechead.training.errors import TrainError

__all__ = ["build_draft_vocab", "draft_to_target", "target_to_draft", "token_frequencies"]


def token_frequencies(examples: Iterable[Any], vocab_size: int) -> Tensor:
    """Count tokens at loss-masked positions: -> LongTensor (V,).

    `examples` yields mappings with `input_ids` and `loss_mask` (lists or tensors, any matching
    shape, e.g. one sequence or a padded batch), or is a collection of such iterables (several
    datasets): an item that is not a mapping is iterated in turn.
    """
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for item in examples:
        if isinstance(item, (str, bytes)):
            raise TrainError(
                f"token_frequencies needs mappings with input_ids and loss_mask, got {item!r:.40}"
            )
        if not isinstance(item, Mapping):
            counts += token_frequencies(item, vocab_size)
            continue
        ids = torch.as_tensor(item["input_ids"], dtype=torch.long).flatten()
        mask = torch.as_tensor(item["loss_mask"]).flatten() != 0
        if ids.shape != mask.shape:
            raise TrainError(
                f"input_ids ({ids.numel()} tokens) and loss_mask ({mask.numel()}) differ in length"
            )
        ids = ids[mask].cpu()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            raise TrainError(
                f"token id {int(ids.max()) if int(ids.max()) >= vocab_size else int(ids.min())} is outside "
                f"the target vocabulary 0..{vocab_size - 1}: the data was tokenized for another model"
            )
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def build_draft_vocab(freqs: Tensor, draft_vocab_size: int) -> tuple[Tensor, Tensor, float]:
    """Top `draft_vocab_size` tokens by frequency -> (d2t (Vd,) long, t2d (V,) bool, coverage).

    Ties go to the lower id; with fewer distinct tokens than Vd the lowest unused ids fill the rest,
    so the size is exact; Vd == V is the identity. coverage = fraction of counted (loss-masked)
    tokens inside the draft vocab.
    """
    freqs = torch.as_tensor(freqs, dtype=torch.long).cpu()
    vocab_size = freqs.numel()
    if draft_vocab_size > vocab_size:
        raise TrainError(
            f"head.draft_vocab_size = {draft_vocab_size} is larger than the target vocabulary ({vocab_size}): "
            f"set head.draft_vocab_size <= {vocab_size}"
        )
    if draft_vocab_size < 1:
        raise TrainError(f"head.draft_vocab_size must be >= 1, got {draft_vocab_size}")
    total = int(freqs.sum())
    if draft_vocab_size < vocab_size and total == 0:
        raise TrainError(
            "no loss-masked tokens to count: cannot pick a draft vocabulary (check the data's loss_mask)"
        )
    # A stable sort on -freq keeps ids ascending among equal counts (zero counts included).
    order = torch.sort(-freqs, stable=True).indices
    chosen = order[:draft_vocab_size].sort().values  # (Vd,) target ids in id order
    d2t = chosen - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    coverage = float(freqs[chosen].sum()) / total if total else 1.0
    return d2t, t2d, coverage
