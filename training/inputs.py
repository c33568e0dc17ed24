"""Where a training run's data and target come from: the raw data and the whole frozen target (online),
or a hidden-state cache and only the target's embedding and lm_head (offline, training/hidden_cache/)."""

from __future__ import annotations

from typing import Any

import torch

from spechead.data.errors import DataError
from spechead.data.pipeline import TrainData, build_datasets
from spechead.training.hidden_cache.batches import HiddenCollator
from spechead.training.hidden_cache.match import offline_data
from spechead.training.hidden_cache.target import CachedTarget, load_cached_target
from spechead.training.settings import TrainSettings
from spechead.training.target import FrozenTarget, load_target


def training_data(s: TrainSettings, tokenizer: Any) -> TrainData:
    """The tokenized splits: built from the raw data (online) or read from the cache (offline)."""
    if s.data.hidden_states == "offline":
        return offline_data(s, tokenizer)
    return build_datasets(s.data, tokenizer, s.trainer.max_length, s.trainer.seed)


def training_target(
    s: TrainSettings, data: TrainData, device: torch.device | str
) -> FrozenTarget | CachedTarget:
    """The full frozen target (online) or its embedding + lm_head over the cached states (offline)."""
    if s.data.hidden_states == "offline":
        if not isinstance(data.collator, HiddenCollator):
            raise DataError("offline training needs the data of offline_data()")
        return load_cached_target(s.model, data.collator.layers, device)
    return load_target(s.model, device)
