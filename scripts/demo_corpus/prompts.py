"""The built-in evaluation and tree-tuning prompt sets, drawn from held-out demo conversations.

Each set is a list of rows {"question_id", "category", "turns"} (the JSONL format of
`spechead.data.prompt_sets`); `scripts/make_demo.py` writes them to data/demo/prompts/NAME.jsonl.
Every generator is sequential, so its first k rows are the rows a smaller set would hold.

    demo        Spec-Bench categories: mt_bench (multi-turn), translation, summarization, qa,
                math_reasoning, rag (a question answered from retrieved passages in the prompt)
    demo-mt     MT-bench style: two user turns each, category = the demo task kind
    demo-kinds  one turn each, category = the demo task kind (31 kinds)
    demo-tune   the demo set's six categories from another held-out draw (its own seed): what trees are
                tuned on (scripts/build_tree.py, the end of a demo training run), so a tree is tuned on
                prompts of the kind it is benchmarked on but never on the benchmark's own prompts
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

from .corpus import make_conversations

EVAL_SEED = 2027  # not the corpus seed (0): the demo target and heads never trained on these prompts
TUNE_SEED = 123
PROMPTS_PER_SET = 256  # rows in each data/demo/prompts/NAME.jsonl
SPEC_BENCH_KINDS = {
    "translation": ("translation",),
    "summarization": ("summary",),
    "qa": ("capital", "definition", "animal", "planet"),
    "math_reasoning": ("arithmetic", "word_problem", "percentage", "statistics", "unit_conversion"),
}
Row = dict  # {"question_id": str, "category": str, "turns": [str, ...]}


def _pool(seed: int = EVAL_SEED) -> Iterator[tuple[str, list[str]]]:
    """Endless (task kind, user turns) of held-out demo conversations, deterministic for a seed."""
    chunk = 0
    while True:
        for conv in make_conversations(500, seed=seed + chunk, with_kind=True):
            yield conv["kind"], [m["content"] for m in conv["messages"] if m["role"] == "user"]
        chunk += 1


def kinds_rows(n: int) -> list[Row]:
    """First user turns of held-out demo conversations; category = task kind."""
    return [_row(f"demo-{i}", kind, turns[:1]) for i, (kind, turns) in zip(range(n), _pool())]


def mt_rows(n: int) -> list[Row]:
    """Two-turn prompts (MT-bench style) from multi-turn held-out demo conversations."""
    two = ((kind, turns[:2]) for kind, turns in _pool() if len(turns) >= 2)
    return [_row(f"demo-mt-{i}", kind, turns) for i, (kind, turns) in zip(range(n), two)]


def spec_bench_rows(n: int, seed: int = EVAL_SEED, name: str = "demo") -> list[Row]:
    """`n` prompts cycling through the six Spec-Bench categories (see the module docstring), drawn
    from the held-out conversations of `seed`; question ids NAME-i."""
    rng = random.Random(seed)
    makers: dict[str, Callable[[], list[str]]] = {
        "mt_bench": _first(seed, lambda kind, turns: len(turns) >= 2, turns=2),
        **{
            c: _first(seed, lambda kind, turns, ks=kinds: kind in ks) for c, kinds in SPEC_BENCH_KINDS.items()
        },
        "rag": lambda: _rag_turn(rng, seed),
    }
    names = list(makers)
    return [_row(f"{name}-{i}", names[i % 6], makers[names[i % 6]]()) for i in range(n)]


def tune_rows(n: int) -> list[Row]:
    """The demo set's categories drawn from TUNE_SEED's held-out conversations (not the demo set's)."""
    return spec_bench_rows(n, seed=TUNE_SEED, name="demo-tune")


def _row(qid: str, category: str, turns: list[str]) -> Row:
    return {"question_id": qid, "category": category, "turns": turns}


def _first(seed: int, keep: Callable[[str, list[str]], bool], turns: int = 1) -> Callable[[], list[str]]:
    """A maker returning the next pool conversation's first `turns` user turns that `keep` accepts."""
    pool = ((kind, ts) for kind, ts in _pool(seed) if keep(kind, ts))
    return lambda: next(pool)[1][:turns]


def _rag_turn(rng: random.Random, seed: int) -> list[str]:
    """A question plus four passages (answers of QA conversations), one of which answers it."""
    convs = [c for c in make_conversations(400, seed=seed + 99 + rng.randrange(10**6), with_kind=True)
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
