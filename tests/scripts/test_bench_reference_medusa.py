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


def row(tok_s: float, lo: float, hi: float, tau: float, passes: list[int], mismatches: int = 0) -> dict:
    return {"tok_s": tok_s, "tok_s_range": [lo, hi], "tau": tau, "mismatches": mismatches, "tokens": 40,
            "passes": passes}  # fmt: skip


def test_render_compares_each_tree_in_both_engines() -> None:
    import torch

    result = {
        "settings": {"prompts": 2, "prompt_set": "demo", "max_new_tokens": 8, "repeats": 3, "device": "cpu"},
        "reference_versions": {"transformers": "4.36.2", "torch": "2", "threads": 1},
        "trees": {"2x1": 4, "1x1": 2},
        "default_tree": 7,
        "reference": {"2x1": row(15.0, 14.0, 16.0, 1.5, [5, 6]), "1x1": row(12.0, 11.0, 13.0, 1.25, [6, 7])},
        "ours": {"plain": row(10.0, 9.0, 11.0, 1.0, [8, 8]), "defaults": row(30.0, 28.0, 33.0, 3.0, [3, 3]),
                 "2x1": row(25.0, 24.0, 26.0, 1.5, [5, 5], 1), "1x1": row(18.0, 17.0, 19.0, 1.25, [6, 6])},
    }  # fmt: skip
    lines = script("bench_reference_medusa").render(result).splitlines()
    assert lines[0].endswith(
        f"up to 8 new tokens, greedy, CPU ({torch.get_num_threads()} threads), median of 3 alternating repeats"
    )
    assert lines[4:] == [
        "| 2x1 (4) | reference | 1.50 | 15.0 [14.0, 16.0] | 1.50x |  | 0 |",
        "| 2x1 (4) | spechead | 1.50 | 25.0 [24.0, 26.0] | 2.50x | 1.67x | 1 |",
        "| 1x1 (2) | reference | 1.25 | 12.0 [11.0, 13.0] | 1.20x |  | 0 |",
        "| 1x1 (2) | spechead | 1.25 | 18.0 [17.0, 19.0] | 1.80x | 1.50x | 0 |",
        "| our defaults (7) | spechead | 3.00 | 30.0 [28.0, 33.0] | 3.00x | 2.00x the reference's best tree | 0 |",
        "| our plain | spechead | 1.00 | 10.0 [9.0, 11.0] | 1.00x | 0.67x the reference's best tree | 0 |",
        "",
        "40 tokens a run",
        "",
        "passes per prompt, the reference's minus ours (difference: prompts): 2x1 +0: 1, +1: 1; 1x1 +0: 1, +1: 1",
    ]


def test_trees_as_deep_as_the_head_are_run_deeper_ones_refused(
    tiny_target_dir, tmp_path, capsys, monkeypatch, int8_cpu
) -> None:
    """A tree of the head's depth passes the check (and reaches the reference engine, absent here); one
    deeper is refused before anything is loaded. Our engine runs the trees on the head's float weights
    (the reference's), our defaults as they are (on a CPU: int8 projections)."""
    from transformers import AutoConfig

    from spechead.inference.generator import SpeculativeGenerator

    made, load = [], SpeculativeGenerator.from_pretrained
    monkeypatch.setattr(
        SpeculativeGenerator, "from_pretrained", lambda *a, **k: made.append(load(*a, **k)) or made[-1]
    )

    config = AutoConfig.from_pretrained(tiny_target_dir)
    head = MedusaHead(MedusaConfig(hidden_size=config.hidden_size, vocab_size=config.vocab_size, num_heads=2,
                                   target_num_layers=config.num_hidden_layers,
                                   target_name_or_path=str(tiny_target_dir)))  # fmt: skip
    head_dir = head.save_pretrained(tmp_path / "head")
    argv = ["--ref-python", sys.executable, "--target", str(tiny_target_dir), "--head", str(head_dir),
            "--out", str(tmp_path / "o"), "--prompts", "1", "--max-new-tokens", "2", "--repeats", "1"]  # fmt: skip
    main = script("bench_reference_medusa").main
    capsys.readouterr()
    assert main([*argv, "--trees", "1x1", "2x1x1"]) == 2
    assert capsys.readouterr().err == "error: a tree deeper than the head's 2 heads: shorten --trees\n"
    assert main([*argv, "--trees", "2x1"]) == 2
    last = capsys.readouterr().err.splitlines()[-1]  # (after the loading bars, which end in \r)
    assert last.startswith("error: the reference engine failed: ModuleNotFoundError") and "medusa" in last
    assert [g.draft_weights for g in made] == [None, "int8", None]  # plain, defaults, the 2x1 tree


class MedusaEngine:
    """A stand-in for medusa-llm 0.1's MedusaModel (not installable here): each step runs the module's
    tree_decoding once, accepts `per_pass` tokens of a fixed continuation, hands the new ids so far to the
    tokenizer's decode and yields; it stops at EOS (4) itself, as the engine does."""

    def __init__(self, module, tokenizer, continuation: list[int], per_pass: int) -> None:
        self.module, self.tokenizer, self.continuation, self.per_pass = (
            module,
            tokenizer,
            continuation,
            per_pass,
        )

    def medusa_generate(self, x, temperature, max_steps, medusa_choices):
        new: list[int] = []
        for start in range(0, len(self.continuation), self.per_pass):
            self.module.tree_decoding()
            new += self.continuation[start : start + self.per_pass]
            self.tokenizer.decode(torch.tensor(new), skip_special_tokens=True)
            yield {"text": ""}
            if 4 in new:
                return


@pytest.mark.parametrize(
    ("continuation", "per_pass", "ids", "passes"),
    [
        ([7, 8, 9, 10, 11, 12], 2, [7, 8, 9], 2),
        ([7, 8, 9, 10, 11, 12], 1, [7, 8, 9], 3),  # stops once it has the budget, not a pass later
        ([7, 4, 9, 10], 2, [7, 4], 1),
        ([7, 8, 9, 4], 2, [7, 8, 9], 2),
    ],
)
def test_the_references_tree_runs_stop_at_the_budget_and_count_their_own_passes(
    continuation, per_pass, ids, passes
):
    """Each prompt (after an untimed warm-up): the new ids the engine decoded, cut after EOS and at 3
    tokens, and the tree verifications of that prompt alone."""
    import types

    ref = script("reference_medusa")
    module = types.SimpleNamespace(tree_decoding=lambda: None)
    counter = ref.count_passes(module)
    tokenizer = ref.IdsTokenizer(eos=4)
    engine = MedusaEngine(module, tokenizer, continuation, per_pass)
    runs = ref.run_tree(engine, counter, tokenizer, [[1, 2], [3]], [1, 2], eos=4, max_new=3, device="cpu")
    assert [r["ids"] for r in runs] == [ids, ids] and [r["passes"] for r in runs] == [passes, passes]
