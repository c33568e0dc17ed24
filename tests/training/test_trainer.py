"""End-to-end training: in-process, through the CLI, with 2 processes, killed and resumed."""

from __future__ import annotations

import json
import os
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
    assert (out / "best" / "model.safetensors").is_file()


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


@pytest.mark.slow
def test_cli_with_wandb_offline(tmp_path, tiny_target_dir, chat_file, training_kit):
    out = tmp_path / "run"
    args = training_kit.overrides(
        tiny_target_dir, chat_file, out, logger="wandb", **{"logger.mode": "offline"}
    )
    proc = training_kit.cli(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"head saved to {out / 'head'}" in proc.stdout
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
