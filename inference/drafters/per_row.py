"""Drafters that are per row by nature (prompt lookup, lookahead, draft models, ...): what they implement
(`RowDrafter`, one row's timeline) and the adapter that puts them behind the engine's one interface
(`base.Drafter`): a per-row clone of the drafter each (own state, the SAME modules: weights shared, not
copied) making exactly the calls of a batch-1 run, so row b proposes its batch-1 trees and draws only
from its own generator; a batch of one uses the drafter itself. A `Drafter` (EAGLE, Medusa, P-EAGLE,
DFlash) needs none of this: `rows_drafter` hands it back as it is."""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
from torch import nn

from spechead.heads.grad import inference_mode
from spechead.inference.drafters.base import BatchDraft, Draft, Drafter, DrafterBase, path_states
from spechead.inference.sampling import SamplingParams
from spechead.inference.tree import TokenTree


class RowDrafter(DrafterBase, ABC):
    """What a drafter that is per row by nature implements (the engine runs it through `rows_drafter`):
    it proposes token trees for one row; keeps whatever state (caches) it needs consistent with what was
    accepted."""

    @abstractmethod
    def start(self, prompt: torch.Tensor, hidden: dict[int, torch.Tensor], root: int) -> None:
        """A new sequence: prompt ids [T] now in the target cache, target states {layer: [T, H]}, root."""

    @abstractmethod
    def propose(self, root: int, sampling: SamplingParams, generator: torch.Generator | None) -> Draft:
        """A tree rooted at `root` (the last emitted token)."""

    @abstractmethod
    def accept(self, tokens: torch.Tensor, hidden: dict[int, torch.Tensor], next_root: int) -> None:
        """tokens [K] (root + accepted drafts) joined the target cache with states {layer: [K, H]}."""

    def accept_path(
        self, tokens: list[int], hidden: dict[int, torch.Tensor], path: list[int], next_root: int
    ) -> None:
        """`accept` as the decoding loop calls it: the path's tokens [K] as a host list (root first), the
        target's states at EVERY node of the verified tree {layer: [1, N, H]} and the path's node indices
        [K] (ascending, 0 first). By default the path's rows are taken and `accept` is called; a drafter
        that reads them more cheaply another way overrides it. Either way what it learns is `accept`'s."""
        self.accept(torch.tensor(tokens), path_states(hidden, path), next_root)

    def verified(self, tree: TokenTree, logits: torch.Tensor) -> None:  # noqa: B027
        """Optional (default: nothing): the target's logits [N, V] at every node of `tree`, the tree as
        verified (the proposed one, or its first nodes when cut to fit a fixed cache). Called once per
        pass, before `accept`, only when decoding goes on; logits stay on the target's device."""


def hears_verified(drafter: Drafter | RowDrafter) -> bool:
    """Whether the decoding loop must call `drafter.verified` (it reads the verified tree's logits: its
    class overrides the hook of its interface, or the instance was given one); the loop skips the call
    and its [N, V] view for every other drafter."""
    hook = Drafter.verified if isinstance(drafter, Drafter) else RowDrafter.verified
    return type(drafter).verified is not hook or "verified" in getattr(drafter, "__dict__", {})


def rows_drafter(drafter: Drafter | RowDrafter) -> Drafter:
    """The drafter the engine runs: a `Drafter` as it is (any B; its `start` resets it), a `RowDrafter`
    behind per-row clones (`RowLoopDrafter`)."""
    return drafter if isinstance(drafter, Drafter) else RowLoopDrafter(drafter)


def clone_drafter(drafter: RowDrafter) -> RowDrafter:
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


class RowLoopDrafter(Drafter):
    """A `RowDrafter` behind the engine's `Drafter` interface: B per-row clones (a batch of one: the
    drafter itself)."""

    def __init__(self, drafter: RowDrafter) -> None:
        self.drafter = drafter
        self.rows: list[RowDrafter] = []
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
        """Each row's `RowDrafter.accept_path` with its states over the whole tree {layer: [1, N, H]}."""
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
