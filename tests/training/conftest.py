"""Fixtures for training tests: a small chat file and a helper to build settings like the CLI does."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from spechead.configs import register_resolvers
from spechead.training.cli import settings_from_config

ROOT = Path(__file__).resolve().parents[2]
register_resolvers()


def tiny_overrides(target_dir: Path, data_path: Path, out: Path, **extra) -> list[str]:
    """CLI overrides for a seconds-long run on the tiny target."""
    values = {
        "model": "local",
        "model.path": str(target_dir),
        "data": "jsonl",
        "data.path": str(data_path),
        "trainer.output_dir": str(out),
        "trainer.max_steps": 6,
        "trainer.batch_size": 4,
        "trainer.max_length": 64,
        "trainer.eval_every": 3,
        "trainer.save_every": 3,
        "trainer.log_every": 1,
        "logger": "none",
        "head": "medusa",
        **extra,
    }
    if values["head"] in ("medusa", "medusa2"):
        values.setdefault("head.num_heads", 2)
    return [f"{k}={v}" for k, v in values.items()]


def make_settings(overrides: list[str]):
    with initialize_config_module("spechead.configs", version_base=None):
        return settings_from_config(compose("train", overrides=overrides))


def run_cli(args: list[str], *, launcher: list[str] | None = None, timeout: int = 240, **kw):
    """Run train.py (optionally under `accelerate launch`) offline; returns the CompletedProcess."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline"}
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = (launcher or [sys.executable]) + [str(ROOT / "train.py"), *args]
    return subprocess.run(
        cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=kw.get("cwd", ROOT)
    )


def run_cli_in_process(args: list[str], monkeypatch, capsys) -> subprocess.CompletedProcess:
    """train.py as `python train.py ARGS` runs it, in this process (its exit status, stdout and stderr as
    run_cli returns them): a process costs ~5 s of imports. The tests that need a process (one error line,
    W&B, a kill, accelerate launch) keep run_cli."""
    monkeypatch.setattr(sys, "argv", [str(ROOT / "train.py"), *args])
    capsys.readouterr()
    try:
        runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
        code = 0
    except SystemExit as err:
        code = 0 if err.code is None else err.code if isinstance(err.code, int) else 1  # as a process exits
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


@pytest.fixture(scope="session")
def training_kit():
    """The helpers above, as a fixture (test modules cannot import conftest under importlib mode)."""

    class Kit:
        overrides = staticmethod(tiny_overrides)
        settings = staticmethod(make_settings)
        cli = staticmethod(run_cli)
        cli_in_process = staticmethod(run_cli_in_process)

    return Kit
