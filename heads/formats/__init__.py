"""Heads in other projects' layouts: import them on the fly, export spechead heads for serving engines.

Import (through `load_head` / `DraftHead.from_pretrained`, hence `SpeculativeGenerator.from_pretrained`):
EAGLE-1/2 heads of the EAGLE authors, EAGLE-3 heads (official, SGLang, SpecForge), vLLM `speculators`
EAGLE-3, P-EAGLE and DFlash heads, z-lab / SGLang DFlash drafters, Medusa-1 heads (FasterDecoding and
vLLM). Export: EAGLE-3 heads to `speculators` (vLLM) and `sglang` (SGLang / official layout), P-EAGLE to
`speculators`, DFlash to `sglang` and `vllm`, Medusa heads to `medusa` (vLLM's Medusa loader).
A layout spechead's modules cannot reproduce exactly is refused with a HeadError saying what.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from spechead.heads.base import DraftHead, register_foreign_loader
from spechead.heads.errors import HeadError
from spechead.heads.families import family_named, family_names, family_of
from spechead.heads.formats.detect import LAYOUTS, detect_layout, layout_of_config
from spechead.heads.formats.dflash_import import with_sglang_mask_token_id
from spechead.heads.formats.eagle import WEIGHT_NAMES as EAGLE_WEIGHTS
from spechead.heads.formats.eagle import is_eagle_tensors
from spechead.heads.formats.weights import read_json, read_tensors, tensor_names, weight_files

# Every export format of a registered family (each family's registration names its exporters).
FORMATS = sorted({fmt for name in family_names() for fmt in family_named(name).exports})


def export_formats(head: DraftHead) -> list[str]:
    """Formats `head` can be exported to, as its family registers them ([] if none)."""
    return sorted(family_of(head.config).exports)


def export_head(
    head: DraftHead, fmt: str, out: str | Path, *, dtype: torch.dtype | None = None, **options: Any
) -> Path:
    """Write `head` into directory `out` in format `fmt` (options: speculative_tokens, verifier)."""
    if fmt not in export_formats(head):
        valid = ", ".join(export_formats(head)) or "none"
        raise HeadError(
            f"a {head.family} head cannot be exported as {fmt!r}: formats for {head.family} heads: {valid}"
        )
    return family_of(head.config).exporter(fmt)(head, Path(out), dtype=dtype, **options)


def is_head_dir(config: dict[str, Any], path: str | Path) -> bool:
    """True if `config` (the config.json at `path`) is a spechead head or a head in a known layout."""
    if isinstance(config, dict) and "family" in config:
        return True
    local = Path(path).expanduser()
    return (detect_layout(local, config) if local.is_dir() else layout_of_config(config)) is not None


def load_foreign(
    directory: Path,
    *,
    source: str | Path | None = None,
    revision: str | None = None,
    family: str = "",
    target_config: PretrainedConfig | None = None,
    target_tokenizer: PreTrainedTokenizerBase | None = None,
    device: torch.device | str | int | None = None,
    dtype: torch.dtype | None = None,
) -> DraftHead | None:
    """The head in `directory` converted from a reference layout, or None if it is not one.

    source / revision: where `directory` came from (a Hub id lets missing pickled weights be fetched).
    family: the head family the caller needs ("" = any). target_config: the target's config, which
    fills what a layout leaves implicit (EAGLE-3 default layers need the target's depth), and so does
    target_tokenizer (a z-lab DFlash config without a mask token id: the one SGLang finds in the tokenizer).
    """
    file = directory / "config.json"
    if not file.is_file():
        return None
    config = read_json(file)
    if "family" in config:
        return None  # a spechead head
    hub = None if source is None or Path(source).expanduser().is_dir() else str(source)
    layout = detect_layout(directory, config) or _eagle_on_hub(directory, config, hub, revision)
    if layout is None:
        return None
    what, names, importer = LAYOUTS[layout]
    if layout == "dflash":
        config = with_sglang_mask_token_id(config, target_tokenizer)
    tensors = read_tensors(weight_files(directory, names, hub, revision))
    head = importer(directory, config, tensors, target_config=target_config, device=device, dtype=dtype)
    if family and head.family != family:
        raise HeadError(
            f"{directory} holds a {head.family!r} head ({what}), not a {family!r} head: use load_head()"
        )
    return head


def _eagle_on_hub(
    directory: Path, config: dict[str, Any], hub: str | None, revision: str | None
) -> str | None:
    """Return "eagle" for a Hub EAGLE-1/2 head whose pickled weights the snapshot left out, else None."""
    # Published EAGLE heads have one decoder layer (rarely two): never fetch a whole model's pickle.
    if hub is None or "architectures" not in config or int(config.get("num_hidden_layers") or 99) > 2:
        return None
    try:
        files = weight_files(directory, EAGLE_WEIGHTS, hub, revision)
    except HeadError:
        return None
    return "eagle" if is_eagle_tensors(tensor_names(files)) else None


register_foreign_loader(load_foreign)  # load_head / DraftHead.from_pretrained convert through it

__all__ = ["FORMATS", "export_formats", "export_head", "is_head_dir", "load_foreign"]
