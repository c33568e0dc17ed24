"""Self-distillation end to end: regenerate demo data with the demo target, then train a head on it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from spechead.heads import load_head

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "data" / "demo"


@pytest.mark.slow
def test_regenerate_demo_data_then_train_on_it(training_kit, tmp_path):
    spec = importlib.util.spec_from_file_location("regenerate_script", ROOT / "scripts" / "regenerate.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    data = tmp_path / "regenerated.jsonl"
    code = script.main(["--target", str(DEMO / "target"), "--data", str(DEMO / "chat.jsonl"), "--out", str(data),
                        "--max-examples", "24", "--batch-size", "8", "--max-new-tokens", "96"])  # fmt: skip
    assert code == 0
    regenerated = [json.loads(line)["messages"] for line in data.read_text().splitlines()]
    original = [json.loads(line)["messages"] for line in (DEMO / "chat.jsonl").read_text().splitlines()[:24]]
    answers = [(a["content"], b["content"]) for x, y in zip(original, regenerated)
               for a, b in zip(x, y) if a["role"] == "assistant"]  # fmt: skip
    assert len(regenerated) == 24 and any(old != new for old, new in answers)  # the target's own words

    out = tmp_path / "run"
    overrides = training_kit.overrides(DEMO / "target", data, out, **{"trainer.max_length": 128})
    proc = training_kit.cli(overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"head saved to {out / 'head'}" in proc.stdout
    head = load_head(out / "head")
    assert type(head).family == "medusa" and head.config.num_heads == 2
