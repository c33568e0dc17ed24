"""EAGLE losses on small hand-built tensors with known answers."""

from __future__ import annotations

import math

import pytest
import torch

from spechead.training.eagle_losses import eagle3_step_loss, eagle_loss, step_weights


def test_eagle_loss_known_values_and_masking() -> None:
    target_f = torch.zeros(1, 3, 2)
    pred_f = torch.tensor([[[0.5, 0.0], [3.0, 0.0], [float("nan"), 0.0]]], requires_grad=True)
    # SmoothL1 (beta 1): 0.5 -> 0.125, 3.0 -> 2.5; mean over H=2 -> 0.0625, 1.25; mean over 2 valid.
    pred_logits = torch.zeros(1, 3, 4, requires_grad=True)  # uniform: CE = log 4 whatever the target
    target_logits = torch.tensor([[[5.0, 0, 0, 0], [0, 0, 9.0, 0], [float("nan")] * 4]])
    valid = torch.tensor([[True, True, False]])  # the NaN row is masked out entirely
    loss, stats = eagle_loss(pred_f, target_f, pred_logits, target_logits, valid, ce_weight=0.1)
    feature = (0.0625 + 1.25) / 2
    assert stats["feature_loss"] == pytest.approx(feature)
    assert stats["ce_loss"] == pytest.approx(math.log(4))
    assert loss.item() == pytest.approx(feature + 0.1 * math.log(4))
    assert stats["count"] == 2 and stats["accuracy"] == pytest.approx(0.5)  # argmax 0 vs targets 0, 2
    loss.backward()
    assert torch.isfinite(pred_f.grad).all() and pred_f.grad[0, 2].abs().sum() == 0


def test_eagle_loss_sends_no_gradient_to_the_targets_side() -> None:
    """The target's features and logits are labels: a target tensor that requires grad gets none (the
    frozen target must not be trained through the head's loss), the prediction's side does."""
    g = torch.Generator().manual_seed(0)
    pred_f, target_f = (torch.randn(1, 3, 4, generator=g, requires_grad=True) for _ in range(2))
    pred_logits, target_logits = (torch.randn(1, 3, 6, generator=g, requires_grad=True) for _ in range(2))
    loss, _ = eagle_loss(pred_f, target_f, pred_logits, target_logits, torch.ones(1, 3, dtype=torch.bool))
    loss.backward()
    assert target_f.grad is None and target_logits.grad is None
    assert pred_f.grad.abs().sum() > 0 and pred_logits.grad.abs().sum() > 0


def test_eagle_loss_soft_ce_prefers_the_target_distribution() -> None:
    target_logits = torch.tensor([[[2.0, 1.0, 0.0]]])
    features = torch.zeros(1, 1, 2)
    valid = torch.ones(1, 1, dtype=torch.bool)
    _, matched = eagle_loss(features, features, target_logits, target_logits, valid)
    _, uniform = eagle_loss(features, features, torch.zeros(1, 1, 3), target_logits, valid)
    p = torch.softmax(target_logits[0, 0], -1)
    assert matched["ce_loss"] == pytest.approx(float(-(p * p.log()).sum()), abs=1e-6)  # the entropy
    assert uniform["ce_loss"] > matched["ce_loss"]


def test_eagle_loss_with_no_valid_position_is_zero_not_nan() -> None:
    pred = torch.randn(1, 2, 3, requires_grad=True)
    loss, stats = eagle_loss(
        pred, torch.randn(1, 2, 3), torch.randn(1, 2, 5), torch.randn(1, 2, 5), torch.zeros(1, 2)
    )
    assert loss.item() == 0.0 and stats["count"] == 0
    loss.backward()
    assert pred.grad is not None


def test_eagle3_step_loss_restricts_to_the_draft_vocab() -> None:
    t2d = torch.tensor([True, False, True, True])  # draft ids 0, 1, 2 = target ids 0, 2, 3
    p = torch.tensor([0.4, 0.3, 0.2, 0.1])
    target_logits = torch.stack(
        [
            p.log(),  # argmax 0: in the draft vocab
            torch.tensor([0.0, 5.0, 1.0, 0.0]),  # argmax 1: outside -> no loss, counted wrong
            torch.tensor([0.0, 0.0, 7.0, 0.0]),  # argmax 2 = draft id 1
            torch.tensor([9.0, 0.0, 0.0, 0.0]),  # masked by `valid`
        ]
    )[None]  # (1, 4, V)
    restricted = p[t2d] / p[t2d].sum()  # (0.4, 0.2, 0.1) / 0.7
    draft_logits = torch.stack(
        [restricted.log(), torch.tensor([3.0, 0.0, 0.0]), torch.tensor([0.0, 2.0, 0.0]), torch.zeros(3)]
    )[None].requires_grad_(True)  # (1, 4, Vd)
    valid = torch.tensor([[True, True, True, False]])
    loss, correct, count = eagle3_step_loss(draft_logits, target_logits, t2d, valid)
    entropy = float(-(restricted * restricted.log()).sum())  # row 0: draft equals the restricted target
    row2 = float(
        -(
            torch.softmax(target_logits[0, 2, t2d], -1) * torch.log_softmax(draft_logits[0, 2].detach(), -1)
        ).sum()
    )
    assert loss.item() == pytest.approx((entropy + row2) / 2, abs=1e-6)
    assert int(correct) == 2 and int(count) == 3  # rows 0 and 2 right, row 1 impossible
    loss.backward()
    assert draft_logits.grad[0, 1].abs().sum() == 0 and draft_logits.grad[0, 3].abs().sum() == 0


def test_eagle3_step_loss_bf16_empty_and_bad_shapes() -> None:
    t2d = torch.tensor([True, True, False])
    draft = torch.randn(2, 3, 2, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randn(2, 3, 3, dtype=torch.bfloat16)
    loss, correct, count = eagle3_step_loss(draft, target, t2d, torch.ones(2, 3, dtype=torch.bool))
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    loss, correct, count = eagle3_step_loss(draft, target, t2d, torch.zeros(2, 3, dtype=torch.bool))
    assert loss.item() == 0.0 and int(count) == 0 and int(correct) == 0
    with pytest.raises(ValueError, match="t2d marks"):
        eagle3_step_loss(torch.randn(1, 1, 3), torch.randn(1, 1, 3), t2d, torch.ones(1, 1))


def test_step_weights() -> None:
    assert step_weights(3) == pytest.approx([1.0, 0.8, 0.64])
    assert step_weights(2, decay=0.5) == [1.0, 0.5]
    with pytest.raises(ValueError):
        step_weights(0)
