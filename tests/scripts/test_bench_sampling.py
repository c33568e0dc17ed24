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


def test_median_us_is_the_median_of_the_timed_repeats_after_one_untimed_call(script, monkeypatch):
    """Planted durations (microseconds): the first call is a warm-up, never timed; the median of the
    `repeats` after it, in microseconds."""
    import time

    now, durations = [0.0], [100.0, 1.0, 9.0, 2.0]  # warm-up, then the three timed calls
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])

    def fn():
        now[0] += 1e-6 * durations.pop(0)

    median = script("bench_sampling").median_us(fn, 3, __import__("torch").device("cpu"))
    assert median == pytest.approx(2.0) and durations == []


def test_the_nucleus_counted_is_row_zeros_at_the_given_scale_and_top_p(script, capsys):
    import torch

    module = script("bench_sampling")
    assert (
        module.main(["--vocab", "500", "--scale", "3", "--rows", "3", "--repeats", "1", "--top-p", "0.5"])
        == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert "top-p 0.5" in lines[0] and "median of 1 " in lines[0]
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(0)) * 3.0
    expected = module.sorted_nucleus(torch.softmax(logits, -1)[0], 0.5).sum()
    assert lines[2].split(" | ")[:3] == ["500", "3", f"{float(expected):.0f}"]
    assert float(module.sorted_nucleus(torch.softmax(logits, -1)[0], 0.9).sum()) != float(expected)


@pytest.mark.parametrize(
    "bad", [["--vocab", "100", "1"], ["--rows", "1"], ["--repeats", "0"], ["--top-p", "0"]]
)
def test_each_bad_number_is_refused(script, capsys, bad):
    with pytest.raises(SystemExit) as exc:
        script("bench_sampling").main(bad)
    assert exc.value.code == 2 and "--rows >= 2" in capsys.readouterr().err


def test_the_walks_time_the_chain_and_the_sibling_tree_at_the_given_top_p(script, monkeypatch):
    """ "walk" times the chain of best children, "walk, siblings" the sibling tree, both with the
    requested top-p; "walk torch, every row" walks the chain too; "draw" is spechead's own draw."""
    module = script("bench_sampling")
    seen, walked = [], []
    accept, walk = module.sample_accept, module.walk

    def spy_accept(tree, rows, *args):
        seen.append((tree.parents.tolist(), rows.params.top_p, rows.params.temperature))
        return accept(tree, rows, *args)

    def spy_walk(tree, *args, **kwargs):
        walked.append(tree.parents.tolist())
        return walk(tree, *args, **kwargs)

    monkeypatch.setattr(module, "sample_accept", spy_accept)
    monkeypatch.setattr(module, "walk", spy_walk)
    drawn, sample = [], module.sample
    monkeypatch.setattr(
        module, "sample", lambda probs, coins: drawn.append(probs.shape) or sample(probs, coins)
    )
    import torch

    module.measure(300, 2.0, 5, 0.6, 1, torch.device("cpu"))  # each timing: a warm-up and one repeat
    chain, siblings = [-1, 0, 1, 2, 3], [-1, 0, 0, 0, 1]
    assert seen == [(chain, 0.6, 1.0)] * 2 + [(siblings, 0.6, 1.0)] * 2
    assert walked == [chain] * 2 and drawn == [(300,)] * 2  # "draw" draws with spechead's sample


def test_a_nucleus_unlike_the_sort_stops_the_benchmark(script, monkeypatch):
    """The torch nucleus timed must keep the ids the sort keeps: a wrong one is an error, not a row."""
    import torch

    module = script("bench_sampling")
    monkeypatch.setattr(module, "nucleus", lambda probs, top_p: module.sorted_nucleus(probs, top_p / 2))
    with pytest.raises(AssertionError):
        module.measure(300, 2.0, 3, 0.6, 1, torch.device("cpu"))


def test_sorted_nucleus_stops_once_top_p_is_reached(script):
    """The definition: the fewest best ids whose mass reaches top_p (a mass exactly at top_p ends it),
    ties kept in id order."""
    import torch

    sorted_nucleus = script("bench_sampling").sorted_nucleus
    probs = torch.tensor([0.25, 0.5, 0.25])
    assert sorted_nucleus(probs, 0.75).tolist() == [True, True, False]
    assert sorted_nucleus(probs, 0.76).tolist() == [True, True, True]
    assert sorted_nucleus(probs, 0.5).tolist() == [False, True, False]
