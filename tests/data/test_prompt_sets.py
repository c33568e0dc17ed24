"""Evaluation prompt sets: the JSONL format (Spec-Bench / MT-bench style) and the built-in demo set."""

from __future__ import annotations

import json

import pytest

from spechead.data.errors import DataError
from spechead.data.prompt_sets import load_prompt_set


def test_demo_set_has_categories_and_is_deterministic():
    a, b = load_prompt_set("demo", 30), load_prompt_set("demo", 30)
    assert a == b and len(a) == 30
    assert len({p.category for p in a}) >= 10 and all(len(p.turns) == 1 and p.turns[0] for p in a)


def test_jsonl_mt_bench_style(tmp_path):
    path = tmp_path / "question.jsonl"
    rows = [
        {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now shorter."]},
        {"category": "math", "turns": "What is 2+2?"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    prompts = load_prompt_set(str(path))
    assert [(p.id, p.category, p.turns) for p in prompts] == [
        ("81", "writing", ["Write a poem.", "Now shorter."]),
        ("2", "math", ["What is 2+2?"]),
    ]
    assert len(load_prompt_set(str(path), limit=1)) == 1


@pytest.mark.parametrize(
    "content, needle",
    [
        ("{not json}\n", ":1: expected"),
        ('{"category": "x"}\n', ":1: expected"),
        ('{"turns": [""]}\n', "non-empty"),
        ("\n", "no prompts"),
    ],
)
def test_bad_prompt_files(tmp_path, content, needle):
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match=needle):
        load_prompt_set(str(path))


def test_missing_prompt_file(tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_prompt_set(str(tmp_path / "nope.jsonl"))
