"""Read a hidden-state cache as training data: token rows (a torch Dataset) + a collator adding states.

The rows are exactly the tokenized conversations of the online path, in the same order, so a
DataLoader with the same sampler yields the same batches; the collator pads them as the online
collator does and adds the cached states as `batch["hidden_states"]` (S, B, T, H) for the S stored
indices in `layers` order (zeros on padding). States are read lazily from the memory-mapped shards.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch.utils.data import Dataset

from spechead.data.collate import Collator
from spechead.data.errors import DataError
from spechead.training.hidden_cache.layout import load_index

OPEN_SHARDS = 32  # safetensors handles kept open per process


class ShardReader:
    """Random access to the rows of one split's shards (global row numbers of that split)."""

    def __init__(self, directory: Path, shards: list[dict]):
        self.directory = directory
        self.shards = shards
        self.starts = [s["start"] for s in shards]
        self._handles: OrderedDict[str, Any] = OrderedDict()
        self._offsets: dict[str, torch.Tensor] = {}

    def __getstate__(self) -> dict:  # DataLoader workers open their own handles
        return {**self.__dict__, "_handles": OrderedDict(), "_offsets": {}}

    def _open(self, file: str):
        handle = self._handles.pop(file, None)
        if handle is None:
            path = self.directory / file
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as err:  # OSError, or safetensors' own error for a damaged file
                raise DataError(f"cannot read cache shard {path} ({err}): rebuild the cache") from None
            if len(self._handles) >= OPEN_SHARDS:
                self._handles.popitem(last=False)
        self._handles[file] = handle
        return handle

    def locate(self, row: int) -> tuple[Any, int, int]:
        """(shard handle, first token, end token) of split row `row`."""
        shard = self.shards[bisect.bisect_right(self.starts, row) - 1]
        handle = self._open(shard["file"])
        offsets = self._offsets.get(shard["file"])
        if offsets is None:
            offsets = self._offsets[shard["file"]] = handle.get_tensor("offsets")
        local = row - shard["start"]
        return handle, int(offsets[local]), int(offsets[local + 1])

    def states(self, row: int, layers: Sequence[int]) -> list[torch.Tensor]:
        """The row's stored states at `layers`: len(layers) x (T_r, H)."""
        handle, a, b = self.locate(row)
        return [handle.get_slice(f"hidden.{i}")[a:b] for i in layers]

    def tokens(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """All rows' (input_ids (N,) int32, loss_mask (N,) uint8, offsets (R + 1,) int64), in row order."""
        ids, masks, offsets = [], [], [torch.zeros(1, dtype=torch.int64)]
        for shard in self.shards:
            handle = self._open(shard["file"])
            ids.append(handle.get_tensor("input_ids"))
            masks.append(handle.get_tensor("loss_mask"))
            offsets.append(handle.get_tensor("offsets")[1:] + offsets[-1][-1])
        if not self.shards:
            return torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.uint8), offsets[0]
        return torch.cat(ids), torch.cat(masks), torch.cat(offsets)


class CachedRows(Dataset):
    """One split's token rows {input_ids (T_r,), loss_mask (T_r,), cache_split, cache_row}; no states."""

    def __init__(self, reader: ShardReader, split: str):
        self.reader = reader
        self.split = split
        self.input_ids, self.loss_mask, self.offsets = reader.tokens()

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return {
            "input_ids": self.input_ids[a:b].long(),
            "loss_mask": self.loss_mask[a:b].long(),
            "cache_split": self.split,
            "cache_row": i,
        }

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (self[i] for i in range(len(self)))


class HiddenCollator:
    """Pads token rows like `Collator` and adds their cached states (S, B, T, H), zeros on padding."""

    def __init__(self, pad_token_id: int, readers: dict[str, ShardReader], layers: Sequence[int]):
        self.base = Collator(pad_token_id=pad_token_id)
        self.readers = readers  # by split name: rows say which split they come from
        self.layers = list(layers)  # stored indices to read, in the order of batch["hidden_states"]

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = self.base([{"input_ids": f["input_ids"], "loss_mask": f["loss_mask"]} for f in features])
        reader = self.readers[features[0]["cache_split"]]
        rows = [reader.states(f["cache_row"], self.layers) for f in features]  # B x S x (T_r, H)
        first = rows[0][0]
        batch_size, length = batch["input_ids"].shape
        states = torch.zeros(len(self.layers), batch_size, length, first.shape[-1], dtype=first.dtype)
        for b, per_layer in enumerate(rows):
            for s, x in enumerate(per_layer):
                states[s, b, : x.shape[0]] = x
        batch["hidden_states"] = states  # (S, B, T, H)
        return batch


def open_split(directory: Path, index: dict, split: str) -> CachedRows:
    """The token rows of `split` of the cache in `directory` (index from load_index)."""
    part = index["splits"].get(split, {"shards": []})
    return CachedRows(ShardReader(directory, part["shards"]), split)


__all__ = ["CachedRows", "HiddenCollator", "ShardReader", "load_index", "open_split"]
