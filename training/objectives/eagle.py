"""EAGLE-1 (and EAGLE-2, the same head): predict the target's next feature, read logits through its lm_head.

Alignment: the head output at t (from f_t and x_{t+1}) is the predicted f_{t+1}; it is regressed on the
target's f_{t+1} and its logits are scored against the target's distribution at t + 1 (token x_{t+2}).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spechead.heads.eagle import EagleConfig, EagleHead
from spechead.heads.unroll import ttt_forward, ttt_valid
from spechead.training.eagle_losses import eagle_loss
from spechead.training.metrics import align_chain, answer_roots, chain_counts, chain_summary, walked_counts
from spechead.training.objectives.base import Objective, Recipe, mean_metric


@dataclass
class EagleLossConfig:
    """`head.loss.*` for EAGLE-1."""

    feature_weight: float = 1.0  # SmoothL1 on the predicted feature
    ce_weight: float = 0.1  # soft cross-entropy to the target distribution
    noise: float = 0.2  # width of the uniform noise added to input features while training
    chain_depth: int = 5  # draft depth of the simulated acceptance length at evaluation


def shift_left(x: torch.Tensor) -> torch.Tensor:
    """x[:, t+1] at t (last position zero): (B, T, ...) -> (B, T, ...)."""
    return torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], dim=1)


def next_token_valid(batch: dict) -> torch.Tensor:
    """(B, T) bool: the head output at t predicts x_{t+2}, an assistant token that exists."""
    mask = batch["loss_mask"].bool()
    return torch.cat([mask[:, 2:], torch.zeros_like(mask[:, :2])], dim=1)


def greedy_chain_tau(
    outputs: list[torch.Tensor], logits_fn, target_logits: torch.Tensor, batch: dict
) -> dict[str, torch.Tensor]:
    """Summable simulated-tau counts of unrolled drafts vs the target's greedy token (temperature 0)."""
    target_next = shift_left(target_logits.argmax(-1))  # (B, T): target's argmax for x_{t+2}
    predicted = next_token_valid(batch)
    correct = []
    for j, out in enumerate(outputs):
        hit = logits_fn(out).argmax(-1) == target_next
        correct.append(hit & predicted & ttt_valid(batch["attention_mask"], j))
    anchors = predicted & ttt_valid(batch["attention_mask"], 0)
    chains = align_chain(correct)  # (D, B, T)
    return {**chain_counts(chains[:, anchors]), **walked_counts(chains, anchors & answer_roots(batch))}


class EagleObjective(Objective):
    """EAGLE-1 on a frozen target: feature regression + soft CE, uniform noise on input features."""

    needs_logits = True

    def __init__(self, head: EagleHead, cfg: EagleLossConfig):
        self.head = head
        self.cfg = cfg

    def _losses(self, model, target, batch, noise: float):
        cap = self.capture(target, batch)
        features = cap.hidden[0]  # (B, T, H)
        if noise > 0:
            features = features + (torch.rand_like(features) - 0.5) * noise
        pred = model(features, shift_left(batch["input_ids"]), attention_mask=batch["attention_mask"])
        valid = next_token_valid(batch)
        loss, stats = eagle_loss(
            pred,
            shift_left(cap.hidden[0]),
            self.head.logits(pred),
            shift_left(cap.logits),
            valid,
            self.cfg.feature_weight,
            self.cfg.ce_weight,
        )
        return loss, stats, cap

    def loss(self, model, target, batch, step):
        loss, stats, _ = self._losses(model, target, batch, self.cfg.noise)
        return loss, {k: float(v) for k, v in stats.items() if k != "count"}

    def eval_counts(self, model, target, batch):
        loss, stats, cap = self._losses(model, target, batch, 0.0)
        count = torch.tensor(float(stats["count"]))
        outputs = ttt_forward(
            self.head, cap.hidden[0], batch["input_ids"], batch["attention_mask"], self.cfg.chain_depth
        )
        return {
            "loss_sum": loss.detach().cpu() * count,
            "feature_sum": torch.tensor(float(stats["feature_loss"])) * count,
            "correct": torch.tensor(float(stats["accuracy"])) * count,
            "count": count,
            **greedy_chain_tau(outputs, self.head.logits, cap.logits, batch),
        }

    def summarize(self, counts):
        return {
            "loss": mean_metric(counts, "loss_sum", "count"),
            "feature_loss": mean_metric(counts, "feature_sum", "count"),
            "acc/step0_top1": mean_metric(counts, "correct", "count"),
            **chain_summary(counts),
        }


RECIPE = Recipe(
    EagleConfig, EagleLossConfig, lambda head, target, loss, sections, data: EagleObjective(head, loss)
)
