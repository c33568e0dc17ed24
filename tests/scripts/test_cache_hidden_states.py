"""scripts/cache_hidden_states.py on the tiny target: exact sizes, resume after a kill, disk check, bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from spechead.training.hidden_cache import layout as hc

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def script(script):
    return script("cache_hidden_states")


def args(target: Path, chats: Path, cache: Path, *extra: str) -> list[str]:
    return [
        "head=eagle3",
        "model=local",
        f"model.path={target}",
        "data=jsonl",
        f"data.path={chats}",
        "trainer.max_length=64",
        "trainer.batch_size=4",
        f"data.cache_dir={cache}",
        "cache.dtype=float32",
        "cache.shard_mb=0.1",
        *extra,
    ]


@pytest.fixture(scope="module")
def full_cache(script, tiny_target_dir, chat_file, tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("caches") / "full"
    assert script.main(args(tiny_target_dir, chat_file, cache)) == 0
    return cache


def shard_files(cache: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(cache.glob("*.safetensors"))}


def test_cache_holds_the_stored_layers_and_its_size_matches_the_estimate(full_cache, tiny_target_dir):
    index = hc.load_index(full_cache)
    assert index["built_for"]["stored_layers"] == [1, 2, 4]  # EAGLE-3's [2, L//2, L-3] + final, L = 4
    assert index["bytes_per_token"] == 3 * 32 * 4 + 5  # 3 states x H=32 x fp32 + id + loss flag
    assert index["splits"]["val"]["rows"] >= 1 and len(index["splits"]["train"]["shards"]) > 2
    tokens = sum(p["tokens"] for p in index["splits"].values())
    on_disk = sum(p.stat().st_size for p in full_cache.glob("*.safetensors"))
    assert on_disk == sum(p["bytes"] for p in index["splits"].values())
    assert 1.0 <= on_disk / (tokens * index["bytes_per_token"]) < 1.05  # headers + row offsets only
    first = index["splits"]["train"]["shards"][0]
    with safe_open(str(full_cache / first["file"]), framework="pt") as f:
        assert sorted(f.keys()) == ["hidden.1", "hidden.2", "hidden.4", "input_ids", "loss_mask", "offsets"]
        assert f.get_slice("hidden.4").get_shape() == [first["tokens"], 32]


def test_killed_build_resumes_to_the_same_bytes(script, full_cache, tiny_target_dir, chat_file, tmp_path):
    cache = tmp_path / "resumed"
    # A run "killed" after its second shard: stop there, and leave a partial file of the third.
    assert script.main(args(tiny_target_dir, chat_file, cache, "cache.max_shards=2")) == 0
    assert len(list(cache.glob("*.safetensors"))) == 2 and not (cache / hc.INDEX_FILE).exists()
    third = sorted(full_cache.glob("train-*.safetensors"))[2].name
    (cache / f".{third}.tmp").write_bytes(b"\0" * 1000)
    assert script.main(args(tiny_target_dir, chat_file, cache)) == 0
    assert shard_files(cache) == shard_files(full_cache)
    assert json.loads((cache / hc.INDEX_FILE).read_text())["splits"] == hc.load_index(full_cache)["splits"]
    assert not list(cache.glob(".*.tmp"))


def test_rerunning_a_complete_cache_does_no_work(script, full_cache, tiny_target_dir, chat_file, capsys):
    assert script.main(args(tiny_target_dir, chat_file, full_cache)) == 0
    assert "built 0 tokens" in capsys.readouterr().out


def test_refuses_to_start_without_the_disk_it_needs(
    script, tiny_target_dir, chat_file, tmp_path, capsys, monkeypatch
):
    import shutil as real_shutil

    from spechead.training.hidden_cache import build as cache_builder

    usage = real_shutil.disk_usage(tmp_path)
    monkeypatch.setattr(cache_builder.shutil, "disk_usage", lambda p: usage._replace(free=1000))
    cache = tmp_path / "c"
    assert script.main(args(tiny_target_dir, chat_file, cache)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the cache needs 0.00") and "--force" in err and "\n" == err[-1]
    assert not cache.exists()  # nothing written
    assert script.main(args(tiny_target_dir, chat_file, cache, "--force", "cache.max_shards=1")) == 0
    assert len(list(cache.glob("*.safetensors"))) == 1


def test_other_settings_in_the_same_directory_are_refused(
    script, full_cache, tiny_target_dir, chat_file, capsys
):
    copy = full_cache.parent / "copy"
    shutil.copytree(full_cache, copy, dirs_exist_ok=True)
    assert script.main(args(tiny_target_dir, chat_file, copy, "trainer.max_length=48")) == 2
    assert "holds a cache built with another trainer.max_length" in capsys.readouterr().err
    assert script.main(args(tiny_target_dir, chat_file, copy, "cache.dtype=bfloat16")) == 2
    assert "another cache.dtype" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["cache.nope=1"], "unknown key cache.nope"),
        (["cache.dtype"], "cache.dtype: write cache.KEY=VALUE (keys: "),
        (["cache.dtype=int8"], "cache.dtype='int8'"),
        (["cache.shard_mb=0"], "cache.shard_mb must be > 0"),
        (["--fast"], "unknown option --fast"),
        (["data.cache_dir=null"], "set data.cache_dir=DIR"),
        (["head=nope"], "Could not find 'head/nope'"),
    ],
)
def test_bad_input_is_one_line(script, tiny_target_dir, chat_file, tmp_path, capsys, extra, message):
    assert script.main(args(tiny_target_dir, chat_file, tmp_path / "c") + extra) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


@pytest.mark.slow
def test_two_processes_write_their_own_shards_with_the_same_content(
    full_cache, tiny_target_dir, chat_file, tmp_path
):
    cache = tmp_path / "two"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file"]
    cmd = [
        *launcher,
        str(ROOT / "configs/accelerate/cpu-2proc.yaml"),
        str(ROOT / "scripts/cache_hidden_states.py"),
    ]
    proc = subprocess.run(
        [*cmd, *args(tiny_target_dir, chat_file, cache)], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(p.name for p in cache.glob("progress-rank*.json")) == [
        "progress-rank0.json",
        "progress-rank1.json",
    ]
    assert proc.stdout.count("cache complete") == 1  # only the main process reports
    mine, single = hc.load_index(cache)["splits"], hc.load_index(full_cache)["splits"]
    for split in single:
        for a, b in zip(mine[split]["shards"], single[split]["shards"]):
            assert a["file"].endswith(f"rank{a['number'] % 2}.safetensors")
            ta, tb = load_file(str(cache / a["file"])), load_file(str(full_cache / b["file"]))
            assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def test_a_complete_cache_prints_where_it_is_and_how_to_train_from_it(
    script, full_cache, tiny_target_dir, chat_file, capsys
):
    assert script.main(args(tiny_target_dir, chat_file, full_cache)) == 0
    out = capsys.readouterr().out
    assert f"cache complete in {full_cache}: " in out
    assert out.endswith(f"data.hidden_states=offline data.cache_dir={full_cache}\n")


def test_summary_reports_sizes_per_token_and_throughput(script):
    """The printed numbers: bytes per token of the whole cache, the estimate's, measured / estimate, and
    the tokens per second this process built."""
    from spechead.training.hidden_cache.build import CacheReport

    report = CacheReport(Path("/c"), complete=True, tokens=1000, built_tokens=400, estimate_bytes=400_000,
                         disk_bytes=410_000, seconds=2.0)  # fmt: skip
    assert script.summary(report).splitlines() == [
        "built 400 tokens in 2.0 s (200 tokens/s in this process)",
        "cache complete in /c: 410,000 bytes on disk for 1,000 tokens = 410.0 bytes/token "
        "(estimate 400.0; measured/estimate 1.0250)",
        "train from it: python train.py ... data.hidden_states=offline data.cache_dir=/c",
    ]
    unfinished = CacheReport(Path("/c"), complete=False, tokens=1000, built_tokens=400, estimate_bytes=400_000,
                             disk_bytes=0, seconds=2.0)  # fmt: skip
    assert script.summary(unfinished).splitlines()[1:] == [
        "cache in /c is unfinished: rerun the same command to continue it"
    ]
    empty = CacheReport(Path("/c"), complete=True, tokens=0, built_tokens=0, estimate_bytes=0, disk_bytes=0,
                        seconds=0.0)  # fmt: skip
    assert "0 tokens = 0.0 bytes/token (estimate 0.0; measured/estimate 0.0000)" in script.summary(empty)


def test_help_prints_the_usage(script, capsys):
    for flag in ("-h", "--help"):
        assert script.main([flag]) == 0
        assert "cache.shard_mb=1024" in capsys.readouterr().out
