"""Self-speculative drafting: the target drafts for itself with some decoder layers skipped (Draft &
Verify) or by exiting early through its own final norm and lm_head (LayerSkip-style); no extra weights.

The draft model is a VIEW of the target (`skip_view`) sharing every parameter and never modifying it; on
it `LayerSkipDrafter` is a `DraftModelDrafter` with its OWN cache of committed tokens (the target's cache
belongs to the runner; reusing its first layers' K/V would save only the prompt's prefill). Early exit
at layer k is the skip set {k, ..., L-1}.

A drafter file (`save_drafter_file`, from scripts/search_skip.py) is JSON: {"drafter": "layer_skip",
"skip_layers": [...], "num_layers": L, "num_draft": k} or {"drafter": "early_exit", "exit_layer": k, ...};
other keys (the search's measurements) are kept for the reader and ignored.
"""

from __future__ import annotations

import copy
import json
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

from torch import nn
from transformers import PreTrainedModel

from spechead.heads.hybrid import check_attention_only
from spechead.inference.drafters.draft_model import DraftModelDrafter

KINDS = ("layer_skip", "early_exit")
M = TypeVar("M", bound=nn.Module)


def default_skip(num_layers: int) -> list[int]:
    """Every other layer from the second to the second-to-last: 8 layers -> [1, 3, 5]."""
    return list(range(1, num_layers - 1, 2))


def parse_layers(value: int | str | Sequence[int], num_layers: int) -> list[int]:
    """Layer indices from 3, "2+3+6", "4-7" (a range, both ends), "1+4-6" or [2, 3]; sorted, checked."""
    if isinstance(value, int):  # a bool too: refused as no int below
        layers = [value]
    elif isinstance(value, str):
        layers = []
        for part in filter(None, value.replace(" ", "").split("+")):
            low, sep, high = part.partition("-")
            if not low.isdigit() or (sep and not high.isdigit()):
                raise ValueError(f"skip layers {value!r}: give indices joined by + and ranges like 2+3+5-7")
            layers += list(range(int(low), int(high) + 1)) if sep else [int(low)]
    else:
        layers = list(value)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
        raise ValueError(f"skip layers must be ints, got {value!r}")
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"skip layers {bad} out of range: the target has layers 0..{num_layers - 1}")
    layers = sorted(set(layers))
    if len(layers) == num_layers:
        raise ValueError(f"skip layers {layers} skip all {num_layers} layers: keep at least one")
    return layers


def _light_copy(module: M) -> M:
    """A new module object sharing `module`'s parameters, buffers and children, with no hooks; its
    own child/parameter dicts, so replacing a child of the copy leaves `module` untouched."""
    view = copy.copy(module)
    for name, value in vars(module).items():
        if name in ("_modules", "_parameters", "_buffers"):
            view.__dict__[name] = dict(value)
        elif "hooks" in name and isinstance(value, dict):
            view.__dict__[name] = OrderedDict()
    view.__dict__.pop("_spechead_capture", None)  # the target runner's capture belongs to the target
    return view


def skip_view(target: PreTrainedModel, skip: Sequence[int]) -> PreTrainedModel:
    """The target without the decoder layers `skip`: shallow copies of the LM, its decoder, the kept layers
    and their attention (no hooks: the runner's capture never fires for a draft pass), the kept layers'
    attention renumbered 0..K-1 for the draft cache and the config saying K layers."""
    decoder = target.get_decoder()
    owner = next((name for name, child in target.named_children() if child is decoder), None)
    if owner is None or not isinstance(getattr(decoder, "layers", None), nn.ModuleList):
        raise ValueError(
            f"{type(target).__name__}: layer skipping needs a decoder-only LM whose decoder (a direct child) "
            "has a `layers` ModuleList, like LlamaForCausalLM"
        )
    kept = [i for i in range(len(decoder.layers)) if i not in set(skip)]
    layers = []
    for new_index, old_index in enumerate(kept):
        layer = _light_copy(decoder.layers[old_index])
        attention = getattr(layer, "self_attn", None)
        if attention is None or not hasattr(attention, "layer_idx"):
            raise ValueError(
                f"layer {old_index} has no self_attn.layer_idx: cannot give the draft its own cache"
            )
        layer.self_attn = _light_copy(attention)
        layer.self_attn.layer_idx = new_index  # the draft cache holds the kept layers only
        if hasattr(layer, "layer_idx"):
            layer.layer_idx = new_index
        layers.append(layer)
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = len(kept)
    if isinstance(getattr(config, "layer_types", None), list):  # e.g. sliding / full attention per layer
        config.layer_types = [config.layer_types[i] for i in kept]
    view_decoder = _light_copy(decoder)
    view_decoder.layers = nn.ModuleList(layers)
    if isinstance(getattr(decoder, "norm", None), nn.Module):
        view_decoder.norm = _light_copy(decoder.norm)  # the runner may hook the target's final norm
    view_decoder.config = config
    view = _light_copy(target)
    setattr(view, owner, view_decoder)
    view.config = config
    return view


class LayerSkipDrafter(DraftModelDrafter):
    """The target drafting for itself through `skip_view` (a chain by default; DraftModelDrafter's shape
    options too). skip_layers: `parse_layers`, default `default_skip`; exit_layer: instead, early exit
    after the first `exit_layer` layers (1..L-1); num_draft 3: a draft token costs (L - skipped) / L."""

    def __init__(
        self,
        target: PreTrainedModel,
        skip_layers: int | str | Sequence[int] | None = None,
        *,
        exit_layer: int | None = None,
        num_draft: int = 3,
        **shape,
    ):
        check_attention_only(target.config, "self-drafting")  # (before its view: not all attention)
        total = len(target.get_decoder().layers)
        if exit_layer is not None:
            if skip_layers is not None:
                raise ValueError("give skip_layers (layer skip) or exit_layer (early exit), not both")
            if isinstance(exit_layer, bool) or not isinstance(exit_layer, int) or not 1 <= exit_layer < total:
                raise ValueError(
                    f"exit_layer must be an int in 1..{total - 1} (the target has {total} layers)"
                )
            skip = list(range(exit_layer, total))
        else:
            skip = default_skip(total) if skip_layers is None else parse_layers(skip_layers, total)
        self.skip_layers = tuple(skip)
        self.exit_layer = exit_layer
        self.kind = "layer_skip" if exit_layer is None else "early_exit"
        self.num_target_layers = total
        super().__init__(skip_view(target, skip), num_draft, **shape)

    def check_target(self, hidden_size: int, vocab_size: int, num_layers: int) -> None:
        super().check_target(hidden_size, vocab_size, num_layers)
        if num_layers != self.num_target_layers:
            raise ValueError(
                f"this {self.kind} drafter was built on a target with {self.num_target_layers} layers, "
                f"not {num_layers}: build it from the generator's own target"
            )


def read_drafter_file(path: Path) -> dict | None:
    """The drafter file's dict, or None when `path` is not a self-speculative drafter file."""
    if path.suffix != ".json" or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("drafter") in KINDS else None


def save_drafter_file(path: str | Path, drafter: LayerSkipDrafter, **info) -> Path:
    """Write `drafter` (kind, layers, target layer count, chain length) and extra `info` as a drafter file."""
    path = Path(path)
    if path.suffix != ".json":
        raise ValueError(f"a drafter file ends in .json, got {path}")
    exit_layer = drafter.exit_layer
    layers = {"exit_layer": exit_layer} if exit_layer else {"skip_layers": list(drafter.skip_layers)}
    about = {"drafter": drafter.kind, **layers, "num_layers": drafter.num_target_layers}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**about, "num_draft": drafter.depth, **info}, indent=1) + "\n")
    return path
