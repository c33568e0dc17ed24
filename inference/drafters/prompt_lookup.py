"""Prompt lookup: draft the tokens that followed the latest n-gram's previous occurrence. No weights."""

from __future__ import annotations

import torch

from spechead.inference.drafters.base import Draft, chain
from spechead.inference.drafters.per_row import RowDrafter
from spechead.inference.sampling import SamplingParams


def lookup(tokens: list[int], max_ngram: int, min_ngram: int, num_draft: int) -> list[int]:
    """Up to `num_draft` tokens that followed the most recent earlier occurrence of the longest suffix
    n-gram (max_ngram..min_ngram) of `tokens`; [] when none matches."""
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # most recent earlier occurrence: a token follows
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + num_draft]
    return []


class PromptLookupDrafter(RowDrafter):
    """n-gram drafting from the prompt and the output so far (a chain, deterministic children)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, num_draft: int = 8):
        if not 1 <= min_ngram <= max_ngram or num_draft < 1:
            raise ValueError("prompt lookup needs 1 <= min_ngram <= max_ngram and num_draft >= 1")
        self.max_ngram, self.min_ngram, self.num_draft = max_ngram, min_ngram, num_draft
        self.tokens: list[int] = []

    def start(self, prompt: torch.Tensor, hidden: dict[int, torch.Tensor], root: int) -> None:
        self.tokens = [*prompt.tolist(), root]

    def propose(self, root: int, sampling: SamplingParams, generator: torch.Generator | None) -> Draft:
        return Draft(chain(lookup(self.tokens, self.max_ngram, self.min_ngram, self.num_draft), root))

    def accept(self, tokens: torch.Tensor, hidden: dict[int, torch.Tensor], next_root: int) -> None:
        self.tokens += [*tokens[1:].tolist(), next_root]  # tokens[0] is the root, already listed
