"""The per-depth plan of a static draft tree: which nodes each depth expands, their ranks, speculative-slot
masks and the order the tree is emitted in.

Built once per (tree, device) from a `StaticTree` with host loops; EAGLE drafting (eager rows and their
compiled graphs) reads it as tensors, so the depth loop does no host work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from spechead.inference.tree import StaticTree, depth_first, depth_first_order


@dataclass
class StaticPlan:
    """steps: one dict per depth d >= 1 over the tree's nodes in depth order (`StaticTree` ids: a depth's
    nodes are contiguous): depth, nodes [n_d], expand [E] (their parents), need (top-k width), pick [n_d]
    (each node's candidate in the depth's [E * need] block) and, for d >= 2, run [E], run_parent [E] and
    allowed [E, S + E] (bool: the ancestors' speculative slots and self).

    The tree a draft EMITS is depth-first (`tree.depth_first_order`: the greedy path is nodes 0..d, so
    accepting along it commits a contiguous prefix): order [N] (emitted node -> depth-order id), parents
    [N] (of the emitted tree). One mask a draft, not one a depth: spec_allowed [Q, Q] (the steps'
    `allowed` stacked, padded with False for later queries) and spec_offsets [Q] (query j at position
    C + its node's depth - 1), Q the speculative slots a draft writes. expanded [sum E]: the emitted ids
    of every depth's expanded nodes, depth by depth (where drawn children's q rows go)."""

    steps: list[dict]
    order: Tensor
    parents: Tensor
    spec_allowed: Tensor
    spec_offsets: Tensor
    expanded: Tensor  # [sum E] the emitted ids of every depth's expanded nodes, depth by depth


def build_static_plan(st: StaticTree, device: torch.device) -> StaticPlan:
    """The plan of static tree `st` with tensors on `device`; see `StaticPlan`."""
    parents, depth, rank = st.parents.tolist(), st.depth.tolist(), st.rank.tolist()
    slot: dict[int, int] = {}  # node -> speculative slot
    steps = []
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    first = {d: depth.index(d) for d in set(depth)}  # nodes of a depth are contiguous from here
    for d in range(1, max(depth) + 1):
        nodes = [i for i in range(st.size) if depth[i] == d]
        assert nodes == list(range(first[d], first[d] + len(nodes))), "static trees come depth by depth"
        expand = sorted({parents[i] for i in nodes})
        row = {p: r for r, p in enumerate(expand)}
        need = max(rank[i] for i in nodes) + 1
        step = {"depth": d, "nodes": as_long(nodes), "expand": as_long(expand), "run": None, "need": need,
                "pick": as_long([row[parents[i]] * need + rank[i] for i in nodes])}  # fmt: skip
        if d >= 2:  # the expanded nodes sit at depth d - 1 >= 1: run them now
            step.update(run=as_long(expand), run_parent=as_long([parents[i] for i in expand]),
                        allowed=_allowed(expand, parents, slot).to(device))  # fmt: skip
        steps.append(step)
    # emitted in depth-first order: a permutation of the final gather's indices, no op more per pass
    order = depth_first_order(parents, st.rank.tolist())  # [N] emitted node -> depth-order id
    emitted = depth_first(st).parents  # [N]
    ran = [step for step in steps if step["run"] is not None]
    spec = sum(len(step["run"]) for step in ran)  # Q
    blocks = [F.pad(step["allowed"], (0, spec - step["allowed"].shape[1])) for step in ran]
    spec_allowed = torch.cat(blocks) if ran else torch.zeros(0, 0, dtype=torch.bool, device=device)
    spec_offsets = as_long([step["depth"] - 2 for step in ran for _ in range(len(step["run"]))])  # [Q]
    where = {node: i for i, node in enumerate(order)}  # depth-order id -> emitted id
    expanded = as_long([where[node] for step in steps for node in step["expand"].tolist()])
    return StaticPlan(steps, as_long(order), emitted.to(device), spec_allowed, spec_offsets, expanded)


def _allowed(expand: list[int], parents: list[int], slot: dict[int, int]) -> Tensor:
    """Bool [E, S + E] for the E nodes `expand` run at one depth after S speculative slots: each sees its
    ancestors' slots and its own (new) one; records their slots in `slot`."""
    base = len(slot)
    allowed = torch.zeros(len(expand), base + len(expand), dtype=torch.bool)
    for r, node in enumerate(expand):
        allowed[r, base + r] = True
        anc = parents[node]
        while anc > 0:
            allowed[r, slot[anc]] = True
            anc = parents[anc]
    for r, node in enumerate(expand):
        slot[node] = base + r
    return allowed
