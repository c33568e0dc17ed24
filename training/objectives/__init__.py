"""Training objectives by head family (`head.family`): build a fresh head and its recipe for a target."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

from spechead.heads.base import HeadConfig, head_class, resolve_layers
from spechead.heads.decoder_layer import layer_config_from
from spechead.heads.errors import HeadError
from spechead.heads.families import Family, family_named
from spechead.heads.formats.dflash_export import SGLANG_MASK_TOKEN, sglang_mask_token_id
from spechead.training.errors import TrainError
from spechead.training.objectives.base import Objective, Recipe
from spechead.training.objectives.eagle3 import DEFAULT_DRAFT_VOCAB
from spechead.training.settings import HeadSettings, build
from spechead.training.target import FrozenTarget

__all__ = ["Objective", "Recipe", "build_objective", "family_for"]


def family_for(name: str) -> Family:
    """The registered family `head=name` trains (TrainError naming the known ones otherwise)."""
    try:
        return family_named(name)
    except HeadError as err:
        raise TrainError(str(err)) from None


def head_config(
    fam: Family, recipe: Recipe, arch: dict[str, Any], layers: list[int] | None, target: FrozenTarget
) -> HeadConfig:
    """The family's config for `target`: sizes, depth and layer shapes come from the target, never the YAML."""
    taken = {f.name for f in fields(HeadConfig)} | {"layer_config"}
    clash = sorted(taken & set(arch))
    if clash:
        raise TrainError(f"head.{clash[0]} is taken from the target; remove it from the head config")
    values = {
        **arch,
        "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size,
        "target_layers": resolve_layers(
            list(layers or fam.default_layers(target.num_layers)), target.num_layers
        ),
        "target_name_or_path": target.name_or_path,
        "target_num_layers": target.num_layers,
        "target_architecture": target.architecture,
    }
    names = {f.name for f in fields(recipe.config_cls)}
    draft_layer = values.pop("draft_layer", "llama")
    if "layer_config" in names:  # heads with a decoder layer: Llama-style, or the target's own class
        try:
            values["layer_config"] = layer_config_from(target.config, draft_layer)
        except HeadError as err:
            raise TrainError(str(err)) from None
    elif draft_layer != "llama":
        raise TrainError(
            f"head.draft_layer is for heads with a decoder layer (eagle, eagle3), not {fam.name}"
        )
    if "draft_vocab_size" in names and values.get("draft_vocab_size") is None:
        values["draft_vocab_size"] = min(DEFAULT_DRAFT_VOCAB, target.vocab_size)
    return build(recipe.config_cls, values, "head")


def _init_from(head, directory: str, target: FrozenTarget) -> None:
    """Start from a trained head of the same shape (e.g. Medusa-1 heads as Medusa-2's first stage)."""
    try:
        trained = type(head).from_pretrained(directory)
        trained.check_target(target.hidden_size, target.vocab_size, target.num_layers)
    except HeadError as err:
        raise TrainError(f"head.init_from={directory}: {err}") from None
    mine, theirs = head.state_dict(), trained.state_dict()
    differ = sorted(mine.keys() ^ theirs.keys()) + sorted(
        k for k in mine.keys() & theirs.keys() if mine[k].shape != theirs[k].shape
    )
    if differ:  # (e.g. mask_embedding: a DFlash head that learned its mask; give its head.mask_token_id=-1)
        first = differ[0]
        where = (
            "only in the trained head" if first not in mine else "not in the trained head" if first not in theirs
            else "of another shape"
        )  # fmt: skip
        raise TrainError(
            f"head.init_from={directory} has another architecture than head.* ({first} {where}): "
            "give the head.* settings it was trained with (num_heads, num_layers, mask_token_id?)"
        )
    head.load_state_dict(theirs)


def auto_mask_token_id(tokenizer: Any, target: FrozenTarget) -> tuple[int, str]:
    """`head.mask_token_id=auto` (DFlash): a token SGLang's DFLASH can embed the masks with on `target` (the
    exported head then loads there; `sglang_mask_token_id`), else -1, a learned mask embedding; and the line
    that says so."""
    if tokenizer is None:
        raise TrainError("head.mask_token_id=auto needs the target's tokenizer: give an id, or -1 (learned)")
    chosen = sglang_mask_token_id(tokenizer.get_vocab(), len(tokenizer), target.vocab_size)
    if chosen < 0:
        return -1, (
            f"head.mask_token_id=auto: no {SGLANG_MASK_TOKEN}, spare embedding row or reserved special token "
            "in this target: a learned mask embedding (it exports for vLLM with scripts/export.py --format vllm "
            "--mask-token-id ID, not for SGLang; give head.mask_token_id=<id> of a token the target never reads "
            "for that)"
        )
    name = (
        tokenizer.convert_ids_to_tokens(chosen) if chosen < len(tokenizer) else f"{SGLANG_MASK_TOKEN}, added"
    )
    return (
        chosen,
        f"head.mask_token_id=auto: {chosen} ({name}), embedded as the masks, as SGLang's DFLASH will",
    )


def build_objective(
    settings: HeadSettings, target: FrozenTarget, train_data=None, tokenizer: Any = None
) -> Objective:
    """A fresh head of `settings.family` for `target`, wrapped in its training objective.

    `train_data` (rows with input_ids and loss_mask) is read by families that size themselves on the
    data, such as EAGLE-3's draft vocabulary; `tokenizer` (the target's) by `head.mask_token_id=auto`.
    """
    fam = family_for(settings.family)
    recipe: Recipe = fam.load("recipe")
    arch = dict(settings.arch)
    init_from = arch.pop("init_from", None)
    note = None
    if arch.get("mask_token_id") == "auto":
        arch["mask_token_id"], note = auto_mask_token_id(tokenizer, target)
    sections = {
        name: build(cls, dict(arch.pop(name, {}) or {}), f"head.{name}")
        for name, cls in recipe.sections.items()
    }
    config = head_config(fam, recipe, arch, settings.layers, target)
    head = head_class(config.family)(config)
    head.attach_target_modules(lm_head=target.lm_head, embed_tokens=target.embed_tokens)
    if getattr(config, "own_embedding", False):  # trained from the target's (the optimizer sees it)
        head.init_embedding_from_target_(target.embed_tokens.weight)
    if getattr(config, "init_from_lm_head", False):
        head.init_from_lm_head_(target.lm_head.weight)
    objective = recipe.make(
        head, target, build(recipe.loss_cls, settings.loss, "head.loss"), sections, train_data
    )
    if init_from:  # after make, which sizes a fresh head on the data (EAGLE-3's draft vocabulary and lm_head)
        _init_from(head, str(Path(init_from).expanduser()), target)
        objective.notes[:] = [n for n in objective.notes if not n.startswith("draft vocabulary:")]
        objective.notes.append(f"head.init_from={init_from}: every weight and buffer of the trained head")
    if note:
        objective.notes.append(note)
    return objective
