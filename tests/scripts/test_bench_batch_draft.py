"""scripts/bench_batch_draft.py on a tiny target: one row per (mode, batch size), the eager rows
(`EagleRows`, a batch of one too) and the fixed-shape rows (`GraphRows`, forced on a CPU), and a head that
is not EAGLE refused in one line."""

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
    assert [r["drafter"] for r in rows] == ["EagleRows"] * 2 + ["GraphRows"] * 2
    assert all(r["pass_ms"] > 0 for r in rows)
    assert "graphs     B=3" in capsys.readouterr().out


def test_a_medusa_head_is_refused(script, tiny_target_dir, heads, tmp_path):
    with pytest.raises(SystemExit, match="not an EAGLE / EAGLE-3 head"):
        script("bench_batch_draft").main(
            ["--target", str(tiny_target_dir), "--drafter", str(heads["medusa"])]
        )


@pytest.fixture
def planted(monkeypatch):
    """A clock that moves only inside the eager rows' propose (P) and accept (A) (`EagleRows`, which the
    drafter's own calls run), once seen["plant"]() is called (loading calibrates trees on the real one, on
    the same rows), with a record of what each call was given from then on."""
    import time

    from spechead.inference.drafters.eagle.rows import EagleRows

    now, seen = [0.0], {"propose": [], "accept": [], "start": []}

    def plant() -> None:
        monkeypatch.setattr(time, "perf_counter", lambda: now[0])
        for calls in (seen["propose"], seen["accept"], seen["start"]):
            calls.clear()  # (loading's calibration ran on the rows too)

    seen["plant"] = plant
    propose, accept, start = EagleRows.propose, EagleRows.accept, EagleRows.start

    def timed_propose(self, *args):
        now[0] += 2.0**-7
        draft = propose(self, *args)
        seen["propose"].append(tuple(draft.tokens.shape))
        return draft

    def timed_accept(self, ids, lengths, *args, **kwargs):
        if not starting:  # (a start commits its prompts through the rows' accept: not a pass's)
            now[0] += 2.0**-9
            seen["accept"].append((tuple(ids.shape), list(lengths)))
        return accept(self, ids, lengths, *args, **kwargs)

    starting: list[bool] = []

    def seen_start(self, prompts, *args):
        seen["start"].append([len(p) for p in prompts])
        starting.append(True)
        try:
            return start(self, prompts, *args)
        finally:
            starting.clear()

    monkeypatch.setattr(EagleRows, "propose", timed_propose)
    monkeypatch.setattr(EagleRows, "accept", timed_accept)
    monkeypatch.setattr(EagleRows, "start", seen_start)
    return seen


def test_pass_ms_times_only_the_passes_after_the_warm_up(script, tiny_target_dir, heads, planted):
    """Planted times: each pass is one propose (2^-7 s) and one accept of 2 tokens a row (2^-9 s); the
    warm-up passes run first, untimed."""
    from spechead.inference.generator import SpeculativeGenerator

    gen = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), str(heads["eagle3"]), compile=False)
    drafter = gen.drafter.with_tree([[0], [0, 0], [1]])
    planted["plant"]()
    text = gen.target.config.get_text_config()
    ms = script("bench_batch_draft").pass_ms(drafter, 2, 9, 3, 2, text.hidden_size, text.vocab_size)
    assert ms == pytest.approx(1e3 * (2.0**-7 + 2.0**-9))
    assert planted["start"] == [[9, 9]] and planted["propose"] == [(2, 4)] * 5
    assert planted["accept"] == [((2, 2), [2, 2])] * 5


def test_the_tree_and_context_given_are_the_ones_drafted(
    script, tiny_target_dir, heads, tmp_path, planted, monkeypatch
):
    from spechead.inference.generator import SpeculativeGenerator

    load = SpeculativeGenerator.from_pretrained
    monkeypatch.setattr(
        SpeculativeGenerator, "from_pretrained", lambda *a, **k: (load(*a, **k), planted["plant"]())[0]
    )
    argv = ["--target", str(tiny_target_dir), "--drafter", str(heads["eagle3"]), "--modes", "eager",
            "--batch-size", "2", "--iters", "2", "--warmup", "1", "--context", "7", "--choices", "[[0], [1]]",
            "--out", str(tmp_path)]  # fmt: skip
    script("bench_batch_draft").main(argv)
    assert planted["start"] == [[7, 7]] and planted["propose"] == [(2, 3)] * 3
    written = json.loads((tmp_path / "bench_batch_draft.json").read_text())
    assert written["settings"]["choices"] == "[[0], [1]]" and written["settings"]["context"] == 7
    assert written["rows"][0]["pass_ms"] == pytest.approx(1e3 * (2.0**-7 + 2.0**-9))


def test_compile_values(script):
    module = script("bench_batch_draft")
    assert module.compile_value("inductor") is True
    assert module.compile_value("graphs") == "graphs" and module.compile_value("eager") == "eager"


def test_any_compile_backend_is_a_compiled_mode(script, tiny_target_dir, heads, tmp_path):
    """A mode other than eager and graphs (here the backend aot_eager) compiles the drafter too."""
    argv = ["--target", str(tiny_target_dir), "--drafter", str(heads["eagle3"]), "--modes", "aot_eager",
            "--batch-size", "1", "--iters", "1", "--warmup", "1", "--context", "6", "--out", str(tmp_path)]  # fmt: skip
    script("bench_batch_draft").main(argv)
    rows = json.loads((tmp_path / "bench_batch_draft.json").read_text())["rows"]
    assert [(r["mode"], r["drafter"]) for r in rows] == [("aot_eager", "GraphRows")]
