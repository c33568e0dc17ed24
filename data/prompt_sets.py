"""Evaluation prompt sets: categories and user turns, built in for the demo or loaded from a file or the Hub.

JSONL format (one object per line), the one Spec-Bench and MT-bench `question.jsonl` files use:
    {"question_id": 81, "category": "writing", "turns": ["first user turn", "optional second turn"]}
`question_id` is optional; `turns` may also be a single string (also read from a `prompt`, `question`
or `instruction` column). Multi-turn prompts are decoded turn by turn, each answer fed back.

Built-in sets for the demo target: data/demo/prompts/NAME.jsonl, drawn from held-out demo
conversations (never trained on) by scripts/make_demo.py (see scripts/demo_corpus/prompts.py):
    demo        Spec-Bench categories: mt_bench (multi-turn), translation, summarization, qa,
                math_reasoning, rag (a question answered from retrieved passages in the prompt)
    demo-mt     MT-bench style: two user turns each, category = the demo task kind
    demo-kinds  one turn each, category = the demo task kind (31 kinds)
    demo-tune   the demo set's six categories from another held-out draw (never the benchmark's prompts):
                what trees are tuned on (scripts/build_tree.py, the end of a demo training run)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

from spechead.data.errors import DataError

BUILT_IN = ("demo", "demo-mt", "demo-kinds", "demo-tune")
TURN_FIELDS = ("turns", "prompt", "question", "instruction")


def built_in_file(name: str) -> Path:
    """data/demo/prompts/NAME.jsonl inside the installed spechead.data package."""
    return Path(str(files("spechead.data"))) / "demo" / "prompts" / f"{name}.jsonl"


@dataclass
class EvalPrompt:
    """One evaluation prompt: its category and the user turns, in order."""

    id: str
    category: str
    turns: list[str]


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


def load_prompt_set(source: str, limit: int | None = None) -> list[EvalPrompt]:
    """A built-in set (see BUILT_IN: its first `limit`, default 24, prompts in order), a JSONL file, or a
    data directory / Hub dataset id[:split] (`limit` prompts spread over the categories)."""
    if source in BUILT_IN:
        prompts, limit = load_jsonl(built_in_file(source)), limit or 24
        if limit > len(prompts):
            raise DataError(
                f"the built-in prompt set {source!r} holds {len(prompts)} prompts, {limit} were asked for: "
                "ask for fewer or pass a JSONL file of your own"
            )
        return prompts[:limit]
    path = Path(source).expanduser()
    if path.suffix in (".jsonl", ".json") or path.is_file():
        prompts = load_jsonl(path)
    else:
        prompts = load_dataset_prompts(source)
    return spread(prompts, limit) if limit else prompts
