"""EAGLE-3.1 norms train with no other change than the head options (`+head.norm_before_fc=true ...`):
the saved head keeps them, its new input norm moved from its initial ones, and it exports to vLLM's
speculators layout with them."""

from __future__ import annotations

import json

import torch

from spechead.heads import Eagle3Head, load_head
from spechead.heads.formats import export_head
from spechead.training.trainer import train

OPTIONS = ("norm_before_fc", "norm_before_residual", "norm_output")


def test_eagle31_head_trains_saves_and_exports(tmp_path, tiny_target_dir, chat_file, training_kit) -> None:
    extra = {"head": "eagle3", "trainer.lr": 0.003, "head.ttt_steps": 2, "head.draft_vocab_size": 200}
    extra["head.layers"] = "[1,2,3]"  # ascending, below the final norm: exportable
    extra.update({f"+head.{name}": "true" for name in OPTIONS})
    result = train(
        training_kit.settings(training_kit.overrides(tiny_target_dir, chat_file, tmp_path / "o", **extra))
    )
    head = load_head(result.head_dir)
    assert isinstance(head, Eagle3Head) and all(getattr(head.config, name) for name in OPTIONS)
    assert not torch.equal(head.input_norm.weight, torch.ones_like(head.input_norm.weight))  # trained
    assert 1.0 <= result.metrics["tau"] <= 3.0
    out = export_head(head, "speculators", tmp_path / "spec", with_embedding=False)
    config = json.loads((out / "config.json").read_text())
    assert all(config[name] is True for name in OPTIONS)
    assert all(getattr(load_head(out).config, name) for name in OPTIONS)
