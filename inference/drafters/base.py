"""The one interface the decoding engine talks to: `Drafter`, over B rows (a batch of one is a batch).

A row's ROOT is the target's last token (emitted, not yet cached). Each pass the drafter proposes a tree
rooted at each row's root (`propose` -> `BatchDraft`), the target verifies every node in one pass and
keeps the accepted path (root + accepted drafts), and `accept_paths` tells the drafter which tokens
became real, with the target's states, and the next roots.

Heads implement `Drafter` (one head call over every row); a drafter that is per row by nature implements
`per_row.RowDrafter`. Either way row b's tree is the one its batch-1 run would propose (up to float
rounding), and a sampling drafter draws only from row b's own generator: every row keeps its batch-1
output. `DrafterBase` is what the generator reads of any drafter.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.utils.rnn import pad_sequence

from spechead.inference.acceptance import RULES
from spechead.inference.devices import host_to_device
from spechead.inference.sampling import SamplingParams
from spechead.inference.tree import TokenTree

if TYPE_CHECKING:  # (typing.Self from Python 3.11; torch installs typing_extensions)
    from typing_extensions import Self


@dataclass
class Draft:
    """A proposed tree (tokens [N], parents [N], node 0 the root) and the lossless rule that verifies it;
    q [N, V]: the draft distribution each node's children were drawn from (rules iid and
    without_replacement), None for deterministic children."""

    tree: TokenTree
    rule: str = "deterministic"
    q: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {self.rule!r}")
        if self.rule != "deterministic" and self.q is None:
            raise ValueError(f"rule {self.rule!r} needs the draft distribution q [N, V]")


class DrafterBase:
    """What the generator reads of any drafter, a `Drafter` or a per-row `RowDrafter`."""

    #: HF hidden-state indices of the target the drafter reads (captured during prefill and verify).
    hidden_layers: tuple[int, ...] = ()
    choices: list[list[int]] | None = None  # its static tree's rank paths (None: dynamic trees or none)
    #: the most nodes (root included) a proposed tree can have (the runner reserves that much KV scratch)
    max_nodes: int = 64
    #: whether `with_tree` swaps its tree (heads, whose trees are tuned per device and batch size)
    tunes_tree: bool = False
    #: how sampled decoding chooses its children (acceptance.RULES): only "deterministic" children (rule
    #: A) can be accepted on the device before the host reads them
    rule: str = "deterministic"

    def check_target(self, hidden_size: int, vocab_size: int, num_layers: int) -> None:
        """Raise ValueError when this drafter cannot serve a target of these sizes (default: its `head`'s
        check, a HeadError; no head: any)."""
        head = getattr(self, "head", None)
        if head is not None:
            head.check_target(hidden_size, vocab_size, num_layers)

    def with_tree(self, choices: list[list[int]]) -> Self:
        """The same drafter (weights shared, other options kept) with another static tree of rank paths
        (see `tree_from_choices`); only drafters that `tunes_tree` have one to swap."""
        raise NotImplementedError(f"{type(self).__name__} has no tree of ranks to swap")

    def use_compile(self, compile: bool | str) -> None:  # noqa: B027
        """Run the drafter's own forwards under torch.compile (default: nothing to compile)."""


def paths_states(states: dict[int, torch.Tensor], paths: torch.Tensor) -> dict[int, torch.Tensor]:
    """Each row's path rows of per-node states {layer: [B, N, H]}: paths [B, K] of node indices (host or
    device) -> {layer: [B, K, H]}, one gather a layer."""
    out = {}
    for layer, state in states.items():
        at = host_to_device(paths, state.device)[:, :, None].expand(-1, -1, state.shape[-1])  # [B, K, H]
        out[layer] = state.gather(1, at)
    return out


def head_states(head: Any, hidden: dict[int, torch.Tensor], layers: Sequence[int]) -> list[torch.Tensor]:
    """The states of `layers`, in order, from hidden {layer: [..., K, H]}, on the head's device in its dtype
    (a bf16 target may feed an fp32 head); a KeyError names the missing layers."""
    try:
        states = [hidden[layer] for layer in layers]
    except KeyError:
        missing = [layer for layer in layers if layer not in hidden]
        raise KeyError(f"hidden states of layers {missing} missing (drafter reads {tuple(layers)})") from None
    weight = head.fc.weight  # (`to` costs even as a no-op)
    return [
        x if (x.dtype, x.device) == (weight.dtype, weight.device) else x.to(weight.device, weight.dtype)
        for x in states
    ]


def next_ids_of(tokens: torch.Tensor, counts: torch.Tensor, roots: torch.Tensor) -> torch.Tensor:
    """Each committed position's next token: tokens [B, P] (root + accepted, padded), counts [B] and
    the next roots [B] -> [B, P] (tokens shifted by one, the root after row b's last real one)."""
    shifted = torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1)  # [B, P]
    last = (counts - 1).clamp(min=0)[:, None]  # [B, 1]
    return shifted.scatter(1, last, roots[:, None].to(shifted.dtype))


def padded_prompts(
    prompts: Sequence[torch.Tensor], hidden: Sequence[dict[int, torch.Tensor]], layers: Sequence[int]
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Prompts [T_b] and their states {layer: [T_b, H]} of `layers` as tokens [B, T] (on the host) and
    states {layer: [B, T, H]}, T the longest T_b, padded with zeros (a drafter's `start` of B rows)."""
    tokens = pad_sequence(list(prompts), batch_first=True).to("cpu", torch.long)
    return tokens, {layer: pad_sequence([h[layer] for h in hidden], batch_first=True) for layer in layers}


@dataclass
class BatchDraft:
    """Trees for B rows padded to one size N: tokens [B, N], parents [B, N], both on the host or both on
    the drafter's device. Row b's tree is its first sizes[b] nodes; the padding nodes after them are
    children of the root that no real node descends from (verified and ignored). rule and q [B, N, V]
    (zeros on padding) as `Draft`'s."""

    tokens: torch.Tensor
    parents: torch.Tensor
    sizes: list[int]
    rule: str = "deterministic"
    q: torch.Tensor | None = None

    @classmethod
    def of(cls, drafts: Sequence[Draft]) -> BatchDraft:
        """Stack per-row drafts (all with the same rule), padding each to the largest (a batch of one:
        views of its tensors, no copies)."""
        if len(drafts) == 1:
            tree, q = drafts[0].tree, drafts[0].q
            q = q[None] if q is not None else None
            return cls(tree.tokens[None], tree.parents[None], [tree.size], drafts[0].rule, q)
        n = max(d.tree.size for d in drafts)
        tokens = torch.stack(
            [torch.cat([d.tree.tokens, d.tree.tokens[:1].expand(n - d.tree.size)]) for d in drafts]
        )  # [B, N]: padded with the root
        parents = pad_sequence([d.tree.parents for d in drafts], batch_first=True)  # [B, N]: padded with 0
        q = None
        if drafts[0].q is not None:
            like = drafts[0].q  # [N_0, V]: made where the rows' q are (no round trip to the host)
            q = torch.zeros(len(drafts), n, like.shape[-1], dtype=like.dtype, device=like.device)
            for b, d in enumerate(drafts):
                assert d.q is not None  # every row's draft has the same rule
                q[b, : d.tree.size] = d.q[: d.tree.size]
        return cls(tokens, parents, [d.tree.size for d in drafts], drafts[0].rule, q)

    def cut(self, room: int) -> BatchDraft:
        """Only the first `room` nodes of every tree (near a fixed cache's end; lossless)."""
        if self.tokens.shape[1] <= room:
            return self
        q = self.q[:, :room] if self.q is not None else None
        return BatchDraft(self.tokens[:, :room], self.parents[:, :room], [min(s, room) for s in self.sizes],
                          self.rule, q)  # fmt: skip

    def tree(self, b: int) -> TokenTree:
        """Row b's tree (its real nodes only)."""
        n = self.sizes[b]
        return TokenTree(self.tokens[b, :n], self.parents[b, :n])

    def masked_tokens(self) -> torch.Tensor:
        """tokens [B, N] with -1 at the padding nodes (a greedy match never accepts them), where they are."""
        n = self.tokens.shape[1]
        if all(size == n for size in self.sizes):
            return self.tokens
        real = torch.arange(n)[None, :] < torch.tensor(self.sizes)[:, None]  # [B, N]
        return torch.where(host_to_device(real, self.tokens.device), self.tokens, -1)

    def rows(self, keep: Sequence[int]) -> BatchDraft:
        """Only rows `keep` (in this order)."""
        pick = host_to_device(torch.tensor(list(keep)), self.tokens.device)
        q = self.q[pick] if self.q is not None else None
        return BatchDraft(self.tokens[pick], self.parents[pick], [self.sizes[i] for i in keep], self.rule, q)

    @classmethod
    def plain(cls, roots: torch.Tensor) -> BatchDraft:
        """Plain decoding's trees: each row's root alone, roots [B, 1] (host or device)."""
        batch = roots.shape[0]
        return cls(roots, torch.full((batch, 1), -1, dtype=torch.long, device=roots.device), [1] * batch)


class Drafter(DrafterBase, ABC):
    """Drafts for B rows at once; rows are indexed 0..B-1 in the decoding loop's current order."""

    @abstractmethod
    def start(
        self, prompts: Sequence[torch.Tensor], hidden: Sequence[dict[int, torch.Tensor]], roots: Sequence[int]
    ) -> None:
        """New sequences: prompts [T_b] in the target cache, states {layer: [T_b, H]} per row, roots."""

    @abstractmethod
    def propose(
        self,
        roots: Sequence[int],
        sampling: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> BatchDraft:
        """Every row's tree rooted at roots[b], with row b's own sampling params and generator."""

    @abstractmethod
    def accept(
        self,
        tokens: torch.Tensor,
        lengths: Sequence[int],
        hidden: dict[int, torch.Tensor],
        next_roots: Sequence[int],
    ) -> None:
        """Row b's first lengths[b] of tokens [B, K] (root + accepted drafts; padded after) joined the
        target cache with states {layer: [B, K, H]} (same padding); next_roots [B]."""

    @abstractmethod
    def keep(self, rows: Sequence[int]) -> None:
        """Keep only these rows (in this order)."""

    def verified(self, draft: BatchDraft, logits: torch.Tensor) -> None:  # noqa: B027
        """Optional: the target's logits [B, N, V] at every node of `draft` as verified, before the next
        `accept` (lookahead reads its Jacobi guesses there)."""

    def accept_paths(
        self,
        tokens: Sequence[list[int]],
        hidden: dict[int, torch.Tensor],
        paths: Sequence[list[int]],
        next_roots: Sequence[int],
    ) -> None:
        """`accept` as the decoding loop calls it: row b's path tokens [K_b] (root first) and node indices
        [K_b] (ascending, 0 first) as host lists, the target's states at EVERY node of the verified trees
        {layer: [B, N, H]}. By default each row's path rows are gathered and `accept` is called."""
        k = max(len(p) for p in paths)
        index = torch.tensor([p + p[-1:] * (k - len(p)) for p in paths])  # [B, K] the last node repeated
        ids = torch.tensor([t + t[-1:] * (k - len(t)) for t in tokens])  # [B, K]
        self.accept(ids, [len(p) for p in paths], paths_states(hidden, index), next_roots)

    # ---- one draft ahead: the accepted paths still on the device (engine/loop.py) ----------------------

    def queues(self, batch: int) -> bool:
        """Whether, for `batch` rows, it accepts and drafts from device tensors (`accept_queued`,
        `propose_queued`, `settle`; greedy rows or rule A): when its own class defines `accept_queued`."""
        return "accept_queued" in vars(type(self))

    @property
    def commit_width(self) -> int:
        """The accepted path's length at least that `accept_queued` reads."""
        return 1

    def accept_queued(
        self, hidden: dict[int, torch.Tensor], tokens: torch.Tensor, paths: torch.Tensor, ks: torch.Tensor,
        nexts: torch.Tensor,
    ) -> None:  # fmt: skip
        """Queue the accept: the verified trees' states {layer: [B, N, H]} and tokens [B, N], paths
        [B, >= commit_width] (the accepted nodes ascending, the last repeated), K [B], next tokens [B]."""
        raise NotImplementedError

    def propose_queued(self, nexts: torch.Tensor) -> BatchDraft:
        """Queue every row's next tree from the next tokens [B] on the device."""
        raise NotImplementedError

    def settle(self, ks: Sequence[int]) -> None:  # noqa: B027
        """The host has read each row's K (default: nothing to follow)."""


def at_least(name: str, value: object, low: int = 1) -> None:
    """ValueError unless `value` is an int (not a bool) >= `low`."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def chain(tokens: list[int], root: int) -> TokenTree:
    """A single-path tree: root -> tokens[0] -> tokens[1] -> ... ([N] = len(tokens) + 1)."""
    return TokenTree(torch.tensor([root, *tokens], dtype=torch.long), torch.arange(-1, len(tokens)))
