"""scripts/bench_sampling.py on small vocabularies: every timing of every size and scale is printed, and
the nucleus it times keeps as many ids as the sort it is timed against."""

from __future__ import annotations

import pytest


def test_every_size_and_scale_gets_its_timings(script, capsys):
    module = script("bench_sampling")
    args = ["--vocab", "100", "3000", "--scale", "6", "1", "--rows", "3", "--repeats", "2"]
    assert module.main(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "walks of 3 nodes" in lines[0]
    header = lines[1].split(" | ")
    assert header[:3] == ["V", "scale", "nucleus ids"] and len(header) == 11
    assert header[-1] == "walk, siblings"
    rows = [line.split(" | ") for line in lines[2:]]
    assert [(r[0], r[1]) for r in rows] == [("100", "6"), ("100", "1"), ("3000", "6"), ("3000", "1")]
    assert all(float(x) > 0 for r in rows for x in r[2:])
    assert int(rows[3][2]) > 1024 > int(rows[2][2])  # a flat row's nucleus is past both guesses


def test_bad_numbers_are_one_error_line(script, capsys):
    with pytest.raises(SystemExit) as exc:
        script("bench_sampling").main(["--top-p", "1.0"])
    assert exc.value.code == 2
    assert "0 < --top-p < 1" in capsys.readouterr().err


def test_sibling_tree_is_the_roots_best_then_a_chain(script):
    import torch

    probs = torch.softmax(torch.randn(6, 50, generator=torch.Generator().manual_seed(0)), -1)
    tree = script("bench_sampling").sibling_tree(probs)
    assert tree.parents.tolist() == [-1, 0, 0, 0, 1, 4]
    assert tree.tokens[1:4].tolist() == probs[0].topk(3).indices.tolist()
    assert tree.tokens[4] == probs[1].argmax() and tree.tokens[5] == probs[4].argmax()
    small = script("bench_sampling").sibling_tree(probs[:3])
    assert small.parents.tolist() == [-1, 0, 0]
