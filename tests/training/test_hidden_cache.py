"""The hidden-state cache format: shard plan, exact sizes, atomic writes, index, reading rows back."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from spechead.data.collate import Collator
from spechead.data.errors import DataError
from spechead.training.hidden_cache import layout as hc
from spechead.training.hidden_cache.batches import HiddenCollator, open_split

H = 8
LAYERS = [1, 3]


def rows(lengths: list[int], seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [
        {
            "input_ids": torch.randint(0, 100, (n,), generator=gen),
            "loss_mask": torch.randint(0, 2, (n,), generator=gen),
            "states": {i: torch.randn(n, H, generator=gen) for i in LAYERS},
        }
        for n in lengths
    ]


def write_cache(directory, splits: dict[str, list[dict]], shard_bytes: int) -> dict:
    """Plan, write and index a cache of synthetic rows the way the builder does."""
    per_token = hc.bytes_per_token(len(LAYERS), H, torch.float32)
    lengths = {s: [len(r["input_ids"]) for r in rs] for s, rs in splits.items()}
    shards = hc.plan_shards(lengths, per_token, shard_bytes)
    plan = {"format": hc.FORMAT, "version": hc.VERSION, "bytes_per_token": per_token, "pad_token_id": 0}
    plan["shards"] = [vars(s) for s in shards]
    directory.mkdir(parents=True, exist_ok=True)
    hc.atomic_write_json(directory / hc.PLAN_FILE, plan)
    entries = []
    for shard in shards:
        part = splits[shard.split][shard.start : shard.end]
        tensors = hc.shard_tensors(
            [r["input_ids"] for r in part],
            [r["loss_mask"] for r in part],
            {i: [r["states"][i] for r in part] for i in LAYERS},
        )
        name = shard.file_name(0)
        size = hc.write_shard(directory / name, tensors, {"split": shard.split})
        entries.append({**vars(shard), "file": name, "bytes": size})
        hc.record_progress(directory, 0, entries)
    return hc.write_index(directory, plan, hc.completed_shards(directory))


def data_bytes(path) -> int:
    """Bytes of tensor data in a safetensors file: its size minus the 8-byte length and the JSON header."""
    with open(path, "rb") as f:
        (header,) = struct.unpack("<Q", f.read(8))
    return path.stat().st_size - 8 - header


def test_plan_cuts_each_split_into_consecutive_shards_of_about_the_size():
    per_token = 100
    shards = hc.plan_shards({"train": [5, 5, 5, 5, 5, 3], "val": [4, 4]}, per_token, shard_bytes=1000)
    assert [(s.split, s.start, s.end, s.tokens) for s in shards] == [
        ("train", 0, 2, 10),
        ("train", 2, 4, 10),
        ("train", 4, 6, 8),  # the split's last shard may be smaller
        ("val", 0, 2, 8),  # a shard never mixes splits
    ]
    assert [s.number for s in shards] == [0, 1, 2, 3]


def test_bytes_on_disk_per_token_match_the_estimate(tmp_path):
    splits = {"train": rows([7, 3, 12, 9, 5]), "val": rows([6, 4], seed=1)}
    index = write_cache(tmp_path, splits, shard_bytes=2000)
    per_token = hc.bytes_per_token(len(LAYERS), H, torch.float32)
    assert per_token == 2 * 8 * 4 + 5
    for part in index["splits"].values():
        for shard in part["shards"]:
            expected = hc.tensor_bytes(shard["tokens"], shard["end"] - shard["start"], 1, per_token)
            assert data_bytes(tmp_path / shard["file"]) == expected  # exact: only headers on top
    tokens = sum(p["tokens"] for p in index["splits"].values())
    on_disk = sum(p["bytes"] for p in index["splits"].values())
    assert tokens == 46
    assert 1.0 <= on_disk / (tokens * per_token) < 1.5  # headers and offsets: tiny rows make them visible


def test_rows_and_states_read_back_in_order(tmp_path):
    splits = {"train": rows([7, 3, 12, 9, 5]), "val": rows([6, 4], seed=1)}
    index = write_cache(tmp_path, splits, shard_bytes=1500)
    assert len(index["splits"]["train"]["shards"]) > 1
    train = open_split(tmp_path, index, "train")
    assert len(train) == 5
    for i, row in enumerate(train):
        assert row["cache_split"] == "train" and row["cache_row"] == i
        assert torch.equal(row["input_ids"], splits["train"][i]["input_ids"])
        assert torch.equal(row["loss_mask"], splits["train"][i]["loss_mask"])
        for layer, state in zip(LAYERS, train.reader.states(i, LAYERS)):
            assert torch.equal(state, splits["train"][i]["states"][layer])


def test_collator_pads_like_the_online_collator_and_adds_states(tmp_path):
    splits = {"train": rows([7, 3, 12]), "val": rows([6, 4], seed=1)}
    index = write_cache(tmp_path, splits, shard_bytes=10**6)
    train, val = open_split(tmp_path, index, "train"), open_split(tmp_path, index, "val")
    collate = HiddenCollator(0, {"train": train.reader, "val": val.reader}, [3, 1])
    batch = collate([train[2], train[1]])
    online = Collator(pad_token_id=0)([splits["train"][2], splits["train"][1]])
    for key in ("input_ids", "attention_mask", "loss_mask"):
        assert torch.equal(batch[key], online[key])
    states = batch["hidden_states"]  # (S, B, T, H) in the collator's layer order
    assert states.shape == (2, 2, 12, H)
    assert torch.equal(states[0, 1, :3], splits["train"][1]["states"][3])
    assert torch.equal(states[1, 0], splits["train"][2]["states"][1])
    assert not states[:, 1, 3:].any()  # zeros on padding
    assert collate([val[1]])["hidden_states"].shape == (2, 1, 4, H)


def test_a_partial_or_missing_shard_is_never_counted_as_finished(tmp_path):
    index = write_cache(tmp_path, {"train": rows([5, 5, 5, 5])}, shard_bytes=300)
    shards = index["splits"]["train"]["shards"]
    assert len(hc.completed_shards(tmp_path)) == len(shards) == 4
    last = tmp_path / shards[-1]["file"]
    last.write_bytes(last.read_bytes()[:100])  # e.g. a copy cut short
    (tmp_path / shards[1]["file"]).unlink()
    assert sorted(hc.completed_shards(tmp_path)) == [0, 2]
    (tmp_path / ".x.safetensors.tmp").write_bytes(b"partial")
    hc.remove_temporaries(tmp_path)
    assert not list(tmp_path.glob(".*.tmp"))


def test_index_is_only_written_for_a_complete_cache(tmp_path):
    write_cache(tmp_path, {"train": rows([5, 5, 5])}, shard_bytes=300)
    plan = hc.read_json(tmp_path / hc.PLAN_FILE)
    done = hc.completed_shards(tmp_path)
    del done[1]
    with pytest.raises(DataError, match=r"shards \[1\] are not finished"):
        hc.write_index(tmp_path, plan, done)


def test_load_index_says_how_to_fix_a_missing_unfinished_or_foreign_cache(tmp_path):
    with pytest.raises(DataError, match="does not exist: build it with"):
        hc.load_index(tmp_path / "nope")
    write_cache(tmp_path / "c", {"train": rows([5, 5, 5])}, shard_bytes=300)
    assert hc.load_index(tmp_path / "c")["complete"]
    (tmp_path / "c" / hc.INDEX_FILE).unlink()
    (tmp_path / "c" / "progress-rank0.json").unlink()
    with pytest.raises(DataError, match=r"unfinished \(0/3 shards\): rerun"):
        hc.load_index(tmp_path / "c")
    (tmp_path / "d").mkdir()
    with pytest.raises(DataError, match="holds no hidden-state cache"):
        hc.load_index(tmp_path / "d")
    (tmp_path / "d" / hc.INDEX_FILE).write_text(json.dumps({"format": "other"}))
    with pytest.raises(DataError, match="is not a spechead-hidden-cache v1 index"):
        hc.load_index(tmp_path / "d")


def test_storage_dtype_names():
    assert hc.storage_dtype("bf16") is torch.bfloat16 and hc.storage_dtype("float32") is torch.float32
    with pytest.raises(DataError, match="cache.dtype='int8'"):
        hc.storage_dtype("int8")


def test_a_failed_shard_write_keeps_the_previous_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    part = rows([5, 4])
    tensors = hc.shard_tensors(
        [r["input_ids"] for r in part],
        [r["loss_mask"] for r in part],
        {i: [r["states"][i] for r in part] for i in LAYERS},
    )
    path = tmp_path / "train-00000-rank0.safetensors"
    hc.write_shard(path, tensors, {"shard": "train 0"})
    before = path.read_bytes()

    def half_then_disk_full(tensors, filename, metadata=None):
        save_file(tensors, filename, metadata=metadata)
        with open(filename, "r+b") as f:
            f.truncate(100)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hc, "save_file", half_then_disk_full)
    with pytest.raises(OSError, match="No space left"):
        hc.write_shard(path, {**tensors, "input_ids": tensors["input_ids"] + 1}, {"shard": "train 0"})
    assert path.read_bytes() == before  # a reader never sees the half-written file
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
