"""The one entry point the trainer calls: raw conversations -> tokenized train/val splits + collator."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import datasets

from spechead.data.chat import TokenizeStats, require_chat_template, tokenize_dataset
from spechead.data.collate import Collator
from spechead.data.conversations import DataConfig, load_conversations
from spechead.data.errors import DataError

log = logging.getLogger(__name__)


@dataclass
class TrainData:
    """Tokenized splits (columns input_ids, loss_mask; one row per conversation) and their collator."""

    train: datasets.Dataset
    val: datasets.Dataset  # may have 0 rows (val_size=0, a 1-conversation dataset, or all val rows dropped)
    stats: TokenizeStats  # train and val together
    collator: Collator


def build_datasets(cfg: DataConfig, tokenizer: Any, max_length: int, seed: int) -> TrainData:
    """Load cfg's conversations, hold out a validation split, tokenize both and build the collator.

    The split is made on conversations before tokenization, deterministically for `seed`, so one
    conversation never lands in both splits. Raises DataError for bad data or settings.
    """
    require_chat_template(tokenizer)  # fail before reading a large dataset
    conversations = load_conversations(cfg)
    train_raw, val_raw = split_conversations(conversations, cfg.val_size, seed)
    train, train_stats = tokenize_dataset(train_raw, tokenizer, max_length, cfg.num_proc)
    # A small validation split may lose all its rows to truncation; training can still go on.
    val, val_stats = tokenize_dataset(val_raw, tokenizer, max_length, cfg.num_proc, allow_empty=True)
    stats = train_stats + val_stats
    log.info("data %s: %s; %d train / %d val", cfg.name, stats.summary(), len(train), len(val))
    return TrainData(train=train, val=val, stats=stats, collator=Collator(pad_token_id=_pad_id(tokenizer)))


def split_conversations(
    ds: datasets.Dataset, val_size: float, seed: int
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """(train, val) rows of `ds`; val has val_count(len(ds), val_size) rows, chosen by `seed`."""
    n_val = val_count(len(ds), val_size)
    if n_val == 0:
        return ds, ds.select([])
    parts = ds.train_test_split(test_size=n_val, seed=seed, shuffle=True)
    return parts["train"], parts["test"]


def val_count(n: int, val_size: float) -> int:
    """Validation rows for n conversations: a fraction (<1) or a count (>=1), at least 1 and at most n-1."""
    if val_size < 0:
        raise DataError(f"data.val_size={val_size} is negative: use a fraction (<1), a count (>=1) or 0")
    if val_size == 0 or n < 2:
        return 0
    wanted = round(n * val_size) if val_size < 1 else int(val_size)
    return min(max(wanted, 1), n - 1)  # keep at least one training conversation


def _pad_id(tokenizer: Any) -> int:
    # Padding is masked out by attention_mask and loss_mask, so any valid id works when none is defined.
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return int(token_id)
    return 0
