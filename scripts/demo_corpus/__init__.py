"""The demo-asset generators: the synthetic chat corpus and the held-out prompt sets built from it.

Tooling for `scripts/make_demo.py`, not part of the installed library: training and decoding read
the files it writes (data/demo/chat.jsonl, data/demo/prompts/*.jsonl) and never import this.
Scripts in scripts/ import it as `demo_corpus` (their folder is on sys.path when they run).
"""

from .corpus import TASKS, make_conversations, task_kinds
from .prompts import PROMPT_SETS, PROMPTS_PER_SET, prompt_rows

__all__ = ["PROMPT_SETS", "PROMPTS_PER_SET", "TASKS", "make_conversations", "prompt_rows", "task_kinds"]
