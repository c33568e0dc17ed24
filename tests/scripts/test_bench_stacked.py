"""scripts/bench_stacked.py on the tiny target: both targets timed in turns, their tokens compared."""

from __future__ import annotations


def test_times_both_and_compares_their_tokens(script, tiny_target_dir, capsys):
    module = script("bench_stacked")
    assert module.main(["--target", str(tiny_target_dir), "--rounds", "2", "--tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert "8 groups stacked; 2 rounds of 6 tokens, cpu" in out  # the tiny target's 4 layers, two groups each
    assert "unstacked: median" in out and "stacked: median" in out and "greedy tokens equal: True" in out


def test_bad_numbers_are_one_error_line(script, tiny_target_dir, capsys):
    assert script("bench_stacked").main(["--target", str(tiny_target_dir), "--rounds", "0"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == ["error: --rounds and --tokens must be at least 1"]
