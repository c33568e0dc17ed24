"""scripts/bench_overhead.py on a tiny target: the pass splits into target forward, draft networks and
engine, each measured where it happens (wrapped calls), and the JSON holds every number."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from spechead.heads.eagle3 import Eagle3Config, Eagle3Head

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def eagle3_dir(tmp_path_factory, tiny_target_dir) -> Path:
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32)
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.from_target(model.config))
    return head.save_pretrained(tmp_path_factory.mktemp("overhead") / "eagle3")


def prompts(path: Path) -> Path:
    rows = [
        {"category": "qa", "turns": [q]} for q in ("What is the capital of France?", "Please add 2 and 3.")
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("drafter", ["eagle3", "eagle3-compiled", "prompt_lookup"])
def test_pass_splits_into_target_draft_and_engine(
    script, tiny_target_dir, eagle3_dir, tmp_path, capsys, drafter
):
    out = tmp_path / "split.json"
    spec = str(eagle3_dir) if drafter.startswith("eagle3") else drafter
    argv = ["--target", str(tiny_target_dir), "--drafter", spec, "--prompt-set", str(prompts(tmp_path / "p.jsonl")),
            "--max-new-tokens", "10", "--out", str(out)]  # fmt: skip
    if drafter == "eagle3-compiled":  # the whole draft as one graph ("eager": traced, no code generation)
        argv += ["--compile-draft", "eager"]
    assert script("bench_overhead").main(argv) == 0
    printed = capsys.readouterr().out
    row = json.loads(out.read_text())
    assert "engine" in printed and row["plain_step_ms"] > 0 and row["tau"] >= 1
    parts = row["target_forward_ms"] + row["draft_networks_ms"] + row["engine_ms"]
    assert row["pass_ms"] == pytest.approx(parts)
    assert 0 < row["target_forward_ms"] < row["pass_ms"] and row["engine_ms"] > 0
    if drafter.startswith("eagle3"):  # head steps and top-k (compiled: the graphs) timed, per depth
        assert row["draft_networks_ms"] > 0 and row["draft_depths"] == len(max(row["tree"], key=len))
        assert row["draft_ms_per_depth"] == pytest.approx(row["draft_networks_ms"] / row["draft_depths"])
    else:  # no network drafts: prompt lookup's work is all engine
        assert row["draft_networks_ms"] == 0 and row["draft_ms_per_depth"] is None


def test_sampling_times_the_drawn_children_as_draft_work(
    script, tiny_target_dir, eagle3_dir, tmp_path, capsys
):
    """--temperature: both sides sample; an EAGLE head drawing its children (rule=without_replacement)
    has its head calls and draws timed as draft networks, and the class is left as it was."""
    from spechead.inference.drafters.sampled_children import SampledChildren

    top = SampledChildren.top
    out = tmp_path / "sampled.json"
    tree = tmp_path / "chain.json"
    tree.write_text("[[0], [0, 0], [0, 0, 0]]")
    spec = f"{eagle3_dir}@tree={tree},rule=without_replacement"
    argv = ["--target", str(tiny_target_dir), "--drafter", spec, "--prompt-set", str(prompts(tmp_path / "p.jsonl")),
            "--max-new-tokens", "10", "--temperature", "1.0", "--top-p", "0.9", "--out", str(out)]  # fmt: skip
    assert script("bench_overhead").main(argv) == 0
    row = json.loads(out.read_text())
    assert row["draft_depths"] == 3 and row["draft_networks_ms"] > 0 and row["engine_ms"] > 0
    assert SampledChildren.top is top


def test_a_run_that_raises_leaves_the_class_unwrapped(
    script, tiny_target_dir, eagle3_dir, tmp_path, monkeypatch
):
    """The drawn children's timer is set on the shared class: a decoding error still takes it off."""
    from spechead.inference.drafters.sampled_children import SampledChildren

    top, module = SampledChildren.top, script("bench_overhead")

    def broken(*args, **kwargs):
        assert SampledChildren.top is not top  # (instrumented by now)
        raise RuntimeError("decoding failed")

    monkeypatch.setattr(module, "decode", broken)
    argv = ["--target", str(tiny_target_dir), "--drafter", str(eagle3_dir), "--prompt-set",
            str(prompts(tmp_path / "p.jsonl")), "--max-new-tokens", "4"]  # fmt: skip
    with pytest.raises(RuntimeError, match="decoding failed"):
        module.main(argv)
    assert SampledChildren.top is top
