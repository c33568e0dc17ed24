"""Head families as plug-ins: one `Family` registration per family says what code elsewhere needs.

    fam = family_named("eagle3")     # by the name `head=` uses (configs/head/*.yaml, model cards)
    fam = family_of(head.config)     # a head's family (a Medusa head carrying a LoRA adapter: medusa2)
    recipe = fam.load("recipe")      # a "module:attribute" part, imported on first use

heads/ imports neither training/ nor inference/: the parts that live there are named as
"module:attribute" strings (as entry points are) and imported only by the layer that asks for them,
so the import arrows stay as they are. Each family module registers its families at its end
(heads/medusa.py: medusa and medusa2); heads/__init__.py imports them all. Adding a family = its head
module (with its registration), its objective under training/objectives/, its drafter, and tests.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from spechead.heads.base import HeadConfig
from spechead.heads.errors import HeadError


class Work(NamedTuple):
    """What one training step keeps for backward, the memory plan's input (training/memory_plan.py)."""

    logit_sets: int  # logit sets per trained position
    vocab: int  # the head's logit width
    layer_passes: int  # decoder-layer passes per trained position
    # additive attention-mask elements kept for backward, per row, in units of T^2 (masks grow with the
    # square of the length: EAGLE-3's step j attends over T * (j + 1) keys from T queries)
    mask_area: float


def last_layer(num_layers: int) -> list[int]:
    """[-1] (HF index of the final normed state) for a target of any depth."""
    return [-1]


@dataclass(frozen=True)
class Family:
    """One head family, as code outside its own modules sees it.

    Parts named "module:attribute" are imported by `load` (see the module doc for why strings).
    """

    name: str  # `head=NAME`; the recipe's and the model card's name
    head: str  # the DraftHead family saved in config.json (a medusa2 head is a Medusa head)
    summary: str  # what it is, for people (model card)
    tags: tuple[str, ...]  # Hub tags of a published head
    recipe: str  # training: its `Recipe` (head config class, loss settings, objective factory)
    drafter: str  # inference: the drafter class, built as cls(head, **options)
    tree_option: str  # the drafter option a static tree goes in ("choices" or "tree")
    default_tree: Mapping[str, Any]  # drafter options of its own default tree (used without tree.json)
    accuracy: str  # (model, head, sequences, *, depth, topk, starts) -> top-k accuracy [depth, topk]
    assumed_accuracy: str  # (head) -> a typical accuracy table [depth, topk] when none was measured
    # without a tree.json on a CPU: calibrate a static tree from the assumed table (EAGLE: its default
    # dynamic tree is sized for a GPU) instead of keeping the default tree (the table then only sizes batch trees)
    calibrate_assumed: bool
    drafts_per_depth: bool  # one head call per tree depth (EAGLE), not one pass for every depth (Medusa)
    work: Callable[[HeadConfig], Work]  # memory plan
    exports: Mapping[str, str] = field(default_factory=dict)  # export format -> exporter
    default_layers: Callable[[int], list[int]] = last_layer  # target depth -> HF hidden-state indices
    trains_target: str = ""  # why it trains inside the target ("" = it does not): online only, no ZeRO-3

    def load(self, part: str) -> Any:
        """The object the "module:attribute" field `part` names, e.g. load("recipe")."""
        return _import(getattr(self, part))

    def exporter(self, fmt: str) -> Callable[..., Any]:
        """The exporter of format `fmt` (one of `exports`)."""
        return _import(self.exports[fmt])


def _import(spec: str) -> Any:
    module, _, attribute = spec.partition(":")
    return getattr(importlib.import_module(module), attribute)


_FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Make `family` known by its name (re-registering an equal family is allowed: module reloads)."""
    existing = _FAMILIES.get(family.name)
    if existing is not None and existing != family:
        raise ValueError(f"head family {family.name!r} is already registered differently")
    twin = next((f for f in _FAMILIES.values() if f.name != family.name and _key(f) == _key(family)), None)
    if twin is not None:  # `family_of` must find one family per saved head
        raise ValueError(
            f"head family {family.name!r} has the same head ({family.head!r}) and target training as "
            f"{twin.name!r}: a saved head could not tell them apart"
        )
    _FAMILIES[family.name] = family
    return family


def _key(family: Family) -> tuple[str, bool]:
    return family.head, bool(family.trains_target)


def family_names() -> list[str]:
    """The registered families' names."""
    return sorted(_FAMILIES)


def family_named(name: str) -> Family:
    """The family called `name`; HeadError listing the known ones otherwise."""
    if name not in _FAMILIES:
        raise HeadError(f"unknown head family {name!r} (known: {', '.join(family_names())})")
    return _FAMILIES[name]


def family_of(config: HeadConfig | Mapping[str, Any]) -> Family:
    """The family of a head config (a HeadConfig or config.json's dict): the registered family of its head
    class, the one that trains inside the target when the head carries a LoRA adapter (medusa2)."""
    get = (
        config.get if isinstance(config, Mapping) else lambda key, default=None: getattr(config, key, default)
    )
    head, adapter = str(get("family", "")), bool(get("lora_adapter"))
    for fam in _FAMILIES.values():
        if fam.head == head and bool(fam.trains_target) == adapter:
            return fam
    raise HeadError(f"no registered family for a {head!r} head{' with an adapter' if adapter else ''}")
