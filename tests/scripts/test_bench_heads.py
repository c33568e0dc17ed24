"""scripts/bench_heads.py trains every requested family and writes the table and the JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


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
        [
            sys.executable,
            str(ROOT / "scripts" / "bench_heads.py"),
            "--heads",
            "medusa",
            "eagle3",
            "--out",
            str(out),
            "--",
            *overrides,
        ],
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
