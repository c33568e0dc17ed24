"""Tensor files of heads published by other projects: find, fetch, read; and write exports.

Reference projects ship safetensors (speculators, SpecForge, vLLM) or pickled state dicts
(`pytorch_model.bin` of EAGLE, `medusa_lm_head.pt` of Medusa). Pickles are read with
`torch.load(weights_only=True)`, which unpickles tensors and plain containers only (no code runs).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

from spechead.heads.errors import HeadError
from spechead.heads.files import umask_mode


def read_json(file: Path) -> dict[str, Any]:
    """A JSON object from `file` (HeadError if it is missing, invalid or not an object)."""
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError:
        raise HeadError(f"{file.parent} has no {file.name}") from None
    except json.JSONDecodeError as err:
        raise HeadError(f"{file} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise HeadError(f"{file} holds a JSON {type(data).__name__}, not an object")
    return data


def _local_files(directory: Path, names: tuple[str, ...]) -> list[Path]:
    """The first of `names` present in `directory` (all shards for "*.safetensors")."""
    for name in names:
        found = sorted(directory.glob(name)) if "*" in name else [directory / name]
        found = [f for f in found if f.is_file()]
        if found:
            return found
    return []


def _fetch(source: str, revision: str | None, names: tuple[str, ...]) -> list[Path]:
    """Download the first of `names` that the Hub repo `source` holds ([] if none or offline)."""
    from huggingface_hub import hf_hub_download  # lazy: only Hub heads need it

    for name in names:
        if "*" in name:
            continue  # globs come with the snapshot already
        try:
            return [Path(hf_hub_download(source, name, revision=revision))]
        except Exception:  # missing file, offline, no access: try the next name
            continue
    return []


def weight_files(
    directory: Path, names: tuple[str, ...], source: str | None = None, revision: str | None = None
) -> list[Path]:
    """Files holding the weights: the first of `names` in `directory`, else fetched from Hub `source`."""
    files = _local_files(directory, names)
    if not files and source is not None and not Path(source).expanduser().is_dir():
        files = _fetch(source, revision, names)
    if not files:
        raise HeadError(f"{directory} has none of the weight files {list(names)}")
    return files


def read_tensors(files: list[Path]) -> dict[str, Tensor]:
    """All tensors of safetensors or pickled state-dict files, merged (CPU)."""
    tensors: dict[str, Tensor] = {}
    for file in files:
        try:
            if file.suffix == ".safetensors":
                part = load_file(str(file), device="cpu")
            else:
                part = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as err:  # corrupt file, a pickle holding more than tensors
            raise HeadError(f"could not read {file}: {type(err).__name__}: {err}") from None
        if not isinstance(part, dict) or not all(isinstance(v, Tensor) for v in part.values()):
            raise HeadError(f"{file} is not a state dict of tensors")
        tensors.update(part)
    return tensors


def tensor_names(files: list[Path]) -> set[str]:
    """Tensor names of the files without reading safetensors data (pickles are memory-mapped)."""
    names: set[str] = set()
    for file in files:
        try:
            if file.suffix == ".safetensors":
                with safe_open(str(file), framework="pt") as f:
                    names.update(f.keys())
            else:
                names.update(torch.load(file, map_location="cpu", weights_only=True, mmap=True))
        except Exception:  # unreadable: not a layout we can recognise
            continue
    return names


def _cpu_copies(tensors: dict[str, Tensor], dtype: torch.dtype | None) -> dict[str, Tensor]:
    """Contiguous CPU copies of `tensors`, floating ones cast to `dtype` if given."""
    out = {}
    for name, tensor in tensors.items():
        tensor = tensor.detach().to("cpu")
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        out[name] = tensor.contiguous().clone()  # clone: tied or shared storage cannot be saved twice
    return out


def write_tensors(tensors: dict[str, Tensor], file: Path, dtype: torch.dtype | None = None) -> Path:
    """Save contiguous CPU copies (floating tensors cast to `dtype` if given) as safetensors, with the mode
    the umask gives a new file (safetensors alone writes 0600)."""
    save_file(_cpu_copies(tensors, dtype), str(file), metadata={"format": "pt"})
    umask_mode(file)
    return file


def write_pickle(tensors: dict[str, Tensor], file: Path, dtype: torch.dtype | None = None) -> Path:
    """Save them as a pickled state dict of plain tensors (what reference engines `torch.load`)."""
    torch.save(_cpu_copies(tensors, dtype), file)
    return file


def target_embedding(target: str, revision: str | None = None) -> Tensor:
    """The input embedding [V, H] of target checkpoint `target` (a directory or a Hub id), read from its
    safetensors alone (the one tensor whose name ends in embed_tokens.weight; no model is built)."""
    from transformers.utils import cached_file  # local directories and Hub ids alike

    def fetch(name: str) -> Path | None:
        found = cached_file(target, name, revision=revision, _raise_exceptions_for_missing_entries=False)
        return Path(found) if found else None

    try:
        index = fetch("model.safetensors.index.json")
        if index is not None:
            weight_map = read_json(index).get("weight_map", {})
            names = [n for n in weight_map if n.endswith("embed_tokens.weight")]
            file = fetch(weight_map[names[0]]) if len(names) == 1 else None
        else:
            file = fetch("model.safetensors")
            names = []
            if file is not None:
                with safe_open(str(file), framework="pt") as f:
                    names = [n for n in f.keys() if n.endswith("embed_tokens.weight")]
    except (OSError, ValueError) as err:  # not a directory nor a reachable Hub repo (or an invalid id)
        raise HeadError(f"cannot read the target {target}: {err}") from None
    if file is None or len(names) != 1:
        raise HeadError(
            f"{target} has no safetensors checkpoint with exactly one embed_tokens.weight: pass the target "
            "the head was trained for"
        )
    with safe_open(str(file), framework="pt") as f:
        return f.get_tensor(names[0])
