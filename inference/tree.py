"""Token trees for speculative decoding: structure, attention masks, position ids, paths.

A tree of N nodes is in topological order: `tokens` [N] and `parents` [N] (long), parents[0] = -1 and
0 <= parents[i] < i. Node 0 is the ROOT, the last emitted token, not yet in the target's cache. Structure
is computed with host loops (trees are small); masks and positions batched on the parents' device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spechead.heads.directory import tree_paths


@dataclass
class TokenTree:
    """A draft tree: `tokens` [N] long, `parents` [N] long (parents[0] = -1, parents[i] < i)."""

    tokens: torch.Tensor
    parents: torch.Tensor

    def __post_init__(self) -> None:
        for name, x in (("tokens", self.tokens), ("parents", self.parents)):
            if not isinstance(x, torch.Tensor) or x.dim() != 1 or x.numel() == 0:
                raise ValueError(f"{name} must be a non-empty 1-D tensor [N], got {getattr(x, 'shape', x)!r}")
            if x.dtype.is_floating_point or x.dtype == torch.bool:
                raise ValueError(f"{name} must be an integer tensor, got {x.dtype}")
        if self.tokens.shape != self.parents.shape:
            raise ValueError(
                f"tokens [N] and parents [N] must have the same length, got {self.tokens.numel()} "
                f"and {self.parents.numel()}"
            )
        par = self.parents.tolist()
        if par[0] != -1:
            raise ValueError(f"parents[0] must be -1 (node 0 is the root), got {par[0]}")
        for i, p in enumerate(par[1:], start=1):
            if not 0 <= p < i:
                raise ValueError(f"parents must be topological: need 0 <= parents[{i}] < {i}, got {p}")

    @property
    def size(self) -> int:
        """N, the number of nodes including the root."""
        return int(self.tokens.numel())


def children(parents: torch.Tensor) -> list[list[int]]:
    """For each node of a valid tree's parents [N] (`TokenTree`'s rules), its children in ascending order."""
    par = parents.tolist()
    kids: list[list[int]] = [[] for _ in par]
    for i, p in enumerate(par[1:], start=1):
        kids[p].append(i)
    return kids


def path_to_node(parents: torch.Tensor, node: int) -> list[int]:
    """Node indices from the root to `node` of a valid tree's parents [N], both included (e.g. [0, 2, 5])."""
    par = parents.tolist()
    if not 0 <= node < len(par):
        raise ValueError(f"node must be in [0, {len(par)}), got {node}")
    path = [node]
    while par[path[-1]] >= 0:
        path.append(par[path[-1]])
    return path[::-1]


@dataclass
class StaticTree:
    """A static tree shape: `parents` [N], `depth` [N] (root 0), `rank` [N] (root -1): node i >= 1 is the
    rank[i]-th candidate (0 = most likely) among the children of parents[i]."""

    parents: torch.Tensor
    depth: torch.Tensor
    rank: torch.Tensor

    @property
    def size(self) -> int:
        """N, the number of nodes including the root."""
        return int(self.parents.numel())


def tree_from_choices(choices: list[list[int]]) -> StaticTree:
    """A static tree from Medusa-style paths of child ranks, e.g. [[0], [1], [0, 0], [0, 1]]: the root,
    then the paths sorted by (length, ranks), so parents precede children (`tree_paths` checks them)."""
    paths = tree_paths(choices)
    index = {path: i for i, path in enumerate([(), *paths])}
    nodes = [(-1, 0, -1)] + [(index[p[:-1]], len(p), p[-1]) for p in paths]  # (parent, depth, rank) [N]
    return StaticTree(*torch.tensor(nodes, dtype=torch.long).T.contiguous())  # one field a row of [3, N]


def depth_first_order(parents: list[int], rank: list[int]) -> list[int]:
    """Node ids of a tree (parents [N], child ranks [N]) in depth-first order, each node's children
    by rank (0 first): the rank-0 chain from the root, the greedy main path, becomes nodes 0..d, so
    a pass that accepts along it commits a contiguous prefix (no cache entries move)."""
    kids = children(torch.tensor(parents))
    order, stack = [], [0]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(sorted(kids[node], key=lambda c: rank[c], reverse=True))  # rank 0 popped first
    return order


def depth_first(st: StaticTree) -> StaticTree:
    """The same tree with its nodes renumbered in `depth_first_order` (parents still precede children)."""
    order = depth_first_order(st.parents.tolist(), st.rank.tolist())
    place = {node: i for i, node in enumerate(order)}
    parents = [-1] + [place[int(st.parents[node])] for node in order[1:]]
    return StaticTree(torch.tensor(parents, dtype=torch.long), st.depth[order], st.rank[order])


def ancestors_on_device(parents: torch.Tensor) -> torch.Tensor:
    """Bool [B, N, N] from parents [B, N] (on any device): [b, i, j] iff j is i or an ancestor of i.

    Pointer jumping: ceil(log2 N) rounds of gathers, the same count for every tree of that size (no
    host round trip, nothing data-dependent). parents[b, 0] = -1; padded nodes may point anywhere < i.
    """
    batch, n = parents.shape
    idx = torch.arange(n, device=parents.device)
    anc = (idx[:, None] == idx[None, :]).expand(batch, n, n)  # [B, N, N] distance 0
    jump = parents.clamp(min=0)  # [B, N] the 2^k-th ancestor (clamped at the root)
    for _ in range(max(n - 1, 0).bit_length()):  # covers distances < 2^rounds >= N
        anc = anc | torch.gather(anc, 1, jump[:, :, None].expand(batch, n, n))
        jump = torch.gather(jump, 1, jump)
    return anc


def tree_inputs_on_device(
    parents: torch.Tensor, past_len: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Additive mask [B, 1, N, past_len + N], position ids [B, N] and ancestors [B, N, N] for parents [B, N].

    Built on parents' device: every node sees the prefix and, in the last N columns, its ancestors and
    itself (0 = attend, finfo(dtype).min = blocked: additive, as a bool or 0/1 mask would be silently
    wrong under eager attention); position = past_len + depth.
    """
    anc = ancestors_on_device(parents)  # [B, N, N]
    batch, n = parents.shape
    mask = torch.zeros(batch, 1, n, past_len + n, dtype=dtype, device=parents.device)
    mask[:, 0, :, past_len:].masked_fill_(~anc, torch.finfo(dtype).min)
    return mask, anc.sum(-1) - 1 + past_len, anc


def mask_after(
    lengths: torch.Tensor, own: torch.Tensor, columns: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Additive mask [B, 1, q, columns] and the block's slots [B, w]: row b's q queries see the slots
    before lengths[b] [B] and those of the block lengths[b] + 0..w-1 that own [B, q, w] names; every later
    slot is blocked (lengths[b] + w <= columns is the caller's to check, on the host)."""
    batch, q, width = own.shape
    slots = lengths[:, None] + torch.arange(width, device=own.device)  # [B, w]
    allowed = (torch.arange(columns, device=own.device)[None, :] < lengths[:, None])[:, None, :]
    allowed = allowed.expand(batch, q, columns).scatter(2, slots[:, None, :].expand(batch, q, width), own)
    mask = torch.zeros(batch, 1, q, columns, dtype=dtype, device=own.device)  # [B, 1, q, S]
    mask[:, 0].masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask, slots


def select_best(parents: list[int], scores: list[float], budget: int) -> list[int]:
    """The ids, ascending, of node 0 and the `budget` best nodes by scores [n] (ties: lower id) of a tree
    parents [n], closed under ancestors: a node is taken with its missing ancestors only if they all fit."""
    kept = {0}
    for node in sorted(range(1, len(parents)), key=lambda n: (-scores[n], n)):
        if len(kept) - 1 >= budget:
            break
        chain = []
        anc = node
        while anc not in kept:
            chain.append(anc)
            anc = parents[anc]
        if len(kept) - 1 + len(chain) <= budget:
            kept.update(chain)
    return sorted(kept)
