"""Drafters that are per row by nature (prompt lookup, lookahead, draft models, ...) behind the one batched
interface: a per-row clone of the drafter each (own state, the SAME modules: weights shared, not copied)
making exactly the calls of a batch-1 run, so row b proposes its batch-1 trees and draws only from its
own generator; a batch of one uses the drafter itself. A drafter that is a `BatchDrafter` itself (EAGLE,
Medusa) needs none of this: `rows_drafter` hands it back as it is."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from spechead.heads.grad import inference_mode
from spechead.inference.drafters.base import BatchDraft, BatchDrafter, Draft, Drafter, hears_verified
from spechead.inference.sampling import SamplingParams


def rows_drafter(drafter: Drafter | BatchDrafter) -> BatchDrafter:
    """The batched drafter the engine runs: a `BatchDrafter` as it is (any B; its `start` resets it), a
    batch-1 drafter behind per-row clones (`RowLoopDrafter`)."""
    return drafter if isinstance(drafter, BatchDrafter) else RowLoopDrafter(drafter)


def clone_drafter(drafter: Drafter) -> Drafter:
    """A per-row copy of `drafter`: its own state, the SAME modules (weights are shared, not copied)."""
    memo: dict[int, object] = {}

    def share(obj: object) -> None:
        if isinstance(obj, nn.Module) and id(obj) not in memo:
            for module in obj.modules():
                memo[id(module)] = module
                for value in vars(module).values():  # modules attached outside _modules (target lm_head)
                    share(value)

    for value in vars(drafter).values():
        share(value)
    return copy.deepcopy(drafter, memo)


class RowLoopDrafter(BatchDrafter):
    """Drafters that are per row by nature behind the `BatchDrafter` interface: B per-row clones (a batch
    of one: the drafter itself)."""

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter
        self.rows: list[Drafter] = []
        self._hears = hears_verified(drafter)
        self._parents: tuple[torch.Tensor, torch.Tensor] | None = None  # a static tree's [N] and [1, N]

    @inference_mode
    def start(
        self, prompts: Sequence[torch.Tensor], hidden: Sequence[dict[int, torch.Tensor]], roots: Sequence[int]
    ) -> None:
        one = len(prompts) == 1
        self.rows = [self.drafter] if one else [clone_drafter(self.drafter) for _ in prompts]
        for row, prompt, states, root in zip(self.rows, prompts, hidden, roots):
            row.start(prompt, states, root)

    @inference_mode
    def propose(
        self,
        roots: Sequence[int],
        sampling: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> BatchDraft:
        drafts = [
            row.propose(root, params, generator)
            for row, root, params, generator in zip(self.rows, roots, sampling, generators)
        ]
        if len(drafts) == 1:
            return self._one(drafts[0])
        return BatchDraft.of(drafts)

    def _one(self, draft: Draft) -> BatchDraft:
        """A batch of one draft: views, no copies (a static tree's parents: the same [1, N] view each
        pass, which the target runner recognises without reading it)."""
        tree = draft.tree
        if self._parents is None or self._parents[0] is not tree.parents:
            self._parents = (tree.parents, tree.parents[None])
        q = draft.q[None] if draft.q is not None else None
        return BatchDraft(tree.tokens[None], self._parents[1], [tree.size], draft.rule, q)

    @inference_mode
    def accept(
        self,
        tokens: torch.Tensor,
        lengths: Sequence[int],
        hidden: dict[int, torch.Tensor],
        next_roots: Sequence[int],
    ) -> None:
        for b, (row, k) in enumerate(zip(self.rows, lengths)):
            row.accept(tokens[b, :k], {layer: h[b, :k] for layer, h in hidden.items()}, next_roots[b])

    @inference_mode
    def accept_paths(
        self,
        tokens: Sequence[list[int]],
        hidden: dict[int, torch.Tensor],
        paths: Sequence[list[int]],
        next_roots: Sequence[int],
    ) -> None:
        """Each row's `Drafter.accept_path` with its states over the whole tree {layer: [1, N, H]}."""
        for b, row in enumerate(self.rows):
            states = {layer: h[b : b + 1] for layer, h in hidden.items()} if len(self.rows) > 1 else hidden
            row.accept_path(tokens[b], states, paths[b], next_roots[b])

    @inference_mode
    def keep(self, rows: Sequence[int]) -> None:
        self.rows = [self.rows[b] for b in rows]

    def verified(self, draft: BatchDraft, logits: torch.Tensor) -> None:
        if self._hears:
            for b, row in enumerate(self.rows):
                row.verified(draft.tree(b), logits[b, : draft.sizes[b]])  # [N_b, V]: its real nodes
