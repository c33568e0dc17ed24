"""A static tree of rank paths over a parallel drafter's block slots (P-EAGLE, DFlash; Medusa's rule).

One forward drafts a block: slot d (0-based) scores the token d + 1 steps after the root, and a node at
depth d >= 1 of child rank r carries slot d - 1's r-th best token (every branch at one depth shares that
slot's candidates). The default tree is the chain of each slot's best token (the papers' draft).
"""

from __future__ import annotations

import torch
from torch import Tensor

from spechead.inference.tree import depth_first, tree_from_choices


def chain_choices(slots: int) -> list[list[int]]:
    """The chain of every slot's best token: [[0], [0, 0], ...] ([slots] paths)."""
    return [[0] * (d + 1) for d in range(slots)]


class BlockTree:
    """A static tree over a block of `slots` slots: `static` (parents, depth, rank [N], depth-first: the
    rank-0 chain is nodes 0..d) and `pick` [N - 1], node i >= 1's index into the slots' top ids flattened
    [slots * width]."""

    def __init__(self, choices: list[list[int]] | None, slots: int) -> None:
        self.choices = [c for c in (choices or chain_choices(slots)) if len(c) <= slots]
        static = self.static = depth_first(tree_from_choices(self.choices))  # parents, depth, rank [N]
        self.parents, self.size = static.parents, static.size  # [N], N (the root included)
        self.depth = int(static.depth.max())  # the deepest node: accepted paths are <= depth + 1 tokens
        self.width = int(static.rank.max()) + 1 if static.size > 1 else 1  # candidates each slot gives
        self.slots = max(self.depth, 1)  # slots a draft reads (deeper ones are never used)
        self.pick = (static.depth[1:] - 1) * self.width + static.rank[1:]  # [N - 1] slot d - 1's rank-th best

    def tokens(self, roots: Tensor, top: Tensor) -> Tensor:
        """The tree's tokens [B, N] for roots [B] and each slot's best ids top [B, >= slots, >= width] (on
        `pick`'s device, see `batch_parents`): node 0 the root, node i carries top's flattened pick[i - 1]."""
        flat = top[:, : self.slots, : self.width].flatten(1)  # [B, slots * width]
        return torch.cat([roots.to(top.device)[:, None], flat.index_select(1, self.pick)], dim=1)

    def batch_parents(self, batch: int, device: torch.device) -> Tensor:
        """The parents [B, N] of B rows' trees (one [N] expanded) on `device`, where `pick` moves too (a
        compiled draft reads it there: moved before the call, not inside)."""
        if self.parents.device != device:
            self.parents, self.pick = self.parents.to(device), self.pick.to(device)
        return self.parents[None].expand(batch, -1)
