"""Medusa drafting: every head's top-k at the last committed position fills a static tree.

Head k at position t predicts token t+2+k; the root (token t+1) comes from the target itself, so a
node at depth d (root = 0) with child rank r carries head (d-1)'s r-th best token. All branches at one
depth share that head's candidates, as in the reference design.
"""

from __future__ import annotations

import torch

from spechead.heads.medusa import MedusaHead
from spechead.inference.drafters.base import Draft, Drafter
from spechead.inference.sampling import SamplingParams
from spechead.inference.tree import TokenTree, tree_from_choices

# A 24-node default (plus the root): wide near the root, a long greedy spine for easy text.
DEFAULT_MEDUSA_CHOICES: list[list[int]] = [
    [0], [1], [2], [3],
    [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0],
    [0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0], [0, 0, 2],
    [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0], [0, 1, 0, 0],
    [0, 0, 0, 0, 0], [0, 0, 0, 0, 1],
    [0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 0],
]  # fmt: skip


class MedusaDrafter(Drafter):
    """Static-tree drafting with Medusa heads (children deterministic: lossless rule A when sampling)."""

    def __init__(self, head: MedusaHead, choices: list[list[int]] | None = None):
        self.head = head.eval()
        depth_limit = head.config.num_heads
        choices = [c for c in (choices or DEFAULT_MEDUSA_CHOICES) if len(c) <= depth_limit]
        self.static = tree_from_choices(choices)  # parents [N], depth [N], rank [N]
        # Precomputed once: which heads run, how many candidates each gives, where they go.
        depth, rank = self.static.depth, self.static.rank  # [N], [N]
        self._drafted = torch.nonzero(depth > 0)[:, 0]  # [N - 1] node indices
        self._head_of = depth[self._drafted] - 1  # [N - 1] which head fills each node
        self._rank_of = rank[self._drafted]  # [N - 1] which of its candidates
        self._width = int(rank.max()) + 1 if len(rank) > 1 else 1
        self._used_heads = int(depth.max())  # heads deeper than the tree never run
        self.hidden_layers = (head.config.target_layers[0],)
        self.last_hidden: torch.Tensor | None = None  # [H] target state of the last cached token

    def check_target(self, hidden_size: int, vocab_size: int, num_layers: int) -> None:
        self.head.check_target(hidden_size, vocab_size, num_layers)

    def start(self, prompt: torch.Tensor, hidden: dict[int, torch.Tensor], root: int) -> None:
        self.last_hidden = hidden[self.hidden_layers[0]][-1]

    @torch.no_grad()
    def propose(self, root: int, sampling: SamplingParams, generator: torch.Generator | None) -> Draft:
        state = self.last_hidden.to(next(self.head.parameters()).dtype)[None, None]  # [1, 1, H]
        logits = [self.head.head_logits(k, state)[0, 0] for k in range(self._used_heads)]  # K x [V]
        tokens = torch.full((self.static.size,), int(root), dtype=torch.long)  # [N]
        if logits:
            candidates = torch.stack(logits).topk(self._width, dim=-1).indices.cpu()  # [K, width]
            tokens[self._drafted] = candidates[self._head_of, self._rank_of]  # the tree lives on the CPU
        return Draft(TokenTree(tokens=tokens, parents=self.static.parents))

    def accept(self, tokens: torch.Tensor, hidden: dict[int, torch.Tensor], next_root: int) -> None:
        self.last_hidden = hidden[self.hidden_layers[0]][-1]
