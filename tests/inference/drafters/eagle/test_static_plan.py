"""The static tree's per-depth plan: which nodes each depth expands, the speculative slots each sees, and
where every node's candidate sits among all depths' (checked by hand on a small tree)."""

from __future__ import annotations

import torch

from spechead.inference.drafters.eagle.static_plan import build_static_plan
from spechead.inference.tree import ancestor_mask, tree_from_choices

CHOICES = [[0], [1], [0, 0], [1, 0], [0, 0, 0]]  # nodes 1, 2 | 3 (under 1), 4 (under 2) | 5 (under 3)


def test_plan_of_a_small_tree():
    st = tree_from_choices(CHOICES)
    plan = build_static_plan(st, torch.device("cpu"), torch.float32)
    # emitted depth-first, rank 0 first: [0], [0, 0], [0, 0, 0] (the main path) are nodes 1..3
    assert plan.order.tolist() == [0, 1, 3, 5, 2, 4]
    assert plan.parents.tolist() == plan.host_parents.tolist() == [-1, 0, 1, 2, 0, 4]
    assert torch.equal(plan.path_sum, ancestor_mask(plan.parents).double())
    d1, d2, d3 = plan.steps
    assert d1["expand"].tolist() == [0] and d1["need"] == 2 and d1["run"] is None
    assert d2["expand"].tolist() == [1, 2] and d2["nodes"].tolist() == [3, 4] and d2["need"] == 1
    assert d2["run"].tolist() == [1, 2] and torch.equal(d2["allowed"], torch.eye(2, dtype=torch.bool))
    # node 3 runs at depth 3 after slots 0, 1 (nodes 1, 2): it sees its parent 1's slot and its own
    assert d3["run"].tolist() == [3] and d3["allowed"].tolist() == [[True, False, True]]
    blocked = torch.finfo(torch.float32).min
    assert d3["additive"].tolist() == [[0.0, blocked, 0.0]]
    assert d1["next_run"].tolist() == [0, 1] and d2["next_run"].tolist() == [0] and d3["next_run"] is None
    # candidates of all depths concatenated: depth 1 [1 x 2], depth 2 [2 x 1], depth 3 [1 x 1]; in
    # depth order they would be 0..4, each emitted node takes its depth-order node's
    assert plan.pick.tolist() == [0, 2, 4, 1, 3]
    # the flags that let eager drafting skip a gather or a mask: none applies below depth 1 here
    assert not d2["sees_all"] and not d3["sees_all"]  # two nodes at once; node 3 must not see slot 1
    assert not d2["same_rows"] and not d3["same_rows"]  # depth 2 reads row 0 twice, depth 3 one of two
    assert d1["next_all"] and not d2["next_all"]


def test_plan_of_a_chain_skips_every_gather_and_mask():
    plan = build_static_plan(tree_from_choices([[0], [0, 0], [0, 0, 0]]), torch.device("cpu"), torch.float32)
    d1, d2, d3 = plan.steps
    assert d2["sees_all"] and d3["sees_all"] and d2["same_rows"] and d3["same_rows"]
    assert d1["next_all"] and d2["next_all"]
    assert plan.order.tolist() == [0, 1, 2, 3]  # a chain is its own depth-first order
