"""scripts/bench_heads.py trains every requested family and writes the table and the JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def both_heads(out, overrides: list[str]) -> list[str]:
    """bench_heads.py's arguments for a Medusa and an EAGLE-3 run into `out`, with training overrides."""
    return ["--heads", "medusa", "eagle3", "--out", str(out), "--", *overrides]


@pytest.mark.slow
def test_bench_heads_table(tmp_path, tiny_target_dir, chat_file):
    out = tmp_path / "bench"
    overrides = [
        "model=local",
        f"model.path={tiny_target_dir}",
        "data=jsonl",
        f"data.path={chat_file}",
        "trainer.max_steps=2",
        "trainer.batch_size=4",
        "trainer.max_length=64",
        "head.init_from=null",
    ]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_heads.py"), *both_heads(out, overrides)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((out / "results.json").read_text())
    assert [r["family"] for r in rows] == ["medusa", "eagle3"]
    for row in rows:
        assert row["params"] > 0 and row["steps"] == 2 and 1.0 <= row["tau"]
        assert len(row["accuracy_by_depth"]) == (4 if row["family"] == "medusa" else 7)
    table = (out / "table.md").read_text()
    assert table.count("\n") == 4 and "| eagle3 |" in table and table.strip() in proc.stdout


def overrides_for(target: Path, chats: Path) -> list[str]:
    return ["logger=none", "model=local", f"model.path={target}", "data=jsonl", f"data.path={chats}",
            "trainer.max_steps=2", "trainer.batch_size=4", "trainer.max_length=32", "head.init_from=null"]  # fmt: skip


@pytest.mark.parametrize(
    ("family", "extra", "depths"),
    [
        ("medusa", ["head.num_heads=11"], 11),
        ("eagle3", [], 7),
        ("peagle", ["head.block_size=4"], 4),  # K slots of one block
        ("dflash", ["head.block_size=4"], 3),  # the block's positions after the accepted token
    ],
)
def test_a_row_holds_the_runs_numbers_depths_in_order(
    script, tiny_target_dir, chat_file, tmp_path, monkeypatch, family, extra, depths
):
    """One family trained in-process (11 Medusa heads: depth 10 sorts after depth 9, not after 1): the
    floating-point parameters saved (not EAGLE-3's vocabulary maps), every depth's accuracy in depth
    order, the run's tau and throughput, its time on the script's clock (planted: 7 s); an old output
    directory is cleared first."""
    from types import SimpleNamespace

    from safetensors.torch import load_file

    module = script("bench_heads")
    now, results, train = [0.0], [], module.train

    def timed_train(settings):
        results.append(train(settings))
        now[0] += 7.0
        return results[-1]

    monkeypatch.setattr(module, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr(module, "train", timed_train)
    module.register_resolvers()
    stale = tmp_path / family / "stale.txt"
    stale.parent.mkdir()
    stale.write_text("old")
    row = module.run_family(family, tmp_path, [*overrides_for(tiny_target_dir, chat_file), *extra])
    assert not stale.exists()
    saved = load_file(str(tmp_path / family / "head" / "model.safetensors"))
    assert row["params"] == sum(t.numel() for t in saved.values() if t.is_floating_point())
    metrics = row["metrics"]
    assert row["accuracy_by_depth"] == [metrics[f"acc/depth{d}"] for d in range(1, depths + 1)]
    assert row["tau"] == metrics["tau"] and row["steps"] == 2 and row["family"] == family
    assert row["train_seconds"] == 7.0 and row["tokens_per_s"] == results[0].tokens_per_second > 0


def test_table_prints_each_number_in_its_unit(script):
    row = {"family": "eagle3", "params": 2_500_000, "train_seconds": 61.4, "steps": 30,
           "tokens_per_s": 12345.6, "accuracy_by_depth": [0.812, 0.5], "tau": 2.3456}  # fmt: skip
    lines = script("bench_heads").table([row, {**row, "family": "medusa"}]).splitlines()
    assert len(lines) == 4 and lines[0].count("|") == lines[1].count("|") == lines[2].count("|") == 8
    assert lines[2] == "| eagle3 | 2.50M | 61 s | 30 | 12,346 | 0.81, 0.50 | 2.346 |"
    assert lines[3].startswith("| medusa |")


def test_a_family_that_fails_leaves_the_rows_before_it(
    script, tiny_target_dir, chat_file, tmp_path, monkeypatch
):
    """results.json is written after each family: the second one failing keeps the first's row; no
    run logs to Weights & Biases (offline here: it would leave a wandb folder)."""
    module = script("bench_heads")
    run_family = module.run_family

    def second_fails(family, out, overrides):
        if family == "eagle3":
            raise RuntimeError("out of memory")
        return run_family(family, out, overrides)

    monkeypatch.setattr(module, "run_family", second_fails)
    out = tmp_path / "bench"
    argv = ["bench_heads.py", *both_heads(out, overrides_for(tiny_target_dir, chat_file)[1:])]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(RuntimeError, match="out of memory"):
        module.main()
    assert [r["family"] for r in json.loads((out / "results.json").read_text())] == ["medusa"]
    assert not (out / "medusa" / "wandb").exists()  # the script's runs log nowhere (logger=none)


def test_draft_rows_time_one_parallel_forward_beside_eagle3(script, tiny_target_dir, chat_file):
    """At the trained target's shape: EAGLE-3's depth-7 draft, then P-EAGLE K and DFlash block K for K = 8
    and 16, each one head forward, as a multiple of EAGLE-3's; the Markdown has a line per drafter."""
    module = script("bench_heads")
    module.register_resolvers()
    overrides = ["model=local", f"model.path={tiny_target_dir}", "data=jsonl", f"data.path={chat_file}"]
    rows = module.draft_rows(overrides, context=16, dflash_layers=2, iters=1)
    assert [r["drafter"] for r in rows] == ["eagle3 depth 7", "peagle K=8", "dflash block 8 (2 layers)",
                                            "peagle K=16", "dflash block 16 (2 layers)"]  # fmt: skip
    assert [(r["drafts"], r["forwards"]) for r in rows] == [(7, 6), (8, 1), (7, 1), (16, 1), (15, 1)]
    assert rows[0]["x_eagle3"] == 1.0 and all(r["draft_ms"] > 0 for r in rows)
    assert all(r["x_eagle3"] == r["draft_ms"] / rows[0]["draft_ms"] for r in rows)
    lines = module.draft_markdown(rows).splitlines()
    assert len(lines) == 7 and lines[4].startswith("| dflash block 8 (2 layers) | 7 | 1 | ")
    deeper = module.draft_rows(overrides, context=16, dflash_layers=1, iters=1, peagle_layers=3)
    assert deeper[1]["drafter"] == "peagle K=8 (3 layers)"  # (as the head was built: its config's)
