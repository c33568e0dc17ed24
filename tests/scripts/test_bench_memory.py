"""scripts/bench_memory.py: the memory plan per family at the 8B shape and a measured tiny run beside it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_memory.py"


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, cwd=cwd, env=env
    )


def test_plan_per_family_at_the_8b_shape(script):
    """The plan train.py prints, per family at max_length 2048 (meta-device target and heads: no weights):
    P-EAGLE's partitions lower its head activations below its unpartitioned run's and EAGLE-3's TTT's; the
    target activations and the frozen target do not depend on the head."""
    module = script("bench_memory")
    rows = {r["run"]: r for r in module.plan_rows(module.parse([]))}
    assert list(rows) == ["eagle3 TTT 7", "peagle K=8 partitions 4", "peagle K=8 partitions 1",
                          "dflash block 16, 5 layers"]  # fmt: skip
    eagle3, parted, whole = (
        rows["eagle3 TTT 7"],
        rows["peagle K=8 partitions 4"],
        rows["peagle K=8 partitions 1"],
    )
    # head activations: S logit sets over the 32000 draft vocab, fp32 logits + grads, per token, + the seven
    # TTT masks (T x T * (j + 1), fp32: 28 T^2 x 4 bytes) + layer passes
    assert parted["head_activations_gib"] < eagle3["head_activations_gib"] < whole["head_activations_gib"]
    assert (2048 * 7 * 32000 * 8 + 28 * 2048**2 * 4) / 2**30 < eagle3["head_activations_gib"] < 11.0
    assert len({r["target_activations_gib"] for r in rows.values()}) == 1
    text = module.render(list(rows.values()), [], module.parse([]))
    assert (
        "fit where EAGLE-3's TTT fits: plan 26.53 GiB (peagle K=8 partitions 4) vs 32.69 GiB -> met" in text
    )


def test_measured_run_beside_its_plan(tmp_path, script, capsys):
    """A tiny CPU run of each family's objective: a positive peak above the start of training, beside the
    plan for the same run; options as asked, a bad number is argparse's error."""
    proc = run("--seq-len", "512", "--partitions", "7", "--measure-seq-len", "48", "--steps", "1",
               "--dflash-block", "8", "--dflash-layers", "2", "--out", "m.json", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((tmp_path / "m.json").read_text())
    runs = ["eagle3 TTT 7", "peagle K=8 partitions 7", "peagle K=8 partitions 1", "dflash block 8, 2 layers"]
    assert [row["run"] for row in r["plan"]] == [row["run"] for row in r["measured"]] == runs
    assert all(row["measured_mib"] > 0 and row["plan_mib"] > 0 for row in r["measured"])
    # the live tensors' peak over a profiled step, and P-EAGLE's partitions hold fewer logit sets live than
    # its unpartitioned run
    peaks = {row["run"]: row["tensor_peak_mib"] for row in r["measured"]}
    assert all(peaks[run] > 0 and row["plan_work_mib"] > 0 for run, row in zip(runs, r["measured"]))
    assert peaks["peagle K=8 partitions 7"] < peaks["peagle K=8 partitions 1"]
    assert "batch 1 x 512 tokens" in proc.stdout and "| peagle K=8 partitions 7 | " in proc.stdout
    assert "measured on the CPU, tiny Llama (hidden 128, vocab 2048), 2 x 48 tokens, 1 steps" in proc.stdout
    # (in this process: argparse's error comes before any work, and a process costs ~5 s of imports)
    with pytest.raises(SystemExit) as bad:
        script("bench_memory").main(["--steps", "0", "--no-measure"])
    assert bad.value.code == 2 and "--steps must be >= 1, got 0" in capsys.readouterr().err
