"""Offline hidden-state cache on disk: layout, size estimate, atomic shard writes and the index.

A cache directory holds, per split (train, val), shards of consecutive rows (conversations) as
safetensors files with these tensors (N = the shard's tokens, R = its rows):

    input_ids (N,) int32   loss_mask (N,) uint8   offsets (R + 1,) int64 (row r = [offsets[r], offsets[r+1]))
    hidden.{i} (N, H)      one per stored hidden-state index i (HF `output_hidden_states` numbering)

`plan.json` fixes the shard row ranges before any work (so a rerun produces the same shards), each
process records the shards it finished in `progress-rank{r}.json`, and `index.json` (written last,
only once every shard exists) lists the complete cache. A shard is written to a temporary name,
fsynced and renamed, so a file under its final name is always complete.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from spechead.data.errors import DataError
from spechead.heads.files import umask_mode

FORMAT = "spechead-hidden-cache"
VERSION = 1
PLAN_FILE = "plan.json"
INDEX_FILE = "index.json"
PROGRESS_GLOB = "progress-rank*.json"
SPLITS = ("train", "val")
STORAGE_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
TOKEN_BYTES = 4 + 1  # input_ids int32 + loss_mask uint8 per token
OFFSET_BYTES = 8  # one int64 offset per row (+1 per shard)


def storage_dtype(name: str) -> torch.dtype:
    """The torch dtype for a cache dtype name (float32/bfloat16/float16 or fp32/bf16/fp16)."""
    if name not in STORAGE_DTYPES:
        raise DataError(f"cache.dtype={name!r}: use one of {', '.join(STORAGE_DTYPES)}")
    return STORAGE_DTYPES[name]


def bytes_per_token(num_layers: int, hidden_size: int, dtype: torch.dtype) -> int:
    """Bytes one token takes: num_layers states of hidden_size values, plus its id and loss flag."""
    return num_layers * hidden_size * dtype.itemsize + TOKEN_BYTES


def tensor_bytes(tokens: int, rows: int, shards: int, per_token: int) -> int:
    """Bytes of all tensor data (headers excluded) for `tokens` tokens in `rows` rows over `shards` shards."""
    return tokens * per_token + (rows + shards) * OFFSET_BYTES


@dataclass
class Shard:
    """One planned shard: rows [start, end) of `split` holding `tokens` tokens."""

    split: str
    number: int  # global shard number over the whole cache (train shards first)
    start: int
    end: int
    tokens: int

    def file_name(self, rank: int) -> str:
        return f"{self.split}-{self.number:05d}-rank{rank}.safetensors"


def plan_shards(lengths: dict[str, Sequence[int]], per_token: int, shard_bytes: int) -> list[Shard]:
    """Cut each split's rows (lengths in tokens, in order) into consecutive shards of about shard_bytes."""
    shards: list[Shard] = []
    for split in SPLITS:
        rows = list(lengths.get(split, []))
        start, tokens = 0, 0
        for i, n in enumerate(rows):
            tokens += int(n)
            if tokens * per_token >= shard_bytes or i == len(rows) - 1:
                shards.append(Shard(split, len(shards), start, i + 1, tokens))
                start, tokens = i + 1, 0
    return shards


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` via a temporary file, fsync and rename: readers never see a partial file."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1) + "\n").encode())


def write_shard(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> int:
    """Save a shard's tensors atomically (temporary name, fsync, rename); returns its size in bytes.

    Nothing ever exists under `path` unless the whole shard was written; on failure the temporary is removed.
    """
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
        umask_mode(tmp)  # safetensors creates files readable by their owner only
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)  # a failed write (disk full, interrupt) leaves no partial file
        raise
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    return path.stat().st_size


def shard_tensors(
    ids: Sequence[torch.Tensor], masks: Sequence[torch.Tensor], states: dict[int, list[torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """A shard's tensors from R rows: ids/masks R x (T_r,), states {index: R x (T_r, H)}."""
    lengths = torch.tensor([0] + [int(t.numel()) for t in ids], dtype=torch.int64)
    out = {
        "input_ids": torch.cat(list(ids)).to(torch.int32),  # (N,)
        "loss_mask": torch.cat(list(masks)).to(torch.uint8),  # (N,)
        "offsets": torch.cumsum(lengths, 0),  # (R + 1,)
    }
    for index, rows in states.items():
        out[f"hidden.{index}"] = torch.cat(rows)  # (N, H)
    return out


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise DataError(f"cannot read {path} ({err}): the cache is damaged; rebuild it") from None


def completed_shards(directory: Path) -> dict[int, dict]:
    """Shards recorded as finished by any process ({number: entry}) whose file is there at full size."""
    done: dict[int, dict] = {}
    for progress in sorted(directory.glob(PROGRESS_GLOB)):
        for entry in read_json(progress)["shards"]:
            file = directory / entry["file"]
            if file.is_file() and file.stat().st_size == entry["bytes"]:
                done[entry["number"]] = entry
    return done


def record_progress(directory: Path, rank: int, entries: list[dict]) -> None:
    """Rewrite this process's list of finished shards (atomically)."""
    atomic_write_json(directory / f"progress-rank{rank}.json", {"rank": rank, "shards": entries})


def own_progress(directory: Path, rank: int) -> list[dict]:
    path = directory / f"progress-rank{rank}.json"
    return read_json(path)["shards"] if path.is_file() else []


def remove_temporaries(directory: Path) -> None:
    """Delete leftover partial files (of a killed run); only called when no process is writing."""
    for tmp in directory.glob(".*.tmp"):
        tmp.unlink(missing_ok=True)


def write_index(directory: Path, plan: dict, done: dict[int, dict]) -> dict:
    """Write index.json listing every shard per split; requires all planned shards to be done."""
    missing = [s["number"] for s in plan["shards"] if s["number"] not in done]
    if missing:
        raise DataError(f"cannot index {directory}: shards {missing[:5]} are not finished")
    splits: dict[str, dict] = {}
    for s in plan["shards"]:
        part = splits.setdefault(s["split"], {"rows": 0, "tokens": 0, "bytes": 0, "shards": []})
        entry = done[s["number"]]
        part["rows"] += s["end"] - s["start"]
        part["tokens"] += s["tokens"]
        part["bytes"] += entry["bytes"]
        part["shards"].append({**s, "file": entry["file"], "bytes": entry["bytes"]})
    index = {**{k: v for k, v in plan.items() if k != "shards"}, "complete": True, "splits": splits}
    atomic_write_json(directory / INDEX_FILE, index)
    return index


def shard_from_dict(entry: dict) -> Shard:
    return Shard(entry["split"], entry["number"], entry["start"], entry["end"], entry["tokens"])


def load_index(directory: str | Path) -> dict:
    """The complete cache's index; DataError (one line, with the fix) when absent or unfinished."""
    directory = Path(directory).expanduser()
    if not directory.is_dir():
        raise DataError(
            f"data.cache_dir={directory} does not exist: build it with "
            f"`python scripts/cache_hidden_states.py data.cache_dir={directory} ...` (same head/model/data)"
        )
    index_file = directory / INDEX_FILE
    if not index_file.is_file():
        if (directory / PLAN_FILE).is_file():
            plan = read_json(directory / PLAN_FILE)
            done = len(completed_shards(directory))
            raise DataError(
                f"the cache in {directory} is unfinished ({done}/{len(plan['shards'])} shards): rerun "
                "scripts/cache_hidden_states.py with the same arguments to finish it"
            )
        raise DataError(f"{directory} holds no hidden-state cache (no {INDEX_FILE}): check data.cache_dir")
    index = read_json(index_file)
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise DataError(
            f"{index_file} is not a {FORMAT} v{VERSION} index: rebuild it with scripts/cache_hidden_states.py"
        )
    return index
