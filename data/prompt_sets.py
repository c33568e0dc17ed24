"""Evaluation prompt sets: categories and user turns, from a local JSONL file or built in for the demo.

JSONL format (one object per line), the one Spec-Bench and MT-bench `question.jsonl` files use:
    {"question_id": 81, "category": "writing", "turns": ["first user turn", "optional second turn"]}
`question_id` is optional; `turns` may also be a single string. Multi-turn prompts are decoded turn
by turn, each answer fed back before the next turn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from spechead.data.demo import make_conversations
from spechead.data.errors import DataError

DEMO_SEED = 2027  # not the corpus seed: the demo heads never trained on these prompts


@dataclass
class EvalPrompt:
    """One evaluation prompt: its category and the user turns, in order."""

    id: str
    category: str
    turns: list[str]


def demo_prompts(n: int) -> list[EvalPrompt]:
    """Built-in prompts for the demo target: first user turns of held-out demo conversations."""
    prompts = []
    for i, conv in enumerate(make_conversations(n, seed=DEMO_SEED, with_kind=True)):
        users = [m["content"] for m in conv["messages"] if m["role"] == "user"]
        prompts.append(EvalPrompt(id=f"demo-{i}", category=conv["kind"], turns=users[:1]))
    return prompts


def load_jsonl(path: Path) -> list[EvalPrompt]:
    """Prompts from a JSONL file in the format above; DataError naming the line for bad rows."""
    if not path.is_file():
        raise DataError(f"prompt file {path} not found: pass an existing JSONL file or 'demo'")
    prompts = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            turns = [row["turns"]] if isinstance(row["turns"], str) else list(row["turns"])
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise DataError(
                f"{path}:{n}: expected {{'category', 'turns'}} JSON ({type(err).__name__}: {err})"
            ) from None
        if not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise DataError(f"{path}:{n}: 'turns' must be non-empty strings")
        prompts.append(EvalPrompt(str(row.get("question_id", n)), str(row.get("category", "default")), turns))
    if not prompts:
        raise DataError(f"prompt file {path} has no prompts")
    return prompts


def load_prompt_set(source: str, limit: int | None = None) -> list[EvalPrompt]:
    """'demo' (built in) or a JSONL path; at most `limit` prompts, spread over categories in file order."""
    prompts = demo_prompts(limit or 24) if source == "demo" else load_jsonl(Path(source).expanduser())
    return prompts[:limit] if limit else prompts
