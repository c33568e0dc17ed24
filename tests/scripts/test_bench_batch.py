"""scripts/bench_batch.py on a tiny setup: one line per (drafter, batch), the JSON, no greedy mismatch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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


def test_bench_batch_sampling(script, tiny_target_dir, medusa_dir, tmp_path, capsys):  # noqa: F811
    """--temperature: every engine samples (HF too), each prompt with its own seed whatever the batch it
    lands in; no equality check. A bad --top-p is one error line."""
    module = script("bench_batch")
    out = tmp_path / "bbs"
    argv = ["--target", str(tiny_target_dir), "--drafter", f"medusa={medusa_dir}", "--batch-size", "1", "3",
            "--prompt-set", str(prompt_file(tmp_path / "p.jsonl")), "--max-new-tokens", "10",
            "--temperature", "1.0", "--top-p", "0.9", "--seed", "5", "--out", str(out)]  # fmt: skip
    assert module.main(argv) == 0
    assert capsys.readouterr().out.count("sampled") == 2
    rows = json.loads((out / "bench_batch.json").read_text())["rows"]
    for row in rows:
        assert row["greedy_mismatches"] is None
        assert row["plain_tokens_per_s"] > 0 and row["hf_tokens_per_s"] > 0 and row["spec_tokens_per_s"] > 0
    args = module.parse(["--temperature", "0.7", "--seed", "5"])
    assert module.sampling(args, 3, 2) == {"temperature": 0.7, "top_p": 1.0, "seed": [8, 9]}
    assert module.sampling(module.parse([]), 3, 2) == {}
    with pytest.raises(SystemExit) as exc:
        module.parse(["--top-p", "0"])
    assert exc.value.code == 2
    assert "0 < --top-p <= 1" in capsys.readouterr().err
