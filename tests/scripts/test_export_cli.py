"""scripts/export.py: exports saved heads, checks the export by reloading it, and answers bad input
with one `error:` line and exit status 2."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from spechead.heads import load_head
from spechead.heads.eagle import EagleConfig, EagleHead
from spechead.heads.eagle3 import Eagle3Config, Eagle3Head
from spechead.heads.medusa import MedusaConfig, MedusaHead

ROOT = Path(__file__).resolve().parents[2]


def script():
    spec = importlib.util.spec_from_file_location("export_script", ROOT / "scripts" / "export.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(argv: list[str]) -> int:
    return script().main([str(a) for a in argv])


@pytest.fixture(scope="module")
def eagle3_dir(tmp_path_factory, tiny_llama) -> Path:
    target = tiny_llama(40, layers=8, hidden=16)  # default layers [2, 4, 5]: distinct and ascending
    torch.manual_seed(0)
    head = Eagle3Head(
        Eagle3Config.from_target(target.config, draft_vocab_size=24, target_name_or_path="org/t")
    )
    return head.save_pretrained(tmp_path_factory.mktemp("eagle3") / "head")


@pytest.fixture(scope="module")
def medusa_dir(tmp_path_factory) -> Path:
    head = MedusaHead(MedusaConfig(hidden_size=16, vocab_size=40, num_heads=2, target_num_layers=6))
    return head.save_pretrained(tmp_path_factory.mktemp("medusa") / "head")


@pytest.fixture(scope="module")
def eagle3_local(tmp_path_factory, tiny_llama) -> tuple[Path, Path]:
    """(head dir, target dir): an EAGLE-3 head recording a local target checkpoint as its target."""
    target_dir = tmp_path_factory.mktemp("local") / "tiny-target"
    target = tiny_llama(40, layers=8, hidden=16, seed=3)
    target.save_pretrained(target_dir)
    config = Eagle3Config.from_target(target.config, draft_vocab_size=24, target_name_or_path=str(target_dir))
    return Eagle3Head(config).save_pretrained(tmp_path_factory.mktemp("eagle3l") / "head"), target_dir


def test_a_head_with_its_own_embedding_exports_it_without_reading_a_target(
    tiny_llama, tmp_path, capsys
) -> None:
    """own_embedding: the speculators export ships the head's table; its target (org/t, unreadable here) is
    not read, and the reloaded export has every tensor of the head, the embedding included."""
    target = tiny_llama(40, layers=8, hidden=16)
    config = Eagle3Config.from_target(
        target.config, draft_vocab_size=24, target_name_or_path="org/t", own_embedding=True
    )
    saved = Eagle3Head(config).save_pretrained(tmp_path / "head")
    assert run([saved, "--format", "speculators", "--out", tmp_path / "o"]) == 0
    assert "tensors identical" in capsys.readouterr().out
    shipped = load_file(tmp_path / "o" / "model.safetensors")["embed_tokens.weight"]
    assert torch.equal(shipped, load_head(saved).embed_tokens.weight)
    assert run([saved, "--format", "speculators", "--no-embedding", "--out", tmp_path / "p"]) == 2
    assert "drop --no-embedding" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["speculators", "sglang"])
def test_exports_an_eagle3_head(eagle3_dir, tmp_path, capsys, fmt) -> None:
    out = tmp_path / fmt
    extra = ["--no-embedding"] if fmt == "speculators" else []  # (its target org/t cannot be read here)
    assert run([eagle3_dir, "--format", fmt, "--out", out, "--dtype", "bfloat16", *extra]) == 0
    printed = capsys.readouterr().out
    assert f"as {fmt} to {out}" in printed and "tensors identical" in printed
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "bfloat16"  # transformers 5's name; SGLang's layout also has torch_dtype
    assert config.get("torch_dtype", "bfloat16") == "bfloat16" and ("torch_dtype" in config) == (
        fmt == "sglang"
    )
    assert {t.dtype for n, t in load_file(out / "model.safetensors").items() if n not in ("d2t", "t2d")} == {
        torch.bfloat16
    }
    back, head = load_head(out, dtype=torch.bfloat16), load_head(eagle3_dir)
    assert torch.equal(back.lm_head.weight, head.lm_head.weight.to(torch.bfloat16))
    umask = os.umask(0o022)
    os.umask(umask)
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {
        p.name: oct(0o666 & ~umask) for p in out.iterdir()
    }  # readable by others as the umask says (safetensors alone writes 0600)


def test_speculators_options(eagle3_dir, tmp_path) -> None:
    out = tmp_path / "spec"
    argv = [eagle3_dir, "--format", "speculators", "--out", out, "--no-embedding"]
    assert run([*argv, "--verifier", "org/model", "--speculative-tokens", "5"]) == 0
    config = json.loads((out / "config.json").read_text())
    spec = config["speculators_config"]
    assert spec["verifier"]["name_or_path"] == "org/model" and "verifier_note" not in config
    assert spec["proposal_methods"][0]["speculative_tokens"] == 5
    assert run([*argv[:3], "--out", tmp_path / "abs", "--no-embedding", "--verifier", "/models/t"]) == 0
    config = json.loads((tmp_path / "abs" / "config.json").read_text())  # never a local path
    assert (
        config["speculators_config"]["verifier"]["name_or_path"] == "t" and "'t'" in config["verifier_note"]
    )


def test_speculators_ships_the_targets_embedding(eagle3_local, tmp_path, capsys) -> None:
    """The speculators layout holds the target's embedding (read from the head's recorded target or
    --target); --no-embedding leaves it out; a local target is recorded by its directory's name + a note."""
    head_dir, target_dir = eagle3_local
    out = tmp_path / "spec"
    assert run([head_dir, "--format", "speculators", "--out", out]) == 0
    assert "note: the head was trained on a local target whose directory is named 'tiny-target'" in (
        capsys.readouterr().out
    )
    want = load_file(target_dir / "model.safetensors")["model.embed_tokens.weight"]
    assert torch.equal(load_file(out / "model.safetensors")["embed_tokens.weight"], want)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == "tiny-target"
    assert run([head_dir, "--format", "speculators", "--out", tmp_path / "n", "--no-embedding"]) == 0
    assert "embed_tokens.weight" not in load_file(tmp_path / "n" / "model.safetensors")
    assert run([head_dir, "--format", "sglang", "--out", tmp_path / "g"]) == 0
    assert "embed_tokens.weight" not in load_file(
        tmp_path / "g" / "model.safetensors"
    )  # SGLang uses the target's


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "org/t"),  # the recorded target cannot be read: one line naming it
        (["--format", "sglang", "--no-embedding"], "--no-embedding is for --format speculators, not sglang"),
    ],
)
def test_embedding_errors_are_one_line(eagle3_dir, tmp_path, capsys, argv, message) -> None:
    fmt = [] if "--format" in argv else ["--format", "speculators"]
    assert run([eagle3_dir, *fmt, *argv, "--out", tmp_path / "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "x").exists() or not any((tmp_path / "x").iterdir())


def test_exports_a_medusa_head(medusa_dir, tmp_path) -> None:
    assert run([medusa_dir, "--format", "medusa", "--out", tmp_path / "m"]) == 0
    assert json.loads((tmp_path / "m" / "config.json").read_text())["model_type"] == "medusa"


@pytest.mark.parametrize(
    ("which", "fmt", "message"),
    [
        ("medusa", "speculators", "is a medusa head; formats for medusa heads: fasterdecoding, medusa"),
        ("eagle3", "medusa", "is a eagle3 head; formats for eagle3 heads: sglang, speculators"),
        ("missing", "medusa", "could not be fetched from the Hub"),
        ("taken", "medusa", "is not an empty directory"),
    ],
)
def test_bad_input_is_one_error_line(eagle3_dir, medusa_dir, tmp_path, capsys, which, fmt, message) -> None:
    head = {"medusa": medusa_dir, "eagle3": eagle3_dir, "taken": medusa_dir}.get(which, tmp_path / "nope")
    out = tmp_path / "out"
    if which == "taken":
        out.mkdir()
        (out / "config.json").write_text("{}")
    assert run([head, "--format", fmt, "--out", out]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_exports_an_eagle_head_with_its_targets_embedding(tiny_target_dir, tmp_path, capsys) -> None:
    """--format eagle holds the target's embedding: read from the head's recorded target, or --target."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    config = EagleConfig.from_target(target.config, first_layer_input_norm=False)
    head_dir = EagleHead(config).save_pretrained(tmp_path / "head")  # records tiny_target_dir as its target
    assert run([head_dir, "--format", "eagle", "--out", tmp_path / "a"]) == 0
    assert "tensors identical" in capsys.readouterr().out
    state = torch.load(tmp_path / "a" / "pytorch_model.bin", weights_only=True)
    assert torch.equal(state["embed_tokens.weight"], target.get_input_embeddings().weight)
    assert run([head_dir, "--format", "eagle", "--out", tmp_path / "b", "--target", tmp_path]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "exactly one embed_tokens.weight" in err and err.count("\n") == 1


def test_the_round_trip_check_refuses_an_export_of_another_head(medusa_dir, tmp_path) -> None:
    """check_round_trip compares the reloaded export with the head: other tensor names, or other values
    under the same names, are a HeadError (not a pass, not a KeyError)."""
    from spechead.heads import HeadError

    check_round_trip = script().check_round_trip
    out = tmp_path / "m"
    assert run([medusa_dir, "--format", "medusa", "--out", out]) == 0
    assert check_round_trip(load_head(medusa_dir), out, None) == 6
    torch.manual_seed(1)
    other = MedusaHead(MedusaConfig(hidden_size=16, vocab_size=40, num_heads=2, target_num_layers=6))
    with pytest.raises(HeadError, match="reloads heads.0.1.weight with other values"):
        check_round_trip(other, out, None)
    more = MedusaHead(MedusaConfig(hidden_size=16, vocab_size=40, num_heads=3, target_num_layers=6))
    with pytest.raises(HeadError, match="reloads with other tensors than the head's"):
        check_round_trip(more, out, None)


def test_prints_how_many_tensors_the_round_trip_checked(medusa_dir, tmp_path, capsys) -> None:
    assert run([medusa_dir, "--format", "medusa", "--out", tmp_path / "m"]) == 0
    count = len(load_head(medusa_dir).state_dict())
    assert f"reloaded with spechead, {count} tensors identical" in capsys.readouterr().out


def test_speculators_draft_length_defaults_to_3(eagle3_dir, tmp_path) -> None:
    assert run([eagle3_dir, "--format", "speculators", "--out", tmp_path / "s", "--no-embedding"]) == 0
    spec = json.loads((tmp_path / "s" / "config.json").read_text())["speculators_config"]
    assert spec["proposal_methods"][0]["speculative_tokens"] == 3


def test_out_expands_the_home_directory(medusa_dir, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)  # a literal "~" directory would land here
    assert run([medusa_dir, "--format", "medusa", "--out", "~/m"]) == 0
    assert (tmp_path / "home" / "m" / "config.json").is_file() and not (tmp_path / "~").exists()


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_an_unusable_out_is_one_error_line(medusa_dir, tmp_path, capsys, where) -> None:
    """--out naming a file is refused up front; --out under a file fails writing (OSError): both one line."""
    (tmp_path / "f").write_text("x")
    out = tmp_path / "f" if where == "a file" else tmp_path / "f" / "m"
    assert run([medusa_dir, "--format", "medusa", "--out", out]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert ("is not an empty directory" in err) == (where == "a file")


def test_an_eagle_head_without_a_recorded_target_needs_target(tiny_llama, tmp_path, capsys) -> None:
    config = EagleConfig.from_target(tiny_llama(40, hidden=16).config, target_name_or_path="")
    head_dir = EagleHead(config).save_pretrained(tmp_path / "head")
    assert run([head_dir, "--format", "eagle", "--out", tmp_path / "a"]) == 2
    err = capsys.readouterr().err
    assert err == "error: the head does not record its target: pass --target TARGET\n"
