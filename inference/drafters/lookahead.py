"""Lookahead decoding (Fu et al. 2024): Jacobi iterations over a 2D window + an n-gram pool, no draft model.

Each pass sends ONE tree to the target with two branches under the root (the last emitted token):

- verification branch: up to `candidates` n-grams from the pool whose first token is the root, merged
  into a trie (their N-1 continuation tokens), most recent first;
- lookahead branch: the window, `ngram - 1` levels x `window` columns of guessed tokens. Cell (l, c)
  sits at offset c + l + 1 after the root. Level 0 is a chain off the root (root -> (0,0) -> (0,1) ...),
  and each column's higher levels are a chain hanging off its level-0 cell ((l-1, c) -> (l, c)).

Why this is the paper's lookahead mask and not an approximation: there, cell (l, c) attends to the
level-0 cells of columns <= c and to the cells of its own column below level l. Those are exactly its
ancestors in the tree above, at consecutive offsets, so the tree mask with position = depth (what the
engine builds from `parents`) reproduces it unchanged. Verifying the lookahead nodes too is still
lossless: greedy keeps a node only when it equals the target's argmax on its own path, and under
sampling every child is a deterministic function of past passes (rule A), whichever branch it is in.

After the pass, `verified` reads the target's argmax at the top level: for column c that is the next
Jacobi guess, and (window[0][c], ..., window[L-1][c], output) is an N-gram for the pool. `accept`
shifts the window by the emitted tokens (the new root sits k tokens further: new (l, c) = old
(l + 1, c + k - 1), the new top level = the outputs; columns that fall off are refilled from the
sequence) and adds the N-grams of the prompt (`pool_from_prompt`) and of the emitted text to the pool.
The pool is a dict first token -> recent continuations, bounded per key; it lives for one sequence.

Choices of this version (none affects losslessness): the window cells are verified too (a right guess
is accepted like any candidate); the window starts full of prompt tokens (fixed seed) and its n-grams
enter the pool from the first pass, with no level-by-level warm-up; the Jacobi outputs are the target's
argmax also when sampling, so the tree stays deterministic.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

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


def window_ngrams(window: Window, top: list[int | None]) -> list[tuple[int, ...] | None]:
    """Column c's n-gram (window[0][c], ..., window[L-1][c], top[c]); None where top[c] is unknown."""
    return [None if out is None else (*(level[c] for level in window), out) for c, out in enumerate(top)]


def jacobi_update(window: Window, top: list[int | None], shift: int, fill: list[int]) -> Window:
    """The window after the root moved `shift` >= 1 tokens on; top [W] = target argmax at the top level.

    new[l][c] = window[l + 1][c + shift - 1] and new[L-1][c] = top[c + shift - 1] (each cell keeps its
    absolute offset); cells whose source is gone (past the window, or a top output not computed) take
    tokens from `fill` in order (cycled).
    """
    levels, width = len(window), len(window[0])
    rows: list[Sequence[int | None]] = [*window[1:], top]
    spare = iter(fill * (levels * width // max(len(fill), 1) + 1))
    new = []
    for row in rows:
        out = []
        for c in range(width):
            src = c + shift - 1
            value = row[src] if src < width else None
            out.append(next(spare) if value is None else value)
        new.append(out)
    return new


def candidate_trie(conts: list[tuple[int, ...]], offset: int) -> tuple[list[int], list[int]]:
    """Continuations merged into a trie below the root: (tokens, parents) of its nodes, in insertion order.

    Parents index the whole tree: the root is 0 and the trie's first node gets index `offset`.
    """
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
    tokens: list[int] = []
    parents: list[int] = []
    at: list[list[int]] = []
    for level, row in enumerate(window):
        at.append([])
        for c, token in enumerate(row):
            if level == 0:
                parent = 0 if c == 0 else at[0][c - 1]
            else:
                parent = at[level - 1][c]
            at[level].append(offset + len(tokens))
            tokens.append(token)
            parents.append(parent)
    return tokens, parents, at


class LookaheadDrafter(RowDrafter):
    """Lookahead decoding: a `window` x (`ngram` - 1) Jacobi window and up to `candidates` pool n-grams.

    pool_size: continuations kept per first token. pool_from_prompt: seed the pool with the prompt's
    n-grams. seed: the fixed seed of the initial window guesses (drawn from the prompt). Children are
    deterministic (rule A under sampling); greedy output equals plain decoding.
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
        top_nodes = self._at[-1] if self._at else []
        present = [i for i in top_nodes if i < tree.size]  # a tree cut near the cache's end loses some
        best = logits[present].argmax(-1).tolist() if present else []
        found = dict(zip(present, best))
        self._top = [found.get(i) for i in top_nodes]
        for gram in window_ngrams(self.grid, self._top):
            if gram is not None:
                pool_add(self.pool, gram, self.pool_size)

    def accept(self, tokens: torch.Tensor, hidden: dict[int, torch.Tensor], next_root: int) -> None:
        before = len(self.tokens)
        self.tokens += [*tokens[1:].tolist(), next_root]  # tokens[0] is the root, already listed
        for gram in ngrams(self.tokens, self.ngram, start=before - self.ngram + 1):
            pool_add(self.pool, gram, self.pool_size)
        if self._top:
            fill = self.tokens[-self.window :][::-1]  # vacated cells: recent tokens, newest first
            self.grid = jacobi_update(self.grid, self._top, int(tokens.numel()), fill)
        self._top = []
