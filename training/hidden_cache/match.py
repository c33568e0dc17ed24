"""Training from a hidden-state cache (`data.hidden_states=offline`): what a cache must match, and the
data + target the trainer uses in its place.

A cache records what it was built for (`built_for`): the target, tokenizer, data settings,
max_length and seed (which fix the tokenized rows and the train/val split) and the stored layers.
Training from it refuses any difference with a one-line error naming the setting, so the offline
run sees exactly the batches and states the online run would.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from transformers import AutoConfig

from spechead.data.chat import TokenizeStats
from spechead.data.pipeline import TrainData
from spechead.heads.base import resolve_layers
from spechead.training.errors import TrainError
from spechead.training.hidden_cache.batches import HiddenCollator, open_split
from spechead.training.hidden_cache.layout import load_index
from spechead.training.objectives import family_for
from spechead.training.settings import HeadSettings, TrainSettings
from spechead.training.target import TargetConfig

# DataConfig keys that do not change the tokenized rows.
DATA_KEYS_IGNORED = ("hidden_states", "cache_dir", "num_proc", "name")
LABELS = {"tokenizer": "tokenizer or chat template", "target_fingerprint": "target config or weights"}


def stored_layers(head: HeadSettings, num_layers: int) -> list[int]:
    """The hidden-state indices a cache for `head` stores: the head's layers plus the final normed state."""
    layers = head.layers or family_for(head.family).default_layers(num_layers)
    return sorted(set(resolve_layers(list(layers), num_layers)) | {num_layers})


def _local(path: str) -> str:
    expanded = os.path.expanduser(path)
    return os.path.abspath(expanded) if os.path.exists(expanded) else path


def target_fingerprint(cfg: TargetConfig) -> str:
    """sha256 of the target's config.json and weight index (or single weight file size)."""
    from transformers.utils.hub import cached_file

    digest = hashlib.sha256()
    for name in ("config.json", "model.safetensors.index.json"):
        file = cached_file(cfg.path, name, revision=cfg.revision, _raise_exceptions_for_missing_entries=False)
        digest.update(Path(file).read_bytes() if file else b"-")
    single = Path(_local(cfg.path)) / "model.safetensors"
    digest.update(str(single.stat().st_size if single.is_file() else "").encode())
    return digest.hexdigest()[:16]


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of the tokenizer's vocabulary/rules, special tokens and chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    extra = json.dumps([tokenizer.chat_template, str(tokenizer.special_tokens_map)], sort_keys=True)
    return hashlib.sha256((vocab + extra).encode()).hexdigest()[:16]


def built_for(s: TrainSettings, tokenizer: Any, num_layers: int) -> dict[str, Any]:
    """What a cache built with settings `s` holds; training compares its own record to this."""
    data = {k: v for k, v in asdict(s.data).items() if k not in DATA_KEYS_IGNORED}
    data["path"] = _local(s.data.path)
    return {
        "head_family": s.head.family,
        "stored_layers": stored_layers(s.head, num_layers),
        "model.path": _local(s.model.path),
        "model.dtype": s.model.dtype,
        "model.revision": s.model.revision,
        "target_fingerprint": target_fingerprint(s.model),
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "trainer.max_length": s.trainer.max_length,
        "trainer.seed": s.trainer.seed,
        **{f"data.{k}": v for k, v in data.items()},
    }


def check_compatible(cache: dict[str, Any], mine: dict[str, Any], where: str) -> None:
    """TrainError naming the first setting in which the cache differs from this run."""
    rebuild = "rebuild the cache with scripts/cache_hidden_states.py for these settings"
    missing = sorted(set(mine["stored_layers"]) - set(cache["stored_layers"]))
    if missing:
        raise TrainError(
            f"the cache in {where} (built for head {cache['head_family']}) stores hidden states "
            f"{cache['stored_layers']} but head {mine['head_family']} needs {mine['stored_layers']}: {rebuild}"
        )
    for key, value in mine.items():
        if key in ("head_family", "stored_layers") or cache.get(key) == value:
            continue
        what = LABELS.get(key, key)
        hint = f" (or set {key}={cache.get(key)})" if "." in key else ""
        raise TrainError(
            f"the cache in {where} was built with another {what} "
            f"({cache.get(key)!r}, this run: {value!r}): {rebuild}{hint}"
        )


def target_config(cfg: TargetConfig):
    try:
        return AutoConfig.from_pretrained(
            cfg.path, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code
        )
    except (OSError, ValueError) as err:
        raise TrainError(f"model.path={cfg.path!r}: cannot read its config ({err})") from None


def offline_data(s: TrainSettings, tokenizer: Any) -> TrainData:
    """Train/val rows from `s.data.cache_dir`, after checking the cache matches `s`."""
    why = family_for(s.head.family).trains_target  # such families need the whole target at every step
    if why:
        raise TrainError(
            f"head {s.head.family} cannot train from a hidden-state cache ({why}): use data.hidden_states=online"
        )
    directory = Path(s.data.cache_dir).expanduser()
    index = load_index(directory)
    num_layers = target_config(s.model).get_text_config().num_hidden_layers
    mine = built_for(s, tokenizer, num_layers)
    check_compatible(index["built_for"], mine, str(directory))
    train, val = open_split(directory, index, "train"), open_split(directory, index, "val")
    readers = {"train": train.reader, "val": val.reader}
    collator = HiddenCollator(index["pad_token_id"], readers, mine["stored_layers"])
    return TrainData(train=train, val=val, stats=TokenizeStats(**index["stats"]), collator=collator)
