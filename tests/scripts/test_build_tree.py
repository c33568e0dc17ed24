"""scripts/build_tree.py measures a saved head, writes HEAD/tree.json, and the generator then uses it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.tree import depth_first, tree_from_choices

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def head_dir(tmp_path, tiny_target_dir, medusa_for) -> Path:
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32)
    return medusa_for(model, num_heads=3).save_pretrained(tmp_path / "head")


def test_build_tree_end_to_end(script, tiny_target_dir, head_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Hello", "Add 2 and 3.", "Paris?")))
    argv = ["--target", str(tiny_target_dir), "--head", str(head_dir), "--nodes", "7",
            "--prompts", "2", "--prompts-file", str(prompts), "--max-new-tokens", "10", "--topk", "4"]  # fmt: skip
    assert script("build_tree").main(argv) == 0
    out = capsys.readouterr().out
    assert "expected accept length: chosen" in out and "measured tau, chosen tree" in out

    saved = json.loads((head_dir / "tree.json").read_text())
    choices = saved["choices"]
    assert len(choices) == 7 and max(map(len, choices)) <= 3 and max(max(c) for c in choices) < 4
    assert saved["expected_accept_length"] >= 1.0 and saved["measured_on"]["prompts"] == 2
    assert len(saved["accuracy"]) == 3 and len(saved["accuracy"][0]) == 4
    # the check's tau is saved with the tree (loading scales the table to it) and is the one printed
    assert f"measured tau, chosen tree: {saved['measured_tau']:.3f}" in out

    # By default the saved accuracy table is re-optimised for this device's measured costs
    # (inference/calibrate.py); calibrate=False uses the saved choices as they are.
    calibrated = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), str(head_dir))
    assert calibrated.calibration["accuracy_source"] == "tree.json"
    assert calibrated.drafter.static.size == len(calibrated.calibration["choices"]) + 1
    gen = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), str(head_dir), calibrate=False)
    saved_tree = depth_first(tree_from_choices(choices))  # drafters number static trees depth-first
    assert gen.drafter.static.parents.tolist() == saved_tree.parents.tolist()
    assert gen.drafter.static.rank.tolist() == saved_tree.rank.tolist()
    forced = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), str(head_dir), choices=[[0]])
    assert forced.drafter.static.size == 2  # an explicit `choices` option wins over tree.json

    # With a hardware cost profile (scripts/benchmark.py's JSON) the node count is chosen for speed.
    profile = tmp_path / "decoding.json"
    profile.write_text(json.dumps({"t_step_ms": 4.0, "verify_ms_by_size": {"1": 4.0, "2": 400.0}}))
    assert script("build_tree").main([*argv, "--cost-profile", str(profile), "--no-check"]) == 0
    saved = json.loads((head_dir / "tree.json").read_text())
    assert len(saved["choices"]) == 1 and saved["expected_speedup"] > 0  # verification this dear: one node
    assert "measured_tau" not in saved  # --no-check: nothing measured


def test_build_tree_demo_prompts_and_errors(script, tiny_target_dir, head_dir, capsys):
    script = script("build_tree")
    prompts, source = script.load_prompts(5, None)
    assert len(prompts) == 5 and all(prompts) and "demo-tune" in source
    argv = ["--target", str(tiny_target_dir), "--head", str(head_dir / "missing"), "--prompts", "1"]
    assert script.main(argv) == 2 and "not a local directory" in capsys.readouterr().err


def test_build_tree_for_an_eagle3_head(script, tiny_target_dir, tmp_path, capsys):
    """EAGLE heads get a static tree from measured accuracy by draft step; decoding then uses it."""
    from spechead.heads import Eagle3Config, Eagle3Head

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32)
    head = Eagle3Head(Eagle3Config.from_target(model.config))
    head.init_lm_head_from_target_(model.lm_head.weight)
    head_dir = head.save_pretrained(tmp_path / "eagle3")
    argv = ["--target", str(tiny_target_dir), "--head", str(head_dir), "--nodes", "6", "--prompts", "2",
            "--max-new-tokens", "12", "--topk", "3", "--depth", "3"]  # fmt: skip
    assert script("build_tree").main(argv) == 0
    out = capsys.readouterr().out
    assert "measured tau, default tree (dynamic)" in out and "measured tau, chosen tree" in out
    saved = json.loads((head_dir / "tree.json").read_text())
    assert saved["family"] == "eagle3" and len(saved["choices"]) == 6 and len(saved["accuracy"]) == 3
    assert max(map(len, saved["choices"])) <= 3 and max(max(c) for c in saved["choices"]) < 3

    gen = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), str(head_dir), calibrate=False)
    assert gen.drafter._static is not None and gen.drafter._static.size == 7  # root + 6 nodes
    dynamic = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), str(head_dir), tree="dynamic")
    assert dynamic.drafter._static is None
    ids = gen.tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True,
                                            return_dict=False)  # fmt: skip
    plain = SpeculativeGenerator(gen.target, gen.tokenizer, None).generate(input_ids=ids, max_new_tokens=10)
    assert gen.generate(input_ids=ids, max_new_tokens=10).token_ids == plain.token_ids  # still lossless
