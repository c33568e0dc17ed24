"""scripts/bench_cold_ops.py on a tiny target: every op gets its cold, after-a-copy and warm times."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("tokens", [1, 3])
def test_every_op_is_timed_cold_after_a_copy_and_warm(script, tiny_target_dir, capsys, tokens):
    module = script("bench_cold_ops")
    assert module.main(["--target", str(tiny_target_dir), "--tokens", str(tokens), "--repeats", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert f"forwards of {tokens} tokens" in lines[0]
    rows = lines[2:]
    assert len(rows) == 6 and any(r.startswith("numpy argmax") for r in rows)
    for row in rows:
        times = [float(x) for x in row.split()[-3:]]  # cold, after a copy, warm (us)
        assert all(t > 0 for t in times), row


def test_bad_numbers_are_one_error_line(script, tiny_target_dir, capsys):
    with pytest.raises(SystemExit) as exc:
        script("bench_cold_ops").main(["--target", str(tiny_target_dir), "--repeats", "0"])
    assert exc.value.code == 2
    assert "--tokens and --repeats must be >= 1" in capsys.readouterr().err
