"""The static tree's per-depth plan: which nodes each depth expands, the speculative slots each sees, and
where every node's candidate sits among all depths' (checked by hand on a small tree)."""

from __future__ import annotations

import torch

from spechead.inference.drafters.eagle.static_plan import build_static_plan
from spechead.inference.tree import tree_from_choices

CHOICES = [[0], [1], [0, 0], [1, 0], [0, 0, 0]]  # nodes 1, 2 | 3 (under 1), 4 (under 2) | 5 (under 3)


def test_plan_of_a_small_tree():
    st = tree_from_choices(CHOICES)
    plan = build_static_plan(st, torch.device("cpu"))
    # emitted depth-first, rank 0 first: [0], [0, 0], [0, 0, 0] (the main path) are nodes 1..3
    assert plan.order.tolist() == [0, 1, 3, 5, 2, 4]
    assert plan.parents.tolist() == [-1, 0, 1, 2, 0, 4]
    d1, d2, d3 = plan.steps
    assert d1["expand"].tolist() == [0] and d1["need"] == 2 and d1["run"] is None
    assert d1["pick"].tolist() == [0, 1]  # nodes 1, 2: ranks 0 and 1 of the root's candidates
    assert d2["expand"].tolist() == [1, 2] and d2["nodes"].tolist() == [3, 4] and d2["need"] == 1
    assert d2["pick"].tolist() == [0, 1] and d2["run_parent"].tolist() == [0, 0]
    assert d2["run"].tolist() == [1, 2] and d3["run"].tolist() == [3]
    # every speculative query at once: nodes 1, 2 (depth 2's run: each sees itself) then node 3, at
    # positions C + 0, 0, 1, after slots 0, 1: it sees its parent 1's slot and its own
    assert plan.spec_allowed.tolist() == [[True, False, False], [False, True, False], [True, False, True]]
    assert plan.spec_offsets.tolist() == [0, 0, 1]
    # the expanded nodes, depth by depth, as emitted ids (where drawn children's q rows go): 0 | 1, 2 | 3
    assert plan.expanded.tolist() == [0, 1, 4, 2]


def test_plan_of_a_chain():
    plan = build_static_plan(tree_from_choices([[0], [0, 0], [0, 0, 0]]), torch.device("cpu"))
    assert plan.order.tolist() == [0, 1, 2, 3]  # a chain is its own depth-first order
    assert plan.spec_allowed.tolist() == [[True, False], [True, True]] and plan.spec_offsets.tolist() == [
        0,
        1,
    ]
