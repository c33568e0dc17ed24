"""EAGLE-1 and EAGLE-3 train end to end on the tiny target, save heads that reload, and report tau."""

from __future__ import annotations

import pytest
import torch

from spechead.heads import Eagle3Head, EagleHead, MedusaHead, load_head
from spechead.heads.errors import HeadError
from spechead.training.errors import TrainError
from spechead.training.metrics import align_chain, chain_counts, chain_summary
from spechead.training.objectives import build_objective
from spechead.training.settings import HeadSettings
from spechead.training.target import FrozenTarget
from spechead.training.trainer import train


def test_chain_tau_hand_computed():
    # Two steps over T=4; step j at position t is right where marked.
    step0 = torch.tensor([[True, True, False, True]])
    step1 = torch.tensor([[False, True, True, True]])
    aligned = align_chain([step0, step1])  # chain at s uses step0[s], step1[s+1]
    anchors = torch.tensor([[True, True, True, False]])
    # s=0: step0 ok, step1[1] ok -> 3; s=1: step0 ok, step1[2] ok -> 3; s=2: step0 wrong -> 1.
    counts = chain_counts(aligned[:, anchors])
    assert counts["positions"] == 3 and float(counts["tau_sum"]) == pytest.approx(7.0)
    summary = chain_summary(counts)
    assert summary["tau"] == pytest.approx(7 / 3)
    # depth 1 right for s=0,1; depth 2 (step1 at s+1) right for s=0,1,2
    assert summary["acc/depth1"] == pytest.approx(2 / 3) and summary["acc/depth2"] == pytest.approx(1.0)


@pytest.mark.parametrize("family, cls", [("eagle", EagleHead), ("eagle3", Eagle3Head)])
def test_trains_saves_and_reloads(family, cls, tmp_path, tiny_target_dir, chat_file, training_kit, capsys):
    out = tmp_path / family
    extra = {"head": family, "trainer.lr": 0.003}
    if family == "eagle3":
        extra.update({"head.ttt_steps": 3, "head.draft_vocab_size": 200})
    result = train(training_kit.settings(training_kit.overrides(tiny_target_dir, chat_file, out, **extra)))
    head = load_head(result.head_dir)
    assert isinstance(head, cls)
    assert 1.0 <= result.metrics["tau"] <= 1.0 + (3 if family == "eagle3" else 5)
    if family == "eagle3":
        assert head.config.target_layers == [2, 2, 1]  # [2, L//2, L-3] of the 4-layer target
        assert {"acc/step0_top1", "acc/step2_top1"} <= set(result.metrics)
        assert int(head.t2d.sum()) == 200 and head.d2t.shape == (200,)
        assert "draft vocabulary: 200 tokens cover" in capsys.readouterr().out
    else:
        assert {"feature_loss", "acc/step0_top1"} <= set(result.metrics)
    names = set(head.state_dict())
    assert not any("embed_tokens" in n for n in names)  # the target's embedding is never saved
    with pytest.raises(HeadError, match=f"holds a '{family}' head"):
        MedusaHead.from_pretrained(result.head_dir)


def test_draft_vocab_larger_than_target(tmp_path, tiny_target_dir, chat_file, training_kit):
    s = training_kit.settings(
        training_kit.overrides(
            tiny_target_dir, chat_file, tmp_path / "o", head="eagle3", **{"head.draft_vocab_size": 5000}
        )
    )
    with pytest.raises((HeadError, TrainError), match="draft_vocab_size"):
        train(s)


def test_eagle3_layer_out_of_range(tmp_path, tiny_target_dir, chat_file, training_kit):
    s = training_kit.settings(
        training_kit.overrides(
            tiny_target_dir, chat_file, tmp_path / "o", head="eagle3", **{"head.layers": "[1,2,7]"}
        )
    )
    with pytest.raises(HeadError, match="layer index 7 does not exist"):
        train(s)


@pytest.mark.parametrize("family", ["eagle3", "peagle"])
def test_init_from_keeps_the_trained_heads_draft_vocabulary_and_lm_head(family, tiny_llama, tmp_path):
    """head.init_from: the trained head's own draft vocabulary and lm_head, not ones sized anew on the data
    (make builds those for a fresh head; loading the head before it undid them)."""
    target = FrozenTarget(tiny_llama(48, layers=4), "tiny")
    rows = [{"input_ids": list(range(16)) * 2, "loss_mask": [1] * 32}]  # the data's tokens: 0..15
    fresh = HeadSettings(family, family, None, {"draft_vocab_size": 16}, {})
    trained = build_objective(fresh, target, rows).head
    tokens = torch.arange(20, 36)  # the trained head's vocabulary: none of the data's tokens
    t2d = torch.zeros(48, dtype=torch.bool)
    t2d[tokens] = True
    trained.set_draft_vocab(tokens - torch.arange(16), t2d)
    with torch.no_grad():
        trained.lm_head.weight.normal_()
    trained.save_pretrained(tmp_path / "trained")
    warm = HeadSettings(
        family, family, None, {"draft_vocab_size": 16, "init_from": str(tmp_path / "trained")}, {}
    )
    objective = build_objective(warm, target, rows)
    assert torch.equal(objective.head.t2d, t2d) and torch.equal(objective.head.d2t, trained.d2t)
    assert torch.equal(objective.head.lm_head.weight, trained.lm_head.weight)
    assert not any(note.startswith("draft vocabulary:") for note in objective.notes)
    assert any(note.startswith("head.init_from=") for note in objective.notes)
