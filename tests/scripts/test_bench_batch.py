"""scripts/bench_batch.py on a tiny setup: one line per (drafter, batch), the JSON, no greedy mismatch."""

from __future__ import annotations

import json
from pathlib import Path

from .test_benchmark import medusa_dir, prompt_file  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parents[2]


def test_bench_batch_lines_and_json(script, tiny_target_dir, medusa_dir, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "bb"
    argv = ["--target", str(tiny_target_dir), "--drafter", f"medusa={medusa_dir}", "--batch-size", "1", "3",
            "--prompt-set", str(prompt_file(tmp_path / "p.jsonl")), "--max-new-tokens", "10",
            "--out", str(out)]  # fmt: skip
    assert script("bench_batch").main(argv) == 0
    text = capsys.readouterr().out
    assert "medusa     B=1" in text and "medusa     B=3" in text
    rows = json.loads((out / "bench_batch.json").read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 3]
    for row in rows:
        assert row["greedy_mismatches"] == 0
        assert row["plain_tokens_per_s"] > 0 and row["hf_tokens_per_s"] > 0 and row["spec_tokens_per_s"] > 0


def test_bench_batch_with_the_batch_passes_compiled(script, tiny_target_dir, medusa_dir, tmp_path, capsys):  # noqa: F811
    """--compile graphs: both engines decode through the kept fixed-row runner (eager on a CPU)."""
    out = tmp_path / "bbc"
    argv = ["--target", str(tiny_target_dir), "--drafter", f"medusa={medusa_dir}", "--batch-size", "3",
            "--prompt-set", str(prompt_file(tmp_path / "p.jsonl")), "--max-new-tokens", "10", "--no-hf",
            "--compile", "graphs", "--out", str(out)]  # fmt: skip
    assert script("bench_batch").main(argv) == 0
    data = json.loads((out / "bench_batch.json").read_text())
    assert data["settings"]["compile"] == "graphs" and data["rows"][0]["greedy_mismatches"] == 0
    assert data["rows"][0]["spec_tokens_per_s"] > 0 and data["rows"][0]["hf_tokens_per_s"] is None
