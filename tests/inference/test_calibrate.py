"""The tree follows the hardware: from_pretrained times verify/draft costs on this device and picks the
static tree with the best expected speedup for the accuracy table saved with the head."""

from __future__ import annotations

import json

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from spechead.heads import Eagle3Config, Eagle3Head
from spechead.inference.calibrate import calibrated_choices, saved_accuracy
from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.tree import tree_from_choices
from spechead.inference.tree_search import best_choices_for_cost


def test_expensive_verification_gives_a_small_tree():
    accuracy = torch.tensor([[0.6, 0.2, 0.1], [0.5, 0.2, 0.1], [0.5, 0.1, 0.1]])
    flat = {1: 10.0, 64: 10.5}  # a GPU: 64 nodes cost about one step
    steep = {1: 10.0, 2: 11.0, 4: 13.0, 8: 20.0, 16: 40.0, 64: 160.0}  # a CPU
    big, _ = best_choices_for_cost(accuracy, flat, 10.0, draft_ms_per_depth=1.0)
    small, _ = best_choices_for_cost(accuracy, steep, 10.0, draft_ms_per_depth=1.0)
    assert len(small) < len(big)


def test_from_pretrained_calibrates_the_saved_tree(tiny_target_dir, tmp_path):
    config = AutoConfig.from_pretrained(tiny_target_dir)
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.from_target(config, target_layers=[1, 2, config.num_hidden_layers]))
    head.save_pretrained(tmp_path / "head")
    accuracy = [[0.7, 0.2, 0.05], [0.6, 0.2, 0.05], [0.6, 0.1, 0.05]]
    (tmp_path / "head" / "tree.json").write_text(json.dumps({"choices": [[0]], "accuracy": accuracy}))
    assert saved_accuracy(tmp_path / "head").shape == (3, 3)
    gen = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), str(tmp_path / "head"))
    info = gen.calibration
    assert info is not None and set(info["verify_ms_by_size"]) >= {1, 2, 4, 8}
    assert info["draft_ms_per_depth"] > 0 and info["expected_speedup"] > 0
    tree_from_choices(info["choices"])  # a valid tree, and the one the drafter uses
    assert gen.drafter._static.size == len(info["choices"]) + 1
    prompt = [5, 9, 11, 7]
    plain = AutoModelForCausalLM.from_pretrained(tiny_target_dir).generate(
        torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, 4:]
    gen.eos = set()
    assert gen.generate(input_ids=prompt, max_new_tokens=12).token_ids == plain.tolist()
    off = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), str(tmp_path / "head"), calibrate=False)
    assert off.calibration is None and off.drafter._static.size == 2  # the saved [[0]]
    chosen, _ = calibrated_choices(gen.target, gen.drafter, torch.tensor(accuracy), max_nodes=4)
    assert 1 <= len(chosen) <= 4


def test_an_eagle_head_without_a_table_gets_a_cpu_sized_tree(tiny_target_dir, tmp_path):
    config = AutoConfig.from_pretrained(tiny_target_dir)
    Eagle3Head(Eagle3Config.from_target(config, target_layers=[1, 2, 3])).save_pretrained(tmp_path / "h")
    gen = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), str(tmp_path / "h"))
    assert gen.calibration["accuracy_source"].startswith("assumed")
    assert gen.drafter._static is not None  # a measured static tree, not the GPU-sized dynamic default
    dynamic = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), str(tmp_path / "h"), tree="dynamic")
    assert dynamic.calibration is None and dynamic.drafter._static is None
