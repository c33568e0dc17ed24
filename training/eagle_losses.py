"""EAGLE-1/2 and EAGLE-3 training losses (pure functions on already-aligned tensors).

Alignment the caller does:
- EAGLE-1/2: the head's prediction at position t is the feature of position t + 1, so compare
  pred_features[:, t] with the target's final normed feature at t + 1, and the head's logits at t with
  the target's logits at t + 1 (both predict x_{t+2}); `valid` marks t where x_{t+2} is a loss token.
- EAGLE-3: the logits of TTT step j at position t also predict x_{t+2}: compare them with the target's
  logits at t + 1; `valid` = ttt_valid(attention_mask, j) & loss_mask at t + 2.
Every mean is over valid positions; an empty batch gives 0 (still in the graph), never NaN.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _fp32(x: Tensor) -> Tensor:
    # bf16 log-softmax over a large vocabulary is coarse; losses are computed in (at least) fp32.
    return x.to(torch.promote_types(x.dtype, torch.float32))


def soft_cross_entropy(logits: Tensor, target_probs: Tensor) -> Tensor:
    """Per-row CE -sum p * log_softmax(logits): logits, target_probs (N, V) -> (N,)."""
    return -(target_probs * F.log_softmax(_fp32(logits), dim=-1)).sum(dim=-1)


def eagle_loss(
    pred_features: Tensor,
    target_features: Tensor,
    pred_logits: Tensor,
    target_logits: Tensor,
    valid: Tensor,
    feature_weight: float = 1.0,
    ce_weight: float = 0.1,
) -> tuple[Tensor, dict[str, float]]:
    """EAGLE-1/2 loss: feature_weight * SmoothL1(features) + ce_weight * soft CE to softmax(target).

    pred_features, target_features: (B, T, H); pred_logits, target_logits: (B, T, V); valid: (B, T)
    bool, already aligned (see the module docstring). SmoothL1 is averaged over H, the CE summed over
    V, both then averaged over valid positions. Returns (scalar loss, {loss, feature_loss, ce_loss,
    accuracy, count}); accuracy = top-1 of pred_logits equals the target's top-1.
    """
    valid = valid.bool()
    count = int(valid.sum())
    denom = max(count, 1)
    pred_f, target_f = _fp32(pred_features[valid]), _fp32(target_features[valid]).detach()  # (N, H)
    feature_loss = F.smooth_l1_loss(pred_f, target_f, reduction="none").mean(dim=-1).sum() / denom
    rows, target_rows = pred_logits[valid], target_logits[valid].detach()  # (N, V)
    target_probs = F.softmax(_fp32(target_rows), dim=-1)
    ce_loss = soft_cross_entropy(rows, target_probs).sum() / denom
    loss = feature_weight * feature_loss + ce_weight * ce_loss
    with torch.no_grad():
        correct = int((rows.argmax(dim=-1) == target_rows.argmax(dim=-1)).sum())
    stats = {
        "loss": float(loss.detach()),
        "feature_loss": float(feature_loss.detach()),
        "ce_loss": float(ce_loss.detach()),
        "accuracy": correct / denom,
        "count": float(count),
    }
    return loss, stats


def eagle3_step_loss(
    draft_logits: Tensor, target_logits: Tensor, t2d: Tensor, valid: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """One TTT step's loss: CE to the target distribution restricted to the draft vocab.

    draft_logits (B, T, Vd); target_logits (B, T, V); t2d (V,) bool (draft ids follow target-id
    order); valid (B, T) bool, aligned. The soft target is softmax(target_logits[..., t2d]), i.e. the
    target distribution renormalised over draft tokens (forward KL up to the target's entropy).
    Positions whose target argmax is outside the draft vocab are left out of the loss, which is the
    mean over the remaining positions. Returns (loss, correct, count) with correct = draft top-1
    (as a target id) equals the target top-1, counted over ALL valid positions (count), so
    correct / count is the step's acceptance proxy. Call once per step: only (N, V) rows of one step
    are ever materialised in fp32.
    """
    valid = valid.bool()
    t2d = t2d.bool().to(target_logits.device)
    if t2d.shape[0] != target_logits.shape[-1] or int(t2d.sum()) != draft_logits.shape[-1]:
        raise ValueError(
            f"t2d marks {int(t2d.sum())} of {t2d.shape[0]} tokens but draft logits have "
            f"{draft_logits.shape[-1]} and target logits {target_logits.shape[-1]} entries"
        )
    rows = draft_logits[valid]  # (N, Vd)
    target_rows = target_logits[valid].detach()  # (N, V)
    target_top = target_rows.argmax(dim=-1)  # (N,) target ids
    in_draft = t2d[target_top]  # (N,)
    target_probs = F.softmax(_fp32(target_rows[in_draft][:, t2d]), dim=-1)  # (M, Vd)
    ce = soft_cross_entropy(rows[in_draft], target_probs)  # (M,)
    loss = ce.sum() / max(int(in_draft.sum()), 1)
    with torch.no_grad():
        draft_vocab = t2d.nonzero().squeeze(-1)  # (Vd,) target id of each draft id
        correct = (draft_vocab[rows.argmax(dim=-1)] == target_top).sum()
    count = torch.tensor(int(valid.sum()), device=correct.device)
    return loss, correct, count


def step_weights(steps: int, decay: float = 0.8) -> list[float]:
    """Per-step TTT loss weights decay**j: deeper steps are harder and matter less for acceptance."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    return [decay**j for j in range(steps)]
