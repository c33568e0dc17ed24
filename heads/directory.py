"""A head directory, the one place that knows its files: reads, writes and checks them for loading,
publishing and tree building alike.

    HEAD/config.json          family, format version, the head's config     read_config / write_config
    HEAD/model.safetensors    the head's own weights                        (DraftHead.save/from_pretrained)
    HEAD/tree.json            a static tree, its measured accuracy          read_tree / write_tree
    HEAD/adapter/             a peft LoRA adapter the target runs with      adapter_dir (Medusa-2)

A Hub id becomes its local snapshot (`resolve`, only the files decoding reads); `loading_files` is
what a published copy must hold to load exactly as the local one does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from spechead.heads.errors import HeadError

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
TREE_NAME = "tree.json"  # from scripts/build_tree.py
ADAPTER_NAME = "adapter"  # the folder a head that trains the target (Medusa-2) saves its adapter in
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # what peft loads
# What a head fetched from the Hub needs (fnmatch: `*` also matches `/`): config.json, weights, tree.json
# and an adapter's adapter_config.json + weights. Never the card or plots.
HUB_PATTERNS = ("*.json", "*.safetensors", "mask_embedding.pt")  # (vLLM DFlash: a learned mask embedding)


def resolve(path_or_hub_id: str | Path, revision: str | None = None) -> Path:
    """A head's local directory: a local path as is, a Hub id as its snapshot (HUB_PATTERNS files only)."""
    local = Path(path_or_hub_id).expanduser()
    if local.is_dir():
        return local
    if local.exists():
        raise HeadError(f"head {path_or_hub_id} is a file; pass the directory that holds {CONFIG_NAME}")
    from huggingface_hub import snapshot_download  # lazy: only Hub loads need it

    try:
        fetched = snapshot_download(str(path_or_hub_id), revision=revision, allow_patterns=list(HUB_PATTERNS))
    except Exception as err:  # offline, unreachable, missing repo, bad id: all mean "cannot fetch"
        raise HeadError(
            f"head {path_or_hub_id} is not a local directory and could not be fetched from the Hub: "
            f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        ) from err
    return Path(fetched)


# ---- config.json ---------------------------------------------------------------------------------


def read_config(directory: Path) -> dict[str, Any]:
    """HEAD/config.json of a spechead head (HeadError: missing, not JSON, or not a head's config)."""
    file = Path(directory) / CONFIG_NAME
    if not file.is_file():
        raise HeadError(f"{directory} has no {CONFIG_NAME}: it is not a head saved by save_pretrained")
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise HeadError(f"{file} is not valid JSON: {err}") from err
    if not isinstance(raw, dict) or not isinstance(raw.get("family"), str):
        raise HeadError(f"{file} has no 'family': it is not a spechead head config (a target model's?)")
    return raw


def write_config(directory: Path, config: dict[str, Any]) -> Path:
    """Write HEAD/config.json (the directory is created)."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    file = Path(directory) / CONFIG_NAME
    file.write_text(json.dumps(config, indent=2) + "\n")
    return file


# ---- tree.json -----------------------------------------------------------------------------------


def tree_paths(choices: Any) -> list[tuple[int, ...]]:
    """Rank paths (e.g. [[0], [1], [0, 0]]) checked and sorted by (length, ranks), so parents precede
    children; ValueError unless every path is non-empty, ranks >= 0, no duplicates, prefix-closed."""
    if not isinstance(choices, list):
        raise ValueError(f"tree paths must be a list of lists of ranks, got {type(choices).__name__}")
    paths = [tuple(int(x) for x in c) for c in choices]
    if any(not p for p in paths):
        raise ValueError("tree paths: an empty path (the root is added implicitly)")
    if any(x < 0 for p in paths for x in p):
        raise ValueError(f"tree paths: ranks must be >= 0, got {next(list(p) for p in paths if min(p) < 0)}")
    if len(set(paths)) != len(paths):
        raise ValueError("tree paths: duplicate paths")
    known = set(paths) | {()}
    missing = next((p for p in paths if p[:-1] not in known), None)
    if missing is not None:
        raise ValueError(f"tree paths: path {list(missing)} has no parent path {list(missing[:-1])}")
    return sorted(paths, key=lambda p: (len(p), p))


def read_tree(directory: str | Path) -> dict[str, Any] | None:
    """HEAD/tree.json ({"choices": rank paths, "accuracy": [depth, k] table, ...}) with its choices checked,
    or None when the (local) directory has none; ValueError naming the file when it is broken."""
    path = Path(directory).expanduser() / TREE_NAME
    if not path.is_file():
        return None
    try:
        tree = json.loads(path.read_text())
        tree["choices"] = [list(p) for p in tree_paths(tree["choices"])]
        if tree.get("accuracy"):  # (none or [] = no measured table)
            check_accuracy(tree["accuracy"])
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path} is not a valid tree file ({type(err).__name__}: {err})") from err
    return tree


def check_accuracy(table: Any) -> None:
    """ValueError unless `table` is an accuracy table: one row per depth, each the same number of
    probabilities (0..1) by rank."""
    if not isinstance(table, list) or not all(isinstance(row, list) and row for row in table):
        raise ValueError(
            f"accuracy must be a table (a list of [depth][rank] rows), got {json.dumps(table)[:60]}"
        )
    if len({len(row) for row in table}) != 1:
        raise ValueError("accuracy: every depth's row must have the same number of ranks")
    for row in table:
        for x in row:
            if isinstance(x, bool) or not isinstance(x, int | float) or not 0 <= x <= 1:
                raise ValueError(f"accuracy: {x!r} is not a probability between 0 and 1")


def write_tree(directory: str | Path, choices: list[list[int]], **info: object) -> Path:
    """Write HEAD/tree.json = {"choices": ..., **info} (never a tree a drafter would refuse); its path."""
    tree_paths(choices)
    path = Path(directory) / TREE_NAME
    path.write_text(json.dumps({"choices": choices, **info}, indent=2) + "\n")
    return path


def drop_tree(directory: str | Path) -> None:
    """Remove HEAD/tree.json, if any (when new weights are saved there: its tree and accuracy were measured
    on the old ones, and loading would calibrate the new head from them)."""
    (Path(directory) / TREE_NAME).unlink(missing_ok=True)


# ---- adapter/ ------------------------------------------------------------------------------------


def adapter_dir(directory: str | Path, config: dict[str, Any] | None = None) -> Path | None:
    """The LoRA adapter folder the head's config names (`lora_adapter`), checked complete; None if none."""
    directory = Path(directory)
    name = (config if config is not None else read_config(directory)).get("lora_adapter") or ""
    if not name:
        return None
    missing = [f for f in ADAPTER_FILES if not (directory / name / f).is_file()]
    if missing:
        raise HeadError(
            f"{directory / CONFIG_NAME} names the LoRA adapter {name!r} but {directory / name} lacks "
            f"{', '.join(missing)}: use the complete head directory (Medusa-2 saves head and adapter together)"
        )
    return directory / name


# ---- the whole directory -------------------------------------------------------------------------


def loading_files(directory: str | Path) -> dict[str, Path]:
    """{path in the directory: file} of everything loading reads (config, weights, tree, adapter), each
    checked; HeadError when one is missing or broken."""
    directory = Path(directory)
    config = read_config(directory)
    files = {CONFIG_NAME: directory / CONFIG_NAME, WEIGHTS_NAME: directory / WEIGHTS_NAME}
    if not files[WEIGHTS_NAME].is_file():
        raise HeadError(f"{directory} has no {WEIGHTS_NAME}: save the head with save_pretrained")
    try:
        if read_tree(directory) is not None:
            files[TREE_NAME] = directory / TREE_NAME
    except ValueError as err:
        raise HeadError(f"{err}: rebuild it with scripts/build_tree.py or remove it") from None
    adapter = adapter_dir(directory, config)
    if adapter is not None:
        for name in ADAPTER_FILES:
            files[f"{adapter.name}/{name}"] = adapter / name
    return files
