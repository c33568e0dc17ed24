"""scripts/publish.py: --dry-run writes the folder, a real run uploads to a (local, fake) Hub, bad input is
one `error:` line with exit 2."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import ModelCard, constants

from spechead.heads import MedusaConfig, MedusaHead

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory) -> Path:
    """An untrained Medusa head for a target published as me/tiny-target (no run files beside it)."""
    config = MedusaConfig(hidden_size=32, vocab_size=64, target_num_layers=4, num_heads=2,
                          target_name_or_path="me/tiny-target", target_architecture="LlamaForCausalLM")  # fmt: skip
    return MedusaHead(config).save_pretrained(tmp_path_factory.mktemp("cli") / "run" / "head")


def publish(*args: str, **env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "0", **env}
    cmd = [sys.executable, str(ROOT / "scripts" / "publish.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)


def test_dry_run_writes_the_folder_and_uploads_nothing(head_dir, tmp_path):
    out = tmp_path / "preview"
    proc = publish(str(head_dir), "--repo-id", "me/medusa-tiny", "--dry-run", str(out), "--license", "mit")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "uploaded nothing" in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model == "me/tiny-target" and card.data.license == "mit"
    assert "medusa" in card.data.tags and "medusa-2" not in card.data.tags
    assert "No `config.yaml` was found" in card.text


def test_uploads_to_the_hub(head_dir, fake_hub, tmp_path):
    proc = publish(str(head_dir), "--repo-id", "me/medusa-tiny", "--private",
                   HF_ENDPOINT=fake_hub.url, HF_TOKEN="hf_cli_token", HF_HOME=str(tmp_path))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"{fake_hub.url}/me/medusa-tiny/commit/" in proc.stdout
    (commit,) = fake_hub.commits
    assert sorted(commit["files"]) == ["README.md", "config.json", "model.safetensors"]
    assert commit["files"]["model.safetensors"] == (head_dir / "model.safetensors").read_bytes()
    assert fake_hub.repos["me/medusa-tiny"].private


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["{missing}", "--repo-id", "me/x"], "does not exist"),
        (["{head}", "--repo-id", "not a repo"], "repo id"),
        (["{head}", "--repo-id", "me/x", "--benchmark", "{missing}"], "holds no decoding.md"),
        (["{head}", "--repo-id", "me/x"], "no Hugging Face token"),
    ],
)
def test_bad_input_is_one_error_line(head_dir, tmp_path, monkeypatch, capsys, args, message):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)  # and the tests' fresh HF_HOME holds no token
    main = runpy.run_path(str(ROOT / "scripts" / "publish.py"))["main"]  # in process: fast
    assert main([a.format(head=head_dir, missing=tmp_path / "nope") for a in args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines


def main_in_process():
    return runpy.run_path(str(ROOT / "scripts" / "publish.py"))["main"]


def test_dry_run_prints_notes_and_the_files_and_passes_base_model_and_revision(tmp_path, capsys):
    """A target that is no Hub id is a printed note (no base_model); --base-model and --revision reach the
    card; the dry run names the count and the files it wrote."""
    config = MedusaConfig(hidden_size=32, vocab_size=64, target_num_layers=4, num_heads=2,
                          target_name_or_path="/models/local", target_architecture="LlamaForCausalLM")  # fmt: skip
    head = MedusaHead(config).save_pretrained(tmp_path / "run" / "head")
    main = main_in_process()
    assert main([str(head), "--repo-id", "me/m", "--dry-run", str(tmp_path / "a")]) == 0
    printed = capsys.readouterr().out
    assert "note: the target '/models/local' is not a Hub id: the card has no base_model" in printed
    assert ModelCard.load(tmp_path / "a" / "README.md").data.base_model is None
    out = tmp_path / "b"
    argv = [
        str(head),
        "--repo-id",
        "me/m",
        "--dry-run",
        str(out),
        "--base-model",
        "org/real",
        "--revision",
        "dev",
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "note:" not in printed
    assert (
        f"dry run: wrote 3 files to {out}, uploaded nothing: README.md, config.json, model.safetensors"
        in printed
    )
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model == "org/real" and 'snapshot_download("me/m", revision="dev")' in card.text


def test_uploads_to_the_revision_branch(head_dir, fake_hub, tmp_path):
    proc = publish(str(head_dir), "--repo-id", "me/medusa-dev", "--revision", "dev",
                   HF_ENDPOINT=fake_hub.url, HF_TOKEN="hf_cli_token", HF_HOME=str(tmp_path))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    (commit,) = fake_hub.commits
    assert commit["repo"] == "me/medusa-dev" and commit["revision"] == "dev"


def test_a_dry_run_folder_that_cannot_be_written_is_one_error_line(head_dir, tmp_path, capsys):
    (tmp_path / "f").write_text("x")  # the folder would be under a file: OSError, not a traceback
    assert (
        main_in_process()([str(head_dir), "--repo-id", "me/x", "--dry-run", str(tmp_path / "f" / "out")]) == 2
    )
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
