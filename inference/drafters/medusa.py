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
        self.hidden_layers = (head.config.target_layers[0],)
        self.last_hidden: torch.Tensor | None = None  # [H] target state of the last cached token

    def check_target(self, hidden_size: int, vocab_size: int, num_layers: int) -> None:
        self.head.check_target(hidden_size, vocab_size, num_layers)

    def start(self, prompt: torch.Tensor, hidden: dict[int, torch.Tensor], root: int) -> None:
        self.last_hidden = hidden[self.hidden_layers[0]][-1]

    @torch.no_grad()
    def propose(self, root: int, sampling: SamplingParams, generator: torch.Generator | None) -> Draft:
        depth, rank = self.static.depth, self.static.rank  # [N], [N]
        width = int(rank.max()) + 1 if len(rank) > 1 else 1
        state = self.last_hidden.to(next(self.head.parameters()).dtype)[None, None]  # [1, 1, H]
        logits = torch.stack(
            [self.head.head_logits(k, state)[0, 0] for k in range(self.head.num_heads)]
        )  # [K, V]
        candidates = logits.topk(width, dim=-1).indices.cpu()  # [K, width]; the tree lives on the CPU
        tokens = torch.full_like(depth, root)
        drafted = depth > 0
        tokens[drafted] = candidates[depth[drafted] - 1, rank[drafted]]
        return Draft(TokenTree(tokens=tokens.cpu(), parents=self.static.parents))

    def accept(self, tokens: torch.Tensor, hidden: dict[int, torch.Tensor], next_root: int) -> None:
        self.last_hidden = hidden[self.hidden_layers[0]][-1]
