"""The per-depth plan of a static draft tree, built once per (tree, device) with host loops, so that EAGLE's
depth loop (eager rows and their graphs) reads only tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from spechead.inference.tree import StaticTree, depth_first, depth_first_order


@dataclass
class StaticPlan:
    """steps: one dict per depth d >= 1 (`StaticTree` ids: a depth's nodes are contiguous): nodes [n_d],
    expand [E] (their parents), need (top-k width), pick [n_d] (each node's candidate in the depth's
    [E * need] block) and, for d >= 2, run [E] / run_parent [E] (the expanded nodes run in a speculative
    slot each). The emitted tree is depth-first (`depth_first_order`): order [N] (emitted -> depth-order
    id), parents [N]. spec_allowed [Q, Q] (each speculative query sees its ancestors' slots and its own)
    and spec_offsets [Q] (position C + depth - 1) over the Q slots a draft writes, in run order."""

    steps: list[dict]
    order: Tensor
    parents: Tensor
    spec_allowed: Tensor
    spec_offsets: Tensor
    expanded: Tensor  # [sum E] the emitted ids of every depth's expanded nodes (drawn children's q rows)


def build_static_plan(st: StaticTree, device: torch.device) -> StaticPlan:
    """The plan of static tree `st` with tensors on `device`; see `StaticPlan`."""
    parents, depth, rank = st.parents.tolist(), st.depth.tolist(), st.rank.tolist()
    slot: dict[int, int] = {}  # node -> speculative slot (the order the nodes run in)
    offsets: list[int] = []  # each slot's position offset
    steps = []
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    for d in range(1, max(depth) + 1):
        nodes = [i for i in range(st.size) if depth[i] == d]
        expand = sorted({parents[i] for i in nodes})
        row = {p: r for r, p in enumerate(expand)}
        need = max(rank[i] for i in nodes) + 1
        step = {"nodes": as_long(nodes), "expand": as_long(expand), "run": None, "need": need,
                "pick": as_long([row[parents[i]] * need + rank[i] for i in nodes])}  # fmt: skip
        if d >= 2:  # the expanded nodes sit at depth d - 1 >= 1: run them now
            step.update(run=as_long(expand), run_parent=as_long([parents[i] for i in expand]))
            slot.update({node: len(slot) + r for r, node in enumerate(expand)})
            offsets += [d - 2] * len(expand)
        steps.append(step)
    spec_allowed = torch.zeros(len(slot), len(slot), dtype=torch.bool)  # [Q, Q]
    for node, query in slot.items():
        anc = node
        while anc > 0:  # itself, then its ancestors below the root (each ran in a slot before it)
            spec_allowed[query, slot[anc]] = True
            anc = parents[anc]
    # emitted in depth-first order: a permutation of the final gather's indices, no op more per pass
    order = depth_first_order(parents, rank)  # [N] emitted node -> depth-order id
    emitted = depth_first(st).parents  # [N]
    where = {node: i for i, node in enumerate(order)}  # depth-order id -> emitted id
    expanded = as_long([where[node] for step in steps for node in step["expand"].tolist()])
    return StaticPlan(
        steps, as_long(order), emitted.to(device), spec_allowed.to(device), as_long(offsets), expanded
    )
