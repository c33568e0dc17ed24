"""Medusa-1 heads: K independent residual MLP heads on the target's final hidden state.

Head k at position t predicts token t+2+k (the target's own lm_head predicts t+1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import Tensor, nn

from spechead.heads.base import DraftHead, HeadConfig, register_head
from spechead.heads.errors import HeadError
from spechead.heads.families import Family, Work, register_family


@dataclass(kw_only=True)
class MedusaConfig(HeadConfig):
    """Medusa-1 heads. Default reads the final normed state (HF index -1, resolved to L)."""

    family = "medusa"

    target_layers: list[int] = field(default_factory=lambda: [-1])
    num_heads: int = 4
    num_layers: int = 1  # ResBlocks per head
    init_from_lm_head: bool = True  # the builder should call init_from_lm_head_ on a fresh head
    share_lm_head: bool = False  # use the attached frozen target lm_head instead of own projections
    # Medusa-2: subdirectory of the head holding the LoRA adapter the target must run with ("" = none).
    lora_adapter: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_heads < 1:
            raise HeadError(f"num_heads must be >= 1, got {self.num_heads}")
        if self.num_layers < 0:
            raise HeadError(f"num_layers (ResBlocks per head) must be >= 0, got {self.num_layers}")
        if self.num_layers == 0 and self.share_lm_head:
            raise HeadError(
                "a Medusa head with num_layers=0 and share_lm_head=true has nothing to train: change one"
            )
        if len(self.target_layers) != 1:
            raise HeadError(
                f"Medusa heads read exactly one target layer, got target_layers={self.target_layers}"
            )


class ResBlock(nn.Module):
    """x + SiLU(Linear(x)), with the Linear zero-initialised so a fresh block is the identity."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.act = nn.SiLU()

    def forward(self, x: Tensor) -> Tensor:
        """(..., H) -> (..., H)."""
        return x + self.act(self.linear(x))


@register_head
class MedusaHead(DraftHead):
    """K Medusa heads; `heads.{k}` = ResBlocks then (unless share_lm_head) Linear(H, V, bias=False).

    Parameter names follow the reference Medusa layout (`{k}.{num_layers}.weight` is head k's
    projection) so reference checkpoints can be converted by renaming the prefix.
    """

    config_class = MedusaConfig
    family = "medusa"
    config: MedusaConfig

    def __init__(self, config: MedusaConfig) -> None:
        super().__init__(config)
        hidden, vocab = config.hidden_size, config.vocab_size
        # Each head builds its OWN blocks: `[ResBlock(h)] * n` would share one block n times.
        self.heads = nn.ModuleList(
            nn.Sequential(
                *(ResBlock(hidden) for _ in range(config.num_layers)),
                *(() if config.share_lm_head else (nn.Linear(hidden, vocab, bias=False),)),
            )
            for _ in range(config.num_heads)
        )

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    @torch.no_grad()
    def init_from_lm_head_(self, lm_head_weight: Tensor) -> MedusaHead:
        """Copy the target lm_head weight (V, H) into every head's projection (no-op if shared)."""
        expected = (self.config.vocab_size, self.config.hidden_size)
        if tuple(lm_head_weight.shape) != expected:
            raise HeadError(
                f"lm_head weight has shape {tuple(lm_head_weight.shape)} but the heads need {expected}: "
                "pass the weight of this head's own target lm_head"
            )
        if not self.config.share_lm_head:
            for head in self.heads:
                cast(nn.Linear, cast(nn.Sequential, head)[-1]).weight.copy_(lm_head_weight)  # the projection
        return self

    def head_logits(self, k: int, hidden: Tensor) -> Tensor:
        """Head k's logits for token t+2+k at each position t: (B, T, H) -> (B, T, V)."""
        if not 0 <= k < self.config.num_heads:
            raise IndexError(f"head index {k} out of range for {self.config.num_heads} heads")
        if self.config.share_lm_head:
            lm_head = self.target_lm_head  # frozen, possibly bf16 while the head trains in fp32
            return lm_head(self.heads[k](hidden).to(lm_head.weight.dtype)).float()
        return self.heads[k](hidden)

    def forward(self, hidden: Tensor) -> list[Tensor]:
        """All heads: hidden (B, T, H) -> K logits tensors (B, T, V); entry k predicts token t+2+k."""
        return [self.head_logits(k, hidden) for k in range(self.config.num_heads)]


def _medusa_work(config: HeadConfig) -> Work:
    """Memory plan: one logit set per head over the whole vocabulary; ResBlocks are small; no attention."""
    return Work(int(cast(MedusaConfig, config).num_heads), config.vocab_size, 0, 0.0)


_MEDUSA_PARTS: dict[str, Any] = dict(
    head="medusa",
    drafter="spechead.inference.drafters.medusa:MedusaDrafter",
    tree_option="choices",
    default_tree={"choices": None},  # the drafter's DEFAULT_MEDUSA_CHOICES
    accuracy="spechead.inference.tuning.accuracy:measure_medusa_accuracy",
    assumed_accuracy="spechead.inference.tuning.accuracy:assumed_medusa_accuracy",
    calibrate_assumed=False,
    drafts_per_depth=False,
    work=_medusa_work,
    exports={
        "medusa": "spechead.heads.formats.medusa:export_medusa",
        "fasterdecoding": "spechead.heads.formats.medusa:export_fasterdecoding",
    },
)
register_family(
    Family(
        name="medusa",
        summary="Medusa-1 heads (residual MLP heads, head k predicts token t+2+k)",
        tags=("medusa",),
        recipe="spechead.training.objectives.medusa:RECIPE",
        **_MEDUSA_PARTS,
    )
)
register_family(
    Family(
        name="medusa2",
        summary="Medusa-2 heads (trained jointly with a LoRA adapter on the target)",
        tags=("medusa-2", "medusa", "lora"),
        recipe="spechead.training.objectives.medusa2:RECIPE",
        trains_target="it trains a LoRA adapter inside the target",
        **_MEDUSA_PARTS,
    )
)
