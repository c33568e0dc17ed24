"""A drafter over B rows driven as a batch of one, with the batch-1 calls the drafter tests make: each goes
through the drafter's batched API (start / propose / accept / accept_paths of one row), so what a test
checks of a batch of one is what decoding runs."""

from __future__ import annotations

import torch

from spechead.inference.drafters.base import Draft, Drafter
from spechead.inference.sampling import SamplingParams


class OneRow:
    """`drafter`'s batch of one: prompt [T], states {layer: [T, H]}, roots as ints, drafts as `Draft`."""

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter

    def start(self, prompt: torch.Tensor, hidden: dict[int, torch.Tensor], root: int) -> None:
        self.drafter.start([prompt], [hidden], [root])

    def propose(
        self, root: int, sampling: SamplingParams | None = None, generator: torch.Generator | None = None
    ) -> Draft:
        batch = self.drafter.propose([int(root)], [sampling or SamplingParams()], [generator])
        return Draft(batch.tree(0), batch.rule, batch.q[0] if batch.q is not None else None)

    def accept(self, tokens: torch.Tensor, hidden: dict[int, torch.Tensor], next_root: int) -> None:
        """tokens [K] (root + accepted drafts) with states {layer: [K, H]}."""
        states = {layer: h[None] for layer, h in hidden.items()}  # [1, K, H]
        self.drafter.accept(tokens[None], [tokens.numel()], states, [next_root])

    def accept_path(
        self, tokens: list[int], hidden: dict[int, torch.Tensor], path: list[int], next_root: int
    ) -> None:
        """The path's tokens [K], the states of every node {layer: [1, N, H]}, the path's nodes [K]."""
        self.drafter.accept_paths([tokens], hidden, [path], [next_root])
