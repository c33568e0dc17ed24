"""Evaluation prompt sets: the JSONL format (Spec-Bench / MT-bench style) and the built-in demo set."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from spechead.data.errors import DataError
from spechead.data.prompt_sets import load_prompt_set


def test_demo_set_has_the_spec_bench_categories_and_is_deterministic():
    a, b = load_prompt_set("demo", 30), load_prompt_set("demo", 30)
    assert a == b and len(a) == 30
    assert [p.category for p in a[:6]] == [
        "mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag",
    ]  # fmt: skip
    assert all(p.turns and all(t.strip() for t in p.turns) for p in a)
    assert all(len(p.turns) == 2 for p in a if p.category == "mt_bench")
    assert all(len(p.turns) == 1 for p in a if p.category != "mt_bench")
    rag = next(p for p in a if p.category == "rag").turns[0]
    assert "Passages:" in rag and "Question:" in rag
    assert load_prompt_set("demo", 12) == a[:12]  # a smaller set is a prefix: numbers stay comparable


def test_demo_mt_kinds_and_tune_sets():
    mt = load_prompt_set("demo-mt", 8)
    assert len(mt) == 8 and all(len(p.turns) == 2 for p in mt)
    kinds = load_prompt_set("demo-kinds", 40)
    assert len({p.category for p in kinds}) >= 10 and all(len(p.turns) == 1 for p in kinds)
    # the benchmark's kind (its six categories, in the same order) from another held-out draw: templated
    # prompts may recur further down, but the first 48 share no prompt with the benchmark's first 48
    tune, demo = load_prompt_set("demo-tune", 48), load_prompt_set("demo", 48)
    assert [p.category for p in tune] == [p.category for p in demo]
    assert not [p for p in tune if p.turns in [q.turns for q in demo]]
    assert all(len(p.turns) == 2 for p in tune if p.category == "mt_bench")


def test_built_in_sets_are_shipped_files_and_say_when_too_small():
    with pytest.raises(DataError, match="'demo' holds 256 prompts, 300 were asked for: ask for fewer"):
        load_prompt_set("demo", 300)
    code = (
        "import sys; import spechead.data.prompt_sets as p, spechead.training.trainer, spechead.inference.generator; "
        "p.load_prompt_set('demo'); print(sorted(m for m in sys.modules if 'demo_corpus' in m or 'demo_tasks' in m))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stderr[
        -2000:
    ]  # no corpus generator loaded


def test_limit_spreads_over_categories(tmp_path):
    path = tmp_path / "sorted.jsonl"
    rows = [{"category": c, "turns": [f"{c} {i}"]} for c in ("a", "b", "c") for i in range(5)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    assert [p.category for p in load_prompt_set(str(path), limit=5)] == ["a", "b", "c", "a", "b"]


def test_dataset_directory_or_hub_id(tmp_path):
    """A `datasets` source (local directory here; a Hub id goes through the same load_dataset call)."""
    import datasets

    data = tmp_path / "spec_bench"
    data.mkdir()
    datasets.Dataset.from_list(
        [{"question_id": 1, "category": "qa", "prompt": "Who?"}, {"category": "rag", "prompt": "Why?"}]
    ).to_parquet(str(data / "train.parquet"))
    prompts = load_prompt_set(str(data))
    assert [(p.id, p.category, p.turns) for p in prompts] == [("1", "qa", ["Who?"]), ("1", "rag", ["Why?"])]
    with pytest.raises(DataError, match="could not load prompt set 'nobody/no-such-set'"):
        load_prompt_set("nobody/no-such-set")


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
