"""The one interface every drafter implements for SpeculativeGenerator.

Timeline of one sequence (batch 1): the prompt is prefilled into the target's cache; the target's
next token becomes the ROOT (emitted, not yet cached). Each step the drafter proposes a tree rooted at
the root; the target verifies all nodes in one pass; the accepted path (root + accepted drafts) is
kept in the target cache and `accept` tells the drafter which tokens became real, with the target's
hidden states at those positions, and the new root. Just before `accept`, the optional `verified` hook
hands over the target's logits at EVERY node of the tree it verified (lookahead decoding reads its Jacobi
guesses there); drafters that only need the accepted path ignore it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from spechead.inference.acceptance import RULES
from spechead.inference.sampling import SamplingParams
from spechead.inference.tree import TokenTree


@dataclass
class Draft:
    """A proposed tree and how its children were chosen (which lossless rule verifies it).

    tree: tokens [N], parents [N]; node 0 is the root. q: [N, V] draft distribution at each node that
    its children were sampled from (rules iid / without_replacement), None for deterministic children.
    """

    tree: TokenTree
    rule: str = "deterministic"
    q: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {self.rule!r}")
        if self.rule != "deterministic" and self.q is None:
            raise ValueError(f"rule {self.rule!r} needs the draft distribution q [N, V]")


class Drafter(ABC):
    """Proposes token trees; keeps whatever state (caches) it needs consistent with what was accepted."""

    #: HF hidden-state indices of the target the drafter reads (captured during prefill and verify).
    hidden_layers: tuple[int, ...] = ()
    #: Optional: the most nodes (root included) a proposed tree can have; the target runner reserves
    #: that much KV scratch after prompt + max_new_tokens (near a fixed cache's end trees are cut to fit).
    max_nodes: int = 64

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
        """Optional (default: nothing): the target's logits [N, V] at every node of `tree`, the tree as
        verified (the proposed one, or its first nodes when cut to fit a fixed cache). Called once per
        pass, before `accept`, only when decoding goes on; logits stay on the target's device."""

    def check_target(self, hidden_size: int, vocab_size: int, num_layers: int) -> None:  # noqa: B027
        """Raise ValueError when this drafter cannot serve a target of these sizes (default: any)."""

    def use_compile(self, compile: bool | str) -> None:  # noqa: B027
        """Run the drafter's own forwards under torch.compile (SpeculativeGenerator(compile=...) calls
        it; default: nothing to compile)."""


def chain(tokens: list[int], root: int) -> TokenTree:
    """A single-path tree: root -> tokens[0] -> tokens[1] -> ... ([N] = len(tokens) + 1)."""
    n = len(tokens) + 1
    return TokenTree(
        tokens=torch.tensor([root, *tokens], dtype=torch.long),
        parents=torch.arange(-1, n - 1, dtype=torch.long),
    )
