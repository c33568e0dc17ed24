"""Medusa-2: joint LoRA + heads training, saving heads with the adapter, merging for serving."""

from __future__ import annotations

import math

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from spechead.heads import MedusaHead, load_head
from spechead.inference.loading import merge_head_adapter
from spechead.training.errors import TrainError
from spechead.training.objectives import build_objective
from spechead.training.objectives.medusa2 import LoraSettings, add_lora, head_weight
from spechead.training.target import TargetConfig, load_target
from spechead.training.trainer import train


def test_head_weight_sine_warmup():
    assert head_weight(0, 0.2, 100) == 0.0
    assert head_weight(50, 0.2, 100) == pytest.approx(0.2 * math.sin(math.pi / 4))
    assert head_weight(100, 0.2, 100) == head_weight(500, 0.2, 100) == pytest.approx(0.2)
    assert head_weight(3, 0.2, 0) == 0.2


@pytest.fixture(scope="module")
def medusa2_run(tmp_path_factory, tiny_target_dir, chat_file, training_kit):
    out = tmp_path_factory.mktemp("m2") / "run"
    extra = {
        "head": "medusa2",
        "head.loss.lm_loss": "ce",
        "head.loss.head_weight_warmup": 2,
        "trainer.lr": 0.01,
    }
    result = train(training_kit.settings(training_kit.overrides(tiny_target_dir, chat_file, out, **extra)))
    return result


def test_trains_and_saves_heads_with_adapter(medusa2_run):
    head_dir = medusa2_run.head_dir
    head = load_head(head_dir)
    assert isinstance(head, MedusaHead) and head.config.lora_adapter == "adapter"
    assert (head_dir / "adapter" / "adapter_config.json").is_file()
    assert (head_dir / "adapter" / "adapter_model.safetensors").is_file()
    assert {"lm_loss", "tau", "acc/head0_top1"} <= set(medusa2_run.metrics)


def test_merged_adapter_reproduces_adapted_logits(medusa2_run, tiny_target_dir):
    ids = torch.randint(0, 300, (2, 12))

    def fresh():
        return AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()

    with torch.no_grad():
        base = fresh()(ids).logits
        adapted = PeftModel.from_pretrained(fresh(), medusa2_run.head_dir / "adapter").eval()
        unmerged = adapted(ids).logits
        merged = adapted.merge_and_unload()(ids).logits
    torch.testing.assert_close(merged, unmerged, rtol=1e-4, atol=1e-5)
    assert (unmerged - base).abs().max() > 1e-4  # the adapter really learned something


def test_serving_merge_is_quiet_and_merged(medusa2_run, tiny_target_dir, recwarn):
    """Loading a Medusa-2 head for serving merges its adapter without peft's FutureWarning about
    transformers' deprecated `is_gradient_checkpointing` (printed at every load, nothing a user can do;
    `add_lora` in training filters it the same way)."""
    ids = torch.randint(0, 300, (1, 8))
    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        base = target(ids).logits
        merged = merge_head_adapter(target, str(medusa2_run.head_dir))
        assert (merged(ids).logits - base).abs().max() > 1e-4  # the adapter is in the weights
    assert not [w for w in recwarn if issubclass(w.category, FutureWarning)]


def test_add_lora_is_quiet(tiny_target_dir, recwarn):
    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32)
    adapted = add_lora(target, LoraSettings(r=2, alpha=4))
    assert any("lora_A" in name for name, _ in adapted.named_parameters())
    assert not [w for w in recwarn if issubclass(w.category, FutureWarning)]


@pytest.fixture(scope="module")
def stage1_head(tmp_path_factory, tiny_target_dir, chat_file, training_kit):
    """A Medusa-1 head (stage one of the two-stage recipe), trained for 2 steps."""
    out = tmp_path_factory.mktemp("stage1") / "run"
    return train(
        training_kit.settings(
            training_kit.overrides(tiny_target_dir, chat_file, out, **{"trainer.max_steps": 2})
        )
    ).head_dir


def test_two_stage_starts_from_stage_one_heads(
    tmp_path, tiny_target_dir, chat_file, training_kit, stage1_head
):
    s = training_kit.settings(
        training_kit.overrides(
            tiny_target_dir, chat_file, tmp_path / "s2", head="medusa2", **{"head.init_from": stage1_head}
        )
    )
    objective = build_objective(s.head, load_target(s.model))
    trained = load_head(stage1_head).state_dict()
    for key, value in objective.head.state_dict().items():
        torch.testing.assert_close(value, trained[key])


def test_bad_lora_target_modules(tiny_target_dir, chat_file, tmp_path, training_kit):
    s = training_kit.settings(
        training_kit.overrides(
            tiny_target_dir,
            chat_file,
            tmp_path / "o",
            head="medusa2",
            **{"head.lora.target_modules": "[qq_proj]"},
        )
    )
    with pytest.raises(TrainError, match=r"head.lora.target_modules.*q_proj"):
        build_objective(s.head, load_target(TargetConfig(path=str(tiny_target_dir))))


def test_init_from_other_architecture(tmp_path, tiny_target_dir, chat_file, training_kit, stage1_head):
    s = training_kit.settings(
        training_kit.overrides(
            tiny_target_dir, chat_file, tmp_path / "o", **{"head.num_heads": 3, "head.init_from": stage1_head}
        )
    )
    with pytest.raises(TrainError, match="another architecture"):
        build_objective(s.head, load_target(s.model))


def test_checkpoints_hold_only_trained_weights_and_resume(tmp_path, tiny_target_dir, chat_file, training_kit):
    """A Medusa-2 checkpoint carries adapter + heads (never the frozen target) and resumes exactly."""
    from safetensors import safe_open

    extra = {"head": "medusa2", "head.loss.lm_loss": "ce", "trainer.max_steps": 4, "trainer.save_every": 2}
    first = train(
        training_kit.settings(training_kit.overrides(tiny_target_dir, chat_file, tmp_path / "a", **extra))
    )
    with safe_open(str(tmp_path / "a" / "checkpoints" / "step-00000002" / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert keys and all("lora_" in k or k.startswith("head.") for k in keys)
    # Drop the last checkpoint and the outputs: the same command resumes from step 2 and ends identically.
    import shutil

    shutil.rmtree(tmp_path / "a" / "checkpoints" / "step-00000004")
    shutil.rmtree(first.head_dir)
    again = train(
        training_kit.settings(training_kit.overrides(tiny_target_dir, chat_file, tmp_path / "a", **extra))
    )
    assert again.steps == 4
    a = load_head(first.head_dir).state_dict()  # the re-run wrote the same directory
    ref = train(
        training_kit.settings(training_kit.overrides(tiny_target_dir, chat_file, tmp_path / "b", **extra))
    )
    b = load_head(ref.head_dir).state_dict()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-6)
