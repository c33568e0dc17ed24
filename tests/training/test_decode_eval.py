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


def test_tree_tuned_at_the_end_is_saved_and_decoded(
    training_kit, tiny_target_dir, chat_file, tmp_path, monkeypatch, capsys
):
    """trainer.tree_tune_prompts: the run's last step tunes the head's tree for this device, the final
    decode eval decodes with it, and it is saved as head/tree.json, which loading calibrates from."""
    from spechead.inference.generator import SpeculativeGenerator

    prompts = tmp_path / "tune.jsonl"
    prompts.write_text(
        json.dumps({"category": "qa", "turns": ["What is the capital of France?"]}) + "\n"
        + json.dumps({"category": "mt", "turns": ["Please add 2 and 3.", "Thanks! And 4 and 5?"]}) + "\n"
    )  # fmt: skip
    out = tmp_path / "run"
    extra = {"trainer.decode_eval_every": 3, "trainer.decode_eval_prompts": 2, "trainer.decode_eval_max_new_tokens": 8,
             "trainer.tree_tune_prompts": 2, "trainer.tree_tune_prompt_set": str(prompts)}  # fmt: skip
    proc = training_kit.cli_in_process(
        training_kit.overrides(tiny_target_dir, chat_file, out, **extra), monkeypatch, capsys
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"tree tuned on 2 prompts ({prompts})" in proc.stdout + proc.stderr

    tree = json.loads((out / "head" / "tree.json").read_text())
    assert tree["choices"] and tree["measured_tau"] >= 1.0 and tree["family"] == "medusa"
    assert tree["measured_on"]["turns"] == 3 and len(tree["accuracy"]) == 2  # both turns; 2 Medusa heads
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    decoded = {r["step"]: r for r in rows if "decode/tau" in r}
    assert sorted(decoded) == [3, 6]
    # a Medusa head without a tree keeps its default tree; the last eval decodes the tuned one
    assert decoded[3]["decode/tree_nodes"] == 0 and decoded[6]["decode/tree_nodes"] >= 1
    assert decoded[6]["decode/greedy_mismatches"] == 0

    gen = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), str(out / "head"))
    assert gen.calibration is not None and gen.calibration["accuracy_source"] == "tree.json"
