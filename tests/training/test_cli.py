"""train.py's endings: Ctrl-C and a failed write end in one line naming the last checkpoint (exit 130 / 2),
an offline run that cannot load its target says so in one line and leaves no output directory behind."""

from __future__ import annotations

import errno
import signal
import sys
from pathlib import Path

import huggingface_hub
import pytest

from spechead.training import checkpoint, cli

EXTRA = {"trainer.max_steps": 6, "trainer.save_every": 2, "trainer.eval_every": 100}


def run_main(monkeypatch, capsys, args: list[str]) -> tuple[int, list[str]]:
    """cli.main in this process on `args`: (exit status, the non-blank stderr lines, progress bars split)."""
    monkeypatch.setattr(sys, "argv", ["train.py", *args])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        cli.main()
    err = capsys.readouterr().err
    return exited.value.code, [line for line in err.replace("\r", "\n").splitlines() if line.strip()]


@pytest.fixture
def main(monkeypatch, tiny_target_dir, chat_file, training_kit):
    """Train the tiny run into `out` through cli.main: (exit status, stderr lines)."""

    def _main(out: Path, capsys) -> tuple[int, list[str]]:
        args = training_kit.overrides(tiny_target_dir, chat_file, out, **EXTRA)
        return run_main(monkeypatch, capsys, args)

    return _main


@pytest.fixture
def terminal_ctrl_c():
    """SIGINT handled as a fresh `python train.py` handles it (KeyboardInterrupt): a library an earlier test
    ran in this pytest worker may have left another handler (2 of 3 full runs: the run trained on)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_is_one_line_naming_the_last_checkpoint(main, monkeypatch, tmp_path, capsys, terminal_ctrl_c):
    save, raised = checkpoint.save, []

    def save_then_ctrl_c(accelerator, output_dir, state, keep):
        path = save(accelerator, output_dir, state, keep)
        if state.step == 4:
            raised.append(state.step)
            signal.raise_signal(signal.SIGINT)  # Python's own handler: KeyboardInterrupt, as from a terminal
        return path

    monkeypatch.setattr(checkpoint, "save", save_then_ctrl_c)
    out = tmp_path / "run"
    status, lines = main(out, capsys)
    assert raised == [4]
    last = out / "checkpoints" / "step-00000004"
    assert status == 130
    assert lines[-1] == f"interrupted: last checkpoint at {last}; rerun the same command to resume", lines
    assert not any("Traceback" in line for line in lines)


def test_a_full_disk_mid_run_is_one_error_line(main, monkeypatch, tmp_path, capsys):
    """A write outside the checkpoint and head savers (here the metrics log) failing for lack of space."""
    from spechead.training import tracking

    real = tracking.MetricsFile.write

    def disk_full(self, step, metrics):
        if step == 5:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        real(self, step, metrics)

    monkeypatch.setattr(tracking.MetricsFile, "write", disk_full)
    out = tmp_path / "run"
    status, lines = main(out, capsys)
    assert status == 2 and not any("Traceback" in line for line in lines), lines
    assert lines[-1] == (
        f"error: could not write {out / 'metrics.jsonl'} (No space left on device): last checkpoint at "
        f"{out / 'checkpoints' / 'step-00000004'}; rerun the same command to resume"
    )


def test_offline_without_the_target_is_one_line_and_leaves_no_directory(tmp_path, monkeypatch, capsys):
    """HF_HUB_OFFLINE=1 (the setting huggingface_hub reads it into) and a Hub target not in the cache."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    out = tmp_path / "outputs" / "eagle-llama3-70b"
    args = ["head=eagle", "model=llama3-70b", "logger=none", f"trainer.output_dir={out}"]
    status, lines = run_main(monkeypatch, capsys, args)
    assert status == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: model.path=meta-llama/Meta-Llama-3-70B cannot be loaded offline")
    assert "set model.path to a local model directory" in lines[0] and "unset HF_HUB_OFFLINE" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # neither outputs/ nor outputs/eagle-llama3-70b


def test_new_dirs_and_remove_if_empty(tmp_path):
    (tmp_path / "a").mkdir()
    created = cli.new_dirs(str(tmp_path / "a" / "b" / "c"))
    assert created == [tmp_path / "a" / "b" / "c", tmp_path / "a" / "b"]
    (tmp_path / "a" / "b" / "c").mkdir(parents=True)
    (tmp_path / "a" / "b" / "keep").write_text("x")
    cli.remove_if_empty(created)  # c is empty, b holds a file: kept
    assert sorted(p.name for p in (tmp_path / "a" / "b").iterdir()) == ["keep"]
