"""The per-depth plan of a static draft tree: which nodes each depth expands, their parents' rows, ranks,
speculative-slot masks and the indices that gather every node's token and score at the end.

Built once per (tree, device, dtype) from a `StaticTree` with host loops; EAGLE drafting (batch 1 and
batched) and its compiled graph read it as tensors, so the depth loop does no host work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from spechead.inference.tree import StaticTree, ancestors_on_device, depth_first, depth_first_order


@dataclass
class StaticPlan:
    """steps: one dict per depth d >= 1 with the tensors below, over the tree's nodes in depth order
    (`StaticTree` ids: a depth's nodes are contiguous). The tree a draft EMITS is in depth-first order
    (`tree.depth_first_order`: the greedy main path is nodes 0..d, so accepting along it commits a
    contiguous prefix); order [N]: emitted node -> depth-order id (on the device); pick [N - 1]: each
    emitted node's candidate among all depths' (concatenated); path_sum [N, N] float64 (ancestors incl.
    self, to sum log-probs along paths); parents [N] on the device and host_parents [N] on the CPU, both
    of the emitted tree.

    A step: depth, nodes [n_d] (contiguous ids), expand [E] (their parents), need (top-k width), pick
    [n_d] (each node's candidate in the depth's [E * need] block), run_local / parent_rows (the expanded
    nodes' places in the previous depth's block / expanded rows), next_run (this depth's candidates the
    next depth expands, or None) and, for d >= 2, run [E], run_parent [E], allowed [E, S + E] (bool: the
    ancestors' speculative slots and self) and additive (the same as a 0 / finfo.min mask).

    Flags that let eager drafting skip a gather or a mask (each op costs on a CPU): same_rows (parent_rows
    is every row of the previous depth's outputs, in order), next_all (next_run is every candidate, in
    order) and sees_all (d >= 2: ONE node runs and every speculative slot so far is its ancestor's, so it
    attends to everything in the cache: no mask).

    Every speculative query of a draft at once (batched eager drafting builds ONE mask a draft, not one
    a depth): spec_allowed [Q, Q] (bool: the steps' `allowed` stacked, each row padded with False for
    the slots of later queries) and spec_offsets [Q] (query j sits at position C + spec_offsets[j]: its
    node's depth - 1); Q = the speculative slots a draft writes (its expanded nodes below the root).
    expanded [sum E]: the emitted ids of the nodes every depth expands (the rows of each depth's head
    outputs, depth by depth: where drawn children's distributions go, sampled_children.py)."""

    steps: list[dict]
    order: Tensor
    pick: Tensor
    path_sum: Tensor
    parents: Tensor
    host_parents: Tensor
    spec_allowed: Tensor
    spec_offsets: Tensor
    expanded: Tensor  # [sum E] the emitted ids of every depth's expanded nodes, depth by depth


def build_static_plan(st: StaticTree, device: torch.device, dtype: torch.dtype) -> StaticPlan:
    """The plan of static tree `st` with tensors on `device` (masks in `dtype`); see `StaticPlan`."""
    parents, depth, rank = st.parents.tolist(), st.depth.tolist(), st.rank.tolist()
    slot: dict[int, int] = {}  # node -> speculative slot
    steps = []
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    first = {d: depth.index(d) for d in set(depth)}  # nodes of a depth are contiguous from here
    prev_expand: list[int] = [0]
    for d in range(1, max(depth) + 1):
        nodes = [i for i in range(st.size) if depth[i] == d]
        assert nodes == list(range(first[d], first[d] + len(nodes))), "static trees come depth by depth"
        expand = sorted({parents[i] for i in nodes})
        row = {p: r for r, p in enumerate(expand)}
        need = max(rank[i] for i in nodes) + 1
        prev_row = {p: r for r, p in enumerate(prev_expand)}
        rows = [prev_row[parents[p]] for p in expand] if d >= 2 else []
        step = {"depth": d, "nodes": as_long(nodes), "expand": as_long(expand), "run": None, "need": need,
                "pick": as_long([row[parents[i]] * need + rank[i] for i in nodes]),
                # the expanded nodes' places in the previous depth's block (its candidates' order)
                "run_local": as_long([p - first[d - 1] for p in expand]),
                "parent_rows": as_long(rows), "same_rows": rows == list(range(len(prev_expand)))}  # fmt: skip
        prev_expand = expand
        if d >= 2:  # the expanded nodes sit at depth d - 1 >= 1: run them now
            allowed = _allowed(expand, parents, slot)
            additive = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
            step.update(run=as_long(expand), run_parent=as_long([parents[i] for i in expand]),
                        allowed=allowed.to(device), additive=additive.to(device),
                        sees_all=len(expand) == 1 and bool(allowed.all()))  # fmt: skip
        steps.append(step)
    # the nodes each depth expands at the next, as candidates of that depth; every node's candidate
    # among all depths' (each depth's block of E * need after the earlier depths')
    offset, picks = 0, []
    for step, after in zip(steps, [*steps[1:], None]):
        step["next_run"] = None if after is None else step["pick"][after["run_local"]]
        candidates = len(step["expand"]) * step["need"]
        step["next_all"] = after is not None and step["next_run"].tolist() == list(range(candidates))
        picks.append(step["pick"] + offset)
        offset += candidates
    # emitted in depth-first order: a permutation of the final gather's indices, no op more per pass
    order = depth_first_order(parents, st.rank.tolist())  # [N] emitted node -> depth-order id
    emitted = depth_first(st).parents  # [N]
    pick = torch.cat(picks)[torch.tensor(order[1:], device=device) - 1]  # [N - 1]
    path_sum = ancestors_on_device(emitted[None])[0].to(device, torch.float64)  # [N, N]
    ran = [step for step in steps if step["run"] is not None]
    spec = sum(len(step["run"]) for step in ran)  # Q
    blocks = [F.pad(step["allowed"], (0, spec - step["allowed"].shape[1])) for step in ran]
    spec_allowed = torch.cat(blocks) if ran else torch.zeros(0, 0, dtype=torch.bool, device=device)
    spec_offsets = as_long([step["depth"] - 2 for step in ran for _ in range(len(step["run"]))])  # [Q]
    where = {node: i for i, node in enumerate(order)}  # depth-order id -> emitted id
    expanded = as_long([where[node] for step in steps for node in step["expand"].tolist()])
    return StaticPlan(
        steps,
        as_long(order),
        pick,
        path_sum,
        emitted.to(device),
        emitted,
        spec_allowed,
        spec_offsets,
        expanded,
    )


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


def static_scores(plan: StaticPlan, values_by_depth: list[Tensor]) -> Tensor:
    """Cumulative log-probs [N] (float64, root 0) of the emitted tree from each depth's candidates'
    log-probs [E, need]."""
    flat = torch.cat([v.reshape(-1) for v in values_by_depth])[plan.pick]  # [N - 1]
    return plan.path_sum @ F.pad(flat.double(), (1, 0))  # sums along the paths


def kept_scores(plan: StaticPlan, kept: list[tuple[Tensor, Tensor]]) -> Tensor:
    """`static_scores` from each depth's logits [1, E, Vd] and chosen ids [1, E * need] (eager drafting
    keeps those instead of log-probs)."""
    values = []
    for logits, ids in kept:
        logits = logits[0].float()  # [E, Vd]
        chosen = logits.gather(-1, ids.view(logits.shape[0], -1))  # [E, need]
        values.append(chosen - torch.logsumexp(logits, dim=-1, keepdim=True))
    return static_scores(plan, values)
