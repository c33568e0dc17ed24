"""scripts/bench_reference.py + reference_eagle.py: how tokens, speed and mismatches are counted, and bad
input. (The reference engine itself needs an environment of its own, with transformers 4.x: its measured
run is in the README, not in CI.)"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from spechead.heads.eagle import EagleConfig, EagleHead

ROOT = Path(__file__).resolve().parents[2]


def script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reference_outputs_are_cut_after_eos_and_at_the_budget() -> None:
    new_ids = script("reference_eagle").new_ids
    assert new_ids([5, 6, 4, 7, 8], eos=4, limit=10) == [5, 6, 4]  # its last pass emitted past EOS
    assert new_ids([5, 6, 7, 8], eos=4, limit=3) == [5, 6, 7]  # ... and past max_new_tokens
    assert new_ids([4], eos=4, limit=3) == [4]


def test_summary_counts_tokens_passes_and_mismatches() -> None:
    summary = script("bench_reference").summary
    plain = [[1, 2, 3], [4, 5]]
    runs = [
        [{"ids": [1, 2, 3], "s": 1.0, "passes": 2}, {"ids": [4, 6], "s": 1.0, "passes": 1}],
        [{"ids": [1, 2, 3], "s": 0.5, "passes": 2}, {"ids": [4, 6], "s": 0.5, "passes": 1}],
        [{"ids": [1, 2, 3], "s": 2.0, "passes": 2}, {"ids": [4, 6], "s": 2.0, "passes": 1}],
    ]
    row = summary(runs, plain)
    assert row["tok_s"] == 2.5 and row["tok_s_range"] == [1.25, 5.0]  # median of 5 / 2, 5 / 1, 5 / 4
    assert row["tau"] == 5 / 3 and row["tokens"] == 5 and row["mismatches"] == 1
    assert row["passes"] == [2, 1]  # the first repeat's, per prompt


def test_a_head_the_authors_layout_cannot_hold_is_one_error_line(tiny_target_dir, tmp_path, capsys) -> None:
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    head = EagleHead(EagleConfig.from_target(target.config)).save_pretrained(tmp_path / "head")
    argv = ["--ref-python", "python", "--head", str(head), "--target", str(tiny_target_dir)]
    capsys.readouterr()  # (the loading bars above)
    assert script("bench_reference").main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "first_layer_input_norm=false" in err and err.count("\n") == 1


def test_a_failing_reference_engine_is_one_error_line(tmp_path, capsys) -> None:
    run_reference = script("bench_reference").run_reference
    with pytest.raises(RuntimeError, match="the reference engine failed: .*ModuleNotFoundError.*eagle"):
        job = {"target": "t", "head": "h", "eos": 0, "max_new_tokens": 1, "prompts": [[1]], "trees": {}}
        run_reference(sys.executable, job, tmp_path)  # this environment has no eagle-llm


def test_ref_path_comes_first_on_the_references_path(tmp_path) -> None:
    """--ref-path: the reference's own packages (its transformers 4.x) beside the machine's torch."""
    site = tmp_path / "refsite"
    (site / "eagle").mkdir(parents=True)
    (site / "eagle" / "__init__.py").write_text("raise RuntimeError('the eagle of --ref-path')\n")
    job = {"target": "t", "head": "h", "eos": 0, "max_new_tokens": 1, "prompts": [[1]], "trees": {}}
    with pytest.raises(
        RuntimeError, match="the reference engine failed: RuntimeError: the eagle of --ref-path"
    ):
        script("bench_reference").run_reference(sys.executable, job, tmp_path, str(site))


def test_a_device_this_machine_lacks_is_one_error_line(tmp_path, capsys) -> None:
    argv = [
        "--ref-python",
        "python",
        "--head",
        str(tmp_path),
        "--device",
        "cuda",
        "--out",
        str(tmp_path / "o"),
    ]
    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert script("bench_reference").main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --device cuda: CUDA is not available") and err.count("\n") == 1
