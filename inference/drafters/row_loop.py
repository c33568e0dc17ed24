"""The default `BatchDrafter`: one clone of the drafter per row, called in a Python loop.

Each clone has its own state (caches, token history) and the SAME modules (weights are shared, not
copied), and makes exactly the calls of a batch-1 run, so row b proposes its batch-1 trees and draws
only from its own generator. Drafters that can batch their forwards override `Drafter.batched`.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from spechead.heads.grad import inference_mode
from spechead.inference.drafters.base import BatchDraft, BatchDrafter, Drafter
from spechead.inference.sampling import SamplingParams


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
    """B per-row clones of one drafter behind the `BatchDrafter` interface."""

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter
        self.rows: list[Drafter] = []

    @inference_mode
    def start(
        self, prompts: Sequence[torch.Tensor], hidden: Sequence[dict[int, torch.Tensor]], roots: Sequence[int]
    ) -> None:
        self.rows = [clone_drafter(self.drafter) for _ in prompts]
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
        return BatchDraft.of(drafts)

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
        for b, row in enumerate(self.rows):
            row.verified(draft.tree(b), logits[b, : draft.sizes[b]])  # [N_b, V]: its real nodes
