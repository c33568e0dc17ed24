"""build_datasets end to end: disjoint, seeded train/val splits of tokenized conversations."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import datasets
import pytest

from spechead.data.conversations import DataConfig
from spechead.data.errors import DataError
from spechead.data.pipeline import TrainData, build_datasets, val_count


def write_conversations(path: Path, n: int) -> Path:
    """n ShareGPT conversations, each answer unique ("answer <i>")."""
    rows = [
        {
            "conversations": [
                {"from": "human", "value": f"question {i}?"},
                {"from": "gpt", "value": f"answer {i}."},
            ]
        }
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def answers(tokenizer, ds: datasets.Dataset) -> set[str]:
    """The masked (assistant) text of each tokenized row."""
    return {tokenizer.decode([t for t, m in zip(r["input_ids"], r["loss_mask"]) if m]) for r in ds}


def build(path: Path, tokenizer, seed: int = 0, max_length: int = 64, **kw) -> TrainData:
    return build_datasets(DataConfig(path=str(path), **kw), tokenizer, max_length=max_length, seed=seed)


def test_train_and_val_are_disjoint_and_complete(tmp_path, chatml_tokenizer):
    data = build(write_conversations(tmp_path / "c.jsonl", 20), chatml_tokenizer, val_size=0.25)
    assert (len(data.train), len(data.val)) == (15, 5)
    assert data.train.column_names == data.val.column_names == ["input_ids", "loss_mask"]
    train, val = answers(chatml_tokenizer, data.train), answers(chatml_tokenizer, data.val)
    assert not train & val
    assert train | val == {f"answer {i}.<|im_end|>\n" for i in range(20)}
    assert (data.stats.total, data.stats.kept) == (20, 20)
    batch = data.collator([data.train[i] for i in range(4)])
    assert batch["input_ids"].shape == batch["loss_mask"].shape == batch["attention_mask"].shape
    assert batch["input_ids"][batch["attention_mask"] == 0].eq(chatml_tokenizer.pad_token_id).all()


def test_split_is_deterministic_for_a_seed(tmp_path, llama3_tokenizer, monkeypatch):
    path = write_conversations(tmp_path / "c.jsonl", 20)
    a = build(path, llama3_tokenizer, seed=1, val_size=4)
    # A fresh cache, so the second build really recomputes (in 2 processes) instead of reading a's files.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_datasets_2")
    b = build(path, llama3_tokenizer, seed=1, val_size=4, num_proc=2)
    c = build(path, llama3_tokenizer, seed=2, val_size=4)
    assert a.val.to_list() == b.val.to_list() and a.train.to_list() == b.train.to_list()
    assert len(a.val) == 4
    assert answers(llama3_tokenizer, a.val) != answers(llama3_tokenizer, c.val)


def test_small_datasets_and_max_examples(tmp_path, chatml_tokenizer):
    path = write_conversations(tmp_path / "c.jsonl", 10)
    data = build(path, chatml_tokenizer, max_examples=3)  # 5% of 3 rounds to 0: still one val example
    assert (len(data.train), len(data.val)) == (2, 1)
    assert answers(chatml_tokenizer, data.train) | answers(chatml_tokenizer, data.val) == {
        f"answer {i}.<|im_end|>\n" for i in range(3)
    }
    assert (len(build(path, chatml_tokenizer, max_examples=1).val)) == 0
    assert (len(build(path, chatml_tokenizer, val_size=0).val)) == 0


def test_val_count():
    assert [val_count(n, 0.05) for n in (0, 1, 2, 20, 100)] == [0, 0, 1, 1, 5]
    assert [val_count(n, 50) for n in (1, 2, 20, 100)] == [0, 1, 19, 50]
    assert val_count(100, 1) == 1  # 1 is a count (one conversation), not the fraction 100%
    assert val_count(10, 0.36) == 4  # a fraction rounds to the nearest count
    with pytest.raises(DataError, match="val_size"):
        val_count(10, -1)


def test_too_short_max_length_is_a_data_error(tmp_path, chatml_tokenizer):
    with pytest.raises(DataError, match="raise trainer.max_length"):
        build(write_conversations(tmp_path / "c.jsonl", 5), chatml_tokenizer, max_length=4)


def test_tokenizer_without_template_fails_before_loading(chatml_tokenizer):
    tok = copy.deepcopy(chatml_tokenizer)
    tok.chat_template = None
    with pytest.raises(DataError, match="no chat template"):
        build(Path("/nonexistent/data.jsonl"), tok)
