"""scripts/bench_batch_draft.py on a tiny target: one row per (mode, batch size), the eager batched
drafter and the fixed-shape one (forced on a CPU), and a head that is not EAGLE refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from spechead.heads.eagle3 import Eagle3Config, Eagle3Head
from spechead.heads.medusa import MedusaConfig, MedusaHead


@pytest.fixture(scope="module")
def heads(tmp_path_factory, tiny_target_dir) -> dict[str, Path]:
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32)
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("batch_draft")
    cfg = model.config
    medusa = MedusaHead(MedusaConfig(hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, num_heads=2,
                                     target_num_layers=cfg.num_hidden_layers))  # fmt: skip
    return {
        "eagle3": Eagle3Head(Eagle3Config.from_target(cfg)).save_pretrained(root / "eagle3"),
        "medusa": medusa.save_pretrained(root / "medusa"),
    }


def test_rows_by_mode_and_batch(script, tiny_target_dir, heads, tmp_path, capsys):
    argv = ["--target", str(tiny_target_dir), "--drafter", str(heads["eagle3"]), "--modes", "eager", "graphs",
            "--batch-size", "1", "3", "--iters", "2", "--warmup", "1", "--context", "12", "--out", str(tmp_path)]  # fmt: skip
    script("bench_batch_draft").main(argv)
    rows = json.loads((tmp_path / "bench_batch_draft.json").read_text())["rows"]
    assert [(r["mode"], r["batch"]) for r in rows] == [
        ("eager", 1),
        ("eager", 3),
        ("graphs", 1),
        ("graphs", 3),
    ]
    assert [r["drafter"] for r in rows] == ["EagleBatchDrafter"] * 2 + ["CompiledEagleBatchDrafter"] * 2
    assert all(r["pass_ms"] > 0 for r in rows)
    assert "graphs     B=3" in capsys.readouterr().out


def test_a_medusa_head_is_refused(script, tiny_target_dir, heads, tmp_path):
    with pytest.raises(SystemExit, match="not an EAGLE / EAGLE-3 head"):
        script("bench_batch_draft").main(
            ["--target", str(tiny_target_dir), "--drafter", str(heads["medusa"])]
        )
