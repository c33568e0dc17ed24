"""scripts/regenerate.py: self-distillation data from the command line, killable and resumable."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str, background: bool = False) -> subprocess.Popen | subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "scripts" / "regenerate.py"), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if background:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def rows(path: Path) -> list[list[dict]]:
    return [json.loads(line)["messages"] for line in path.read_text().splitlines()]


def test_regenerates_continues_and_refuses_other_settings(
    script, tiny_target_dir, chat_file, tmp_path, capsys
):
    main = script("regenerate").main
    base = ["--target", str(tiny_target_dir), "--data", str(chat_file), "--max-new-tokens", "6",
            "--batch-size", "4", "--temperature", "0.8", "--seed", "1"]  # fmt: skip
    out, whole = tmp_path / "regen.jsonl", tmp_path / "whole.jsonl"
    assert main([*base, "--out", str(out), "--max-examples", "5"]) == 0
    assert "5 conversations" in capsys.readouterr().out and len(rows(out)) == 5
    assert main([*base, "--out", str(out), "--max-examples", "9"]) == 0
    assert "9 conversations" in capsys.readouterr().out
    assert main([*base, "--out", str(whole), "--max-examples", "9"]) == 0
    assert out.read_bytes() == whole.read_bytes()  # extending a run = one run
    assert main([*base, "--out", str(out), "--max-examples", "9"]) == 0
    assert "already has 9 conversations (nothing to do)" in capsys.readouterr().out
    src = [json.loads(line)["messages"] for line in chat_file.read_text().splitlines()[:9]]
    assert [[m for m in c if m["role"] != "assistant"] for c in rows(out)] == [
        [m for m in c if m["role"] != "assistant"] for c in src
    ]
    assert main([*base[:-4], "--out", str(out), "--max-examples", "9", "--seed", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and "other settings (generation.seed: 1 -> 2; generation.temperature: 0.8 -> 0.0)" in err[0]
    )


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_file(script, tiny_target_dir, chat_file, tmp_path):
    args = ["--target", str(tiny_target_dir), "--data", str(chat_file), "--batch-size", "4",
            "--max-new-tokens", "16", "--temperature", "1.0"]  # fmt: skip
    killed = tmp_path / "killed.jsonl"
    proc = cli(*args, "--out", str(killed), background=True)
    state = killed.with_name(killed.name + ".state.json")
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if state.exists() and json.loads(state.read_text())["rows"] >= 4:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = json.loads(state.read_text())["rows"]
    assert 4 <= done < 48, "the run should have been killed part way"
    resumed = cli(*args, "--out", str(killed))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    whole = tmp_path / "whole.jsonl"
    assert script("regenerate").main([*args, "--out", str(whole)]) == 0
    assert killed.read_bytes() == whole.read_bytes() and len(rows(whole)) == 48


def no_template_target(tiny_target_dir: Path, tmp_path: Path) -> Path:
    target = tmp_path / "no_template"
    shutil.copytree(tiny_target_dir, target)
    (target / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing_data", "not found"),
        ("missing_out_folder", "does not exist"),
        ("bad_target", "no tokenizer could be loaded"),
        ("weights_missing", "could not be loaded as a causal LM"),
        ("no_template", "has no chat template"),
        ("bad_temperature", "temperature=-1.0 must be >= 0"),
        ("bad_max_examples", "--max-examples 0 must be at least 1"),
        ("out_is_data", "is the input data"),
        ("no_cuda", "--device cuda: CUDA is not available"),
    ],
)
def test_bad_input_is_one_line_exit_2(script, case, message, tiny_target_dir, chat_file, tmp_path, capsys):
    target, data, out, extra = tiny_target_dir, chat_file, tmp_path / "out.jsonl", []
    if case == "missing_data":
        data = tmp_path / "nope.jsonl"
    elif case == "missing_out_folder":
        out = tmp_path / "no" / "out.jsonl"
    elif case == "bad_target":
        target = tmp_path / "no_model"
    elif case == "weights_missing":
        target = tmp_path / "weights_missing"
        shutil.copytree(tiny_target_dir, target)
        (target / "model.safetensors").unlink()
    elif case == "no_template":
        target = no_template_target(tiny_target_dir, tmp_path)
    elif case == "bad_temperature":
        extra = ["--temperature", "-1"]
    elif case == "bad_max_examples":
        extra = ["--max-examples", "0"]
    elif case == "out_is_data":
        out = chat_file
    elif case == "no_cuda":
        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
        extra = ["--device", "cuda"]
    code = script("regenerate").main(
        ["--target", str(target), "--data", str(data), "--out", str(out), *extra]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: ") and message in err[-1], err


def test_the_target_loads_straight_onto_its_device(script, tiny_target_dir, placements):
    """--device places the target's weights as they are read (device_map), not staged in host memory."""
    model = script("regenerate").load_model(str(tiny_target_dir), "float32", "cpu")
    assert placements == [torch.device("cpu")] and not model.training


def test_a_full_disk_keeps_the_rows_written_and_resumes(script, tiny_target_dir, chat_file, tmp_path, capsys):
    """ENOSPC while a chunk is made durable: one error line, the chunks before kept whole, and the same
    command continues to the file an uninterrupted run writes."""
    main = script("regenerate").main
    base = ["--target", str(tiny_target_dir), "--data", str(chat_file), "--max-new-tokens", "6",
            "--batch-size", "4", "--temperature", "0.8", "--seed", "1", "--max-examples", "9"]  # fmt: skip
    out, whole = tmp_path / "regen.jsonl", tmp_path / "whole.jsonl"
    real_fsync, calls = os.fsync, []

    def fsync(fd: int) -> None:  # the disk fills up on the output's second chunk
        if os.readlink(f"/proc/self/fd/{fd}") == str(out):
            calls.append(fd)
            if len(calls) == 2:
                raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "fsync", fsync)
        assert main([*base, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        f"error: could not write {out} (No space left on device): its first 4 rows are kept; free space "
        "(or choose another --out) and rerun the same command to continue"
    ), err
    assert (
        len(rows(out)) == 4 and json.loads(out.with_name(out.name + ".state.json").read_text())["rows"] == 4
    )
    assert main([*base, "--out", str(out)]) == 0
    assert main([*base, "--out", str(whole)]) == 0
    assert out.read_bytes() == whole.read_bytes() and len(rows(out)) == 9
