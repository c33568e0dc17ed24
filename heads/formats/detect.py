"""Recognise a head published by a reference project from its config.json (and tensor names)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spechead.heads.formats import dflash_import, eagle, eagle3_import, medusa, peagle_import
from spechead.heads.formats.weights import tensor_names

# Layout name -> (what it is, weight file names to look for, importer).
LAYOUTS = {
    "eagle": ("EAGLE-1/2 head (SafeAILab layout)", eagle.WEIGHT_NAMES, eagle.import_eagle),
    "eagle3": (
        "EAGLE-3 head (official / SGLang / SpecForge layout)",
        eagle3_import.WEIGHT_NAMES,
        eagle3_import.import_eagle3,
    ),
    "speculators": (
        "EAGLE-3 head (vLLM speculators layout)",
        eagle3_import.WEIGHT_NAMES,
        eagle3_import.import_speculators,
    ),
    "speculators-peagle": (
        "P-EAGLE head (vLLM speculators layout)",
        peagle_import.WEIGHT_NAMES,
        peagle_import.import_peagle_speculators,
    ),
    "speculators-dflash": (
        "DFlash drafter (vLLM speculators layout)",
        dflash_import.WEIGHT_NAMES,
        dflash_import.import_speculators_dflash,
    ),
    "dflash": (
        "DFlash drafter (z-lab / SGLang layout)",
        dflash_import.WEIGHT_NAMES,
        dflash_import.import_dflash,
    ),
    "medusa": ("Medusa-1 heads (FasterDecoding or vLLM layout)", medusa.WEIGHT_NAMES, medusa.import_medusa),
}
# speculators_model_type -> layout (any other type goes to "speculators", which names the ones it imports)
_SPECULATORS = {"peagle": "speculators-peagle", "dflash": "speculators-dflash"}


def layout_of_config(config: dict[str, Any]) -> str | None:
    """The layout a config.json alone identifies (None for spechead heads and anything else)."""
    if not isinstance(config, dict) or "family" in config:
        return None
    if "speculators_model_type" in config:
        return _SPECULATORS.get(str(config["speculators_model_type"]), "speculators")
    if "medusa_num_heads" in config or config.get("model_type") == "medusa":
        return "medusa"
    architectures = config.get("architectures") or []
    if any("DFlash" in str(a) for a in architectures) or "dflash_config" in config:
        return "dflash"  # before EAGLE-1/2's tensor names, which a DFlash drafter's (fc, layers.*) also match
    if any("Eagle3" in str(a) for a in architectures) or "draft_vocab_size" in config:
        return "eagle3"
    return None


def detect_layout(directory: Path, config: dict[str, Any]) -> str | None:
    """The layout of the head in `directory`: by config, else EAGLE-1/2 by its local tensor names."""
    found = layout_of_config(config)
    if found or not isinstance(config, dict) or "family" in config:
        return found
    files = [f for name in eagle.WEIGHT_NAMES for f in sorted(directory.glob(name)) if f.is_file()]
    return "eagle" if files and eagle.is_eagle_tensors(tensor_names(files[:1])) else None
