"""Training objectives by head family (`head.family`): build a fresh head and its recipe for a target."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from spechead.heads.base import HeadConfig, head_class, resolve_layers
from spechead.heads.errors import HeadError
from spechead.heads.medusa import MedusaConfig
from spechead.training.errors import TrainError
from spechead.training.objectives.base import Objective
from spechead.training.objectives.medusa import MedusaLossConfig, MedusaObjective
from spechead.training.objectives.medusa2 import LoraSettings, Medusa2LossConfig, Medusa2Objective
from spechead.training.settings import HeadSettings, build
from spechead.training.target import FrozenTarget

__all__ = ["FAMILIES", "Objective", "build_objective"]


@dataclass
class Family:
    """How to train one family: its head and config classes, loss settings, and the objective."""

    config_cls: type[HeadConfig]
    loss_cls: type
    make: Callable[..., Objective]  # (head, target, loss_cfg, sections) -> Objective
    sections: dict[str, type]  # extra head.* sub-sections (e.g. lora) and their dataclasses


FAMILIES: dict[str, Family] = {
    "medusa": Family(MedusaConfig, MedusaLossConfig, lambda h, t, loss, sec: MedusaObjective(h, loss), {}),
    "medusa2": Family(
        MedusaConfig,
        Medusa2LossConfig,
        lambda h, t, loss, sec: Medusa2Objective(h, t, loss, sec["lora"]),
        {"lora": LoraSettings},
    ),
}


def head_config(fam: Family, arch: dict[str, Any], layers: list[int], target: FrozenTarget) -> HeadConfig:
    """The family's config for `target`: sizes and layer indices come from the target, never the YAML."""
    reserved = {f.name for f in fields(HeadConfig)}
    clash = sorted(reserved & set(arch))
    if clash:
        raise TrainError(f"head.{clash[0]} is taken from the target; remove it from the head config")
    values = {
        **arch,
        "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size,
        "target_layers": resolve_layers(list(layers), target.num_layers),
        "target_name_or_path": target.name_or_path,
        "target_num_layers": target.num_layers,
        "target_architecture": target.architecture,
    }
    return build(fam.config_cls, values, "head")


def _init_from(head, directory: str, target: FrozenTarget) -> None:
    """Start from a trained head of the same shape (e.g. Medusa-1 heads as Medusa-2's first stage)."""
    try:
        trained = type(head).from_pretrained(directory)
        trained.check_target(target.hidden_size, target.vocab_size, target.num_layers)
    except HeadError as err:
        raise TrainError(f"head.init_from={directory}: {err}") from None
    mine, theirs = head.state_dict(), trained.state_dict()
    if {k: v.shape for k, v in mine.items()} != {k: v.shape for k, v in theirs.items()}:
        raise TrainError(
            f"head.init_from={directory} has another architecture than head.* (num_heads, num_layers?)"
        )
    head.load_state_dict(theirs)


def build_objective(settings: HeadSettings, target: FrozenTarget) -> Objective:
    """A freshly initialised head of `settings.family` for `target`, wrapped in its training objective."""
    if settings.family not in FAMILIES:
        raise TrainError(f"unknown head family {settings.family!r} (known: {', '.join(sorted(FAMILIES))})")
    fam = FAMILIES[settings.family]
    arch = dict(settings.arch)
    init_from = arch.pop("init_from", None)
    sections = {
        name: build(cls, dict(arch.pop(name, {}) or {}), f"head.{name}") for name, cls in fam.sections.items()
    }
    config = head_config(fam, arch, settings.layers, target)
    head = head_class(config.family)(config)
    head.attach_target_modules(lm_head=target.lm_head, embed_tokens=target.embed_tokens)
    if getattr(config, "init_from_lm_head", False):
        head.init_from_lm_head_(target.lm_head.weight)
    if init_from:
        _init_from(head, str(Path(init_from).expanduser()), target)
    return fam.make(head, target, build(fam.loss_cls, settings.loss, "head.loss"), sections)
