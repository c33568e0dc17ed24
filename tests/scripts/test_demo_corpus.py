"""The demo chat corpus: deterministic, well-formed, varied and arithmetically correct."""

from __future__ import annotations

import re
import statistics
from collections import Counter

import pytest
from demo_corpus import TASKS, make_conversations, task_kinds


@pytest.fixture(scope="module")
def corpus() -> list[dict]:
    return make_conversations(2000, seed=0, with_kind=True)


def test_deterministic_per_seed():
    a, b = make_conversations(300, seed=7), make_conversations(300, seed=7)
    assert a == b
    assert make_conversations(300, seed=8) != a
    assert make_conversations(100, seed=7) == a[:100]  # a longer corpus extends a shorter one


def test_with_kind_only_adds_the_kind(corpus):
    plain = make_conversations(2000, seed=0)
    assert [{"messages": c["messages"]} for c in corpus] == plain
    assert {c["kind"] for c in corpus} <= set(task_kinds())


def test_messages_are_well_formed(corpus):
    for conv in corpus:
        msgs = conv["messages"]
        roles = [m["role"] for m in msgs]
        if roles[0] == "system":
            roles = roles[1:]
        assert roles and len(roles) % 2 == 0, roles
        assert roles == ["user", "assistant"] * (len(roles) // 2), roles
        for m in msgs:
            assert set(m) == {"role", "content"}
            assert isinstance(m["content"], str) and m["content"].strip() == m["content"] and m["content"]


def test_variety(corpus):
    kinds = Counter(c["kind"] for c in corpus)
    assert len(TASKS) >= 25 and len(kinds) == len(TASKS)  # every kind shows up in 2000 draws
    assert min(kinds.values()) >= 30
    firsts = [next(m["content"] for m in c["messages"] if m["role"] == "user") for c in corpus]
    assert len(set(firsts)) >= 0.6 * len(corpus)
    answers = [len(m["content"]) for c in corpus for m in c["messages"] if m["role"] == "assistant"]
    assert min(answers) < 20 and max(answers) > 500 and statistics.median(answers) > 40
    assert sum(a > 200 for a in answers) > 0.08 * len(answers)  # plenty of multi-line answers
    user_turns = [sum(m["role"] == "user" for m in c["messages"]) for c in corpus]
    assert 0.18 < sum(t > 1 for t in user_turns) / len(corpus) < 0.32
    assert any(t == 3 for t in user_turns)
    systems = [c["messages"][0]["content"] for c in corpus if c["messages"][0]["role"] == "system"]
    assert 0.10 < len(systems) / len(corpus) < 0.20 and len(set(systems)) >= 3


OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "×": lambda a, b: a * b, "÷": lambda a, b: a / b}


def test_stated_arithmetic_is_correct():
    """Every `a op b = r` an assistant writes (integers) holds, across all task kinds."""
    pattern = re.compile(r"(?<![\d.$])(?<![-+×÷=] )(\d+) ([-+×÷]) (\d+) = (\d+)(?![\d.])(?! [-+×÷])")
    checked = 0
    for conv in make_conversations(3000, seed=1):
        for m in conv["messages"]:
            if m["role"] != "assistant":
                continue
            for a, op, b, r in pattern.findall(m["content"]):
                if op == "÷" and f"{a} ÷ {b} = {r} remainder" in m["content"]:
                    assert int(a) // int(b) == int(r)
                else:
                    assert OPS[op](int(a), int(b)) == int(r), m["content"]
                checked += 1
    assert checked > 50


def test_sorted_number_answers_match_the_question():
    checked = 0
    for conv in make_conversations(2000, seed=2, with_kind=True):
        msgs = [m for m in conv["messages"] if m["role"] != "system"]
        user, answer = msgs[0]["content"], msgs[1]["content"]
        if conv["kind"] != "sorting" or not re.match(
            r"(Sort these numbers|Put in ascending|Can you order)", user
        ):
            continue
        shown = [int(x) for x in re.findall(r"\d+", user)]
        assert [int(x) for x in re.findall(r"\d+", answer)] == sorted(shown), (user, answer)
        checked += 1
    assert checked > 20
