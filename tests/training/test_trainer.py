"""End-to-end training: in-process, through the CLI, with 2 processes, killed and resumed."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from spechead.heads import MedusaHead, load_head
from spechead.training.trainer import train

ROOT = Path(__file__).resolve().parents[2]


def test_train_in_process_saves_reloadable_head(tmp_path, tiny_target_dir, chat_file, training_kit):
    out = tmp_path / "run"
    s = training_kit.settings(training_kit.overrides(tiny_target_dir, chat_file, out))
    result = train(s)
    assert result.steps == 6 and result.head_dir == out / "head"
    head = load_head(out / "head")
    assert isinstance(head, MedusaHead) and head.config.num_heads == 2
    assert head.config.target_name_or_path == str(tiny_target_dir)
    assert head.config.target_layers == [4]  # -1 resolved to the final normed state of a 4-layer target
    saved = json.loads((out / "head" / "config.json").read_text())
    assert saved["family"] == "medusa" and "spechead_version" in saved
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["step"] == 6 and 1.0 <= metrics["tau"] <= 3.0
    assert {"loss", "acc/head0_top1", "acc/head1_top5"} <= set(metrics)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3, 4, 5, 6]
    assert all(r["train/tokens_per_s"] > 0 for r in rows if "train/loss" in r)
    assert {r["step"] for r in rows if "val/tau" in r} == {3, 6}
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000003", "step-00000006"]
    # OUT/best: the head of the evaluation with the highest tau_walked (the tau decoding sees)
    walked = {r["step"]: r["val/tau_walked"] for r in rows if "val/tau_walked" in r}
    best_step = max(walked, key=lambda step: (walked[step], -step))  # (the first of equals)
    state = json.loads((out / "checkpoints" / "step-00000006" / "trainer_state.json").read_text())
    assert (state["best_by"], state["best_step"], state["best_tau"]) == (
        "tau_walked",
        best_step,
        walked[best_step],
    )
    best, final = (load_file(str(out / part / "model.safetensors")) for part in ("best", "head"))
    assert all(torch.equal(best[k], final[k]) for k in final) == (best_step == 6)

    # resumed from a checkpoint whose best was kept by the all-position tau: the best starts anew
    shutil.rmtree(out / "checkpoints" / "step-00000006")
    shutil.rmtree(out / "head")
    old_state = out / "checkpoints" / "step-00000003" / "trainer_state.json"
    kept = {k: v for k, v in json.loads(old_state.read_text()).items() if k not in ("best_by", "best_step")}
    old_state.write_text(json.dumps({**kept, "best_tau": 9.0}))
    train(s)
    state = json.loads((out / "checkpoints" / "step-00000006" / "trainer_state.json").read_text())
    assert (state["best_by"], state["best_step"]) == ("tau_walked", 6)


def test_loss_goes_down(tmp_path, tiny_target_dir, chat_file, training_kit):
    out = tmp_path / "run"
    extra = {"trainer.max_steps": 30, "trainer.eval_every": 30, "trainer.save_every": 30, "trainer.lr": 0.01}
    train(training_kit.settings(training_kit.overrides(tiny_target_dir, chat_file, out, **extra)))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5


def test_shared_lm_head_and_grad_accumulation(tmp_path, tiny_target_dir, chat_file, training_kit):
    out = tmp_path / "run"
    extra = {"head.share_lm_head": "true", "trainer.grad_accum": 2, "trainer.max_steps": 4}
    result = train(training_kit.settings(training_kit.overrides(tiny_target_dir, chat_file, out, **extra)))
    assert result.steps == 4
    saved = load_file(str(out / "head" / "model.safetensors"))
    assert not any(t.shape[0] == 384 for t in saved.values())  # no vocabulary projection of its own
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3, 4]
    # 4 optimizer steps of 2 micro-batches each: 8 batches of the first epoch consumed
    state = json.loads((out / "checkpoints" / "step-00000004" / "trainer_state.json").read_text())
    assert (state["step"], state["epoch"], state["batch_in_epoch"]) == (4, 0, 8)


@pytest.mark.slow
def test_cli_with_wandb_offline(tmp_path, tiny_target_dir, chat_file, training_kit):
    out = tmp_path / "run"
    args = training_kit.overrides(
        tiny_target_dir, chat_file, out, logger="wandb", **{"logger.mode": "offline"}
    )
    proc = training_kit.cli(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"head saved to {out / 'head'}" in proc.stdout
    assert f"best head by tau_walked: {out / 'best'} (step " in proc.stdout
    assert "tau=" in proc.stdout
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    # The resolved config and the metrics are in the run's log (synced later with `wandb sync`).
    log = next(runs[0].glob("run-*.wandb")).read_bytes()
    assert b"max_steps" in log and b"val/tau" in log


@pytest.mark.slow
@pytest.mark.parametrize("family", ["medusa", "eagle3"])
def test_two_processes(family, tmp_path, tiny_target_dir, chat_file, training_kit):
    out = tmp_path / "run"
    launcher = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(ROOT / "configs" / "accelerate" / "cpu-2proc.yaml"),
    ]  # fmt: skip
    extra = {"head": family} if family == "medusa" else {"head": family, "head.ttt_steps": 2}
    proc = training_kit.cli(
        training_kit.overrides(tiny_target_dir, chat_file, out, **extra), launcher=launcher
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 processes" in proc.stdout
    # Every rank restores its own RNG state: one file per process in each checkpoint.
    assert sorted(p.name for p in (out / "checkpoints" / "step-00000006").glob("random_states_*")) == [
        "random_states_0.pkl",
        "random_states_1.pkl",
    ]
    assert load_head(out / "head").family == family


def _tensors(head_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(head_dir / "model.safetensors"))


@pytest.mark.slow
def test_kill_and_resume_gives_the_same_head(tmp_path, tiny_target_dir, chat_file, training_kit):
    extra = {"trainer.max_steps": 40, "trainer.save_every": 4, "trainer.eval_every": 20}
    whole = tmp_path / "whole"
    proc = training_kit.cli(training_kit.overrides(tiny_target_dir, chat_file, whole, **extra))
    assert proc.returncode == 0, proc.stderr[-3000:]

    killed = tmp_path / "killed"
    args = training_kit.overrides(tiny_target_dir, chat_file, killed, **extra)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    victim = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], env=env, cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    marker = killed / "checkpoints" / "step-00000008" / "trainer_state.json"
    deadline = time.time() + 180
    while not marker.exists() and victim.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert not (killed / "head").exists(), "the run finished before it could be killed"

    proc = training_kit.cli(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout
    a, b = _tensors(whole / "head"), _tensors(killed / "head")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-6)


def test_resume_mid_epoch_after_an_epoch_boundary_gives_the_same_head(
    tmp_path, tiny_target_dir, chat_file, training_kit, capsys
):
    """A run resumes from its newest checkpoint, which records the step, the epoch and the position in
    that epoch; resumed mid-way through its second epoch, it ends with the uninterrupted run's head."""
    # 12 training conversations (13 minus 1 held out) in batches of 4: 3 optimizer steps per epoch.
    extra = {
        "data.max_examples": 13, "trainer.max_steps": 5, "trainer.save_every": 2, "trainer.eval_every": 100,
        "trainer.keep_checkpoints": 3,
    }  # fmt: skip

    def run(out: Path):
        return train(training_kit.settings(training_kit.overrides(tiny_target_dir, chat_file, out, **extra)))

    run(tmp_path / "whole")
    checkpoints = tmp_path / "cut" / "checkpoints"
    run(tmp_path / "cut")
    states = [json.loads((p / "trainer_state.json").read_text()) for p in sorted(checkpoints.iterdir())]
    # the last step is always saved (5 is no multiple of save_every); tokens seen only grow
    assert [(s["step"], s["epoch"], s["batch_in_epoch"]) for s in states] == [(2, 0, 2), (4, 1, 1), (5, 1, 2)]
    assert 0 < states[0]["tokens"] < states[1]["tokens"] < states[2]["tokens"]
    shutil.rmtree(checkpoints / "step-00000005")
    shutil.rmtree(tmp_path / "cut" / "head")
    capsys.readouterr()
    assert run(tmp_path / "cut").steps == 5
    assert f"resumed from {checkpoints / 'step-00000004'} (step 4/5)" in capsys.readouterr().out
    a, b = _tensors(tmp_path / "whole" / "head"), _tensors(tmp_path / "cut" / "head")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-6)


def test_each_epoch_visits_the_data_in_a_new_order(tmp_path, tiny_target_dir, chat_file, training_kit):
    """The sampler is reseeded per epoch: with a learning rate too small to change the head, the loss of
    each step depends only on its batch, and the second epoch's batches are not the first one's."""
    # 12 training conversations in batches of 4: 3 steps per epoch
    extra = {
        "data.max_examples": 13,
        "trainer.max_steps": 6,
        "trainer.lr": 1e-12,
        "trainer.warmup_ratio": 0.5,
        "trainer.eval_every": 100,
        "trainer.save_every": 1,
    }
    out = tmp_path / "run"
    train(training_kit.settings(training_kit.overrides(tiny_target_dir, chat_file, out, **extra)))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(losses) == 6
    assert sorted(losses[3:]) != pytest.approx(sorted(losses[:3]), rel=1e-4)
    # the schedule steps once per optimizer step (logged after it): 3 warmup steps, then the cosine
    lrs = [r["train/lr"] for r in rows if "train/lr" in r]
    expected = [k / 3 if k < 3 else (1 + math.cos(math.pi * (k - 3) / 3)) / 2 for k in range(1, 7)]
    assert lrs == pytest.approx([1e-12 * e for e in expected], abs=1e-18)
    # a checkpoint per step, but only the newest trainer.keep_checkpoints (2) are kept
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000005", "step-00000006"]


def test_grad_clip_bounds_the_update(tmp_path, tiny_target_dir, chat_file, training_kit):
    """trainer.grad_clip clips the gradient norm before the optimizer step: clipped to 1e-12 (far below
    AdamW's eps) the head moves much less from its seeded start than with clipping off (0)."""

    def head_after(clip: float, name: str) -> dict[str, torch.Tensor]:
        extra = {"trainer.max_steps": 2, "trainer.grad_clip": clip, "trainer.lr": 0.01}
        out = tmp_path / name
        train(training_kit.settings(training_kit.overrides(tiny_target_dir, chat_file, out, **extra)))
        return _tensors(out / "head")

    clipped, free = head_after(1e-12, "clipped"), head_after(0.0, "free")
    assert clipped.keys() == free.keys()
    assert any((clipped[k] - free[k]).abs().max() > 1e-4 for k in free)


def test_eval_batches_limits_the_validation_batches(tmp_path, tiny_target_dir, chat_file, training_kit):
    """trainer.eval_batches=1 evaluates only the first validation batch: its metrics differ from those of
    the whole (two-batch) validation split."""

    def final_metrics(eval_batches: int, name: str) -> dict[str, float]:
        extra = {"trainer.max_steps": 1, "data.val_size": 8, "trainer.eval_batches": eval_batches}
        out = tmp_path / name
        return train(
            training_kit.settings(training_kit.overrides(tiny_target_dir, chat_file, out, **extra))
        ).metrics

    one, whole = final_metrics(1, "one"), final_metrics(-1, "whole")
    assert one["loss"] != pytest.approx(whole["loss"], rel=1e-6)


def test_an_epoch_is_its_batches_over_grad_accum_optimizer_steps(
    tmp_path, tiny_target_dir, chat_file, training_kit
):
    """Without max_steps, trainer.epochs counts optimizer steps of grad_accum micro-batches each: 3
    batches with grad_accum=2 make 2 steps (the last one on the epoch's remaining batch)."""
    extra = {
        "data.max_examples": 13, "trainer.max_steps": -1, "trainer.epochs": 1, "trainer.grad_accum": 2,
        "trainer.eval_every": 100, "trainer.save_every": 100,
    }  # fmt: skip
    out = tmp_path / "run"
    result = train(training_kit.settings(training_kit.overrides(tiny_target_dir, chat_file, out, **extra)))
    assert result.steps == 2
