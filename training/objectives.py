"""Training objectives: what a head family reads from the target and how it is scored.

The trainer is family-agnostic: it asks the objective which target layers to capture, then for a
loss (training) or for summable counts (evaluation). Adding a head family = adding an objective.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields

import torch
from torch import nn

from spechead.heads.base import DraftHead, HeadConfig, resolve_layers
from spechead.heads.medusa import MedusaConfig, MedusaHead
from spechead.training.errors import TrainError
from spechead.training.losses import medusa_loss, medusa_weights
from spechead.training.metrics import (
    counts_to_accuracy,
    medusa_top1_correct,
    medusa_topk_counts,
    simulated_chain_tau,
)
from spechead.training.settings import build
from spechead.training.target import Captured, FrozenTarget

Batch = dict[str, torch.Tensor]


class Objective(ABC):
    """One head family's training recipe around a frozen target."""

    head: DraftHead

    @property
    def layers(self) -> list[int]:
        """Target hidden-state indices to capture for every batch."""
        return list(self.head.config.target_layers)

    needs_logits: bool = False

    def capture(self, target: FrozenTarget, batch: Batch) -> Captured:
        """The target pass for `batch`; states cast to the head's dtype (a bf16 target, an fp32 head)."""
        cap = target.capture(batch["input_ids"], batch["attention_mask"], self.layers, self.needs_logits)
        dtype = next(self.head.parameters()).dtype
        return Captured([h.to(dtype) for h in cap.hidden], cap.logits)

    @abstractmethod
    def loss(self, model: nn.Module, batch: Batch, cap: Captured) -> tuple[torch.Tensor, dict[str, float]]:
        """Scalar loss to backpropagate and a few floats to log. `model` is the (wrapped) head."""

    @abstractmethod
    def eval_counts(self, model: nn.Module, batch: Batch, cap: Captured) -> dict[str, torch.Tensor]:
        """Summable tensors (counts, sums) for one validation batch; summed over batches and ranks."""

    @abstractmethod
    def summarize(self, counts: dict[str, torch.Tensor]) -> dict[str, float]:
        """Turn summed counts into the metrics to print and log (must include `tau`)."""


@dataclass
class MedusaLossConfig:
    """Medusa-1 loss settings: head k is weighted `decay**k`; accuracies reported at `topk`."""

    decay: float = 0.8
    topk: list[int] = field(default_factory=lambda: [1, 5])


class MedusaObjective(Objective):
    """Medusa-1: heads on the frozen target's final hidden state, CE against the data tokens."""

    def __init__(self, head: MedusaHead, loss_cfg: MedusaLossConfig):
        self.head = head
        self.cfg = loss_cfg
        self.weights = medusa_weights(head.config.num_heads, loss_cfg.decay)

    def loss(self, model, batch, cap):
        logits = model(cap.hidden[0])  # K x (B, T, V)
        loss, per_head = medusa_loss(logits, batch["input_ids"], batch["loss_mask"], self.weights)
        return loss, {f"loss/head{k}": float(v) for k, v in enumerate(per_head)}

    def eval_counts(self, model, batch, cap):
        logits = model(cap.hidden[0])
        loss, _ = medusa_loss(logits, batch["input_ids"], batch["loss_mask"], self.weights)
        correct, total = medusa_topk_counts(
            logits, batch["input_ids"], batch["loss_mask"], tuple(self.cfg.topk)
        )
        chain = medusa_top1_correct(logits, batch["input_ids"], batch["loss_mask"])  # (K, N)
        return {
            "loss_sum": loss.detach() * batch["input_ids"].shape[0],
            "batches": torch.tensor(float(batch["input_ids"].shape[0])),
            "correct": correct,  # (K, len(topk))
            "total": total,  # (K,)
            # tau is a mean over positions: carry its sum and count so batches and ranks add up.
            "tau_sum": torch.tensor(simulated_chain_tau(chain) * chain.shape[1]),
            "positions": torch.tensor(float(chain.shape[1])),
        }

    def summarize(self, counts):
        acc = counts_to_accuracy(counts["correct"], counts["total"])  # (K, len(topk))
        out = {"loss": float(counts["loss_sum"] / counts["batches"].clamp(min=1))}
        for k in range(acc.shape[0]):
            for j, kk in enumerate(self.cfg.topk):
                out[f"acc/head{k}_top{kk}"] = float(acc[k, j])
        out["tau"] = float(counts["tau_sum"] / counts["positions"].clamp(min=1))
        return out


@dataclass
class Family:
    """How to build one head family for training: its head, config, objective and loss settings."""

    head_cls: type[DraftHead]
    config_cls: type[HeadConfig]
    objective_cls: type[Objective]
    loss_cls: type


FAMILIES: dict[str, Family] = {
    "medusa": Family(MedusaHead, MedusaConfig, MedusaObjective, MedusaLossConfig),
}


def build_objective(
    family: str, layers: list[int], arch: dict, loss: dict, target: FrozenTarget
) -> Objective:
    """A freshly initialised head of `family` for `target`, wrapped in its training objective."""
    if family not in FAMILIES:
        raise TrainError(f"unknown head family {family!r} (known: {', '.join(sorted(FAMILIES))})")
    fam = FAMILIES[family]
    reserved = {f.name for f in fields(HeadConfig)}
    clash = sorted(reserved & set(arch))
    if clash:
        raise TrainError(f"head.{clash[0]} is taken from the target; remove it from the head config")
    config = build(
        fam.config_cls,
        {
            **arch,
            "hidden_size": target.hidden_size,
            "vocab_size": target.vocab_size,
            "target_layers": resolve_layers(list(layers), target.num_layers),
            "target_name_or_path": target.name_or_path,
            "target_num_layers": target.num_layers,
            "target_architecture": target.architecture,
        },
        "head",
    )
    head = fam.head_cls(config)
    head.attach_target_modules(lm_head=target.lm_head, embed_tokens=target.embed_tokens)
    if getattr(config, "init_from_lm_head", False) and not getattr(config, "share_lm_head", False):
        head.init_from_lm_head_(target.lm_head.weight)
    return fam.objective_cls(head, build(fam.loss_cls, loss, "head.loss"))
