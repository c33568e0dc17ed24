"""Self-speculative drafter specs: names with inline options and the small drafter file.

    layer_skip                      default skip set (`default_skip`)
    layer_skip@skip=2+3+6           skip layers 2, 3 and 6 ("4-7": a range)
    early_exit@layer=4              the first 4 layers, then the final norm and lm_head
    early_exit                      exit at L // 2
    outputs/skip.json               a drafter file from scripts/search_skip.py
    ...@num_draft=4,width=2x1       any DraftModelDrafter shape option as well

The file is JSON: {"drafter": "layer_skip", "skip_layers": [...], "num_layers": L, "num_draft": k}
or {"drafter": "early_exit", "exit_layer": k, ...}; other keys (the search's measurements) are kept
for the reader and ignored here. Options given with the spec (parsed by `drafter_specs.drafter_options`,
as every spec's) override the file's.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import PreTrainedModel

from spechead.inference.drafters.draft_model import DRAFT_MODEL_OPTIONS
from spechead.inference.drafters.layer_skip import KINDS, LayerSkipDrafter, num_layers_of

ALIASES = {"skip": "skip_layers", "layer": "exit_layer"}  # short inline names -> constructor names


def read_drafter_file(path: Path) -> dict | None:
    """The drafter file's dict, or None when `path` is not a self-speculative drafter file."""
    if path.suffix != ".json" or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("drafter") in KINDS else None


def is_self_spec(spec: object) -> bool:
    """True for `layer_skip` / `early_exit` (with or without @options) and their drafter files."""
    if not isinstance(spec, str):
        return False
    return (
        spec.partition("@")[0] in KINDS
        or read_drafter_file(Path(spec.partition("@")[0]).expanduser()) is not None
    )


def make_self_drafter(name: str, target: PreTrainedModel, **options) -> LayerSkipDrafter:
    """A LayerSkipDrafter on `target` from a kind or drafter file `name` (a spec without its @options,
    which `drafter_specs.drafter_options` parses) and options (they override the file's)."""
    settings: dict = {}
    if name in KINDS:
        kind = name
    else:
        data = read_drafter_file(Path(name).expanduser())
        assert data is not None  # the caller's is_self_spec(spec) read it
        kind, layers = data["drafter"], data.get("num_layers")
        if layers is not None and layers != num_layers_of(target):
            raise ValueError(
                f"drafter file {name} was made for a target with {layers} layers, this one has "
                f"{num_layers_of(target)}: run scripts/search_skip.py on this target"
            )
        settings = {k: data[k] for k in ("skip_layers", "exit_layer", *DRAFT_MODEL_OPTIONS) if k in data}
    for key, value in options.items():
        settings[ALIASES.get(key, key)] = value
    layer_key = "skip_layers" if kind == "layer_skip" else "exit_layer"
    valid = (layer_key, *DRAFT_MODEL_OPTIONS)
    unknown = sorted(set(settings) - set(valid))
    if unknown:
        short = {v: k for k, v in ALIASES.items()}[layer_key]
        raise ValueError(
            f"{kind} drafter: unknown option(s) {', '.join(unknown)}; valid: {short}, {', '.join(DRAFT_MODEL_OPTIONS)}"
        )
    if kind == "early_exit":
        settings.setdefault("exit_layer", num_layers_of(target) // 2)
    return LayerSkipDrafter(target, **settings)


def save_drafter_file(path: str | Path, drafter: LayerSkipDrafter, **info) -> Path:
    """Write `drafter` (kind, layers, chain length) and extra `info` as a drafter file (JSON)."""
    path = Path(path)
    if path.suffix != ".json":
        raise ValueError(f"a drafter file ends in .json, got {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**drafter.describe(), **info}, indent=1) + "\n")
    return path
