"""scripts/bench_train_gpu.py --tiny: the GPU training benchmark's own path on the CPU (a tiny Llama, 3 steps):
the offline run builds the cache and trains through `accelerate launch` with configs/accelerate/ddp.yaml, and
the report holds the trainer's own numbers and its memory plan."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_tiny_offline_run_reports_the_trainers_numbers(script, tmp_path):
    module = script("bench_train_gpu")
    out = tmp_path / "bench"
    status = module.main(["--tiny", "--out", str(out), "--modes", "offline-ddp"])
    report = json.loads((out / "bench_train.json").read_text())
    assert status == 0, (report.get("cache"), report["runs"][0].get("error"))
    s = report["settings"]
    assert (s["shape"], s["hidden_size"], s["num_hidden_layers"], s["steps"], s["seq_len"]) == (
        "tiny",
        64,
        4,
        3,
        64,
    )
    assert (
        report["data"]["rows"] == 3 + module.VAL_ROWS and report["data"]["min_tokens_before_truncation"] > 64
    )
    assert report["cache"]["exit"] == 0 and report["cache"]["tokens"] == 5 * 64  # every row truncated to 64
    run, refused = report["runs"]
    assert (run["mode"], run["accelerate_config"], run["processes"], run["exit"]) == (
        "offline-ddp",
        "ddp.yaml",
        1,
        0,
    )
    work = out / "work" / "runs" / "offline-ddp"
    metrics = json.loads((work / "metrics.json").read_text())
    assert run["steps"] == 3 and run["tokens_per_s"] == metrics["train_tokens_per_s"] > 0
    assert run["last_window_tokens_per_s"] > 0
    assert run["peak_memory_gib"] is None and "peak_memory_gib" not in metrics  # a CPU: no GPU memory
    assert run["plan"][0].startswith("memory plan per process (1 process, no ZeRO")
    assert 0 < run["plan_total_gib"] < 0.1 and run["plan"][-1].startswith("total ~")
    assert not (work / "checkpoints").exists() and not (work / "head").exists()  # the big files go
    assert refused["mode"] == "offline-zero3" and "check_zero3" in refused["skipped"]
    md = (out / "bench_train.md").read_text()
    assert md.startswith("| mode | accelerate config | tokens/s |")
    assert f"| offline-ddp | ddp.yaml x1 | {run['tokens_per_s']:,.0f} |" in md and "| ok |" in md


def test_a_spent_budget_skips_the_runs_and_reuses_the_target(script, tmp_path):
    module = script("bench_train_gpu")
    out = tmp_path / "bench"
    argv = ["--tiny", "--out", str(out), "--budget-s", "1"]
    assert module.main(argv) == 1  # nothing measured is a failure
    report = json.loads((out / "bench_train.json").read_text())
    assert report["target"]["reused"] is False and report["target"]["params"] > 0
    assert [r["mode"] for r in report["runs"]] == [*module.DEFAULT_MODES, "offline-zero3"]
    assert all(r["skipped"].startswith("out of time") for r in report["runs"][:-1])
    config = json.loads((out / "work" / "target" / "config.json").read_text())
    assert (config["vocab_size"], config["rope_parameters"]["rope_type"]) == (4096, "llama3")
    assert module.main(argv) == 1
    assert json.loads((out / "bench_train.json").read_text())["target"]["reused"] is True
    rows = (out / "work" / "chats.jsonl").read_text().splitlines()
    assert len(rows) == 3 + module.VAL_ROWS


def test_plan_from_reads_the_printed_total(script):
    plan_from = script("bench_train_gpu").plan_from
    text = (
        "head: eagle3\nmemory plan per process (1 process, ZeRO-3; activations are estimates):\n"
        "  target  8.03B params, 14.96 GiB in all; 16.92 GiB here\n  head    ...\n  activations ...\n"
        "  total ~1,234.50 GiB\n\ntrain: 0%\n"
    )
    r = plan_from(text)
    assert r["plan_total_gib"] == 1234.5 and len(r["plan"]) == 5 and r["plan"][-1] == "total ~1,234.50 GiB"
    assert plan_from(text.replace("1,234.50 GiB", "512.00 MiB"))["plan_total_gib"] == 0.5
    assert plan_from("no plan here") == {"plan_total_gib": None, "plan": []}
