"""Drafters that are per row by nature (prompt lookup, lookahead, draft models): `RowDrafter`, and
`RowLoopDrafter`, one clone per row (own state, the SAME modules) behind the engine's `Drafter`, making
exactly the calls of a batch-1 run."""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
from torch import nn

from spechead.heads.grad import inference_mode
from spechead.inference.drafters.base import BatchDraft, Draft, Drafter, DrafterBase
from spechead.inference.sampling import SamplingParams
from spechead.inference.tree import TokenTree


class RowDrafter(DrafterBase, ABC):
    """Token trees for one row; keeps its state (caches) consistent with what was accepted."""

    @abstractmethod
    def start(self, prompt: torch.Tensor, hidden: dict[int, torch.Tensor], root: int) -> None:
        """A new sequence: prompt ids [T] now in the target cache, target states {layer: [T, H]}, root."""

    @abstractmethod
    def propose(self, root: int, sampling: SamplingParams, generator: torch.Generator | None) -> Draft:
        """A tree rooted at `root` (the last emitted token)."""

    @abstractmethod
    def accept(self, tokens: torch.Tensor, hidden: dict[int, torch.Tensor], next_root: int) -> None:
        """tokens [K] (root + accepted drafts) joined the target cache with states {layer: [K, H]}."""

    def verified(self, tree: TokenTree, logits: torch.Tensor) -> None:  # noqa: B027
        """Optional: the target's logits [N, V] (on its device) at every node of `tree` as verified (its
        first nodes when cut to fit a fixed cache); once per pass, before `accept`, while decoding goes on."""


def rows_drafter(drafter: Drafter | RowDrafter) -> Drafter:
    """The drafter the engine runs: a `Drafter` as it is (its `start` resets it), else a `RowLoopDrafter`."""
    return drafter if isinstance(drafter, Drafter) else RowLoopDrafter(drafter)


def clone_drafter(drafter: RowDrafter) -> RowDrafter:
    """A per-row copy of `drafter`: its own state, the SAME modules (weights are shared, not copied)."""
    memo: dict[int, object] = {}

    def share(obj: object) -> None:
        if isinstance(obj, DrafterBase):  # and the drafters it holds (a cascade's tiny one)
            for value in vars(obj).values():
                share(value)
        elif isinstance(obj, nn.Module) and id(obj) not in memo:
            for module in obj.modules():
                memo[id(module)] = module
                for value in vars(module).values():  # modules attached outside _modules (target lm_head)
                    share(value)

    share(drafter)
    return copy.deepcopy(drafter, memo)


class RowLoopDrafter(Drafter):
    """A `RowDrafter` behind the engine's `Drafter` interface: B per-row clones (a batch of one: itself)."""

    def __init__(self, drafter: RowDrafter) -> None:
        self.drafter = drafter
        self.rows: list[RowDrafter] = []
        # only a drafter that reads the verified logits (its class's hook or its own) gets the [N, V] views
        self._hears = type(drafter).verified is not RowDrafter.verified or "verified" in vars(drafter)

    @inference_mode
    def start(
        self, prompts: Sequence[torch.Tensor], hidden: Sequence[dict[int, torch.Tensor]], roots: Sequence[int]
    ) -> None:
        self.rows = [self.drafter] if len(prompts) == 1 else [clone_drafter(self.drafter) for _ in prompts]
        for row, prompt, states, root in zip(self.rows, prompts, hidden, roots):
            row.start(prompt, states, root)

    @inference_mode
    def propose(
        self,
        roots: Sequence[int],
        sampling: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> BatchDraft:
        rows = zip(self.rows, roots, sampling, generators)
        return BatchDraft.of([row.propose(root, params, generator) for row, root, params, generator in rows])

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
    def keep(self, rows: Sequence[int]) -> None:
        self.rows = [self.rows[b] for b in rows]

    def verified(self, draft: BatchDraft, logits: torch.Tensor) -> None:
        if self._hears:
            for b, row in enumerate(self.rows):
                row.verified(draft.tree(b), logits[b, : draft.sizes[b]])  # [N_b, V]: its real nodes
