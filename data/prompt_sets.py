"""Evaluation prompt sets: categories and user turns, built in for the demo or loaded from a file or the Hub.

JSONL format (one object per line), the one Spec-Bench and MT-bench `question.jsonl` files use:
    {"question_id": 81, "category": "writing", "turns": ["first user turn", "optional second turn"]}
`question_id` is optional; `turns` may also be a single string (also read from a `prompt`, `question`
or `instruction` column). Multi-turn prompts are decoded turn by turn, each answer fed back.

Built-in sets for the demo target (drawn from held-out demo conversations, never trained on):
    demo        Spec-Bench categories: mt_bench (multi-turn), translation, summarization, qa,
                math_reasoning, rag (a question answered from retrieved passages in the prompt)
    demo-mt     MT-bench style: two user turns each, category = the demo task kind
    demo-kinds  one turn each, category = the demo task kind (31 kinds)
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from spechead.data.demo import make_conversations
from spechead.data.errors import DataError

DEMO_SEED = 2027  # not the corpus seed: the demo heads never trained on these prompts
SPEC_BENCH_KINDS = {
    "translation": ("translation",),
    "summarization": ("summary",),
    "qa": ("capital", "definition", "animal", "planet"),
    "math_reasoning": ("arithmetic", "word_problem", "percentage", "statistics", "unit_conversion"),
}
TURN_FIELDS = ("turns", "prompt", "question", "instruction")


@dataclass
class EvalPrompt:
    """One evaluation prompt: its category and the user turns, in order."""

    id: str
    category: str
    turns: list[str]


def _demo_pool() -> Iterator[tuple[str, list[str]]]:
    """Endless (task kind, user turns) of held-out demo conversations, deterministic."""
    chunk = 0
    while True:
        for conv in make_conversations(500, seed=DEMO_SEED + chunk, with_kind=True):
            yield conv["kind"], [m["content"] for m in conv["messages"] if m["role"] == "user"]
        chunk += 1


def demo_kinds_prompts(n: int) -> list[EvalPrompt]:
    """First user turns of held-out demo conversations; category = task kind."""
    pool = _demo_pool()
    return [EvalPrompt(f"demo-{i}", kind, turns[:1]) for i, (kind, turns) in zip(range(n), pool)]


def demo_mt_prompts(n: int) -> list[EvalPrompt]:
    """Two-turn prompts (MT-bench style) from multi-turn held-out demo conversations."""
    two = ((kind, turns[:2]) for kind, turns in _demo_pool() if len(turns) >= 2)
    return [EvalPrompt(f"demo-mt-{i}", kind, turns) for i, (kind, turns) in zip(range(n), two)]


def demo_spec_bench_prompts(n: int) -> list[EvalPrompt]:
    """`n` prompts cycling through the six Spec-Bench categories (see the module docstring)."""
    rng = random.Random(DEMO_SEED)
    makers: dict[str, Callable[[], list[str]]] = {
        "mt_bench": _first(lambda kind, turns: len(turns) >= 2, turns=2),
        **{c: _first(lambda kind, turns, ks=kinds: kind in ks) for c, kinds in SPEC_BENCH_KINDS.items()},
        "rag": lambda: _rag_turn(rng),
    }
    names = list(makers)
    return [EvalPrompt(f"demo-{i}", names[i % 6], makers[names[i % 6]]()) for i in range(n)]


def _first(keep: Callable[[str, list[str]], bool], turns: int = 1) -> Callable[[], list[str]]:
    """A maker returning the next pool conversation's first `turns` user turns that `keep` accepts."""
    pool = ((kind, ts) for kind, ts in _demo_pool() if keep(kind, ts))
    return lambda: next(pool)[1][:turns]


_QA = SPEC_BENCH_KINDS["qa"]


def _rag_turn(rng: random.Random) -> list[str]:
    """A question plus four passages (answers of QA conversations), one of which answers it."""
    convs = [c for c in make_conversations(400, seed=DEMO_SEED + 99 + rng.randrange(10**6), with_kind=True)
             if c["kind"] in _QA][:4]  # fmt: skip
    passages = [next(m["content"] for m in c["messages"] if m["role"] == "assistant") for c in convs]
    question = next(m["content"] for m in convs[0]["messages"] if m["role"] == "user")
    rng.shuffle(passages)
    lines = "\n".join(f"[{i + 1}] {p}" for i, p in enumerate(passages))
    return [f"Answer the question using the passages below.\n\nPassages:\n{lines}\n\nQuestion: {question}"]


def _row_prompt(row: dict, where: str, index: int) -> EvalPrompt:
    """One {category, turns} row -> EvalPrompt; DataError naming `where` for bad rows."""
    field = next((f for f in TURN_FIELDS if row.get(f) is not None), None)
    if field is None:
        raise DataError(
            f"{where}: expected a 'turns' (or prompt/question/instruction) field, got {sorted(row)}"
        )
    turns = [row[field]] if isinstance(row[field], str) else row[field]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise DataError(f"{where}: '{field}' must be a non-empty string or list of non-empty strings")
    qid = next((row[k] for k in ("question_id", "id") if row.get(k) is not None), index)
    return EvalPrompt(str(qid), str(row.get("category") or "default"), list(turns))


def load_jsonl(path: Path) -> list[EvalPrompt]:
    """Prompts from a JSONL file in the format above; DataError naming the line for bad rows."""
    if not path.is_file():
        raise DataError(
            f"prompt file {path} not found: pass an existing JSONL file, a Hub dataset id or 'demo'"
        )
    prompts = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{n}: expected {{'category', 'turns'}} JSON ({err})") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}:{n}: expected {{'category', 'turns'}} JSON object")
        prompts.append(_row_prompt(row, f"{path}:{n}", n))
    if not prompts:
        raise DataError(f"prompt file {path} has no prompts")
    return prompts


def load_dataset_prompts(source: str) -> list[EvalPrompt]:
    """Prompts from a `datasets` source: a Hub dataset id or a local data directory, 'ID[:split]'."""
    import datasets

    name, _, split = source.partition(":")
    try:
        rows = datasets.load_dataset(name, split=split or "train")
    except Exception as err:  # offline, missing repo, unknown split: one line that names the source
        raise DataError(
            f"could not load prompt set {source!r} ({type(err).__name__}: {str(err).splitlines()[0][:200]}): "
            "pass 'demo', a JSONL file, a data directory or a reachable Hub dataset id[:split]"
        ) from None
    prompts = [_row_prompt(row, f"{source} row {i}", i) for i, row in enumerate(rows)]
    if not prompts:
        raise DataError(f"prompt set {source} has no prompts")
    return prompts


def spread(prompts: list[EvalPrompt], limit: int) -> list[EvalPrompt]:
    """At most `limit` prompts taken round-robin over categories (first-seen order), so a file sorted
    by category still gives every category its share."""
    queues: dict[str, list[EvalPrompt]] = {}
    for p in prompts:
        queues.setdefault(p.category, []).append(p)
    out: list[EvalPrompt] = []
    while len(out) < min(limit, len(prompts)):
        for q in queues.values():
            if q and len(out) < limit:
                out.append(q.pop(0))
    return out


BUILT_IN = {"demo": demo_spec_bench_prompts, "demo-mt": demo_mt_prompts, "demo-kinds": demo_kinds_prompts}


def load_prompt_set(source: str, limit: int | None = None) -> list[EvalPrompt]:
    """A built-in set (see BUILT_IN), a JSONL file, or a data directory / Hub dataset id[:split]."""
    if source in BUILT_IN:
        return BUILT_IN[source](limit or 24)
    path = Path(source).expanduser()
    if path.suffix in (".jsonl", ".json") or path.is_file():
        prompts = load_jsonl(path)
    else:
        prompts = load_dataset_prompts(source)
    return spread(prompts, limit) if limit else prompts
