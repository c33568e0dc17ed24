"""Offline cache crash safety: a shard write that fails midway leaves nothing under the shard's name."""

from __future__ import annotations

import os

import pytest
from safetensors.torch import save_file

from spechead.data.errors import DataError
from spechead.training.hidden_cache import layout as hc
from spechead.training.hidden_cache.build import CacheConfig, build_cache

CRASH_AT = 3  # the third shard write fails


def crash_on_write(number: int, calls: list[str], at_crash: list[str]):
    """A safetensors save_file that works, except call `number`: half the file, then a disk-full error.

    `at_crash` gets the directory listing at that moment: what a killed process (kill -9, power cut,
    which no cleanup code sees) would leave behind.
    """

    def save(tensors, filename, metadata=None):
        calls.append(os.path.basename(filename))
        save_file(tensors, filename, metadata=metadata)
        if len(calls) == number:
            with open(filename, "r+b") as f:
                f.truncate(os.path.getsize(filename) // 2)
            at_crash.extend(sorted(os.listdir(os.path.dirname(filename))))
            raise OSError(28, "No space left on device")

    return save


def test_a_crash_inside_a_shard_write_leaves_no_shard_and_a_rerun_completes(
    tmp_path, tiny_target_dir, chat_file, training_kit, monkeypatch
):
    overrides = training_kit.overrides(tiny_target_dir, chat_file, tmp_path / "unused", head="eagle3")
    settings = training_kit.settings([*overrides, f"data.cache_dir={tmp_path / 'cache'}"])
    cache = tmp_path / "cache"
    config = CacheConfig(dtype="float32", shard_mb=0.1)
    calls: list[str] = []
    at_crash: list[str] = []
    monkeypatch.setattr(hc, "save_file", crash_on_write(CRASH_AT, calls, at_crash))
    with pytest.raises(OSError, match="No space left"):
        build_cache(settings, config, log=lambda line: None)
    monkeypatch.undo()

    plan = hc.read_json(cache / hc.PLAN_FILE)
    assert len(plan["shards"]) > CRASH_AT
    crashed = hc.shard_from_dict(plan["shards"][CRASH_AT - 1]).file_name(0)
    assert crashed not in at_crash  # even a killed writer leaves no partial file under the final name
    assert not (cache / crashed).exists()
    assert sorted(p.name for p in cache.glob("*.safetensors")) == sorted(
        hc.shard_from_dict(sh).file_name(0) for sh in plan["shards"][: CRASH_AT - 1]
    )
    assert not list(cache.glob(".*.tmp"))  # the half-written temporary is gone too
    assert sorted(hc.completed_shards(cache)) == list(range(CRASH_AT - 1))
    assert not (cache / hc.INDEX_FILE).exists()
    with pytest.raises(DataError, match=rf"unfinished \({CRASH_AT - 1}/{len(plan['shards'])} shards\)"):
        hc.load_index(cache)

    report = build_cache(settings, config, log=lambda line: None)  # resumes
    assert report.complete
    done = sum(sh["tokens"] for sh in plan["shards"][: CRASH_AT - 1])
    assert report.built_tokens == report.tokens - done  # the finished shards were not rebuilt
    index = hc.load_index(cache)
    listed = [sh for part in index["splits"].values() for sh in part["shards"]]
    assert [sh["number"] for sh in listed] == list(range(len(plan["shards"])))
    for sh in listed:
        assert (cache / sh["file"]).stat().st_size == sh["bytes"]
    assert crashed in {sh["file"] for sh in listed}
