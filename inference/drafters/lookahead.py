"""Lookahead decoding (Fu et al. 2024): Jacobi iterations over a 2D window + an n-gram pool, no draft model.

Each pass sends ONE tree under the root (the last emitted token): up to `candidates` pool n-grams that
start with the root, merged into a trie, and the window, `ngram - 1` levels x `window` columns of
guesses (level 0 a chain off the root, each column's higher levels a chain off its level-0 cell). That is
the paper's lookahead mask: cell (l, c) attends to the level-0 cells of columns <= c and its own column
below l, its tree ancestors (position = depth). Every node is a deterministic function of past passes and
the Jacobi outputs are argmax also when sampling, so verifying the window stays lossless (rule A).

`verified` reads the target's argmax at the top level (each column's next guess, and an n-gram for the
pool); `accept` shifts the window by the emitted tokens (`jacobi_update`) and pools their n-grams.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from itertools import cycle

import torch

from spechead.inference.drafters.base import Draft
from spechead.inference.drafters.per_row import RowDrafter
from spechead.inference.sampling import SamplingParams
from spechead.inference.tree import TokenTree

Pool = dict[int, list[tuple[int, ...]]]  # first token -> continuations (ngram - 1 tokens), newest first
Window = list[list[int]]  # [levels][window] guessed tokens


def pool_add(pool: Pool, ngram: tuple[int, ...], limit: int) -> None:
    """Put ngram[1:] first under key ngram[0] (moved up if present); keep at most `limit` per key."""
    entries = pool.setdefault(ngram[0], [])
    tail = tuple(ngram[1:])
    if tail in entries:
        entries.remove(tail)
    entries.insert(0, tail)
    del entries[limit:]


def ngrams(tokens: list[int], n: int, start: int = 0) -> list[tuple[int, ...]]:
    """Every n-gram of `tokens` that ENDS at index >= start + n - 1, in order (start: skip older ones)."""
    return [tuple(tokens[i : i + n]) for i in range(max(start, 0), len(tokens) - n + 1)]


def jacobi_update(window: Window, top: list[int | None], shift: int, fill: list[int]) -> Window:
    """The window after the root moved `shift` >= 1 tokens on; top [W] = target argmax at the top level.

    new[l][c] = window[l + 1][c + shift - 1], new[L-1][c] = top[c + shift - 1] (each cell keeps its
    absolute offset); a cell whose source is gone takes the next token of `fill` (cycled).
    """
    width, spare = len(window[0]), cycle(fill)
    rows: list[Sequence[int | None]] = [*window[1:], top]
    new = []
    for row in rows:
        out = []
        for src in range(shift - 1, shift - 1 + width):
            value = row[src] if src < width else None
            out.append(next(spare) if value is None else value)
        new.append(out)
    return new


def candidate_trie(conts: list[tuple[int, ...]], offset: int) -> tuple[list[int], list[int]]:
    """Continuations merged into a trie below the root: (tokens, parents) of its nodes, in insertion order;
    parents index the whole tree (the root 0, the trie's first node `offset`)."""
    tokens: list[int] = []
    parents: list[int] = []
    index: dict[tuple[int, ...], int] = {(): 0}
    for cont in conts:
        for d in range(1, len(cont) + 1):
            if cont[:d] not in index:
                index[cont[:d]] = offset + len(tokens)
                tokens.append(cont[d - 1])
                parents.append(index[cont[: d - 1]])
    return tokens, parents


def window_nodes(window: Window, offset: int) -> tuple[list[int], list[int], list[list[int]]]:
    """The lookahead branch below the root: (tokens, parents, node index [L][W]) with nodes numbered from
    `offset`, level by level. Level 0 is a chain off the root, (l, c) hangs off (l - 1, c)."""
    width = len(window[0])
    at = [[offset + level * width + c for c in range(width)] for level in range(len(window))]
    parents = [
        (at[0][c - 1] if c else 0) if level == 0 else at[level - 1][c]
        for level in range(len(window))
        for c in range(width)
    ]
    return [token for row in window for token in row], parents, at


class LookaheadDrafter(RowDrafter):
    """A `window` x (`ngram` - 1) Jacobi window and up to `candidates` pool n-grams (rule A).

    pool_size: continuations kept per first token (the pool: the prompt's n-grams if pool_from_prompt,
    then the emitted ones). seed: of the initial window guesses, drawn from the prompt.
    """

    def __init__(
        self,
        window: int = 5,
        ngram: int = 4,
        candidates: int = 5,
        pool_size: int = 8,
        pool_from_prompt: bool = True,
        seed: int = 0,
    ):
        if window < 1 or ngram < 2 or candidates < 0 or pool_size < 1:
            raise ValueError(
                "lookahead needs window >= 1, ngram >= 2, candidates >= 0 and pool_size >= 1, got "
                f"window={window}, ngram={ngram}, candidates={candidates}, pool_size={pool_size}"
            )
        self.window, self.ngram, self.candidates = window, ngram, candidates
        self.pool_size, self.pool_from_prompt, self.seed = pool_size, bool(pool_from_prompt), seed
        self.max_nodes = 1 + (window + candidates) * (ngram - 1)
        self.pool: Pool = {}
        self.tokens: list[int] = []  # the sequence so far: prompt + emitted (the root last)
        self.grid: Window = []  # [ngram - 1][window]
        self._at: list[list[int]] = []  # node index of each window cell in the last proposed tree
        self._top: list[int | None] = []  # target argmax at the top level after the last pass

    def start(self, prompt: torch.Tensor, hidden: dict[int, torch.Tensor], root: int) -> None:
        self.tokens = [*prompt.tolist(), root]
        self.pool = {}
        if self.pool_from_prompt:
            for gram in ngrams(self.tokens, self.ngram):
                pool_add(self.pool, gram, self.pool_size)
        rng = random.Random(self.seed)  # guesses from the prompt: plausible tokens, reproducible
        self.grid = [[rng.choice(self.tokens) for _ in range(self.window)] for _ in range(self.ngram - 1)]
        self._at, self._top = [], []

    def propose(self, root: int, sampling: SamplingParams, generator: torch.Generator | None) -> Draft:
        conts = self.pool.get(root, [])[: self.candidates]
        cand_tokens, cand_parents = candidate_trie(conts, offset=1)
        look_tokens, look_parents, self._at = window_nodes(self.grid, offset=1 + len(cand_tokens))
        tokens = torch.tensor([root, *cand_tokens, *look_tokens], dtype=torch.long)  # [N]
        parents = torch.tensor([-1, *cand_parents, *look_parents], dtype=torch.long)  # [N]
        return Draft(TokenTree(tokens, parents))

    def verified(self, tree: TokenTree, logits: torch.Tensor) -> None:
        """Top-level Jacobi outputs: the argmax of logits [N, V] at the window's last level."""
        present = [i for i in self._at[-1] if i < tree.size]  # a tree cut near the cache's end loses some
        found = dict(zip(present, logits[present].argmax(-1).tolist()))
        self._top = [found.get(i) for i in self._at[-1]]
        for c, out in enumerate(self._top):  # column c's n-gram: window[0][c], ..., window[L-1][c], out
            if out is not None:
                pool_add(self.pool, (*(level[c] for level in self.grid), out), self.pool_size)

    def accept(self, tokens: torch.Tensor, hidden: dict[int, torch.Tensor], next_root: int) -> None:
        before = len(self.tokens)
        self.tokens += [*tokens[1:].tolist(), next_root]  # tokens[0] is the root, already listed
        for gram in ngrams(self.tokens, self.ngram, start=before - self.ngram + 1):
            pool_add(self.pool, gram, self.pool_size)
        if self._top:
            fill = self.tokens[-self.window :][::-1]  # vacated cells: recent tokens, newest first
            self.grid = jacobi_update(self.grid, self._top, int(tokens.numel()), fill)
        self._top = []
