"""Choose a static tree from measured head accuracies (the Medusa "optimal sparse tree"; EAGLE too).

accuracy [depth, k]: accuracy[d, r] = probability that head d's r-th candidate (0 = most likely) is the
token the target emits at that depth. A drafted node with child-rank path (r_1, ..., r_D) is assumed
accepted with probability prod_d accuracy[d - 1, r_d] (depths independent), so a tree of paths is
expected to emit 1 + sum of its nodes' probabilities tokens per target pass (the 1 is the target's own).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import torch

from spechead.inference.tree import tree_from_choices


def _accuracy_rows(accuracy: torch.Tensor) -> list[list[float]]:
    """Validate accuracy [depth, k] (finite, in [0, 1]) and return it as nested Python floats."""
    if not isinstance(accuracy, torch.Tensor) or accuracy.dim() != 2 or 0 in accuracy.shape:
        raise ValueError("accuracy must be a non-empty 2-D tensor [depth, k]")
    rows = accuracy.detach().double().cpu().tolist()
    if not all(math.isfinite(x) and 0.0 <= x <= 1.0 for row in rows for x in row):
        raise ValueError("accuracy entries must be probabilities in [0, 1]")
    return rows


def best_choices(accuracy: torch.Tensor, num_nodes: int) -> list[list[int]]:
    """The `num_nodes`-node tree (root not counted) maximising the expected accept length, paths sorted by
    (length, ranks); more nodes than the table allows give the full tree. Best-first on path probability:
    a path is never likelier than its prefix, so the most likely paths form a prefix-closed tree (ties: the
    shorter path, then the smaller ranks, so prefixes come first)."""
    rows = _accuracy_rows(accuracy)
    if num_nodes < 0:
        raise ValueError(f"num_nodes must be >= 0, got {num_nodes}")
    depth, width = len(rows), len(rows[0])
    # heap entries: (-probability, length, ranks); the frontier = children of the chosen paths
    frontier: list[tuple[float, int, tuple[int, ...]]] = [(-rows[0][r], 1, (r,)) for r in range(width)]
    heapq.heapify(frontier)
    chosen: list[tuple[int, ...]] = []
    while frontier and len(chosen) < num_nodes:
        neg_p, length, path = heapq.heappop(frontier)
        chosen.append(path)
        if length < depth:  # child probability = parent * accuracy <= parent: popped later
            for r in range(width):
                heapq.heappush(frontier, (neg_p * rows[length][r], length + 1, (*path, r)))
    return [list(p) for p in sorted(chosen, key=lambda p: (len(p), p))]


def expected_accept_length(accuracy: torch.Tensor, choices: Sequence[Sequence[int]]) -> float:
    """1 + sum over the tree's paths of prod_d accuracy[d, rank_d] (tokens emitted per target pass)."""
    rows = _accuracy_rows(accuracy)
    tree_from_choices([list(c) for c in choices])  # validates: prefix-closed, no duplicates
    if choices and not covers(accuracy, choices):
        need = [max(map(len, choices)), max(map(max, choices)) + 1]
        raise ValueError(f"the tree needs an accuracy table of at least {need}, got {list(accuracy.shape)}")
    return sum((math.prod(rows[d][r] for d, r in enumerate(path)) for path in choices), 1.0)


def covers(accuracy: torch.Tensor, choices: Sequence[Sequence[int]]) -> bool:
    """Whether the table [depth, k] has an entry for every node of the (non-empty) tree `choices`."""
    shape = accuracy.shape
    return bool(choices) and all(len(c) <= shape[0] and max(c) < shape[1] for c in choices)


def interpolate_cost(cost_by_size: dict[int, float], size: int) -> float:
    """Verification time of a `size`-node tree from measured {size: time}, linear between points."""
    points = sorted((int(k), float(v)) for k, v in cost_by_size.items())
    if not points:
        raise ValueError("the cost profile has no measured tree sizes")
    if len(points) == 1:
        return points[0][1]
    i = next((i for i in range(1, len(points) - 1) if size <= points[i][0]), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (size - x0) / (x1 - x0)  # beyond the last point: the last slope


def ranked_choices_for_cost(
    accuracy: torch.Tensor,
    verify_ms_by_size: dict[int, float],
    step_ms: float,
    draft_ms: float = 0.0,
    max_nodes: int = 128,
    draft_ms_per_depth: float = 0.0,
    pass_ms: float = 0.0,
) -> list[tuple[list[list[int]], float]]:
    """The best tree of every size 1..max_nodes with its expected speedup, best first (ties: the smaller
    tree first). A tree of N nodes and depth D is expected at expected_accept_length * step_ms /
    (verify(N + 1) + draft_ms + draft_ms_per_depth * D + pass_ms), verify() interpolated from
    `verify_ms_by_size` (sizes count the root); draft_ms: a one-pass draft (Medusa), draft_ms_per_depth:
    a head run per depth (EAGLE), pass_ms: what every pass costs whatever the tree (commit, accept)."""
    ranked = []
    for n in range(1, max_nodes + 1):
        choices = best_choices(accuracy, n)
        if len(choices) < n:  # the accuracy table allows no bigger tree
            break
        depth = max(map(len, choices))
        cost = interpolate_cost(verify_ms_by_size, n + 1) + draft_ms + draft_ms_per_depth * depth + pass_ms
        ranked.append((choices, expected_accept_length(accuracy, choices) * step_ms / cost))
    return sorted(ranked, key=lambda pair: -pair[1])  # stable: ties keep the smaller tree first
