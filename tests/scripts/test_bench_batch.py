"""scripts/bench_batch.py on a tiny setup: one line per (drafter, batch), the JSON, no greedy mismatch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .test_benchmark import medusa_dir, prompt_file  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parents[2]


def test_bench_batch_lines_and_json(script, tiny_target_dir, medusa_dir, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "bb"
    argv = ["--target", str(tiny_target_dir), "--drafter", f"medusa={medusa_dir}", "--batch-size", "1", "3",
            "--prompt-set", str(prompt_file(tmp_path / "p.jsonl")), "--max-new-tokens", "10",
            "--out", str(out)]  # fmt: skip
    assert script("bench_batch").main(argv) == 0
    text = capsys.readouterr().out
    assert "medusa     B=1" in text and "medusa     B=3" in text
    rows = json.loads((out / "bench_batch.json").read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 3]
    for row in rows:
        assert row["greedy_mismatches"] == 0
        assert row["plain_tokens_per_s"] > 0 and row["hf_tokens_per_s"] > 0 and row["spec_tokens_per_s"] > 0


def test_bench_batch_with_the_batch_passes_compiled(script, tiny_target_dir, medusa_dir, tmp_path, capsys):  # noqa: F811
    """--compile graphs: both engines decode through the kept fixed-row runner (eager on a CPU)."""
    out = tmp_path / "bbc"
    argv = ["--target", str(tiny_target_dir), "--drafter", f"medusa={medusa_dir}", "--batch-size", "3",
            "--prompt-set", str(prompt_file(tmp_path / "p.jsonl")), "--max-new-tokens", "10", "--no-hf",
            "--compile", "graphs", "--out", str(out)]  # fmt: skip
    assert script("bench_batch").main(argv) == 0
    data = json.loads((out / "bench_batch.json").read_text())
    assert data["settings"]["compile"] == "graphs" and data["rows"][0]["greedy_mismatches"] == 0
    assert data["rows"][0]["spec_tokens_per_s"] > 0 and data["rows"][0]["hf_tokens_per_s"] is None


def test_bench_batch_sampling(script, tiny_target_dir, medusa_dir, tmp_path, capsys):  # noqa: F811
    """--temperature: every engine samples (HF too), each prompt with its own seed whatever the batch it
    lands in; no equality check. A bad --top-p is one error line."""
    module = script("bench_batch")
    out = tmp_path / "bbs"
    argv = ["--target", str(tiny_target_dir), "--drafter", f"medusa={medusa_dir}", "--batch-size", "1", "3",
            "--prompt-set", str(prompt_file(tmp_path / "p.jsonl")), "--max-new-tokens", "10",
            "--temperature", "1.0", "--top-p", "0.9", "--seed", "5", "--out", str(out)]  # fmt: skip
    assert module.main(argv) == 0
    assert capsys.readouterr().out.count("sampled") == 2
    rows = json.loads((out / "bench_batch.json").read_text())["rows"]
    for row in rows:
        assert row["greedy_mismatches"] is None
        assert row["plain_tokens_per_s"] > 0 and row["hf_tokens_per_s"] > 0 and row["spec_tokens_per_s"] > 0
    args = module.parse(["--temperature", "0.7", "--seed", "5"])
    assert module.sampling(args, 3, 2) == {"temperature": 0.7, "top_p": 1.0, "seed": [8, 9]}
    assert module.sampling(module.parse([]), 3, 2) == {}
    with pytest.raises(SystemExit) as exc:
        module.parse(["--top-p", "0"])
    assert exc.value.code == 2
    assert "0 < --top-p <= 1" in capsys.readouterr().err


def _one_second_per_reading(module, monkeypatch):
    """The script's clock ticks one second per reading: each timed call then takes exactly 1 s."""
    import itertools
    from types import SimpleNamespace

    ticks = itertools.count()
    monkeypatch.setattr(module, "time", SimpleNamespace(perf_counter=lambda: float(next(ticks))))


def test_tokens_per_s_sums_every_batch_and_tau_leaves_out_each_rows_prefill_token(
    script, tiny_target_dir, monkeypatch
):
    """tokens/s = all new tokens / the wall time of ALL batches (not the last one's), and tau = tokens per
    target pass after each row's first token (the prefill's): plain decoding's tau is exactly 1."""
    from spechead.inference.generator import SpeculativeGenerator

    module = script("bench_batch")
    _one_second_per_reading(module, monkeypatch)
    plain = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), None)
    chats = [[{"role": "user", "content": text}] for text in ("Hello there", "Add 2 and 3.", "Hi")]
    ((tps, outputs, tau),) = module.run_engines([plain], chats, 2, 6, module.parse([]))
    assert len(outputs) == 3 and tau == pytest.approx(1.0)
    assert tps == pytest.approx(sum(map(len, outputs)) / 2)  # two batches (of 2 and 1 rows), 1 s each


def test_hf_tokens_count_each_row_up_to_its_eos(script, tiny_target_dir, monkeypatch):
    """HF generate's rows are counted up to and including their EOS, not the padding after it: a row
    that stops early beside a row that runs on counts as many tokens as our engine emits for each."""
    from spechead.inference.generator import SpeculativeGenerator

    module = script("bench_batch")
    gen = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), None)
    chats = [[{"role": "user", "content": "Hello there"}], [{"role": "user", "content": "Add 2 and 3."}]]
    before = [gen.generate(messages=c, max_new_tokens=12).token_ids for c in chats]
    stop = next(t for t in before[0] if t not in before[1])  # a token row 0 writes, row 1 not: its EOS now
    gen.target.generation_config.eos_token_id = [stop, gen.tokenizer.eos_token_id]
    gen = SpeculativeGenerator(gen.target, gen.tokenizer, None)
    ours = [gen.generate(messages=c, max_new_tokens=12).token_ids for c in chats]
    assert ours[0][-1] == stop and len(ours[0]) < len(ours[1])
    _one_second_per_reading(module, monkeypatch)
    assert module.run_hf(gen, chats, 2, 12, module.parse([])) == pytest.approx(len(ours[0]) + len(ours[1]))
    # one row a batch: two batches of 1 s each, their wall times summed
    assert module.run_hf(gen, chats, 1, 12, module.parse([])) == pytest.approx(
        (len(ours[0]) + len(ours[1])) / 2
    )


def test_a_row_that_differs_from_plain_decoding_is_counted_and_shouted(
    script,
    tiny_target_dir,
    medusa_dir,  # noqa: F811
    tmp_path,
    capsys,
    monkeypatch,
):
    """The lossless check of the report: a speculative row whose tokens differ from plain greedy
    decoding's (an engine broken on purpose: its first row's last token changed) is counted in the line
    and the JSON and named on stderr."""
    module = script("bench_batch")
    real = module.run_engines

    def broken(engines, *args):
        runs = real(engines, *args)
        if len(engines) == 1:
            return runs
        tps, outputs, tau = runs[-1]
        outputs = [list(o) for o in outputs]
        outputs[0][-1] += 1
        return [*runs[:-1], (tps, outputs, tau)]

    monkeypatch.setattr(module, "run_engines", broken)
    out = tmp_path / "bad"
    argv = ["--target", str(tiny_target_dir), "--drafter", f"medusa={medusa_dir}", "--batch-size", "3",
            "--prompt-set", str(prompt_file(tmp_path / "p.jsonl")), "--max-new-tokens", "6", "--no-hf",
            "--out", str(out)]  # fmt: skip
    assert module.main(argv) == 0
    captured = capsys.readouterr()
    assert "mismatches 1" in captured.out
    assert "!!! medusa B=3: 1 outputs differ from plain greedy decoding" in captured.err
    assert json.loads((out / "bench_batch.json").read_text())["rows"][0]["greedy_mismatches"] == 1


def test_the_speedup_is_over_plain_batched_decoding_of_the_same_target(
    script,
    tiny_target_dir,
    medusa_dir,  # noqa: F811
    tmp_path,
    monkeypatch,
    capsys,
):
    """speedup_vs_plain = speculative tokens/s / OUR plain batched tokens/s (HF generate's is its own
    column): with the engines' and HF's rates planted, the row divides the right two."""
    module = script("bench_batch")
    real = module.run_engines

    def planted(engines, *args):
        rates = [100.0, 250.0]  # plain, then speculative
        return [(rate, outputs, tau) for rate, (_, outputs, tau) in zip(rates, real(engines, *args))]

    monkeypatch.setattr(module, "run_engines", planted)
    monkeypatch.setattr(module, "run_hf", lambda *args: 50.0)
    out = tmp_path / "rates"
    argv = ["--target", str(tiny_target_dir), "--drafter", f"medusa={medusa_dir}", "--batch-size", "2",
            "--prompt-set", str(prompt_file(tmp_path / "p.jsonl")), "--max-new-tokens", "4", "--out", str(out)]  # fmt: skip
    assert module.main(argv) == 0
    (row,) = json.loads((out / "bench_batch.json").read_text())["rows"]
    assert (row["plain_tokens_per_s"], row["hf_tokens_per_s"], row["spec_tokens_per_s"]) == (
        100.0,
        50.0,
        250.0,
    )
    assert row["speedup_vs_plain"] == pytest.approx(2.5)
    assert "speedup 2.50x" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--batch-size", "0"], "error: --batch-size must be at least 1, got 0"),
        (["--batch-size", "4", "-1"], "error: --batch-size must be at least 1, got -1"),
        (["--prompts", "0"], "error: --prompts must be at least 1, got 0"),
        (["--max-new-tokens", "0"], "error: --max-new-tokens must be at least 1, got 0"),
        (["--out", "{file}/out"], "error: --out {file}/out is not a writable directory ({file} is a file, "
                                  "not a directory): choose another"),
    ],
)  # fmt: skip
def test_bad_arguments_are_one_line_before_anything_loads(script, tmp_path, capsys, argv, line):
    blocker = tmp_path / "file.txt"  # a regular file: no directory can be made under it, even as root
    blocker.write_text("x")
    with pytest.raises(SystemExit) as exited:
        script("bench_batch").parse([a.format(file=blocker) for a in argv])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines() == [line.format(file=blocker)]


def test_every_drafters_options_are_checked_before_the_first_run(script, tmp_path, capsys):
    """A bad option of the last drafter: one line before anything loads (the target does not even exist)."""
    argv = ["--target", str(tmp_path / "no-target"), "--drafter", "p=prompt_lookup", "--drafter",
            "x=prompt_lookup@depth=2"]  # fmt: skip
    assert script("bench_batch").main(argv) == 2
    assert capsys.readouterr().err.splitlines() == [
        "bench_batch.py: error: --drafter x=prompt_lookup@depth=2: prompt_lookup: unknown option(s) depth; "
        "valid: max_ngram, min_ngram, num_draft"
    ]
