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
    assert head_weight(200, 0.2, 100) == pytest.approx(0.2)  # stays at the peak after warmup


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


def _medusa2(tiny_target_dir, chat_file, tmp_path, training_kit, lm_loss: str):
    """A fresh Medusa-2 objective on the tiny target (adapter dropout off), a batch with a prompt,
    answer tokens and padding, and the frozen base target for reference."""
    extra = {"head": "medusa2", "head.loss.lm_loss": lm_loss, "head.lora.dropout": 0.0}
    s = training_kit.settings(training_kit.overrides(tiny_target_dir, chat_file, tmp_path / "o", **extra))
    target = load_target(s.model)
    objective = build_objective(s.head, target)
    torch.manual_seed(0)
    ids = torch.randint(1, 300, (2, 10))
    attention = torch.ones_like(ids)
    attention[1, 7:] = 0
    loss_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 0, 0, 1], [0, 0, 1, 1, 1, 1, 0, 0, 0, 0]])
    batch = {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask}
    base = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    return objective, target, batch, base


def test_ce_lm_loss_predicts_the_next_answer_token(tiny_target_dir, chat_file, tmp_path, training_kit):
    """lm_loss=ce: cross-entropy of the adapted target's logits at t against input_ids[t+1], over the
    positions t whose next token is loss-masked; at step 0 (lambda = 0) it is the whole loss."""
    objective, target, batch, base = _medusa2(tiny_target_dir, chat_file, tmp_path, training_kit, "ce")
    model = objective.module().eval()
    with torch.no_grad():
        total, logs = objective.loss(model, target, batch, 0)
        logits = base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    keep = batch["loss_mask"][:, 1:].bool()
    expected = torch.nn.functional.cross_entropy(logits[:, :-1][keep], batch["input_ids"][:, 1:][keep])
    assert logs["loss/lm"] == pytest.approx(float(expected), rel=1e-5)  # a fresh adapter is a no-op
    assert float(total) == pytest.approx(logs["loss/lm"], rel=1e-6) and logs["head_weight"] == 0.0
    with torch.no_grad():  # warmed up: lm + lambda * heads
        total, logs = objective.loss(model, target, batch, 10**6)
    assert float(total) == pytest.approx(logs["loss/lm"] + 0.2 * logs["loss/heads"], rel=1e-5)


def test_distill_lm_loss_is_kl_to_the_target_without_adapter(
    tiny_target_dir, chat_file, tmp_path, training_kit
):
    """lm_loss=distill: KL(base target || adapted target) of the next-token distributions at the
    positions t whose next token is loss-masked, averaged over them; the teacher is the same target with
    the adapter disabled."""
    objective, target, batch, base = _medusa2(tiny_target_dir, chat_file, tmp_path, training_kit, "distill")
    model = objective.module().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # an adapter that changes the outputs
        _, logs = objective.loss(model, target, batch, 0)
        student = model(batch["input_ids"], batch["attention_mask"])[0]
        teacher = base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    keep = batch["loss_mask"][:, 1:].bool()
    log_p = teacher[:, :-1][keep].log_softmax(-1)  # (N, V)
    log_q = student[:, :-1][keep].log_softmax(-1)
    expected = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    assert float(expected) > 1e-3  # the adapter moved the outputs
    assert logs["loss/lm"] == pytest.approx(float(expected), rel=1e-4)


def test_heads_learn_faster_than_the_adapter(tiny_target_dir, chat_file, tmp_path, training_kit):
    """Optimizer groups: the adapter at lr, the heads at lr * head.loss.head_lr_scale (4)."""
    objective, *_ = _medusa2(tiny_target_dir, chat_file, tmp_path, training_kit, "ce")
    adapter, heads = objective.param_groups(0.01)
    assert adapter["lr"] == 0.01 and heads["lr"] == pytest.approx(0.04)
    assert {id(p) for p in heads["params"]} == {id(p) for p in objective.head.parameters()}
    assert adapter["params"] and all(
        "lora_" in n
        for n, p in objective.module().named_parameters()
        if any(p is q for q in adapter["params"])
    )
