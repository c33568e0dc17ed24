"""scripts/bench_reference_medusa.py + reference_medusa.py: the trees both engines decode, the target and
head directories the reference reads, and bad input. (The reference engine itself needs an environment of
its own, with transformers 4.x: its measured run is in the README, not in CI.)"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from spechead.heads import MedusaConfig, MedusaHead
from spechead.heads.eagle import EagleConfig, EagleHead
from spechead.heads.formats import export_head

ROOT = Path(__file__).resolve().parents[2]


def script(name: str):
    if str(ROOT / "scripts") not in sys.path:  # (bench_reference_medusa imports bench_reference, as run)
        sys.path.insert(0, str(ROOT / "scripts"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_cartesian_tree_is_the_references_choices_and_our_rank_paths() -> None:
    cartesian = script("bench_reference_medusa").cartesian
    choices, paths = cartesian("7x6")
    assert choices == [1, 7, 6]  # medusa-llm 0.1's: the target's top-1, then each head's top-k
    assert len(paths) == 7 + 7 * 6 and paths[:7] == [[i] for i in range(7)]
    assert sorted(map(tuple, paths[7:])) == [(i, j) for i in range(7) for j in range(6)]
    assert cartesian("2x1x1") == ([1, 2, 1, 1], [[0], [1], [0, 0], [1, 0], [0, 0, 0], [1, 0, 0]])
    for bad in ("", "7x0", "axb", "7,6"):
        with pytest.raises(ValueError, match="each head's top-k joined by x"):
            cartesian(bad)


def test_a_grouped_kv_target_is_copied_with_every_query_heads_kv(tiny_target_dir, tmp_path) -> None:
    """medusa-llm 0.1's cache holds one key/value head per query head: the copy repeats each group's
    head, the same function (logits equal), and a target without groups is used as it is."""
    from transformers import AutoConfig, AutoModelForCausalLM

    copy = script("bench_reference_medusa").with_full_kv_heads
    config = AutoConfig.from_pretrained(tiny_target_dir)
    assert config.num_key_value_heads < config.num_attention_heads  # (the fixture's target groups them)
    out = copy(str(tiny_target_dir), tmp_path / "mha")
    full = AutoModelForCausalLM.from_pretrained(out)
    assert full.config.num_key_value_heads == config.num_attention_heads
    grouped = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32)
    ids = torch.arange(3, 40)[None]
    torch.testing.assert_close(full(ids).logits, grouped(ids).logits, rtol=1e-5, atol=1e-5)
    assert (out / "tokenizer_config.json").exists()
    assert copy(str(out), tmp_path / "again") == out  # nothing to repeat


def test_the_reference_reads_one_head_directory_per_tree_depth(tiny_target_dir, tmp_path) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_target_dir)
    head = MedusaHead(MedusaConfig(hidden_size=config.hidden_size, vocab_size=config.vocab_size, num_heads=4,
                                   target_num_layers=config.num_hidden_layers,
                                   target_name_or_path=str(tiny_target_dir)))  # fmt: skip
    exported = export_head(head, "fasterdecoding", tmp_path / "exported")
    d2 = script("bench_reference_medusa").with_heads(exported, 2, "somewhere/target", tmp_path / "head2")
    cfg = json.loads((d2 / "config.json").read_text())
    assert cfg["medusa_num_heads"] == 2 and cfg["medusa_num_layers"] == 1
    assert cfg["base_model_name_or_path"] == str(Path("somewhere/target").resolve())
    weights = torch.load(d2 / "medusa_lm_head.pt", weights_only=True)  # every head's, the loader skips 2, 3
    assert {k.split(".")[0] for k in weights} == {"0", "1", "2", "3"}


def test_the_references_ids_are_what_it_decoded_cut_after_eos() -> None:
    ref = script("reference_medusa")
    tokenizer = ref.IdsTokenizer(eos=4)
    ids = torch.tensor([[9, 5, 6, 4, 7]])
    assert tokenizer.decode(ids[0, 1:], skip_special_tokens=True) == "" and tokenizer.eos_token_id == 4
    assert ref.new_ids(tokenizer.last.tolist(), eos=4, limit=10) == [5, 6, 4]  # past EOS in its last pass
    assert ref.new_ids([5, 6, 7, 8], eos=4, limit=3) == [5, 6, 7]


def test_bad_input_is_one_error_line(tiny_target_dir, tmp_path, capsys) -> None:
    from transformers import AutoModelForCausalLM

    main = script("bench_reference_medusa").main
    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    eagle = EagleHead(EagleConfig.from_target(target.config)).save_pretrained(tmp_path / "eagle")
    argv = ["--ref-python", "python", "--target", str(tiny_target_dir), "--out", str(tmp_path / "o")]
    capsys.readouterr()  # (the loading bars above)
    assert main([*argv, "--head", str(eagle)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --head must be a Medusa head (this one is eagle)") and err.count("\n") == 1
    assert main([*argv, "--head", str(eagle), "--trees", "7x"]) == 2
    assert "error: tree '7x': give each head's top-k joined by x" in capsys.readouterr().err


def test_a_failing_reference_engine_is_one_error_line(tmp_path) -> None:
    run_reference = script("bench_reference").run_reference
    job = {"head": "h", "eos": 0, "max_new_tokens": 1, "prompts": [[1]], "trees": {}}
    with pytest.raises(RuntimeError, match="the reference engine failed: .*ModuleNotFoundError.*medusa"):
        run_reference(sys.executable, job, tmp_path, runner="reference_medusa.py")  # no medusa-llm here


def test_pass_gaps_count_prompts_by_the_difference_in_passes() -> None:
    gaps = script("bench_reference_medusa").pass_gaps
    assert gaps([5, 6, 4, 9], [5, 5, 3, 10]) == "-1: 1, +0: 1, +1: 2"
