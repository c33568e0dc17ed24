"""Medusa-2: Medusa heads trained jointly with a LoRA adapter on the target (peft).

loss = LM loss of the adapted target (cross-entropy on the data, or self-distillation KL against the
same target with the adapter disabled, which keeps its outputs unchanged) + lambda(step) * the Medusa
head loss, lambda warming up along a sine. Heads get a higher learning rate than the adapter. The
saved head directory holds the heads and `adapter/`; merge the adapter into the target for serving.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from torch import nn

from spechead.heads.directory import ADAPTER_NAME
from spechead.heads.medusa import MedusaConfig, MedusaHead
from spechead.training.errors import TrainError
from spechead.training.losses import medusa_loss, medusa_weights
from spechead.training.objectives.base import Objective, Recipe, mean_metric
from spechead.training.objectives.medusa import medusa_counts, medusa_summary
from spechead.training.target import FrozenTarget


@dataclass
class LoraSettings:
    """The target adapter (`head.lora.*`)."""

    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


@dataclass
class Medusa2LossConfig:
    """Joint-training loss (`head.loss.*`)."""

    decay: float = 0.8  # head k weighted decay**k
    topk: list[int] = field(default_factory=lambda: [1, 5])
    head_weight: float = 0.2  # lambda once warmed up
    head_weight_warmup: int = 100  # optimizer steps of the sine warmup of lambda
    lm_loss: str = "distill"  # distill (KL to the adapter-disabled target) | ce (data tokens)
    head_lr_scale: float = 4.0  # heads learn this much faster than the adapter

    def __post_init__(self) -> None:
        if self.lm_loss not in ("distill", "ce"):
            raise TrainError(f"head.loss.lm_loss={self.lm_loss!r}: use distill or ce")


def head_weight(step: int, peak: float, warmup: int) -> float:
    """lambda at optimizer step `step`: sine ramp from 0 to `peak` over `warmup` steps."""
    if warmup <= 0:
        return peak
    return peak * math.sin(0.5 * math.pi * min(1.0, step / warmup))


class JointLosses(NamedTuple):
    total: torch.Tensor
    lm: torch.Tensor
    heads: torch.Tensor
    per_head: torch.Tensor  # (K,)
    lam: float
    logits: torch.Tensor  # (B, T, V) of the adapted target
    head_logits: list[torch.Tensor]  # K x (B, T, V)


class JointModel(nn.Module):
    """The adapted target and the heads as one module, so DDP syncs adapter and head gradients."""

    def __init__(self, target: nn.Module, head: MedusaHead):
        super().__init__()
        self.target = target
        self.head = head

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        """(B, T) ids -> target logits (B, T, V) and K head logits (B, T, V)."""
        out = self.target(
            input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False
        )
        hidden = out.hidden_states[self.head.config.target_layers[0]]  # (B, T, H): the layer the head reads
        return out.logits, self.head(hidden.to(next(self.head.parameters()).dtype))

    def _trained_keys(self) -> set[str]:
        """State-dict keys that change in training: the adapter, the heads' parameters and buffers."""
        trainable = {name for name, p in self.named_parameters() if p.requires_grad}
        return trainable | {f"head.{name}" for name in self.head.state_dict()}

    def state_dict(self, *args, **kwargs):
        """Only what training changes: checkpoints never carry a copy of the frozen target (GBs)."""
        full = super().state_dict(*args, **kwargs)
        prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
        keep = {prefix + key for key in self._trained_keys()}
        for key in [k for k in full if k not in keep]:
            del full[key]
        return full

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a checkpoint made by state_dict(); the frozen target keeps its own weights."""
        missing, unexpected = super().load_state_dict(state_dict, strict=False, assign=assign)
        missing = [k for k in missing if k in self._trained_keys()]
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"Medusa-2 checkpoint mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)


def add_lora(model: nn.Module, lora: LoraSettings) -> nn.Module:
    """Wrap `model` with a trainable LoRA adapter; its base weights stay frozen."""
    try:
        with warnings.catch_warnings():  # peft reads transformers' deprecated `is_gradient_checkpointing`
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            return get_peft_model(
                model,
                LoraConfig(
                    r=lora.r,
                    lora_alpha=lora.alpha,
                    lora_dropout=lora.dropout,
                    target_modules=list(lora.target_modules),
                ),
            )
    except ValueError as err:
        linear = sorted(
            {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
        )
        raise TrainError(
            f"head.lora.target_modules={list(lora.target_modules)} do not match the target's modules "
            f"({str(err).splitlines()[0]}); its linear layers are named {linear}"
        ) from None


class Medusa2Objective(Objective):
    """Medusa-2 joint training."""

    def __init__(self, head: MedusaHead, target: FrozenTarget, cfg: Medusa2LossConfig, lora: LoraSettings):
        self.head = head
        self.cfg = cfg
        self.weights = medusa_weights(head.config.num_heads, cfg.decay)
        self.peft_model = add_lora(target.model, lora)
        self.joint = JointModel(self.peft_model, head)
        head.config.lora_adapter = ADAPTER_NAME

    def module(self) -> nn.Module:
        return self.joint

    def param_groups(self, lr):
        adapter = [p for p in self.peft_model.parameters() if p.requires_grad]
        heads = [p for p in self.head.parameters() if p.requires_grad]
        return [{"params": adapter, "lr": lr}, {"params": heads, "lr": lr * self.cfg.head_lr_scale}]

    def _lm_loss(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        mask = batch["loss_mask"][:, 1:].bool()  # (B, T-1): positions t whose next token counts
        student = logits[:, :-1][mask].float()  # (N, V)
        if self.cfg.lm_loss == "ce":
            return (
                F.cross_entropy(student, batch["input_ids"][:, 1:][mask]) if mask.any() else student.sum() * 0
            )
        with torch.no_grad(), self.peft_model.disable_adapter():
            teacher = self.peft_model(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
            ).logits
        teacher = teacher[:, :-1][mask].float()
        if not mask.any():
            return student.sum() * 0
        return F.kl_div(
            F.log_softmax(student, -1), F.log_softmax(teacher, -1), log_target=True, reduction="batchmean"
        )

    def _losses(self, model, batch, step):
        logits, head_logits = model(batch["input_ids"], batch["attention_mask"])
        lm = self._lm_loss(logits, batch)
        heads, per_head = medusa_loss(head_logits, batch["input_ids"], batch["loss_mask"], self.weights)
        lam = head_weight(step, self.cfg.head_weight, self.cfg.head_weight_warmup)
        return JointLosses(lm + lam * heads, lm, heads, per_head, lam, logits, head_logits)

    def loss(self, model, target, batch, step):
        out = self._losses(model, batch, step)
        logs = {
            "loss/lm": float(out.lm.detach()),
            "loss/heads": float(out.heads.detach()),
            "head_weight": out.lam,
        }
        logs.update({f"loss/head{k}": float(v) for k, v in enumerate(out.per_head)})
        return out.total, logs

    def eval_counts(self, model, target, batch):
        out = self._losses(model, batch, self.cfg.head_weight_warmup)
        rows = torch.tensor(float(batch["input_ids"].shape[0]))
        counts = {"lm_sum": out.lm.cpu() * rows, "heads_sum": out.heads.cpu() * rows, "batches": rows}
        return {**counts, **medusa_counts(out.head_logits, batch, self.cfg.topk, out.logits)}

    def summarize(self, counts):
        out = {
            "loss": mean_metric(counts, "heads_sum", "batches"),
            "lm_loss": mean_metric(counts, "lm_sum", "batches"),
        }
        return {**out, **medusa_summary(counts, self.cfg.topk)}

    def save(self, path: Path) -> Path:
        self.head.save_pretrained(path)
        self.peft_model.save_pretrained(str(Path(path) / ADAPTER_NAME))
        return Path(path)


RECIPE = Recipe(
    MedusaConfig,
    Medusa2LossConfig,
    lambda head, target, loss, sections, data: Medusa2Objective(head, target, loss, sections["lora"]),
    {"lora": LoraSettings},
)
