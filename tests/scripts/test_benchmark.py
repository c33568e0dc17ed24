"""scripts/benchmark.py on a tiny setup: every method, the JSON's fields, plots, and the greedy equality check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from spechead.inference.evaluation.measure import DecodeSettings, PromptSetRun, Tally, summarize
from spechead.inference.evaluation.report import render
from spechead.inference.stats import TAU, GenerationStats

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def medusa_dir(tmp_path_factory, tiny_target_dir, medusa_for) -> Path:
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32)
    return medusa_for(model, num_heads=2).save_pretrained(tmp_path_factory.mktemp("bench") / "medusa")


def prompt_file(path: Path) -> Path:
    rows = [
        {"question_id": 1, "category": "qa", "turns": ["What is the capital of France?"]},
        {"question_id": 2, "category": "math", "turns": ["Please add 12 and 30.", "And 2 and 3?"]},
        {"question_id": 3, "category": "qa", "turns": ["Translate hello into Spanish."]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_benchmark_writes_table_json_and_plots(
    script, tiny_target_dir, medusa_dir, tmp_path, capsys, int8_cpu
):
    out = tmp_path / "bench"
    argv = ["--target", str(tiny_target_dir), "--drafter", f"medusa={medusa_dir}",
            "--drafter", "lookup=prompt_lookup@num_draft=4", "--prompt-set", str(prompt_file(tmp_path / "p.jsonl")),
            "--max-new-tokens", "12", "--repeats", "2", "--warmup", "1",
            "--assistant", str(tiny_target_dir), "--out", str(out)]  # fmt: skip
    assert script("benchmark").main(argv) == 0
    table = capsys.readouterr().out
    assert "| medusa |" in table and "| hf_assisted |" in table and "tau, pooled per category" in table
    assert "| drafter | tau (pooled) |" in table and f"tau = {TAU}." in table

    report = json.loads((out / "decoding.json").read_text())
    assert report["categories"] == ["math", "qa"]
    assert [r["drafter"] for r in report["rows"]] == ["medusa", "lookup"]
    # a Medusa head on a CPU drafts through int8 projections by default: the table says so
    assert [r["draft_weights"] for r in report["rows"]] == ["int8", None]
    assert "quantized (lossless: the target verifies every token): medusa int8\n" in table
    for row in report["rows"]:
        assert row["greedy_mismatches"] == 0  # lossless: identical to plain greedy decoding
        assert row["tau"] >= 1.0 and len(row["speedups"]) == 2
        assert row["speedup_min"] <= row["speedup"] <= row["speedup_max"]
        assert set(row["tau_by_category"]) == set(row["speedup_by_category"]) == {"math", "qa"}
        assert sum(row["tau_distribution"].values()) == round(row["new_tokens"] * row["passes_per_token"])
        dist = {int(k): n for k, n in row["tau_distribution"].items()}
        assert row["tau"] == pytest.approx(sum(k * n for k, n in dist.items()) / sum(dist.values()))  # pooled
        assert all(0.0 <= a <= 1.0 for a in row["acceptance_by_depth"])
        for key in ("tokens_per_s", "t_step_ms", "t_verify_ms", "t_draft_ms", "t_other_ms", "ideal_speedup"):
            assert row[key] >= 0.0
    methods = ["hf_generate", "spechead_plain (ours)", "hf_prompt_lookup", "hf_assisted"]
    assert [r["method"] for r in report["hf_baselines"]] == methods
    assert all(r["greedy_mismatches"] == 0 for r in report["hf_baselines"])
    ours = report["hf_baselines"][1]  # our plain decoding, whole calls beside HF generate's
    assert ours["tokens_per_s"] > 0 and ours["speedup_vs_hf_generate"] == pytest.approx(
        ours["tokens_per_s"] / report["hf_baselines"][0]["tokens_per_s"]
    )
    assert "POOLED" in report["definitions"]["tau"] and "per-prompt" in report["definitions"]["tau"]
    assert report["settings"]["repeats"] == 2 and report["versions"]["torch"] == torch.__version__
    assert sorted(int(k) for k in report["verify_ms_by_size"]) == [1, 2, 4, 8, 16, 32, 64]
    for png in ("speedup_by_category.png", "acceptance_by_depth.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    assert (out / "decoding.md").read_text().startswith("plain decoding:")


def test_benchmark_sampling(script, tiny_target_dir, medusa_dir, tmp_path):
    out = tmp_path / "bench"
    argv = ["--target", str(tiny_target_dir), "--drafter", f"medusa={medusa_dir}", "--prompt-set", "demo",
            "--prompts", "2", "--max-new-tokens", "8", "--temperature", "0.8", "--top-p", "0.9", "--no-hf",
            "--out", str(out)]  # fmt: skip
    assert script("benchmark").main(argv) == 0
    report = json.loads((out / "decoding.json").read_text())
    assert report["rows"][0]["greedy_mismatches"] is None  # sampled outputs are not compared
    assert report["settings"]["temperature"] == 0.8 and report["hf_baselines"] == []
    assert "n/a (sampling)" in (out / "decoding.md").read_text()


def _run(outputs: list[list[int]], lengths: list[int]) -> PromptSetRun:
    tally = Tally(
        new_tokens=sum(lengths), wall_time=1.0, draft_time=0.1, verify_time=0.5, accept_lengths=lengths
    )
    return PromptSetRun(tally, {"qa": tally}, outputs)


def test_tau_is_pooled_over_passes_not_a_mean_of_prompt_means():
    """Prompt a (qa): 1 pass of 5 tokens; b (qa): 4 passes of 1; c (math): passes of 3 and 1.

    Pooled: (5 + 4 + 4) / 7 passes = 13/7. The mean of per-prompt taus would be (5 + 1 + 2) / 3 = 8/3,
    and of per-category taus (9/5 + 2) / 2 = 1.9: vLLM and SGLang count the pooled value.
    """
    calls = [("qa", [5]), ("qa", [1, 1, 1, 1]), ("math", [3, 1])]
    run = PromptSetRun(Tally(), {}, [])
    for category, lengths in calls:  # what decode_prompts does with each generate() result
        stats = GenerationStats(accept_lengths=lengths, new_tokens=sum(lengths) + 1, wall_time=1.0)
        run.total.add(stats)
        run.by_category.setdefault(category, Tally()).add(stats)
        run.outputs.append(list(range(sum(lengths) + 1)))
    plain = PromptSetRun(run.total, run.by_category, run.outputs)
    row = {"drafter": "d", **summarize([run], [plain], DecodeSettings())}
    assert row["tau"] == pytest.approx(13 / 7)
    assert row["tau"] != pytest.approx(sum(sum(x) / len(x) for _, x in calls) / len(calls))
    assert row["tau_by_category"] == pytest.approx({"qa": 9 / 5, "math": 2.0})
    assert row["tau_distribution"] == {"1": 5, "3": 1, "5": 1}
    table = render("h", [row], [], {})
    assert "| d | 1.86 |" in table and "| qa | 1.80 (" in table and f"tau = {TAU}." in table


def test_greedy_mismatch_is_counted_and_shown():
    plain = _run([[1, 2, 3], [4, 5]], [1] * 5)
    drafted = _run([[1, 2, 3], [4, 6]], [3, 2])
    row = {"drafter": "bad", **summarize([drafted], [plain], DecodeSettings())}
    assert row["greedy_mismatches"] == 1 and row["tau"] == 2.5 and row["acceptance_by_depth"] == [1.0, 0.5]
    assert "| bad |" in render("h", [row], [], {}) and "NO (1)" in render("h", [row], [], {})
    assert "calibrated at load" not in render("h", [row], [], {})
    row["calibrated_tree"] = {"nodes": 3, "depth": 3, "expected_speedup": 1.234}  # what this load picked
    assert "- bad: 3 drafted nodes, depth 3, expected 1.23x" in render("h", [row], [], {})


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--drafter", "no-equals-sign"], "NAME=SPEC"),
        (["--prompt-set", "missing.jsonl"], "not found"),
        (["--drafter", "m=prompt_lookup@depth=x"], "must be an integer, dynamic or a tree file"),
    ],
)
def test_benchmark_bad_input(script, tiny_target_dir, tmp_path, capsys, argv, needle):
    argv = ["--target", str(tiny_target_dir), "--prompts", "1", "--max-new-tokens", "2", "--no-hf",
            "--out", str(tmp_path), *argv]  # fmt: skip
    assert script("benchmark").main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error:") and needle in err[-1]


def test_drafter_options_parse_tree_files(script, tmp_path):
    tree = tmp_path / "tree.json"
    tree.write_text('{"choices": [[0], [1], [0, 0]]}')
    path, options = script("benchmark").drafter_options(f"heads/x@tree={tree},top_k=4")
    assert path == "heads/x" and options == {"tree": [[0], [1], [0, 0]], "top_k": 4}
    assert script("benchmark").drafter_options("h@tree=dynamic") == ("h", {"tree": "dynamic"})


def test_assistant_defaults_to_the_demo_draft_for_the_demo_target(script, tiny_target_dir):
    from spechead.configs import demo_asset

    script = script("benchmark")
    assert script._assistant(script.parse([])) == demo_asset("draft")  # the demo target is the default
    assert script._assistant(script.parse(["--target", str(tiny_target_dir)])) is None
    assert script._assistant(script.parse(["--assistant", "none"])) is None
    assert (Path(demo_asset("draft")) / "model.safetensors").is_file()


@pytest.mark.parametrize("name", ["benchmark", "bench_batch"])
def test_compile_defaults_to_auto_resolved_for_the_device(script, name, capsys):
    """--compile: auto by default, resolved as from_pretrained resolves it (a CPU: eager, and so is the
    plain decoding beside it); off is eager, a bare flag inductor, a backend name as written."""
    parse = script(name).parse
    assert parse([]).compile is False and parse(["--compile", "off"]).compile is False
    assert parse([]).compile_given == "auto"  # (what from_pretrained gets: it proves graphs it chose)
    assert parse(["--compile"]).compile is True and parse(["--compile", "graphs"]).compile == "graphs"
    with pytest.raises(SystemExit):  # argparse's one line: "--compile-draft='x' is not a compile mode ..."
        parse(["--compile-draft", "x"])
    assert "--compile-draft='x' is not a compile mode" in capsys.readouterr().err


class Recording:
    """Our plain generator, keeping each generate() result (to recount what the baselines report)."""

    def __init__(self, gen):
        self.gen, self.results = gen, []
        self.target, self.tokenizer = gen.target, gen.tokenizer

    def generate(self, **kwargs):
        self.results.append(self.gen.generate(**kwargs))
        return self.results[-1]


def _baseline_args(script, tiny_target_dir, *extra):
    return script("benchmark").parse(["--target", str(tiny_target_dir), "--assistant", "none", *extra])


def test_baselines_are_divided_by_hf_generate_and_ours_timed_whole_calls(script, tiny_target_dir):
    """Each HF baseline's speedup is its tokens/s over HF generate's (not 1.0 over itself), and our plain
    decoding beside it counts whole calls, prefill included, as HF's are timed: its tokens/s is all new
    tokens over all generate() wall time."""
    from spechead.data.prompt_sets import EvalPrompt
    from spechead.inference.generator import SpeculativeGenerator

    bench = script("benchmark")
    args = _baseline_args(script, tiny_target_dir, "--max-new-tokens", "6")
    plain = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), None)
    prompts = [EvalPrompt("a", "qa", ["What is the capital of France?", "And of Spain?"])]
    settings = DecodeSettings(max_new_tokens=6)
    base = bench.decode_prompts(plain, prompts, settings)
    ours = Recording(plain)
    rows = bench.measure_baselines(args, ours, prompts, settings, base)
    assert [r["method"] for r in rows] == ["hf_generate", "spechead_plain (ours)", "hf_prompt_lookup"]
    hf = rows[0]["tokens_per_s"]
    for row in rows:
        assert row["speedup_vs_hf_generate"] == pytest.approx(row["tokens_per_s"] / hf)
        assert row["greedy_mismatches"] == 0
    assert rows[2]["speedup_vs_hf_generate"] != pytest.approx(1.0)  # (two timings are never equal)
    new = sum(r.stats.new_tokens for r in ours.results)
    assert rows[1]["tokens_per_s"] == pytest.approx(new / sum(r.stats.wall_time for r in ours.results))


def test_hf_turns_are_sampled_with_seed_plus_turn_index(script, tiny_target_dir):
    """Sampled HF baselines seed turn i (over the whole prompt set) with --seed + i, as our decoding does:
    the same prompt asked twice is drawn with two seeds, each the draw HF generate gives with that seed."""
    from spechead.data.prompt_sets import EvalPrompt
    from spechead.inference.generator import SpeculativeGenerator

    gen = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), None)
    gen.target.generation_config.eos_token_id = None  # (random weights: answers run to their budget)
    prompts = [EvalPrompt("a", "qa", ["Hello there"]), EvalPrompt("b", "qa", ["Hello there"])]
    settings = DecodeSettings(max_new_tokens=8, temperature=1.0, seed=5)
    _, outputs, _ = script("benchmark").hf_generate(gen, prompts, settings)
    ids = gen.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello there"}], add_generation_prompt=True, return_dict=False
    )
    alone = []
    for seed in (5, 6):
        torch.manual_seed(seed)
        out = gen.target.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=True, temperature=1.0,
                                  top_p=1.0, top_k=0, pad_token_id=gen.tokenizer.pad_token_id)  # fmt: skip
        alone.append(out[0, len(ids) :].tolist())
    assert outputs == alone and alone[0] != alone[1]


def test_the_report_header_times_a_plain_step_by_its_verify_pass(script, tmp_path):
    """decoding.md / decoding.json's plain step time is plain decoding's verification time per pass
    (the t_step every row's ideal speedup uses), not its wall time per pass."""
    args = script("benchmark").parse(["--out", str(tmp_path)])
    plain = Tally(new_tokens=10, wall_time=2.0, verify_time=1.0, accept_lengths=[1] * 10)
    base = PromptSetRun(plain, {"qa": plain}, [])
    text = script("benchmark").write(args, [], base, [], [], {})
    payload = json.loads((tmp_path / "decoding.json").read_text())
    assert payload["t_step_ms"] == pytest.approx(100.0) and payload["plain_tokens_per_s"] == pytest.approx(
        5.0
    )
    assert text.startswith("plain decoding: 5.0 tokens/s, 100.00 ms per step")


@pytest.mark.parametrize("flag", ["--repeats", "--prompts", "--max-new-tokens"])
def test_counts_below_one_are_refused_in_one_line(script, flag, capsys):
    with pytest.raises(SystemExit):
        script("benchmark").parse([flag, "0"])
    assert "must be >= 1" in capsys.readouterr().err


def test_hf_tokens_per_s_counts_the_generated_tokens_over_the_generate_calls(
    script, tiny_target_dir, monkeypatch
):
    """HF generate's tokens/s = the tokens each call generated (the prompt and nothing else left out) over
    the time inside its generate() calls: with a clock that ticks one second per reading, 5 tokens a turn."""
    import itertools
    from types import SimpleNamespace

    from spechead.data.prompt_sets import EvalPrompt
    from spechead.inference.generator import SpeculativeGenerator

    bench = script("benchmark")
    ticks = itertools.count()
    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    gen = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), None)
    gen.target.generation_config.eos_token_id = None  # (random weights: answers run to their budget)
    prompts = [EvalPrompt("a", "qa", ["Hello there", "Again?"]), EvalPrompt("b", "qa", ["Hi"])]
    tokens_per_s, outputs, _ = bench.hf_generate(gen, prompts, DecodeSettings(max_new_tokens=5))
    assert [len(o) for o in outputs] == [5, 5, 5] and tokens_per_s == pytest.approx(5.0)


def test_the_table_shows_each_number_in_its_column():
    """decoding.md's cells: speedup as median [min, max], the ideal speedup, each category's own tau and
    speedup, each HF baseline's speedup over HF generate, and greedy equality (n/a when sampled)."""
    row = {"drafter": "d", "tau": 2.5, "passes_per_token": 0.4, "tokens_per_s": 50.0, "speedup": 2.0,
           "speedup_min": 1.3, "speedup_max": 3.0, "t_verify_ms": 3.0, "t_draft_ms": 1.0, "t_other_ms": 0.5,
           "ideal_speedup": 2.75, "greedy_mismatches": None, "acceptance_by_depth": [0.9, 0.6],
           "tau_by_category": {"qa": 2.25, "math": 3.5}, "speedup_by_category": {"qa": 1.75, "math": 2.5}}  # fmt: skip
    hf = [{"method": "hf_generate", "tokens_per_s": 20.0, "speedup_vs_hf_generate": 1.0, "greedy_mismatches": 0},
          {"method": "hf_prompt_lookup", "tokens_per_s": 30.0, "speedup_vs_hf_generate": 1.5,
           "greedy_mismatches": 2}]  # fmt: skip
    table = render("h", [row], hf, {1: 0.002})
    assert (
        "| d | 2.50 | 0.400 | 50.0 | 2.00x [1.30, 3.00] | 3.00 | 1.00 | 0.50 | 2.75x | n/a (sampling) |"
        in table
    )
    assert "| math | 3.50 (2.50x) |" in table and "| qa | 2.25 (1.75x) |" in table
    assert (
        "| hf_generate | 20.0 | 1.00x | yes |" in table
        and "| hf_prompt_lookup | 30.0 | 1.50x | NO (2) |" in table
    )
    assert "- d: 0.90, 0.60" in table and "verification pass by tree size: 1: 2.00 ms" in table


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")  # (peft, saving the adapter)
def test_a_medusa2_heads_plain_baseline_is_its_adapted_target(script, tiny_target_dir, tmp_path):
    """A Medusa-2 head decodes with its LoRA adapter merged into the target, so its plain baseline is that
    merged target (the one loaded), not the base target: greedy outputs equal, speedups over the same
    model. A baseline reloaded from --target would differ from the head's outputs."""
    from peft import LoraConfig, get_peft_model

    from spechead.heads import MedusaConfig, MedusaHead

    torch.manual_seed(0)  # init_lora_weights=False: a random (non-zero) adapter, as if trained
    lora = LoraConfig(r=4, lora_alpha=64, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    adapted = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32), lora)
    head_dir = tmp_path / "medusa2"
    adapted.save_pretrained(head_dir / "adapter")
    cfg = adapted.config
    head = MedusaHead(MedusaConfig(hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, num_heads=2,
                                   target_num_layers=cfg.num_hidden_layers, lora_adapter="adapter"))  # fmt: skip
    head.init_from_lm_head_(adapted.merge_and_unload().lm_head.weight).save_pretrained(head_dir)
    out = tmp_path / "bench"
    argv = ["--target", str(tiny_target_dir), "--drafter", f"m2={head_dir}", "--no-hf",
            "--prompt-set", str(prompt_file(tmp_path / "p.jsonl")), "--max-new-tokens", "10", "--repeats", "1",
            "--warmup", "1", "--out", str(out)]  # fmt: skip
    assert script("benchmark").main(argv) == 0
    assert json.loads((out / "decoding.json").read_text())["rows"][0]["greedy_mismatches"] == 0


def test_an_unwritable_out_is_refused_before_the_run(script, tmp_path, capsys):
    """--out is checked first: here the target does not even exist, and the error is still --out's."""
    blocker = tmp_path / "file.txt"  # a regular file: no directory can be made under it, even as root
    blocker.write_text("x")
    argv = ["--target", str(tmp_path / "no-target"), "--out", str(blocker / "out")]
    assert script("benchmark").main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"error: --out {blocker / 'out'} is not a writable directory ({blocker} is a file, "
                     "not a directory): choose another"]  # fmt: skip


def test_every_drafters_options_are_checked_before_the_first_run(script, medusa_dir, tmp_path, capsys):
    """A bad option of the LAST drafter ends the run before anything is measured: here the target does not
    even exist, and the error is still that drafter's (a static tree goes in tree= for every head)."""
    tree = tmp_path / "tree.json"
    tree.write_text('{"choices": [[0], [0, 0]]}')
    bad = f"{medusa_dir}@top_k=3"
    argv = ["--target", str(tmp_path / "no-target"), "--out", str(tmp_path), "--drafter",
            f"m={medusa_dir}@tree={tree}", "--drafter", "p=prompt_lookup", "--drafter", f"x={bad}"]  # fmt: skip
    assert script("benchmark").main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: drafter x={bad}: medusa head: unknown option(s) top_k; valid: choices"
    ]
