"""Eager static-tree drafting into preallocated outputs (batch 1).

A static tree's shape never changes, so every depth's top-k ids, their target ids and the emitted
tokens have fixed places: `topk` writes each depth's ids into views of one kept buffer, one
`index_select` per depth maps them to target ids in place (EAGLE-3's reduced draft vocab), the next
depth's inputs are views of those, and the whole tree's tokens come out with ONE gather at the end.
On a CPU each op and each Python call costs: this runs about half the ops of concatenating per-depth
results, and no op at all to place the root (a fill of a kept slot).

The buffers are overwritten by the next draft: the returned tokens are a fresh tensor, and the kept
per-depth ids (for `last_scores`) are valid until the next `propose`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from spechead.inference.drafters.eagle.static_plan import StaticPlan


@dataclass
class DepthOutputs:
    """One depth's places: `topk` writes values / ids [1, E, need] (head-vocab ids); flat [E * need] is
    the same ids; mapped [E * need] and row [1, E * need] are their target ids, views of
    `StaticOutputs.targets` (the same memory as ids when the head drafts over the target's vocabulary)."""

    values: Tensor
    ids: Tensor
    flat: Tensor
    mapped: Tensor
    row: Tensor


@dataclass
class StaticOutputs:
    """targets [1 + M]: the root's id, then every depth's candidates' target ids (depth by depth);
    root [1]: its first slot; pick [N]: each emitted node's place in targets (root 0); depths: one
    `DepthOutputs` per depth d >= 1."""

    targets: Tensor
    root: Tensor
    pick: Tensor
    depths: list[DepthOutputs]


def build_static_outputs(plan: StaticPlan, dtype: torch.dtype, mapped: bool) -> StaticOutputs:
    """The buffers for `plan` on its device: values in `dtype` (the head's logits); mapped: the head's
    ids are not the target's (EAGLE-3 with a reduced vocab), so ids get a buffer of their own."""
    device = plan.pick.device
    sizes = [len(step["expand"]) * step["need"] for step in plan.steps]  # E * need per depth
    total = sum(sizes)
    targets = torch.zeros(1 + total, dtype=torch.long, device=device)  # [1 + M]
    head_ids = torch.zeros(total, dtype=torch.long, device=device) if mapped else targets[1:]  # [M]
    values = torch.zeros(total, dtype=dtype, device=device)  # [M]
    depths, offset = [], 0
    for step, size in zip(plan.steps, sizes):
        shape = (1, len(step["expand"]), step["need"])  # [1, E, need]
        block = slice(offset, offset + size)
        place = targets[1 + offset : 1 + offset + size]  # [E * need] their target ids
        depths.append(DepthOutputs(values[block].view(shape), head_ids[block].view(shape), head_ids[block],
                                   place, place[None]))  # fmt: skip
        offset += size
    pick = torch.cat([plan.pick.new_zeros(1), plan.pick + 1])  # [N]
    return StaticOutputs(targets, targets[:1], pick, depths)


def grow_static_eager(
    plan: StaticPlan,
    outs: StaticOutputs,
    feature: Tensor,
    root: int,
    d2t: Tensor | None,
    step_fn: Callable[..., Tensor],
    top_fn: Callable[..., tuple[Tensor, Tensor]],
) -> tuple[Tensor, list[Tensor]]:
    """Fill the static tree depth by depth from the root's feature [1, H]: one `step_fn(parent features
    [1, E, H], ids [1, E], additive block or None, depth - 1)` per depth with nodes to expand, one
    `top_fn(features, need, (values, ids))` per depth. d2t [Vd]: head id -> target id (None: the same).
    Returns the emitted tree's tokens [N] (a new tensor) and each depth's logits [1, E, Vd]."""
    outs.root.fill_(root)
    feats, run = feature[None], None  # [1, E, H] the outputs of a depth's expanded nodes, [1, E] their ids
    logits_by_depth = []
    for step, out in zip(plan.steps, outs.depths):
        if step["run"] is not None:  # the nodes to expand (depth d - 1 >= 1) run on the head
            allowed = None if step["sees_all"] else step["additive"]  # no mask: one node sees all
            parent_feats = feats if step["same_rows"] else feats[:, step["parent_rows"]]
            feats = step_fn(parent_feats, run, allowed, step["depth"] - 1)  # [1, E, H]
        logits_by_depth.append(top_fn(feats, step["need"], (out.values, out.ids))[0])
        if d2t is not None:  # this depth's candidates as target ids, in their places
            torch.index_select(d2t, 0, out.flat, out=out.mapped)
        if step["next_run"] is not None:  # the target ids of the nodes the next depth expands
            run = out.row if step["next_all"] else out.row[:, step["next_run"]]  # [1, E']
    return torch.index_select(outs.targets, 0, outs.pick), logits_by_depth  # (the mapping's op, not `[]`)
