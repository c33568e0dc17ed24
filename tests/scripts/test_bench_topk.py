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
