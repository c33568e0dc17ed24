"""Medusa-1: heads on the frozen target's final hidden state, cross-entropy against the data tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from spechead.heads.medusa import MedusaConfig, MedusaHead
from spechead.training.losses import medusa_loss, medusa_weights
from spechead.training.metrics import (
    chain_counts,
    chain_summary,
    counts_to_accuracy,
    medusa_chains,
    medusa_topk_counts,
    walked_counts,
)
from spechead.training.objectives.base import Objective, Recipe, mean_metric


@dataclass
class MedusaLossConfig:
    """Head k is weighted `decay**k`; accuracies are reported at `topk`."""

    decay: float = 0.8
    topk: list[int] = field(default_factory=lambda: [1, 5])


def medusa_counts(
    logits: list[torch.Tensor], batch: dict, topk: list[int], target_logits: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """Summable accuracy (vs the data) and chain-acceptance counts of K head logits (B, T, V).

    The simulated tau compares head k at t with the target's greedy token at t + 1 + k (temperature
    0 acceptance) when `target_logits` (B, T, V) are given, else with the data token.
    """
    correct, total = medusa_topk_counts(logits, batch["input_ids"], batch["loss_mask"], tuple(topk))
    accepted = batch["input_ids"]
    if target_logits is not None:  # token t+1 := the target's argmax at t
        greedy = target_logits.argmax(-1)  # (B, T)
        accepted = torch.cat([accepted[:, :1], greedy[:, :-1]], dim=1)
    right, anchor = medusa_chains(logits, accepted, batch["loss_mask"])  # (K, B, T), (B, T)
    return {
        "correct": correct,  # (K, len(topk))
        "total": total,  # (K,)
        **chain_counts(right[:, anchor].cpu()),
        **walked_counts(right, anchor),  # the anchor's root (t + 1) is an answer token
    }


def medusa_summary(counts: dict[str, torch.Tensor], topk: list[int]) -> dict[str, float]:
    """Per-head top-k accuracy and simulated chain tau from summed counts."""
    acc = counts_to_accuracy(counts["correct"], counts["total"])  # (K, len(topk))
    out = {f"acc/head{k}_top{kk}": float(acc[k, j]) for k in range(acc.shape[0]) for j, kk in enumerate(topk)}
    out.update(chain_summary(counts))
    return out


class MedusaObjective(Objective):
    """Medusa-1 on a frozen target."""

    def __init__(self, head: MedusaHead, loss_cfg: MedusaLossConfig):
        self.head = head
        self.cfg = loss_cfg
        self.weights = medusa_weights(head.config.num_heads, loss_cfg.decay)

    def loss(self, model, target, batch, step):
        logits = model(self.capture(target, batch).hidden[0])  # K x (B, T, V)
        loss, per_head = medusa_loss(logits, batch["input_ids"], batch["loss_mask"], self.weights)
        return loss, {f"loss/head{k}": float(v) for k, v in enumerate(per_head)}

    def eval_counts(self, model, target, batch):
        # Evaluation also reads the target's logits: tau counts acceptance of its greedy tokens.
        cap = target.capture_batch(batch, self.layers, with_logits=True)
        logits = model(cap.hidden[0].to(next(self.head.parameters()).dtype))
        loss, _ = medusa_loss(logits, batch["input_ids"], batch["loss_mask"], self.weights)
        rows = torch.tensor(float(batch["input_ids"].shape[0]))
        counts = medusa_counts(logits, batch, self.cfg.topk, cap.logits)
        return {"loss_sum": loss.detach().cpu() * rows, "batches": rows, **counts}

    def summarize(self, counts):
        return {"loss": mean_metric(counts, "loss_sum", "batches"), **medusa_summary(counts, self.cfg.topk)}


RECIPE = Recipe(
    MedusaConfig, MedusaLossConfig, lambda head, target, loss, sections, data: MedusaObjective(head, loss)
)
