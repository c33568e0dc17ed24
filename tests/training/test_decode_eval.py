"""Real decoding while training: train.py wires inference's decoding into the trainer's eval steps."""

from __future__ import annotations

import json

import pytest


@pytest.mark.parametrize("head", ["medusa", "eagle", "eagle3"])
def test_decode_eval_logs_real_tau_and_plots(training_kit, tiny_target_dir, chat_file, tmp_path, head):
    out = tmp_path / "run"
    extra = {"head": head, "trainer.decode_eval_every": 3, "trainer.decode_eval_prompts": 2,
             "trainer.decode_eval_max_new_tokens": 8, "logger": "wandb", "logger.mode": "offline"}  # fmt: skip
    if head == "eagle3":
        extra["head.ttt_steps"] = 2
    proc = training_kit.cli(training_kit.overrides(tiny_target_dir, chat_file, out, **extra))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    decoded = [r for r in rows if "decode/tau" in r]
    assert [r["step"] for r in decoded] == [3, 6]
    for r in decoded:
        assert r["decode/tau"] >= 1.0 and r["decode/speedup"] > 0
        assert r["decode/greedy_mismatches"] == 0  # decoding with a half-trained head is still lossless
    summary = json.loads((out / "metrics.json").read_text())
    assert summary["decode/tau"] == decoded[-1]["decode/tau"]
    assert (out / "decode_eval" / "step-6" / "acceptance_by_depth.png").read_bytes()[:4] == b"\x89PNG"
    logged = list((out / "wandb").glob("offline-run-*/files/media/images/decode/*.png"))
    assert len(logged) >= 4, sorted(p.name for p in (out / "wandb").rglob("*.png"))
