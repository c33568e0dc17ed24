"""scripts/bench_fused_drafts.py on a tiny target: a row per parallel head with both paths timed and their
ratio; bad numbers are one error line, exit 2."""

from __future__ import annotations


def test_both_paths_of_every_head_are_timed(script, capsys, tiny_target_dir):
    args = ["--target", str(tiny_target_dir), "--blocks", "4", "--dflash-layers", "1", "--context", "16"]
    assert script("bench_fused_drafts").main([*args, "--rounds", "1", "--iters", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[1] == "| drafter | part | fused ms | modules ms | modules / fused |"
    rows = [line.strip("|").split(" | ") for line in lines[3:]]
    assert [(r[0].strip(), r[1]) for r in rows] == [
        ("peagle-4", "draft"), ("peagle-4", "accept"), ("dflash-4", "draft"), ("dflash-4", "accept")
    ]  # fmt: skip
    for _, _, fused, modules, ratio in rows:
        f, m = float(fused), float(modules)  # (printed to 0.001 ms: the ratio of the unrounded times)
        assert f > 0 and m > 0
        low, high = (m - 5e-4) / (f + 5e-4), (m + 5e-4) / max(f - 5e-4, 1e-9)
        assert low - 0.005 <= float(ratio.strip().rstrip("x")) <= high + 0.005


def test_bad_blocks_are_one_error_line(script, capsys):
    assert script("bench_fused_drafts").main(["--blocks", "1,8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --blocks are numbers >= 2 (got '1,8'), --rounds and --iters >= 1"]
