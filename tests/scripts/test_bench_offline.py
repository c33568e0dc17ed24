"""scripts/bench_offline.py on the tiny target: a cache built, the same head trained online and offline,
every number in the JSON from its own run, and the table's ratios the right way round."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file


def overrides(target: Path, chats: Path) -> list[str]:
    return ["model=local", f"model.path={target}", "data=jsonl", f"data.path={chats}", "trainer.batch_size=4",
            "trainer.max_length=32", "head.init_from=null"]  # fmt: skip


def test_online_and_offline_train_alike_from_the_cache(
    script, tiny_target_dir, chat_file, tmp_path, capsys, monkeypatch
):
    """float32 cache on an fp32 target: both heads the same up to rounding; bytes per token as stored
    (3 states x H = 32 x 4 bytes + id + loss flag), measured on disk and estimated; each run's numbers
    from its own training (the first online, the second from the cache); a rerun starts afresh."""
    from spechead.training.hidden_cache import layout as hc

    module = script("bench_offline")
    runs, train = [], module.train

    def spy(settings):  # (the offline run's tau planted 1 higher: each row's own, not the other's)
        result = train(settings)
        runs.append((settings.data.hidden_states, result, result.metrics["tau"]))
        if settings.data.hidden_states == "offline":
            result.metrics["tau"] += 1.0
        return result

    monkeypatch.setattr(module, "train", spy)
    reports, build_cache = [], module.build_cache
    monkeypatch.setattr(module, "build_cache", lambda *a: reports.append(build_cache(*a)) or reports[-1])
    out = tmp_path / "bench"
    argv = [
        "--out",
        str(out),
        "--steps",
        "2",
        "--dtype",
        "float32",
        "--",
        *overrides(tiny_target_dir, chat_file),
    ]
    assert module.main(argv) == 0
    r = json.loads((out / "bench_offline.json").read_text())
    (online_kind, online, online_tau), (offline_kind, offline, offline_tau) = runs
    assert (online_kind, offline_kind) == ("online", "offline")
    assert r["online_train_tokens_per_s"] == online.tokens_per_second
    assert r["offline_train_tokens_per_s"] == offline.tokens_per_second
    assert r["online_seconds"] == online.seconds and r["offline_seconds"] == offline.seconds
    assert (r["online_tau"], r["offline_tau"]) == (online_tau, offline_tau + 1.0)
    assert online_tau == pytest.approx(offline_tau, abs=1e-3)  # the same training, up to rounding
    index = hc.load_index(out / "cache")
    tokens = sum(p["tokens"] for p in index["splits"].values())
    on_disk = sum(p.stat().st_size for p in (out / "cache").glob("*.safetensors"))
    assert (r["cache_tokens"], r["cache_bytes_on_disk"], r["cache_dtype"]) == (tokens, on_disk, "float32")
    assert r["bytes_per_token_measured"] == pytest.approx(on_disk / tokens)
    assert r["cache_build_tokens_per_s"] == reports[0].tokens_per_s > 0
    computed = r["bytes_per_token_computed"]  # the tensors' bytes (and a few per row); the files add headers
    assert computed == pytest.approx(3 * 32 * 4 + 5, rel=0.01) and 389 <= computed < on_disk / tokens
    assert r["steps"] == 2 and "trainer.max_steps=2" in r["overrides"] and "model=local" in r["overrides"]
    online_dir, offline_dir = out / "online" / "head", out / "offline" / "head"
    assert r["max_head_weight_difference"] == module.head_difference(online_dir, offline_dir) < 1e-4
    assert r["cache_build_seconds_total"] > 0
    assert module.table(r) in capsys.readouterr().out
    assert module.main(argv) == 0  # again: the old cache and heads removed first, all rebuilt
    again = json.loads((out / "bench_offline.json").read_text())
    assert again["cache_tokens"] == tokens and again["cache_build_tokens_per_s"] > 0 and len(runs) == 4
    assert runs[2][1].steps == 2 and runs[3][1].steps == 2


def test_a_bad_setting_is_one_error_line(script, tiny_target_dir, chat_file, tmp_path, capsys):
    argv = [
        "--out",
        str(tmp_path / "b"),
        "--steps",
        "2",
        "--dtype",
        "int3",
        "--",
        *overrides(tiny_target_dir, chat_file),
    ]
    assert script("bench_offline").main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


def test_head_difference_is_the_largest_over_every_tensor(script, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    x = {"w": torch.zeros(3), "v": torch.tensor([1.0, 2.0])}
    save_file(x, str(a / "model.safetensors"))
    save_file(
        {"w": torch.tensor([0.0, -0.25, 0.0]), "v": torch.tensor([1.0, 2.5])}, str(b / "model.safetensors")
    )
    assert script("bench_offline").head_difference(a, b) == 0.5
    save_file(
        {"w": torch.tensor([0.0, -0.75, 0.0]), "v": torch.tensor([1.0, 2.5])}, str(b / "model.safetensors")
    )
    assert script("bench_offline").head_difference(a, b) == 0.75


def test_table_divides_offline_by_online(script):
    r = {"bytes_per_token_measured": 389.5, "bytes_per_token_computed": 389.0, "cache_build_tokens_per_s": 1234.4,
         "steps": 30, "online_train_tokens_per_s": 1000.0, "offline_train_tokens_per_s": 2500.0,
         "online_tau": 1.5, "offline_tau": 1.25, "max_head_weight_difference": 0.000123456}  # fmt: skip
    rows = script("bench_offline").table(r).splitlines()
    assert rows[:2] == ["| measure | value |", "|---|---:|"]
    assert rows[2:] == [
        "| cache bytes/token (measured on disk) | 389.5 |",
        "| cache bytes/token (computed) | 389.0 |",
        "| cache build tokens/s | 1,234 |",
        "| online training tokens/s (30 steps) | 1,000 |",
        "| offline training tokens/s (30 steps) | 2,500 |",
        "| offline / online speed | 2.50x |",
        "| tau online / offline | 1.5000 / 1.2500 |",
        "| max |online head - offline head| | 0.000123 |",
    ]
