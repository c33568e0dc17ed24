"""No lost work: a damaged last checkpoint, a full disk before or while saving, the head written whole."""

from __future__ import annotations

import errno
import json
import shutil
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from spechead.heads.files import current_umask
from spechead.training import checkpoint
from spechead.training.errors import TrainError
from spechead.training.trainer import train

# 12 training conversations in batches of 4: 3 steps an epoch; checkpoints at steps 2 and 4
EXTRA = {"data.max_examples": 13, "trainer.max_steps": 4, "trainer.save_every": 2, "trainer.eval_every": 100}


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_target_dir, chat_file, training_kit) -> Path:
    """A finished 4-step run with checkpoints at steps 2 and 4 (copy it before changing it)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    train(training_kit.settings(training_kit.overrides(tiny_target_dir, chat_file, out, **EXTRA)))
    return out


@pytest.fixture
def rerun(tmp_path, tiny_target_dir, chat_file, training_kit, finished):
    """A copy of the finished run; `rerun(**extra)` trains it again (resumed) with extra overrides."""
    out = tmp_path / "run"
    shutil.copytree(finished, out)

    def _rerun(**extra):
        overrides = training_kit.overrides(tiny_target_dir, chat_file, out, **{**EXTRA, **extra})
        return train(training_kit.settings(overrides))

    _rerun.out = out
    return _rerun


def tensors(head: Path) -> dict[str, torch.Tensor]:
    return load_file(str(head / "model.safetensors"))


def truncate(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("damaged", ["model.safetensors", "optimizer.bin", "trainer_state.json"])
def test_a_damaged_last_checkpoint_resumes_from_the_one_before(rerun, finished, damaged, capsys):
    checkpoints = rerun.out / "checkpoints"
    truncate(checkpoints / "step-00000004" / damaged)
    shutil.rmtree(rerun.out / "head")
    capsys.readouterr()
    assert rerun().steps == 4
    out = capsys.readouterr().out
    warnings = [line for line in out.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and f"checkpoint {checkpoints / 'step-00000004'} is unreadable" in warnings[0]
    assert f"resumed from {checkpoints / 'step-00000002'} (step 2/4)" in out
    # set aside (kept for a look), and out of the way of the saves that followed
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "broken-step-00000004", "step-00000002", "step-00000004",
    ]  # fmt: skip
    a, b = tensors(finished / "head"), tensors(rerun.out / "head")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-6)


def test_no_readable_checkpoint_is_one_clear_error(rerun):
    for step in ("step-00000002", "step-00000004"):
        truncate(rerun.out / "checkpoints" / step / "model.safetensors")
    with pytest.raises(TrainError, match=r"no checkpoint in .*checkpoints can be read back .*move .* away"):
        rerun()


def test_a_full_disk_is_refused_before_training(
    tmp_path, tiny_target_dir, chat_file, training_kit, monkeypatch
):
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(checkpoint, "free_bytes", lambda path: 1000)
    out = tmp_path / "run"
    with pytest.raises(TrainError, match=r"trainer.output_dir=.*needs about 0.0\d\d GB .* 0.000 GB are free"):
        train(training_kit.settings(training_kit.overrides(tiny_target_dir, chat_file, out, **EXTRA)))
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()  # nothing trained
    monkeypatch.setattr(checkpoint, "free_bytes", lambda path: usage.free)  # with the space: it trains
    assert (
        train(training_kit.settings(training_kit.overrides(tiny_target_dir, chat_file, out, **EXTRA))).steps
        == 4
    )
    # what the run already holds there counts as written
    held = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    assert checkpoint.disk_needed(out, 1, 1, keep=2) == 0 < held


def test_a_failed_head_write_keeps_the_old_head_and_names_the_checkpoint(rerun, finished, monkeypatch):
    real = checkpoint.zero.save_head

    def disk_full(objective, path):
        real(objective, path)  # written in part (here: all) when the disk fills up
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.zero, "save_head", disk_full)
    last = rerun.out / "checkpoints" / "step-00000006"
    with pytest.raises(TrainError, match=rf"could not write the head to .*head \(No space left on device\): "
                       rf"the last checkpoint is {last}; free space .* rerun the same command"):  # fmt: skip
        rerun(**{"trainer.max_steps": 6})
    assert sorted(p.name for p in rerun.out.iterdir() if p.name.startswith(".")) == []  # no temporary left
    a, b = tensors(finished / "head"), tensors(rerun.out / "head")  # the good head is untouched
    assert all(torch.equal(a[k], b[k]) for k in a)
    monkeypatch.undo()
    assert rerun(**{"trainer.max_steps": 6}).steps == 6  # the same command again: the head from step 6
    assert json.loads((rerun.out / "metrics.json").read_text())["step"] == 6
    assert any(not torch.equal(a[k], v) for k, v in tensors(rerun.out / "head").items())


def test_a_failed_checkpoint_write_leaves_no_partial_one(rerun, monkeypatch):
    from accelerate import Accelerator

    def disk_full(self, output_dir, **kwargs):
        Path(output_dir).mkdir(parents=True)
        (Path(output_dir) / "model.safetensors").write_bytes(b"\0" * 10)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Accelerator, "save_state", disk_full)
    last = rerun.out / "checkpoints" / "step-00000004"
    with pytest.raises(
        TrainError, match=rf"could not write checkpoint .*step-00000006 .*checkpoint is {last}"
    ):
        rerun(**{"trainer.max_steps": 6})
    assert sorted(p.name for p in (rerun.out / "checkpoints").iterdir()) == ["step-00000002", "step-00000004"]


def test_every_file_of_a_run_has_the_umask_mode(finished):
    """Checkpoints, head and best are readable by others as the umask says (safetensors writes 0600)."""
    expected = 0o666 & ~current_umask()
    written = [
        p for part in ("checkpoints", "head", "best") for p in (finished / part).rglob("*") if p.is_file()
    ]
    assert {p.name for p in written} >= {"model.safetensors", "optimizer.bin", "trainer_state.json"}
    assert {p.relative_to(finished): oct(stat.S_IMODE(p.stat().st_mode)) for p in written if
            stat.S_IMODE(p.stat().st_mode) != expected} == {}  # fmt: skip
