"""Fixtures for training tests: a small chat file and a helper to build settings like the CLI does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from spechead.configs import register_resolvers
from spechead.training.cli import settings_from_config

ROOT = Path(__file__).resolve().parents[2]
register_resolvers()

QUESTIONS = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Please add 12 and 30.", "12 plus 30 is 42."),
    ("Translate hello into Spanish.", "Hello in Spanish is hola."),
    ("Write a short poem about the sea.", "The sea is wide, the sky is blue, the waves come in and out."),
    ("What is the capital of Spain?", "The capital of Spain is Madrid."),
    ("Please add 2 and 3.", "2 plus 3 is 5."),
]


def write_chats(path: Path, n: int = 48) -> Path:
    """`n` short conversations (some multi-turn, some with a system prompt) as messages JSONL."""
    with path.open("w") as f:
        for i in range(n):
            q, a = QUESTIONS[i % len(QUESTIONS)]
            msgs = [{"role": "system", "content": "You are brief."}] if i % 5 == 0 else []
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            if i % 3 == 0:
                q2, a2 = QUESTIONS[(i + 1) % len(QUESTIONS)]
                msgs += [{"role": "user", "content": "Thanks! " + q2}, {"role": "assistant", "content": a2}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    return path


@pytest.fixture(scope="session")
def chat_file(tmp_path_factory) -> Path:
    return write_chats(tmp_path_factory.mktemp("chats") / "chats.jsonl")


def tiny_overrides(target_dir: Path, data_path: Path, out: Path, **extra) -> list[str]:
    """CLI overrides for a seconds-long run on the tiny target."""
    values = {
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
        **extra,
    }
    if values.get("head", "medusa") in ("medusa", "medusa2"):
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


@pytest.fixture(scope="session")
def training_kit():
    """The helpers above, as a fixture (test modules cannot import conftest under importlib mode)."""

    class Kit:
        overrides = staticmethod(tiny_overrides)
        settings = staticmethod(make_settings)
        cli = staticmethod(run_cli)
        chats = staticmethod(write_chats)

    return Kit
