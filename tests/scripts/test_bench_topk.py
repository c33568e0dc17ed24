"""scripts/bench_topk.py on small shapes: every chunk of every case timed, the fastest named in the JSON."""

from __future__ import annotations

import json

import pytest


def test_every_case_and_chunk_gets_a_timing_and_the_fastest_is_named(script, capsys, tmp_path):
    out = tmp_path / "topk.json"
    args = ["--rows", "1", "3", "--vocab", "300", "--chunks", "8", "16", "--calls", "2", "--repeats", "2"]
    assert script("bench_topk").main([*args, "--out", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[1] == "rows x V | mode | one | chunk 8 | chunk 16"
    assert [line.split(" | ")[:2] for line in lines[2:]] == [
        ["1 x 300", "eager"], ["1 x 300", "fastest: " + lines[3].split(": ")[1]],
        ["3 x 300", "eager"], ["3 x 300", "fastest: " + lines[5].split(": ")[1]],
    ]  # fmt: skip
    cases = json.loads(out.read_text())["cases"]
    assert [(c["rows"], c["vocab"], sorted(c["eager"]), c["compiled"]) for c in cases] == [
        (1, 300, ["16", "8", "one"], {}), (3, 300, ["16", "8", "one"], {}),
    ]  # fmt: skip
    for case in cases:  # the fastest by its timings ("one": None)
        fastest = min(case["eager"], key=case["eager"].get)
        assert case["best"] == (None if fastest == "one" else int(fastest))


def test_the_timed_function_is_the_drafters_top(script):
    """Chunked or not: the k best ids of the fp32 logits and their log-probs."""
    import torch

    g = torch.Generator().manual_seed(0)
    logits = torch.stack([torch.randperm(256, generator=g) / 32 for _ in range(4)]).bfloat16()  # distinct
    want = torch.log_softmax(logits.float(), -1).topk(8)
    for chunk in (None, 16):
        values, ids = script("bench_topk").top(logits, 8, chunk)
        assert torch.equal(ids, want.indices) and torch.allclose(values, want.values), chunk


def test_bad_numbers_are_one_error_line(script, capsys):
    with pytest.raises(SystemExit) as exc:
        script("bench_topk").main(["--vocab", "8"])
    assert exc.value.code == 2
    assert "--vocab must be larger than --top-k (8)" in capsys.readouterr().err


def test_time_calls_is_the_median_per_call_after_three_untimed_calls(script, monkeypatch):
    """Planted durations (microseconds): three warm-up calls, then `repeats` runs of `calls` calls."""
    import time

    import torch

    now, durations = [0.0], [100.0] * 3 + [1.0, 1.0, 5.0, 5.0, 2.0, 4.0]  # runs: 1, 5 and 3 us a call
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])

    def fn():
        now[0] += 1e-6 * durations.pop(0)

    assert script("bench_topk").time_calls(fn, 2, 3, torch.device("cpu")) == pytest.approx(3.0)
    assert durations == []


def test_compiled_timings_name_the_fastest(script, monkeypatch, capsys, tmp_path):
    """--compile (here on a CPU): planted timings per (chunk, mode), in the order they are taken; the
    fastest compiled chunk is the one named, and the table prints each mode's row."""
    module = script("bench_topk")
    planted = [5.0, 3.0, 4.0, 9.0, 6.0, 1.0]  # eager one, compiled one, eager 8, compiled 8, eager 16, ...
    counts = set()  # (calls, repeats) of every timing

    def planted_time(fn, calls, repeats, device):
        counts.add((calls, repeats))
        return planted.pop(0)

    monkeypatch.setattr(module, "time_calls", planted_time)
    out = tmp_path / "topk.json"
    argv = ["--rows", "2", "--vocab", "50", "--top-k", "4", "--chunks", "8", "16", "--compile", "--calls", "3",
            "--repeats", "5", "--out", str(out)]  # fmt: skip
    assert module.main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "top-4" in lines[0] and "median of 5" in lines[0] and counts == {(3, 5)}
    assert lines[2:] == [
        "2 x 50 | eager | 5.0 | 4.0 | 6.0",
        "2 x 50 | compiled | 3.0 | 9.0 | 1.0",
        "2 x 50 | fastest: 16",
    ]
    written = json.loads(out.read_text())
    assert (written["device"], written["top_k"]) == ("cpu", 4)
    case = written["cases"][0]
    assert case["eager"] == {"one": 5.0, "8": 4.0, "16": 6.0}
    assert case["compiled"] == {"one": 3.0, "8": 9.0, "16": 1.0}
    assert (case["rows"], case["vocab"], case["k"], case["best"]) == (2, 50, 4, 16)


@pytest.mark.parametrize(
    "bad",
    [["--rows", "2", "0"], ["--top-k", "0"], ["--chunks", "8", "0"], ["--calls", "0"], ["--repeats", "0"]],
)
def test_each_bad_count_is_refused(script, capsys, bad):
    with pytest.raises(SystemExit) as exc:
        script("bench_topk").main(bad)
    assert exc.value.code == 2 and "must be >= 1" in capsys.readouterr().err


def test_a_chunked_top_k_unlike_torchs_stops_the_benchmark(script, monkeypatch):
    """Every chunk timed must give torch.topk's values: a wrong one is an error, not a timing."""
    import argparse

    module = script("bench_topk")
    topk_rows = module.topk_rows
    monkeypatch.setattr(
        module, "topk_rows", lambda x, k, chunk: topk_rows(x if chunk is None else x * 2, k, chunk)
    )
    with pytest.raises(AssertionError):
        module.measure(2, 50, 4, [None, 8], False, argparse.Namespace(device="cpu", calls=1, repeats=1))
