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
    # (inference/tuning/calibrate.py); calibrate=False uses the saved choices as they are.
    calibrated = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), str(head_dir))
    assert calibrated.calibration["accuracy_source"] == "tree.json"
    assert calibrated.drafter.tree.size == len(calibrated.calibration["choices"]) + 1
    gen = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), str(head_dir), calibrate=False)
    saved_tree = depth_first(tree_from_choices(choices))  # drafters number static trees depth-first
    assert gen.drafter.tree.static.parents.tolist() == saved_tree.parents.tolist()
    assert gen.drafter.tree.static.rank.tolist() == saved_tree.rank.tolist()
    forced = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), str(head_dir), choices=[[0]])
    assert forced.drafter.tree.size == 2  # an explicit `choices` option wins over tree.json

    # With a hardware cost profile (scripts/benchmark.py's JSON) the node count is chosen for speed.
    profile = tmp_path / "decoding.json"
    profile.write_text(json.dumps({"t_step_ms": 4.0, "verify_ms_by_size": {"1": 4.0, "2": 400.0}}))
    # (--topk 3: the default tree ranks up to 3 at depth 1, so it does not fit the table: no comparison)
    assert (
        script("build_tree").main([*argv, "--cost-profile", str(profile), "--no-check", "--topk", "3"]) == 0
    )
    saved = json.loads((head_dir / "tree.json").read_text())
    assert saved["default_expected_accept_length"] is None
    assert len(saved["choices"]) == 1 and saved["expected_speedup"] > 0  # verification this dear: one node
    assert "measured_tau" not in saved  # --no-check: nothing measured
    out = capsys.readouterr().out
    assert f"1 nodes give the best expected speedup {saved['expected_speedup']:.2f}x" in out
    assert f"expected accept length: chosen {saved['expected_accept_length']:.3f}\n" in out
    assert (
        saved["draft_ms"] > 0 and "draft_ms_per_depth" not in saved
    )  # Medusa: one draft pass for all depths
    from spechead.inference.tuning.tree_search import (
        ranked_choices_for_cost,
    )  # the speedup counts the draft's cost

    accuracy = torch.tensor(saved["accuracy"])
    _, speedup = ranked_choices_for_cost(accuracy, {"1": 4.0, "2": 400.0}, 4.0, draft_ms=saved["draft_ms"])[0]
    _, free = ranked_choices_for_cost(accuracy, {"1": 4.0, "2": 400.0}, 4.0, draft_ms=0.0)[0]
    assert saved["expected_speedup"] == pytest.approx(speedup, rel=1e-4) != pytest.approx(free, rel=1e-4)


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


def test_build_tree_table_rows_are_depths_and_columns_ranks(script):
    table = script("build_tree").format_table(torch.tensor([[0.5, 0.25, 0.125], [0.0625, 0.0, 0.0]]))
    assert table.splitlines() == [
        "depth   top0   top1   top2",
        "    1  0.500  0.250  0.125",
        "    2  0.062  0.000  0.000",
    ]


@pytest.mark.parametrize(
    ("extra", "config", "message"),
    [
        (["--depth", "0"], None, "--nodes, --prompts, --topk and --depth must be >= 1"),
        ([], {"hidden_size": 8}, "is not a spechead head ("),
    ],
)
def test_build_tree_bad_input_before_loading(script, tmp_path, capsys, extra, config, message):
    """Checked before the target is loaded (the target here does not exist): one `error:` line."""
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text(json.dumps(config or {}))
    argv = ["--target", str(tmp_path / "no-target"), "--head", str(head), *extra]
    assert script("build_tree").main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines


NO_KEYS = " holds no verify_ms_by_size and t_step_ms: pass scripts/benchmark.py's decoding.json"


@pytest.mark.parametrize(
    ("profile", "says"),
    [
        (None, ": cannot read it (FileNotFoundError)"),
        ("{not json", ": cannot read it (JSONDecodeError)"),
        ('{"verify_ms_by_size": {}, "t_step_ms": 5.0}', NO_KEYS),
        ('{"verify_ms_by_size": {"1": 5.0}}', NO_KEYS),
    ],
)
def test_a_bad_cost_profile_is_one_line_before_loading(script, tmp_path, capsys, profile, says):
    """Read before the target loads (it does not exist here), not after minutes of measuring."""
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text("{}")
    file = tmp_path / "decoding.json"
    if profile is not None:
        file.write_text(profile)
    argv = ["--target", str(tmp_path / "no-target"), "--head", str(head), "--cost-profile", str(file)]
    assert script("build_tree").main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: --cost-profile {file}{says}"]


def test_build_tree_compares_with_the_default_tree_and_measures_the_chosen_one(
    script, tiny_target_dir, head_dir, tmp_path, capsys
):
    """With --topk 10 the Medusa default tree fits the table: its expected accept length is printed and
    saved. The saved and printed taus are the chosen tree's and the default tree's own, on every prompt of
    the file (fewer than --prompts)."""
    from spechead.inference.drafters.medusa import DEFAULT_MEDUSA_CHOICES
    from spechead.inference.evaluation.measure import DecodeSettings, decode_prompts
    from spechead.inference.tuning.tree_search import expected_accept_length

    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Hello", "Add 2 and 3.")))
    build_tree = script("build_tree")
    argv = ["--target", str(tiny_target_dir), "--head", str(head_dir), "--nodes", "1", "--prompts", "5",
            "--prompts-file", str(prompts_file), "--max-new-tokens", "8"]  # fmt: skip
    assert build_tree.main(argv) == 0
    out = capsys.readouterr().out
    saved = json.loads((head_dir / "tree.json").read_text())
    choices, accuracy = saved["choices"], torch.tensor(saved["accuracy"])
    default = [c for c in DEFAULT_MEDUSA_CHOICES if len(c) <= 3]
    expected_default = expected_accept_length(accuracy, default)
    assert saved["default_expected_accept_length"] == pytest.approx(expected_default, abs=1e-4)
    assert saved["default_expected_accept_length"] != pytest.approx(saved["expected_accept_length"], abs=1e-3)
    assert (
        f"expected accept length: chosen {saved['expected_accept_length']:.3f} | default ({len(default)} nodes) "
        f"{saved['default_expected_accept_length']:.3f}"
    ) in out
    assert f"chosen tree (1 nodes, depth 1): {json.dumps(choices)}" in out
    measured = saved["measured_on"]
    assert measured["prompts"] == 2 and measured["topk"] == 10
    assert (
        f"top-10 accuracy by depth (medusa) over {measured['generated_tokens']} generated tokens (2 prompts, "
        in out
    )

    prompts, _ = build_tree.load_prompts(5, str(prompts_file))
    taus = {}
    for tree, options in (("default", {"choices": None}), ("chosen", {"choices": choices})):
        gen = SpeculativeGenerator.from_pretrained(
            str(tiny_target_dir), str(head_dir), calibrate=False, **options
        )
        taus[tree] = decode_prompts(
            gen, prompts, DecodeSettings(max_new_tokens=8, fit_context=True)
        ).total.tau
    assert taus["chosen"] != pytest.approx(taus["default"])  # so the two are told apart
    assert saved["measured_tau"] == round(taus["chosen"], 4)
    assert f"measured tau, default tree (static): {taus['default']:.3f}" in out
