"""trainer.push_to_hub: the final head goes to the Hub at the end of training; problems show up first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_training_pushes_the_final_head(training_kit, tiny_target_dir, chat_file, tmp_path, fake_hub):
    out = tmp_path / "run"
    overrides = training_kit.overrides(tiny_target_dir, chat_file, out, **{"trainer.max_steps": 2,
                                       "trainer.push_to_hub": "me/tiny-medusa", "trainer.push_private": True})  # fmt: skip
    env = {**os.environ, "HF_ENDPOINT": fake_hub.url, "HF_HUB_OFFLINE": "0", "HF_TOKEN": "hf_fake",
           "HF_HOME": str(tmp_path / "hf"), "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}  # fmt: skip
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *overrides], capture_output=True, text=True,
                          env=env, timeout=300, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"published to {fake_hub.url}/me/tiny-medusa/commit/" in proc.stdout
    (commit,) = fake_hub.commits
    assert fake_hub.repos["me/tiny-medusa"].private
    assert commit["files"]["model.safetensors"] == (out / "head" / "model.safetensors").read_bytes()
    assert {"config.json", "README.md"} <= set(commit["files"])


def test_push_problems_fail_before_training(training_kit, tiny_target_dir, chat_file, tmp_path):
    out = tmp_path / "run"
    bad = training_kit.cli(
        training_kit.overrides(tiny_target_dir, chat_file, out, **{"trainer.push_to_hub": "no-slash"})
    )
    assert bad.returncode == 2 and "NAMESPACE/NAME" in bad.stderr.strip().splitlines()[-1]
    offline = training_kit.cli(
        training_kit.overrides(tiny_target_dir, chat_file, out, **{"trainer.push_to_hub": "me/x"})
    )
    assert offline.returncode == 2 and "HF_HUB_OFFLINE is set" in offline.stderr.strip().splitlines()[-1]
    assert not (out / "head").exists()  # nothing trained: the problem was found first
