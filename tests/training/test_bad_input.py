"""Every bad input ends in one clear error that says what to fix (and exit status 2 from the CLI)."""

from __future__ import annotations

import json
import shutil

import pytest

from spechead.data.errors import DataError
from spechead.heads.errors import HeadError
from spechead.training.errors import TrainError
from spechead.training.trainer import train


@pytest.fixture
def run(tmp_path, tiny_target_dir, chat_file, training_kit):
    """Train with the tiny defaults plus `extra` overrides; returns the output dir."""

    def _run(data=chat_file, target=tiny_target_dir, out=None, **extra):
        out = out or tmp_path / "run"
        train(training_kit.settings(training_kit.overrides(target, data, out, **extra)))
        return out

    return _run


def test_missing_model_path(run, tmp_path):
    with pytest.raises(TrainError, match="no such directory"):
        run(target=tmp_path / "missing-model")


def test_missing_data_file(run, tmp_path):
    with pytest.raises(DataError, match="not found"):
        run(data=tmp_path / "missing.jsonl")


def test_data_with_wrong_fields(run, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "hi", "answer": "hello"}) + "\n")
    with pytest.raises(DataError, match="messages_field"):
        run(data=bad)


def test_empty_dataset(run, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="empty|no examples"):
        run(data=empty)


def test_every_example_longer_than_max_length(run):
    with pytest.raises(DataError, match="max_length"):
        run(**{"trainer.max_length": 8})


def test_tokenizer_without_chat_template(run, tmp_path, tiny_target_dir):
    target = tmp_path / "no-template"
    shutil.copytree(tiny_target_dir, target)
    for name in ("tokenizer_config.json",):
        cfg = json.loads((target / name).read_text())
        cfg.pop("chat_template", None)
        (target / name).write_text(json.dumps(cfg))
    (target / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(DataError, match="chat template"):
        run(target=target)


def test_head_layer_not_in_target(run):
    with pytest.raises(HeadError, match="does not exist"):
        run(**{"head.layers": "[9]"})


def test_unknown_head_key(run):
    with pytest.raises(TrainError, match="head.num_head"):
        run(**{"+head.num_head": 3})


def test_resume_true_without_checkpoint(run):
    with pytest.raises(TrainError, match="no checkpoint"):
        run(**{"trainer.resume": "true"})


def test_resume_false_refuses_to_overwrite(run):
    out = run()
    with pytest.raises(TrainError, match="already holds checkpoints"):
        run(out=out, **{"trainer.resume": "false"})


def test_resume_with_another_head_config(run):
    out = run()
    with pytest.raises(TrainError, match="different head config"):
        run(out=out, **{"head.num_heads": 3})


def test_resume_with_another_model_config(run):
    """A checkpoint of one target is never resumed with another model config (here its attention)."""
    out = run()
    with pytest.raises(TrainError, match="different model config"):
        run(out=out, **{"model.attn_implementation": "eager"})


@pytest.mark.slow
def test_cli_prints_one_line_and_exits_2(tmp_path, tiny_target_dir, training_kit):
    proc = training_kit.cli(
        training_kit.overrides(tiny_target_dir, tmp_path / "missing.jsonl", tmp_path / "o")
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "missing.jsonl" in lines[0], proc.stderr


@pytest.mark.parametrize(
    "args, needles",
    [
        (["trainer.lrr=1"], ["trainer.lrr", "valid keys for trainer:", "max_steps"]),
        (["head=eagle4"], ["head=eagle4", "valid head options: dflash, eagle, eagle3, medusa, medusa2, peagle"]),
        (["trainer.output_dir={file}/out"], ["trainer.output_dir=", "not a writable directory"]),
        (["model.path=/models/my-llama", "data=jsonl", "data.path=chats.jsonl", "trainer.max_steps=2000"],
         ["model.path=/models/my-llama", "use model=local model.path=/models/my-llama"]),
    ],
)  # fmt: skip
def test_cli_bad_command_line_is_one_line_and_exit_2(
    tmp_path, training_kit, args, needles, monkeypatch, capsys
):
    """Hydra's own reports (exit 1, several lines) and its creating the output dir come after our check."""
    blocker = tmp_path / "file.txt"  # a regular file: no directory can be made under it, even as root
    blocker.write_text("x")
    proc = training_kit.cli_in_process(
        ["logger=none", *(a.format(file=blocker) for a in args)], monkeypatch, capsys
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert all(n in lines[0] for n in needles), lines[0]


def test_wandb_online_without_api_key(run, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc with a W&B key
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    with pytest.raises(TrainError, match="wandb login.*logger=none"):
        run(logger="wandb", **{"logger.mode": "online"})


def test_init_from_a_head_of_another_target(run, tmp_path, tiny_llama, chatml_tokenizer):
    other = tmp_path / "other-target"
    model = tiny_llama(len(chatml_tokenizer), layers=2, hidden=48)
    model.save_pretrained(other)
    chatml_tokenizer.save_pretrained(other)
    out = run(target=other, out=tmp_path / "other", **{"trainer.max_steps": 1})
    with pytest.raises(TrainError, match="hidden_size 48.*target has 32"):
        run(**{"head.init_from": out / "head"})
