"""The built-in evaluation and tree-tuning prompt sets, drawn from held-out demo conversations.

Each set is a list of rows {"question_id", "category", "turns"} (the JSONL format of
`spechead.data.prompt_sets`); `scripts/make_demo.py` writes them to data/demo/prompts/NAME.jsonl.
Every generator is sequential, so its first k rows are the rows a smaller set would hold.

    demo        Spec-Bench categories: mt_bench (multi-turn), translation, summarization, qa,
                math_reasoning, rag (a question answered from retrieved passages in the prompt)
    demo-mt     MT-bench style: two user turns each, category = the demo task kind
    demo-kinds  one turn each, category = the demo task kind (31 kinds)
    demo-tune   first user turns of another held-out draw: what scripts/build_tree.py measures a
                head's accuracy on, so trees are never tuned on the prompts they are benchmarked on
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

from .corpus import make_conversations

EVAL_SEED = 2027  # not the corpus seed (0): the demo target and heads never trained on these prompts
TUNE_SEED = 123
SPEC_BENCH_KINDS = {
    "translation": ("translation",),
    "summarization": ("summary",),
    "qa": ("capital", "definition", "animal", "planet"),
    "math_reasoning": ("arithmetic", "word_problem", "percentage", "statistics", "unit_conversion"),
}
Row = dict  # {"question_id": str, "category": str, "turns": [str, ...]}


def _pool() -> Iterator[tuple[str, list[str]]]:
    """Endless (task kind, user turns) of held-out demo conversations, deterministic."""
    chunk = 0
    while True:
        for conv in make_conversations(500, seed=EVAL_SEED + chunk, with_kind=True):
            yield conv["kind"], [m["content"] for m in conv["messages"] if m["role"] == "user"]
        chunk += 1


def kinds_rows(n: int) -> list[Row]:
    """First user turns of held-out demo conversations; category = task kind."""
    return [_row(f"demo-{i}", kind, turns[:1]) for i, (kind, turns) in zip(range(n), _pool())]


def mt_rows(n: int) -> list[Row]:
    """Two-turn prompts (MT-bench style) from multi-turn held-out demo conversations."""
    two = ((kind, turns[:2]) for kind, turns in _pool() if len(turns) >= 2)
    return [_row(f"demo-mt-{i}", kind, turns) for i, (kind, turns) in zip(range(n), two)]


def spec_bench_rows(n: int) -> list[Row]:
    """`n` prompts cycling through the six Spec-Bench categories (see the module docstring)."""
    rng = random.Random(EVAL_SEED)
    makers: dict[str, Callable[[], list[str]]] = {
        "mt_bench": _first(lambda kind, turns: len(turns) >= 2, turns=2),
        **{c: _first(lambda kind, turns, ks=kinds: kind in ks) for c, kinds in SPEC_BENCH_KINDS.items()},
        "rag": lambda: _rag_turn(rng),
    }
    names = list(makers)
    return [_row(f"demo-{i}", names[i % 6], makers[names[i % 6]]()) for i in range(n)]


def tune_rows(n: int) -> list[Row]:
    """First user turns of `make_conversations(n, seed=TUNE_SEED)` (category = task kind)."""
    convs = make_conversations(n, seed=TUNE_SEED, with_kind=True)
    firsts = ((c["kind"], next(m["content"] for m in c["messages"] if m["role"] == "user")) for c in convs)
    return [_row(f"demo-tune-{i}", kind, [turn]) for i, (kind, turn) in enumerate(firsts)]


def _row(qid: str, category: str, turns: list[str]) -> Row:
    return {"question_id": qid, "category": category, "turns": turns}


def _first(keep: Callable[[str, list[str]], bool], turns: int = 1) -> Callable[[], list[str]]:
    """A maker returning the next pool conversation's first `turns` user turns that `keep` accepts."""
    pool = ((kind, ts) for kind, ts in _pool() if keep(kind, ts))
    return lambda: next(pool)[1][:turns]


def _rag_turn(rng: random.Random) -> list[str]:
    """A question plus four passages (answers of QA conversations), one of which answers it."""
    convs = [c for c in make_conversations(400, seed=EVAL_SEED + 99 + rng.randrange(10**6), with_kind=True)
             if c["kind"] in SPEC_BENCH_KINDS["qa"]][:4]  # fmt: skip
    passages = [next(m["content"] for m in c["messages"] if m["role"] == "assistant") for c in convs]
    question = next(m["content"] for m in convs[0]["messages"] if m["role"] == "user")
    rng.shuffle(passages)
    lines = "\n".join(f"[{i + 1}] {p}" for i, p in enumerate(passages))
    return [f"Answer the question using the passages below.\n\nPassages:\n{lines}\n\nQuestion: {question}"]


PROMPT_SETS: dict[str, Callable[[int], list[Row]]] = {
    "demo": spec_bench_rows,
    "demo-mt": mt_rows,
    "demo-kinds": kinds_rows,
    "demo-tune": tune_rows,
}


def prompt_rows(name: str, n: int) -> list[Row]:
    """The first `n` rows of the built-in set `name`."""
    return PROMPT_SETS[name](n)
