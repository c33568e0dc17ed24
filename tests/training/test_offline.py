"""Training from a hidden-state cache gives the head online training gives; mismatched caches are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from spechead.data.errors import DataError
from spechead.training.errors import TrainError
from spechead.training.hidden_cache.build import CacheConfig, build_cache
from spechead.training.hidden_cache.match import offline_data
from spechead.training.hidden_cache.target import load_cached_target, load_modules
from spechead.training.target import TargetConfig, load_tokenizer
from spechead.training.trainer import train

STEPS = {"trainer.max_steps": 4, "trainer.eval_every": 2, "trainer.save_every": 100}


@pytest.fixture(scope="module")
def caches(tmp_path_factory, tiny_target_dir, chat_file, training_kit) -> dict[str, Path]:
    """fp32 caches of the tiny target: one for EAGLE-3 (states 1, 2, 4), one for Medusa (state 4)."""
    root = tmp_path_factory.mktemp("offline")
    out = {}
    for head in ("eagle3", "medusa"):
        out[head] = root / head
        overrides = training_kit.overrides(tiny_target_dir, chat_file, root / "unused", head=head)
        s = training_kit.settings([*overrides, f"data.cache_dir={out[head]}"])
        report = build_cache(s, CacheConfig(dtype="float32", shard_mb=0.1), log=lambda line: None)
        assert report.complete and report.tokens > 1000
    return out


def offline(cache: Path) -> dict[str, str]:
    return {"data.hidden_states": "offline", "data.cache_dir": str(cache)}


def train_losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["train/loss"] for r in rows if "train/loss" in r]


@pytest.mark.parametrize(
    ("head", "extra"),
    [
        ("eagle3", {"head.ttt_steps": 2}),
        ("eagle", {}),
        ("peagle", {"head.block_size": 3}),
        ("dflash", {"head.block_size": 3}),
    ],
)
def test_offline_training_gives_the_online_head(
    head, extra, caches, tmp_path, tiny_target_dir, chat_file, training_kit
):
    results = {}
    for mode, more in (("online", {}), ("offline", offline(caches["eagle3"]))):
        kw = {"head": head, **extra, **STEPS, **more}
        overrides = training_kit.overrides(tiny_target_dir, chat_file, tmp_path / mode, **kw)
        results[mode] = train(training_kit.settings(overrides))
    online = load_file(str(results["online"].head_dir / "model.safetensors"))
    cached = load_file(str(results["offline"].head_dir / "model.safetensors"))
    assert sorted(online) == sorted(cached)
    for key, value in online.items():
        assert torch.allclose(cached[key].float(), value.float(), atol=1e-5, rtol=0), key
    assert results["offline"].metrics["tau"] == pytest.approx(results["online"].metrics["tau"], abs=1e-6)
    losses = {mode: train_losses(tmp_path / mode) for mode in results}
    assert len(set(losses["online"])) == 4  # it trained: every step's loss differs
    assert losses["offline"] == pytest.approx(losses["online"], rel=1e-5)
    assert results["offline"].metrics["loss"] == pytest.approx(results["online"].metrics["loss"], rel=1e-5)


def test_a_cache_serves_heads_that_need_fewer_states(
    caches, tmp_path, tiny_target_dir, chat_file, training_kit
):
    kw = {"head": "medusa", **STEPS, **offline(caches["eagle3"])}
    result = train(training_kit.settings(training_kit.overrides(tiny_target_dir, chat_file, tmp_path, **kw)))
    assert result.steps == 4 and 1.0 <= result.metrics["tau"] <= 3.0


def test_only_the_embedding_and_lm_head_are_loaded(tiny_target_dir):
    target = load_cached_target(TargetConfig(path=str(tiny_target_dir)), [1, 2, 4], "cpu")
    full = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32)
    assert torch.equal(target.embed_tokens.weight, full.get_input_embeddings().weight)
    assert torch.equal(target.lm_head.weight, full.get_output_embeddings().weight)
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (4, 32, full.config.vocab_size)
    with pytest.raises(TrainError, match="needs the full target"):
        _ = target.model
    states = torch.randn(3, 2, 5, 32)  # (S, B, T, H) as the collator stacks them
    cap = target.capture_batch({"hidden_states": states}, [2, -1], with_logits=True)
    assert torch.equal(cap.hidden[0], states[1]) and torch.equal(cap.hidden[1], states[2])
    assert torch.allclose(cap.logits, full.lm_head(states[2]))


def test_tied_lm_head_is_read_from_the_embedding(tmp_path, tiny_llama):
    model = tiny_llama(64)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    model.save_pretrained(tmp_path)
    cfg = TargetConfig(path=str(tmp_path))
    embed, lm_head = load_modules(cfg, model.config, "cpu")
    assert torch.equal(lm_head.weight, model.get_input_embeddings().weight)
    assert torch.equal(embed.weight, model.get_input_embeddings().weight)


@pytest.mark.parametrize(
    ("cache", "kw", "message"),
    [
        ("medusa", {"head": "eagle3"}, r"stores hidden states \[4\] but head eagle3 needs \[1, 2, 4\]"),
        ("eagle3", {"trainer.max_length": 48}, r"another trainer.max_length \(64, this run: 48\)"),
        ("eagle3", {"trainer.seed": 1}, "another trainer.seed"),
        ("eagle3", {"data.val_size": 0.2}, "another data.val_size"),  # another train/val split
        ("eagle3", {"data.max_examples": 40}, "another data.max_examples"),
        ("eagle3", {"head": "medusa2"}, "head medusa2 cannot train from a hidden-state cache"),
    ],
)
def test_a_mismatched_cache_is_refused(
    cache, kw, message, caches, tmp_path, tiny_target_dir, chat_file, training_kit
):
    overrides = training_kit.overrides(
        tiny_target_dir, chat_file, tmp_path, **{**kw, **offline(caches[cache])}
    )
    s = training_kit.settings(overrides)
    with pytest.raises(TrainError, match=message) as err:
        offline_data(s, load_tokenizer(s.model))
    assert "\n" not in str(err.value)


def test_offline_settings_are_checked(tmp_path, tiny_target_dir, chat_file, training_kit):
    base = training_kit.overrides(tiny_target_dir, chat_file, tmp_path)
    with pytest.raises(DataError, match="data.hidden_states='disk': use online or offline"):
        training_kit.settings([*base, "data.hidden_states=disk"])
    with pytest.raises(DataError, match="needs data.cache_dir=DIR"):
        training_kit.settings([*base, "data.hidden_states=offline"])
    s = training_kit.settings([*base, *[f"{k}={v}" for k, v in offline(tmp_path / "none").items()]])
    with pytest.raises(DataError, match="does not exist: build it with"):
        offline_data(s, load_tokenizer(s.model))


def test_cli_refuses_a_mismatched_cache_in_one_line(
    caches, tmp_path, tiny_target_dir, chat_file, training_kit, monkeypatch, capsys
):
    kw = {"head": "eagle3", **offline(caches["medusa"])}
    args = training_kit.overrides(tiny_target_dir, chat_file, tmp_path, **kw)
    proc = training_kit.cli_in_process(args, monkeypatch, capsys)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: the cache in")
    assert "Traceback" not in proc.stderr


def test_a_target_whose_logits_are_not_lm_head_of_the_final_state_is_refused(
    tmp_path, gemma2_target_dir, chat_file, training_kit
):
    """A cache stores the final normed state instead of logits: a target that soft-caps its logits
    (Gemma-2, here with a cap small enough to matter on a tiny model) cannot be cached."""
    import shutil

    target = tmp_path / "capped"
    shutil.copytree(gemma2_target_dir, target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "final_logit_softcapping": 0.01}))
    extra = {"model.attn_implementation": "eager", "data.cache_dir": str(tmp_path / "cache")}
    s = training_kit.settings(training_kit.overrides(target, chat_file, tmp_path / "unused", **extra))
    with pytest.raises(TrainError, match="logits are not lm_head"):
        build_cache(s, CacheConfig(dtype="float32", shard_mb=0.1), log=lambda line: None)
