"""Tree structure: children, ancestors, additive attention masks, positions, paths, static trees."""

from __future__ import annotations

import pytest
import torch

from spechead.inference.tree import (
    TokenTree,
    ancestors_on_device,
    children,
    depth_first,
    path_to_node,
    select_best,
    tree_from_choices,
    tree_inputs_on_device,
)

from .trees import ancestor_mask, depths


def retrieve_indices(parents: torch.Tensor) -> torch.Tensor:
    """Root-to-leaf paths (a test oracle): LongTensor [paths, max_depth + 1], one row per leaf (leaves in
    ascending node index), each row the path's node indices right-padded with -1. A root-only tree gives
    [[0]]."""
    par = parents.tolist()
    has_child = [False] * len(par)
    for p in par[1:]:
        has_child[p] = True
    rows = []
    for leaf in (i for i, c in enumerate(has_child) if not c):
        path = [leaf]
        while par[path[-1]] >= 0:
            path.append(par[path[-1]])
        rows.append(path[::-1])
    width = max(len(r) for r in rows)
    out = [r + [-1] * (width - len(r)) for r in rows]
    return torch.tensor(out, dtype=torch.long, device=parents.device)


#        0
#      /   \
#     1     2
#    / \     \
#   3   4     5
#   |
#   6
PARENTS = torch.tensor([-1, 0, 0, 1, 1, 2, 3])


def test_depths_children_paths():
    assert depths(PARENTS).tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert children(PARENTS) == [[1, 2], [3, 4], [5], [6], [], [], []]
    assert path_to_node(PARENTS, 6) == [0, 1, 3, 6]
    assert path_to_node(PARENTS, 0) == [0]
    with pytest.raises(ValueError, match="node"):
        path_to_node(PARENTS, 7)


def test_ancestors_on_device():
    m = ancestors_on_device(PARENTS[None])[0]  # [N, N]
    assert m.dtype == torch.bool and m.shape == (7, 7)
    expected = torch.zeros(7, 7, dtype=torch.bool)
    for i in range(7):
        expected[i, path_to_node(PARENTS, i)] = True
    assert torch.equal(m, expected) and torch.equal(ancestor_mask(PARENTS), expected)  # (the oracle too)
    assert m[6].nonzero().flatten().tolist() == [0, 1, 3, 6]
    assert not m[5, 1] and m[5, 2] and m[5, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tree_attention_mask_is_additive_with_prefix(dtype):
    past = 3
    mask, _, _ = tree_inputs_on_device(PARENTS[None], past, dtype)  # [1, 1, N, past + N]
    assert mask.shape == (1, 1, 7, past + 7) and mask.dtype == dtype
    assert (mask[0, 0, :, :past] == 0).all()  # every node sees the whole prefix
    blocked = mask[0, 0, :, past:] == torch.finfo(dtype).min  # [N, N]
    assert torch.equal(~blocked, ancestor_mask(PARENTS))
    assert set(mask.unique().tolist()) == {0.0, torch.finfo(dtype).min}


def test_position_ids():
    _, pos, _ = tree_inputs_on_device(PARENTS[None], 10, torch.float32)  # [1, N]
    assert pos.shape == (1, 7) and pos.dtype == torch.long
    assert pos.tolist() == [[10, 11, 11, 12, 12, 12, 13]]


def test_retrieve_indices():
    ri = retrieve_indices(PARENTS)  # [paths, max_depth + 1]
    # one row per leaf, leaves (4, 5, 6) in ascending node index
    assert ri.tolist() == [[0, 1, 4, -1], [0, 2, 5, -1], [0, 1, 3, 6]]
    assert retrieve_indices(torch.tensor([-1])).tolist() == [[0]]
    assert retrieve_indices(torch.tensor([-1, 0, 1, 2])).tolist() == [[0, 1, 2, 3]]


def test_tree_from_choices():
    st = tree_from_choices([[0, 1], [1], [0], [0, 0], [0, 0, 0], [2]])
    # sorted by (length, ranks): [0], [1], [2], [0,0], [0,1], [0,0,0]
    assert st.parents.tolist() == [-1, 0, 0, 0, 1, 1, 4]
    assert st.depth.tolist() == [0, 1, 1, 1, 2, 2, 3]
    assert st.rank.tolist() == [-1, 0, 1, 2, 0, 1, 0]
    assert st.size == 7
    assert torch.equal(st.depth, depths(st.parents))
    TokenTree(torch.zeros(7, dtype=torch.long), st.parents)  # valid


def test_depth_first_puts_the_rank_0_chain_first_and_keeps_every_path():
    choices = [[0, 1], [1], [0], [0, 0], [0, 0, 0], [2], [1, 0]]
    st = tree_from_choices(choices)
    dfs = depth_first(st)
    # [0], [0,0], [0,0,0] (the main path), [0,1], [1], [1,0], [2]
    assert dfs.parents.tolist() == [-1, 0, 1, 2, 1, 0, 5, 0]
    assert dfs.rank.tolist() == [-1, 0, 0, 0, 1, 1, 0, 2]
    assert torch.equal(dfs.depth, depths(dfs.parents))

    def paths(tree):  # each node's rank path from the root
        return sorted(
            tuple(int(tree.rank[n]) for n in path_to_node(tree.parents, i)[1:]) for i in range(tree.size)
        )

    assert paths(dfs) == paths(st) and len(paths(dfs)) == len(choices) + 1


@pytest.mark.parametrize(
    ("choices", "match"),
    [([[0, 0]], "parent path"), ([[0], [0]], "duplicate"), ([[]], "empty"), ([[-1]], ">= 0")],
)
def test_tree_from_choices_errors(choices, match):
    with pytest.raises(ValueError, match=match):
        tree_from_choices(choices)


@pytest.mark.parametrize(
    ("tokens", "parents", "match"),
    [
        (torch.tensor([1, 2]), torch.tensor([0, 0]), "root"),
        (torch.tensor([1, 2, 3]), torch.tensor([-1, 2, 0]), "topological"),
        (torch.tensor([1, 2]), torch.tensor([-1, 1]), "topological"),
        (torch.tensor([1, 2, 3]), torch.tensor([-1, 0]), "same length"),
        (torch.tensor([1.0, 2.0]), torch.tensor([-1, 0]), "integer"),
        (torch.tensor([1, 2]), torch.tensor([-1.0, 0.0]), "integer"),
        (torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long), "non-empty"),
        (torch.tensor([[1, 2]]), torch.tensor([[-1, 0]]), "1-D"),
    ],
)
def test_token_tree_validation(tokens, parents, match):
    with pytest.raises(ValueError, match=match):
        TokenTree(tokens, parents)


def test_token_tree_size():
    assert TokenTree(torch.tensor([5, 6, 7]), torch.tensor([-1, 0, 0])).size == 3


def test_select_best_closes_ancestors_within_budget() -> None:
    parents = [-1, 0, 1, 0, 3]
    scores = [0.0, -5.0, -1.0, -0.5, -0.2]  # node 2 beats its parent 1 (not a log-prob tree)
    assert select_best(parents, scores, 2) == [0, 3, 4]
    assert select_best(parents, scores, 3) == [0, 1, 3, 4]  # node 2 needs 1 too: does not fit
    assert select_best(parents, scores, 4) == [0, 1, 2, 3, 4]


def test_select_best_breaks_score_ties_by_the_lower_id() -> None:
    parents = [-1, 0, 0, 0, 2]
    scores = [0.0, -1.0, -1.0, -1.0, -1.0]  # every node tied
    assert select_best(parents, scores, 1) == [0, 1]
    assert select_best(parents, scores, 2) == [0, 1, 2]
    assert select_best(parents, scores, 3) == [0, 1, 2, 3]
