"""Medusa loss on hand-built logits: t+2+k alignment, masking, padding, empty heads, weights."""

from __future__ import annotations

import math

import pytest
import torch

from spechead.training.losses import medusa_loss, medusa_weights, shifted_targets

V = 4
C = math.log(3.0)  # logit C on one token of 4: that token has p = 3/6, each other p = 1/6
# Right-padded batch of 2. Row 0: targets at 2..4, position 5 is padding.
INPUT_IDS = torch.tensor([[1, 2, 3, 0, 1, 2], [3, 1, 0, 2, 0, 0]])
LOSS_MASK = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 0, 0]])


def build_logits(num_heads: int, wrong: set[tuple[int, int, int]] = frozenset()) -> list[torch.Tensor]:
    """Head k at (b, t) puts C on input_ids[b, t+2+k] (or the next id if (k, b, t) in `wrong`).

    Positions without a valid target get a huge logit on a wrong token: they must not count.
    """
    batch, seq = INPUT_IDS.shape
    logits = []
    for k in range(num_heads):
        x = torch.zeros(batch, seq, V)
        for b in range(batch):
            for t in range(seq):
                j = t + 2 + k
                if j < seq and LOSS_MASK[b, j]:
                    token = int(INPUT_IDS[b, j]) + ((k, b, t) in wrong)
                    x[b, t, token % V] = C
                else:
                    x[b, t, 0] = 1e4
        logits.append(x)
    return logits


LOG2, LOG6 = math.log(2.0), math.log(6.0)


def test_alignment_masking_and_padding_give_the_hand_computed_loss() -> None:
    # Valid (b, t) per head: head0 {(0,0),(0,1),(0,2),(1,0),(1,1)}, head1 {(0,0),(0,1),(1,0)},
    # head2 {(0,0)}, head3 none (t+5 is padding in both rows). One wrong head-0 guess: (0, 1).
    logits = build_logits(4, wrong={(0, 0, 1)})
    weights = [1.0, 0.5, 0.25, 0.125]
    loss, per_head = medusa_loss(logits, INPUT_IDS, LOSS_MASK, weights)
    expected = torch.tensor([(4 * LOG2 + LOG6) / 5, LOG2, LOG2, 0.0])
    torch.testing.assert_close(per_head, expected)
    torch.testing.assert_close(loss, (expected * torch.tensor(weights)).sum())
    assert not per_head.requires_grad


def test_empty_head_contributes_zero_and_zero_grads_not_nan() -> None:
    logits = [x.requires_grad_() for x in build_logits(4)]
    loss, per_head = medusa_loss(logits, INPUT_IDS, LOSS_MASK, medusa_weights(4))
    loss.backward()
    assert per_head[3] == 0 and torch.isfinite(loss)
    assert logits[3].grad is not None and torch.equal(logits[3].grad, torch.zeros_like(logits[3]))
    assert logits[0].grad.abs().sum() > 0


def test_all_masked_batch_is_zero() -> None:
    loss, per_head = medusa_loss(build_logits(2), INPUT_IDS, torch.zeros_like(LOSS_MASK), [1.0, 1.0])
    assert loss.item() == 0.0 and torch.equal(per_head, torch.zeros(2))


def test_shifted_targets_and_bad_arguments() -> None:
    targets, valid = shifted_targets(INPUT_IDS, LOSS_MASK, offset=2, seq_len=6)
    assert targets[0].tolist() == [3, 0, 1, 2, 0, 0]
    assert valid[0].tolist() == [True, True, True, False, False, False]
    with pytest.raises(ValueError, match="2 loss weights for 3 heads"):
        medusa_loss(build_logits(3), INPUT_IDS, LOSS_MASK, [1.0, 1.0])
    with pytest.raises(ValueError, match="logits cover 7 positions"):
        medusa_loss([torch.zeros(2, 7, V)], INPUT_IDS, LOSS_MASK, [1.0])


def test_shifted_targets_of_logits_shorter_than_the_inputs() -> None:
    """Logits over the first 3 of 6 positions: all 3 targets exist (t + 2 <= 4 < 6), the last included."""
    targets, valid = shifted_targets(INPUT_IDS, LOSS_MASK, offset=2, seq_len=3)
    assert targets.tolist() == [[3, 0, 1], [0, 2, 0]]
    assert valid.tolist() == [[True, True, True], [True, True, False]]
    targets, valid = shifted_targets(INPUT_IDS, LOSS_MASK, offset=4, seq_len=2)  # exactly the last two
    assert targets.tolist() == [[1, 2], [0, 0]] and valid.tolist() == [[True, False], [False, False]]


def test_medusa_weights_decay() -> None:
    assert medusa_weights(3) == pytest.approx([1.0, 0.8, 0.64])
    assert medusa_weights(2, decay=0.5) == [1.0, 0.5]
