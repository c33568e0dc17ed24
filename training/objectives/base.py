"""What every training objective provides to the family-agnostic loop in trainer.py."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from spechead.heads.base import DraftHead, HeadConfig
from spechead.heads.families import Work, family_of
from spechead.training.target import Captured, FrozenTarget

Batch = dict[str, torch.Tensor]


class Objective(ABC):
    """One head family's training recipe around a target.

    The loop prepares `module()` with accelerate, builds the optimizer from `param_groups`, and calls
    `loss` / `eval_counts` with the prepared (possibly DDP-wrapped) module. `save` writes the head.
    """

    head: DraftHead
    needs_logits: bool = False  # whether the target's logits are captured with its hidden states

    @property
    def notes(self) -> list[str]:
        """Lines worth printing once at start (e.g. draft-vocabulary coverage)."""
        if not hasattr(self, "_notes"):
            self._notes: list[str] = []
        return self._notes

    @property
    def layers(self) -> list[int]:
        """Target hidden-state indices to capture for every batch."""
        return list(self.head.config.target_layers)

    def work(self) -> Work:
        """What a step keeps for backward, for the memory plan: the family's registered `work`, unless the
        objective lowers it (P-EAGLE's partitions)."""
        return family_of(self.head.config).work(self.head.config)

    def module(self) -> nn.Module:
        """The module whose parameters train (the head, or the head plus a target adapter)."""
        return self.head

    def param_groups(self, lr: float) -> list[dict]:
        """Optimizer parameter groups; the base learning rate is `lr`."""
        return [{"params": [p for p in self.module().parameters() if p.requires_grad], "lr": lr}]

    def capture(self, target: FrozenTarget, batch: Batch) -> Captured:
        """The frozen target pass for `batch`; states cast to the head's dtype (bf16 target, fp32 head)."""
        cap = target.capture_batch(batch, self.layers, self.needs_logits)
        dtype = next(self.head.parameters()).dtype
        return Captured([h.to(dtype) for h in cap.hidden], cap.logits)

    @abstractmethod
    def loss(
        self, model: nn.Module, target: FrozenTarget, batch: Batch, step: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Scalar loss to backpropagate at optimizer step `step`, and a few floats to log."""

    @abstractmethod
    def eval_counts(self, model: nn.Module, target: FrozenTarget, batch: Batch) -> dict[str, torch.Tensor]:
        """Summable tensors (counts, sums) for one validation batch; summed over batches and ranks."""

    @abstractmethod
    def summarize(self, counts: dict[str, torch.Tensor]) -> dict[str, float]:
        """Turn summed counts into the metrics to print and log (always includes `tau`)."""

    def save(self, path: Path) -> Path:
        """Write the trained head (and anything it needs at inference) to `path`."""
        return self.head.save_pretrained(path)


def mean_metric(counts: dict[str, torch.Tensor], total: str, count: str) -> float:
    """counts[total] / counts[count], 0 when nothing was counted."""
    return float(counts[total] / counts[count].clamp(min=1))


@dataclass(frozen=True)
class Recipe:
    """How to train one family (its registration in heads/families.py names it as `recipe`)."""

    config_cls: type[HeadConfig]  # the head's config, built from head.* and the target
    loss_cls: type  # head.loss settings
    # (head, target, loss settings, {section: settings}, train rows) -> the objective
    make: Callable[..., Objective]
    sections: dict[str, type] = field(default_factory=dict)  # extra head.* sub-sections (e.g. lora)
