"""Deterministic demo chat corpus in OpenAI messages format.

`make_conversations(n, seed)` draws `n` conversations from a registry of task generators
(arithmetic, unit conversions, capitals, recipes, emails, stories, code, ...). Everything comes
from one `random.Random(seed)`, so the corpus is identical across runs and machines. It is the
training data of the shipped demo target (`scripts/make_demo.py`) and of the demo draft heads.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from . import tasks_lang as lang
from . import tasks_logic as logic
from . import tasks_num as num
from . import tasks_write as write
from .facts import Turns

TaskFn = Callable[[random.Random], Turns]

# (kind name, generator). Order matters for determinism: append new kinds at the end.
TASKS: list[tuple[str, TaskFn]] = [
    ("arithmetic", num.arithmetic),
    ("word_problem", num.word_problem),
    ("unit_conversion", num.unit_conversion),
    ("sorting", num.sorting),
    ("number_facts", num.number_facts),
    ("percentage", num.percentage),
    ("statistics", num.statistics),
    ("date_reasoning", logic.date_reasoning),
    ("clock_time", logic.clock_time),
    ("comparison", logic.comparison),
    ("python_code", logic.python_code),
    ("capital", lang.capital),
    ("definition", lang.definition),
    ("spelling", lang.spelling),
    ("word_count", lang.word_count),
    ("recipe", write.recipe),
    ("travel_tips", write.travel_tips),
    ("packing", write.packing),
    ("email", write.email),
    ("summary", write.summary),
    ("translation", lang.translation),
    ("synonym", lang.synonym),
    ("joke", write.joke),
    ("riddle", write.riddle),
    ("story", write.story),
    ("advice", write.advice),
    ("animal", lang.animal),
    ("planet", lang.planet),
    ("grammar", lang.grammar),
    ("list_items", lang.list_items),
    ("small_talk", lang.small_talk),
]

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a friendly assistant. Answer clearly and correctly.",
    "You are SpecBot, a helpful AI assistant.",
    "You are a knowledgeable assistant. Keep your answers accurate.",
    "Be helpful and polite.",
]
MULTI_TURN_P = 0.25  # share of conversations with 2-3 user turns
SYSTEM_P = 0.15  # share of conversations that start with a system prompt


def task_kinds() -> list[str]:
    """Names of all task kinds, in registry order."""
    return [name for name, _ in TASKS]


def make_conversation(rng: random.Random) -> tuple[str, list[dict[str, str]]]:
    """One conversation drawn with `rng`: (task kind, messages)."""
    kind, fn = TASKS[rng.randrange(len(TASKS))]
    turns = fn(rng)
    n_turns = rng.randint(2, min(3, len(turns))) if rng.random() < MULTI_TURN_P else 1
    messages = []
    if rng.random() < SYSTEM_P:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    for user, assistant in turns[:n_turns]:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return kind, messages


def make_conversations(n: int, seed: int = 0, with_kind: bool = False) -> list[dict]:
    """`n` conversations `{"messages": [...]}`; deterministic in (n, seed).

    With `with_kind=True` each item also carries `"kind"` (the task generator's name).
    """
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        kind, messages = make_conversation(rng)
        out.append({"messages": messages, "kind": kind} if with_kind else {"messages": messages})
    return out
