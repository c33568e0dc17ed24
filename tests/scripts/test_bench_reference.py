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


def row(tok_s: float, lo: float, hi: float, tau: float, mismatches: int = 0, tokens: int = 40) -> dict:
    return {"tok_s": tok_s, "tok_s_range": [lo, hi], "tau": tau, "mismatches": mismatches, "tokens": tokens}


def test_render_divides_by_each_engines_plain_decoding() -> None:
    import torch

    result = {
        "settings": {"prompts": 2, "prompt_set": "demo", "max_new_tokens": 8, "repeats": 3, "device": "cpu"},
        "reference_versions": {"transformers": "4.36.2", "torch": "2", "threads": 1},
        "trees": {"reference tree": [[0], [1], [0, 0]], "our calibrated tree": [[0]]},
        "reference": {
            "reference tree": row(25.0, 24.0, 26.0, 2.5, 1, tokens=41),
            "plain": row(10.0, 9.0, 11.0, 1.0),
        },
        "ours": {"plain": row(20.0, 19.0, 21.0, 1.0), "defaults": row(30.0, 28.0, 33.0, 3.0)},
    }
    lines = script("bench_reference").render(result).splitlines()
    assert lines[0] == (
        "the EAGLE authors' engine (eagle-llm, transformers 4.36.2) beside spechead: 2 prompts of demo, up to 8 "
        f"new tokens, greedy, CPU ({torch.get_num_threads()} threads), median of 3 alternating repeats"
    )
    assert lines[4:8] == [
        "| reference tree | reference | 2.50 | 25.0 [24.0, 26.0] | 1.25x | 2.50x | 1 |",
        "| plain | reference | 1.00 | 10.0 [9.0, 11.0] | 0.50x | 1.00x | 0 |",
        "| plain | spechead | 1.00 | 20.0 [19.0, 21.0] | 1.00x | 2.00x | 0 |",
        "| defaults | spechead | 3.00 | 30.0 [28.0, 33.0] | 1.50x | 3.00x | 0 |",
    ]
    assert (
        lines[9]
        == "trees: reference tree: 3 drafted nodes, our calibrated tree: 1 drafted nodes; 40 tokens a run"
    )


def test_run_ours_decodes_each_prompt_after_an_untimed_warm_up(tiny_llama, chatml_tokenizer) -> None:
    from spechead.inference.drafters.prompt_lookup import PromptLookupDrafter
    from spechead.inference.generator import SpeculativeGenerator

    gen = SpeculativeGenerator(tiny_llama(len(chatml_tokenizer)), chatml_tokenizer, PromptLookupDrafter())
    gen.eos = set()
    prompts = [[5, 6, 7, 5, 6], [9, 10, 11]]
    runs = script("bench_reference").run_ours(gen, prompts, 6)
    wanted = [gen.generate(input_ids=p, max_new_tokens=6) for p in prompts]
    assert [r["ids"] for r in runs] == [w.token_ids for w in wanted]  # the warm-up's is not kept
    assert [r["passes"] for r in runs] == [len(w.stats.accept_lengths) for w in wanted]
    assert all(r["s"] > 0 for r in runs)


@pytest.mark.parametrize("error", [RuntimeError, OSError, ValueError])
def test_what_the_user_can_fix_is_one_error_line(capsys, error) -> None:
    """guarded: the reference engine failing (RuntimeError), a file (OSError), a bad value: exit status 2."""

    def bench(args):
        raise error("the reference engine failed: boom")

    assert script("bench_reference").guarded(bench, None) == 2
    assert capsys.readouterr().err == "error: the reference engine failed: boom\n"


def test_ref_path_comes_before_an_existing_pythonpath(tmp_path, monkeypatch) -> None:
    for name in ("refsite", "other"):
        (tmp_path / name / "eagle").mkdir(parents=True)
        (tmp_path / name / "eagle" / "__init__.py").write_text(f"raise RuntimeError('the eagle of {name}')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "other"))
    job = {"target": "t", "head": "h", "eos": 0, "max_new_tokens": 1, "prompts": [[1]], "trees": {}}
    with pytest.raises(RuntimeError, match="RuntimeError: the eagle of refsite"):
        script("bench_reference").run_reference(sys.executable, job, tmp_path, str(tmp_path / "refsite"))


def test_count_passes_counts_each_tree_verification_and_keeps_its_result() -> None:
    import types

    module = types.SimpleNamespace(tree_decoding=lambda x, *, scale: x * scale)
    counter = script("reference_eagle").count_passes(module)
    assert module.tree_decoding(3, scale=2) == 6 and module.tree_decoding(1, scale=5) == 5
    assert counter == [2]


class NaiveEngine:
    """A stand-in for eagle-llm's EaModel (not installable here): naive_generate yields the whole sequence
    after each new token, as the engine's does, from a fixed continuation."""

    def __init__(self, continuation: list[int]) -> None:
        self.continuation = continuation

    def naive_generate(self, x, temperature, max_steps):
        import torch

        for token in self.continuation[:max_steps]:
            x = torch.cat([x, torch.tensor([[token]])], dim=1)
            yield x


@pytest.mark.parametrize(
    ("continuation", "ids", "passes"),
    [([7, 8, 9, 10, 11], [7, 8, 9], 2), ([7, 4, 9, 10], [7, 4], 1), ([4, 9, 9], [4], 1)],
)
def test_run_plain_cuts_at_the_budget_and_eos_and_counts_passes(continuation, ids, passes) -> None:
    """Each prompt's new ids (after an untimed warm-up), cut after EOS (4) and at 3 tokens; its target
    passes: one per token after the prefill's."""
    runs = script("reference_eagle").run_plain(NaiveEngine(continuation), [[1, 2], [3]], eos=4, max_new=3)
    assert [r["ids"] for r in runs] == [ids, ids] and [r["passes"] for r in runs] == [passes, passes]
