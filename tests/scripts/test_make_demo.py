"""scripts/make_demo.py builds a loadable target + tokenizer; the shipped assets match the generator."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from demo_corpus import PROMPT_SETS, make_conversations, prompt_rows
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "data" / "demo"
TINY = [
    "--num-conversations", "60", "--steps", "3", "--batch-size", "4", "--seq-len", "64", "--eval-every", "2",
    "--vocab-size", "400", "--hidden-size", "32", "--num-layers", "2", "--num-heads", "4", "--num-kv-heads", "2",
    "--intermediate-size", "64",
]  # fmt: skip


def _check_target(path: Path) -> None:
    """Offline from_pretrained of model + tokenizer, template, special ids and a forward pass."""
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"  # stored small
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token == "<|im_end|>" and tok.bos_token == "<s>" and tok.pad_token == "<pad>"
    assert model.config.eos_token_id == im_end == model.generation_config.eos_token_id
    assert model.config.bos_token_id == tok.bos_token_id and model.config.pad_token_id == tok.pad_token_id
    assert model.config.vocab_size == len(tok) and not model.config.tie_word_embeddings
    msgs = [
        {"role": "user", "content": "What is 3 × 4? ¿Cómo estás?"},
        {"role": "assistant", "content": "12.\n- ok"},
    ]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == (
        "<s><|im_start|>user\nWhat is 3 × 4? ¿Cómo estás?<|im_end|>\n<|im_start|>assistant\n12.\n- ok<|im_end|>\n"
    )
    prompt = tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert (
        ids[0] == tok.bos_token_id and ids[-2] == im_end and tok.decode(ids) == text
    )  # byte-level round trip
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits  # (1, T, V)
    assert logits.shape == (1, len(ids), len(tok)) and torch.isfinite(logits).all()


@pytest.mark.slow
def test_tiny_build_is_loadable(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    out = tmp_path / "demo"
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_demo.py"), "--out", str(out), *TINY],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "final: train loss" in run.stdout and run.stdout.count("--- sample ---") == 2  # 2 held out of 60
    lines = (out / "chat.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == make_conversations(60, seed=0)
    assert sorted(f.name for f in (out / "prompts").iterdir()) == sorted(f"{n}.jsonl" for n in PROMPT_SETS)
    readme = (out / "README.md").read_text()
    assert "python scripts/make_demo.py --out" in readme and "final validation loss" in readme
    assert (out / "target" / "model.safetensors").stat().st_mode & 0o044 == 0o044  # readable by all
    _check_target(out / "target")
    medium = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_demo.py"), "--out", str(out), "--medium", *TINY],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert medium.returncode == 0, medium.stderr[-3000:]
    assert "--medium" in (out / "medium" / "README.md").read_text()
    _check_target(out / "medium")  # the target's tokenizer, trained on the same split


@pytest.mark.skipif(not (SHIPPED / "target" / "config.json").is_file(), reason="demo assets not built")
def test_shipped_assets_are_current_and_small():
    """data/demo was built from today's generator (rebuild with scripts/make_demo.py if this fails)."""
    lines = (SHIPPED / "chat.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == make_conversations(len(lines), seed=0)
    for name in PROMPT_SETS:  # the built-in prompt sets
        rows = (SHIPPED / "prompts" / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()
        assert [json.loads(line) for line in rows] == prompt_rows(name, len(rows)), name
    assert len((SHIPPED / "chat.jsonl").read_bytes()) <= 4_000_000
    assert sum(f.stat().st_size for f in SHIPPED.rglob("*") if f.is_file()) < 20_000_000
    for name in ("target", "draft", "medium"):  # the demo target and the cascade's tiny and medium levels
        _check_target(SHIPPED / name)


@pytest.mark.parametrize("arch, cls", [("llama", "LlamaForCausalLM"), ("qwen3", "Qwen3ForCausalLM")])
def test_the_target_architecture_is_chosen_and_sized_by_the_cli(arch, cls, tmp_path):
    """--arch picks the family (the second target of scripts/second_target.sh is a Qwen3); every family
    gets head_dim = hidden / heads (Qwen3's own default is 128) and the tokenizer's special ids."""
    from make_demo import build_model, parse_args, train_tokenizer

    tok = train_tokenizer(make_conversations(40, seed=0), 300)
    args = parse_args(["--arch", arch, *TINY])
    model = build_model(args, tok)
    assert type(model).__name__ == cls and model.config.num_hidden_layers == 2
    assert model.config.head_dim == 32 // 4 and model.config.vocab_size == len(tok)
    assert model.config.eos_token_id == tok.eos_token_id and not model.config.tie_word_embeddings
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 7]])).logits  # (1, 3, V)
    assert logits.shape == (1, 3, len(tok))
