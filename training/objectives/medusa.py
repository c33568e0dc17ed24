"""Medusa-1: heads on the frozen target's final hidden state, cross-entropy against the data tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from spechead.heads.medusa import MedusaHead
from spechead.training.losses import medusa_loss, medusa_weights
from spechead.training.metrics import (
    counts_to_accuracy,
    medusa_top1_correct,
    medusa_topk_counts,
    simulated_chain_tau,
)
from spechead.training.objectives.base import Objective, mean_metric


@dataclass
class MedusaLossConfig:
    """Head k is weighted `decay**k`; accuracies are reported at `topk`."""

    decay: float = 0.8
    topk: list[int] = field(default_factory=lambda: [1, 5])


def medusa_counts(logits: list[torch.Tensor], batch: dict, topk: list[int]) -> dict[str, torch.Tensor]:
    """Summable accuracy and chain-acceptance counts of K head logits (B, T, V) on one batch."""
    correct, total = medusa_topk_counts(logits, batch["input_ids"], batch["loss_mask"], tuple(topk))
    chain = medusa_top1_correct(logits, batch["input_ids"], batch["loss_mask"])  # (K, N)
    return {
        "correct": correct,  # (K, len(topk))
        "total": total,  # (K,)
        # tau is a mean over positions: carry its sum and count so batches and ranks add up.
        "tau_sum": torch.tensor(simulated_chain_tau(chain) * chain.shape[1]),
        "positions": torch.tensor(float(chain.shape[1])),
    }


def medusa_summary(counts: dict[str, torch.Tensor], topk: list[int]) -> dict[str, float]:
    """Per-head top-k accuracy and simulated chain tau from summed counts."""
    acc = counts_to_accuracy(counts["correct"], counts["total"])  # (K, len(topk))
    out = {f"acc/head{k}_top{kk}": float(acc[k, j]) for k in range(acc.shape[0]) for j, kk in enumerate(topk)}
    out["tau"] = mean_metric(counts, "tau_sum", "positions")
    return out


class MedusaObjective(Objective):
    """Medusa-1 on a frozen target."""

    def __init__(self, head: MedusaHead, loss_cfg: MedusaLossConfig):
        self.head = head
        self.cfg = loss_cfg
        self.weights = medusa_weights(head.config.num_heads, loss_cfg.decay)

    def _logits(self, model, target, batch) -> list[torch.Tensor]:
        return model(self.capture(target, batch).hidden[0])  # K x (B, T, V)

    def loss(self, model, target, batch, step):
        loss, per_head = medusa_loss(
            self._logits(model, target, batch), batch["input_ids"], batch["loss_mask"], self.weights
        )
        return loss, {f"loss/head{k}": float(v) for k, v in enumerate(per_head)}

    def eval_counts(self, model, target, batch):
        logits = self._logits(model, target, batch)
        loss, _ = medusa_loss(logits, batch["input_ids"], batch["loss_mask"], self.weights)
        rows = torch.tensor(float(batch["input_ids"].shape[0]))
        return {
            "loss_sum": loss.detach().cpu() * rows,
            "batches": rows,
            **medusa_counts(logits, batch, self.cfg.topk),
        }

    def summarize(self, counts):
        return {"loss": mean_metric(counts, "loss_sum", "batches"), **medusa_summary(counts, self.cfg.topk)}
