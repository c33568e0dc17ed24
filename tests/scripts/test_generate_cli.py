"""scripts/generate.py and scripts/benchmark.py run end to end on a tiny target."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_generate_prints_text_and_stats(tiny_target_dir):
    proc = run("generate.py", "--target", str(tiny_target_dir), "--drafter", "prompt_lookup",
               "--prompt", "What is the capital of France?", "--chat", "--max-new-tokens", "12", "--json")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    assert stats["new_tokens"] <= 12 and stats["target_passes"] >= 1 and stats["tau"] >= 1.0


@pytest.mark.slow
def test_generate_several_prompts_is_a_batch(tiny_target_dir, script, capsys):
    common = [
        "--target",
        str(tiny_target_dir),
        "--drafter",
        "prompt_lookup",
        "--chat",
        "--max-new-tokens",
        "10",
    ]
    proc = run(
        "generate.py", *common, "--prompt", "What is the capital of France?", "--prompt", "Add 2 and 3."
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("--- row ") == 2
    row1 = proc.stdout.split("--- row 1\n", 1)[1].rstrip("\n")
    # The other runs in this process (main(argv), what the script runs): the process above is the CLI's,
    # and each process more cost its ~5 s of imports.
    generate = script("generate")
    capsys.readouterr()
    assert generate.main([*common, "--prompt", "Add 2 and 3."]) == 0
    single = capsys.readouterr()
    assert single.out.rstrip("\n") == row1  # greedy: row == its batch-1 output
    assert generate.main([*common, "--prompt", "a", "--prompt", "b", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert isinstance(stats, list) and len(stats) == 2 and all(s["new_tokens"] <= 10 for s in stats)
    assert generate.main([*common, "--prompt", "Add 2 and 3.", "--prompt", "a", "--stream"]) == 0
    streamed = capsys.readouterr()
    pieces = [json.loads(line) for line in streamed.out.splitlines()]
    assert {p["row"] for p in pieces} == {0, 1}  # one JSON line per piece, each naming its row
    assert "".join(p["text"] for p in pieces if p["row"] == 0) == row1.strip()
    assert streamed.err.count("[tau ") == 2  # each row's stats after the stream


def test_generate_compiles_the_draft_when_asked(script, tiny_target_dir, tmp_path, capsys, monkeypatch):
    """--compile-draft BACKEND reaches the generator: the EAGLE draft runs as a graph, the target eager,
    and the answer is plain decoding's; so does --draft-fp8."""
    from transformers import AutoModelForCausalLM

    from spechead.heads import Eagle3Config, Eagle3Head
    from spechead.inference.generator import SpeculativeGenerator

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32)
    head = Eagle3Head(Eagle3Config.from_target(model.config))
    head.init_lm_head_from_target_(model.lm_head.weight)
    head_dir = head.save_pretrained(tmp_path / "eagle3")
    made = []
    load = SpeculativeGenerator.from_pretrained
    monkeypatch.setattr(
        SpeculativeGenerator, "from_pretrained", lambda *a, **k: made.append(load(*a, **k)) or made[-1]
    )
    common = [
        "--target",
        str(tiny_target_dir),
        "--prompt",
        "Add 2 and 3.",
        "--chat",
        "--max-new-tokens",
        "10",
    ]
    generate = script("generate")
    assert generate.main([*common, "--drafter", str(head_dir), "--compile-draft", "eager"]) == 0
    drafted = capsys.readouterr().out
    assert made[-1].drafter._compile == "eager" and not made[-1].runner.static_shapes
    assert made[-1].drafter._rows is made[-1].drafter._graphs is not None  # it drafted as graphs
    assert generate.main(common) == 0  # plain decoding
    assert capsys.readouterr().out.splitlines()[0] == drafted.splitlines()[0]
    assert made[-1].compile is False  # --compile auto, the default: eager on a CPU
    assert generate.main([*common, "--compile", "graphs"]) == 0 and made[-1].compile == "graphs"
    assert capsys.readouterr().out.splitlines()[0] == drafted.splitlines()[0]
    assert generate.main([*common, "--compile", "off"]) == 0 and made[-1].compile is False
    capsys.readouterr()
    assert generate.main([*common, "--compile", "foo"]) == 2  # before loading: one line
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: compile='foo' is not a compile mode: use False (eager), True, auto, graphs, inductor, "
        "max-autotune, reduce-overhead or a torch.compile backend (cudagraphs, eager, aot_eager, ...)"
    ]
    # --draft-fp8: the head's per-depth layers in e4m3 (heads/fp8.py), the answer still plain decoding's
    assert generate.main([*common, "--drafter", str(head_dir), "--draft-fp8"]) == 0
    assert type(made[-1].drafter.head.midlayer.mlp.down_proj).__name__ == "Fp8Linear"
    assert capsys.readouterr().out.splitlines()[0] == drafted.splitlines()[0]
    assert generate.main([*common, "--draft-fp8"]) == 2  # no head: one line
    assert capsys.readouterr().err.strip().startswith("error: draft_fp8 needs an EAGLE / EAGLE-3 head")
    # --draft-fp8 on / off / auto (on a CPU: off), and int8 asked beside FP8 asked is one line
    for flag, weights in (("on", "fp8"), ("off", None), ("auto", None)):
        assert generate.main([*common, "--drafter", str(head_dir), "--draft-fp8", flag]) == 0
        assert made[-1].draft_weights == weights
    capsys.readouterr()
    assert generate.main([*common, "--drafter", str(head_dir), "--draft-fp8", "--draft-int8", "on"]) == 2
    assert (
        capsys.readouterr().err.strip().startswith("error: draft_int8 and draft_fp8 both quantize the draft")
    )
    # --draft-int8 on / off / auto (an EAGLE-3 head on a CPU: off), the answer still plain decoding's
    for flag, weights in (("on", "int8"), ("off", None), ("auto", None)):
        assert generate.main([*common, "--drafter", str(head_dir), "--draft-int8", flag]) == 0
        assert made[-1].draft_weights == weights
        assert capsys.readouterr().out.splitlines()[0] == drafted.splitlines()[0]


def test_generate_bad_input_is_one_line(tiny_target_dir, script, capsys):
    """In this process (main(argv), what the script runs); test_generate_prints_text_and_stats is the process."""
    code = script("generate").main(
        ["--target", str(tiny_target_dir), "--prompt", "hi", "--max-new-tokens", "0"]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: max_new_tokens") and len(err.splitlines()) == 1, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("name", ["generate", "benchmark"])
def test_device_cuda_without_cuda_is_one_line(tiny_target_dir, tmp_path, script, name, capsys):
    extra = ["--prompt", "hi"] if name == "generate" else ["--out", str(tmp_path / "b"), "--no-hf"]
    code = script(name).main(["--target", str(tiny_target_dir), "--device", "cuda", *extra])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: --device cuda: CUDA is not available") and "--device cpu" in lines[0]


@pytest.mark.slow
def test_benchmark_writes_table_and_json(tiny_target_dir, tmp_path):
    out = tmp_path / "bench"
    prompts = tmp_path / "question.jsonl"
    prompts.write_text(
        json.dumps({"question_id": 1, "category": "writing", "turns": ["Write a poem.", "Shorter."]}) + "\n"
        + json.dumps({"question_id": 2, "category": "math", "turns": ["What is 2+2?"]}) + "\n"
    )  # fmt: skip
    proc = run("benchmark.py", "--target", str(tiny_target_dir), "--drafter", "lookup=prompt_lookup",
               "--prompt-set", str(prompts), "--max-new-tokens", "8", "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((out / "decoding.json").read_text())
    (row,) = data["rows"]
    assert row["drafter"] == "lookup" and row["greedy_mismatches"] == 0
    for key in (
        "tau",
        "passes_per_token",
        "tokens_per_s",
        "speedup",
        "t_verify_ms",
        "t_draft_ms",
        "ideal_speedup",
    ):
        assert row[key] > 0 or key == "t_draft_ms"
    assert set(data["verify_ms_by_size"]) == {"1", "2", "4", "8", "16", "32", "64"}
    assert set(row["tau_by_category"]) == {"writing", "math"} and row["speedup_by_category"]["math"] > 0
    # Hugging Face baselines on the same prompts, checked against our plain greedy decoding.
    assert [b["method"] for b in data["hf_baselines"]] == [
        "hf_generate",
        "spechead_plain (ours)",
        "hf_prompt_lookup",
    ]
    assert all(b["greedy_mismatches"] == 0 and b["tokens_per_s"] > 0 for b in data["hf_baselines"])
    assert "| lookup |" in (out / "decoding.md").read_text()
    assert all(0 <= a <= 1 for a in row["acceptance_by_depth"]) and row["speedup_min"] <= row["speedup_max"]
    assert data["versions"]["torch"] and data["settings"]["max_new_tokens"] == 8
    for png in ("speedup_by_category.png", "acceptance_by_depth.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


PROMPT = "Add 2 and 3. Add 2 and"  # no --chat: the raw prompt


def test_generate_a_raw_prompt_with_the_sampling_flags(script, tiny_target_dir, capsys):
    """Without --chat the prompt is not wrapped; --temperature, --top-k, --top-p and --seed reach the
    sampler (the defaults are the API's); the stats line shows the row's own numbers."""
    from spechead.inference.generator import SpeculativeGenerator

    gen = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), "prompt_lookup")
    common = ["--target", str(tiny_target_dir), "--drafter", "prompt_lookup", "--prompt", PROMPT]
    generate = script("generate")
    cases = [
        ([], {}),
        (["--temperature", "1", "--seed", "3"], dict(temperature=1.0, seed=3)),
        (["--temperature", "1", "--seed", "3", "--top-k", "3", "--top-p", "0.5"],
         dict(temperature=1.0, seed=3, top_k=3, top_p=0.5)),
    ]  # fmt: skip
    texts = []
    for flags, options in cases:
        result = gen.generate(prompt=PROMPT, max_new_tokens=10, **options)
        assert generate.main([*common, "--max-new-tokens", "10", *flags]) == 0
        out, err = capsys.readouterr()
        assert out == result.text + "\n", flags
        texts.append(result.text)
    assert len(set(texts)) == 3  # greedy, sampled, sampled from the top 3 / top half: all tell apart
    s = result.stats
    assert s.accepted_tokens != s.drafted_tokens  # so the line's order of the two is checked
    assert (
        f"[tau {s.tau:.2f} tokens per target pass | {s.new_tokens} tokens in {s.target_passes} target passes | "
        f"{s.accepted_tokens}/{s.drafted_tokens} drafts accepted | "
    ) in err


def test_generate_streams_one_prompt_as_plain_text(script, tiny_target_dir, capsys, monkeypatch):
    """--stream with one --prompt prints the text itself (no JSON lines, no newline per piece), then the
    stats; --dtype reaches the loader."""
    from spechead.inference.generator import SpeculativeGenerator

    made = []
    load = SpeculativeGenerator.from_pretrained
    monkeypatch.setattr(
        SpeculativeGenerator, "from_pretrained", lambda *a, **k: made.append(load(*a, **k)) or made[-1]
    )
    common = ["--target", str(tiny_target_dir), "--prompt", PROMPT, "--max-new-tokens", "10"]
    generate = script("generate")
    assert generate.main(common) == 0
    text, stats = capsys.readouterr()
    assert generate.main([*common, "--stream"]) == 0
    out, err = capsys.readouterr()
    assert out == text and "[tau " in err
    assert err.rsplit(" | ", 1)[0] == stats.rsplit(" | ", 1)[0]  # the streamed answer's stats (not tokens/s)
    assert made[-1].target.dtype == torch.float32
    assert generate.main([*common, "--dtype", "bfloat16"]) == 0 and made[-1].target.dtype == torch.bfloat16


@pytest.mark.parametrize("target", ["missing", "unknown architecture"])
def test_generate_a_target_that_cannot_be_loaded_is_one_line(script, tmp_path, capsys, target):
    """A missing --target is an OSError from the loader, an unknown model_type a ValueError of several
    lines from transformers: either is one `error:` line (its first), exit status 2."""
    path = tmp_path / "t"
    if target == "unknown architecture":
        path.mkdir()
        (path / "config.json").write_text(json.dumps({"model_type": "no_such_architecture"}))
    assert script("generate").main(["--target", str(path), "--prompt", "hi"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert ("no_such_architecture" if target == "unknown architecture" else str(path)) in lines[0]


def test_generate_with_a_tree_file_whose_accuracy_is_no_table_is_one_line(
    script, tiny_target_dir, medusa_for, tmp_path, capsys
):
    """tree.json's "accuracy" calibrates the tree at load: a string there was a torch traceback."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32)
    head = medusa_for(model, num_heads=2).save_pretrained(tmp_path / "head")
    (head / "tree.json").write_text(json.dumps({"choices": [[0], [1]], "accuracy": "high"}))
    argv = ["--target", str(tiny_target_dir), "--drafter", str(head), "--prompt", "hi"]
    assert script("generate").main([*argv, "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err.replace("\r", "\n").splitlines()
    lines = [
        line for line in err if line.strip() and not line.startswith("Loading weights")
    ]  # (the target's)
    assert len(lines) == 1 and "accuracy must be a table" in lines[0], lines
    assert lines[0].startswith(f"error: {head / 'tree.json'} is not a valid tree file")
