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
from typing import TYPE_CHECKING

import torch

from spechead.heads.eagle import EagleHead
from spechead.heads.eagle3 import Eagle3Head
from spechead.heads.medusa import MedusaHead
from spechead.heads.unroll import ttt_forward
from spechead.inference.target.runner import TargetRunner
from spechead.inference.tree import tree_from_choices

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def _accuracy_rows(accuracy: torch.Tensor) -> list[list[float]]:
    """Validate accuracy [depth, k] (finite, in [0, 1]) and return it as nested Python floats."""
    if not isinstance(accuracy, torch.Tensor) or accuracy.dim() != 2 or 0 in accuracy.shape:
        raise ValueError("accuracy must be a non-empty 2-D tensor [depth, k]")
    rows = accuracy.detach().double().cpu().tolist()
    if not all(math.isfinite(x) and 0.0 <= x <= 1.0 for row in rows for x in row):
        raise ValueError("accuracy entries must be probabilities in [0, 1]")
    return rows


def best_choices(accuracy: torch.Tensor, num_nodes: int) -> list[list[int]]:
    """The `num_nodes`-node tree (root not counted) maximising the expected accept length.

    Best-first on path probability: a path is never likelier than its prefix, so the `num_nodes` most
    likely paths form a prefix-closed tree, and no other tree of that size has a larger sum. Ties go to
    the shorter path, then the lexicographically smaller ranks (so prefixes always come first). Asking
    for more nodes than the table's depth and width allow gives the full tree. Paths come back sorted
    by (length, ranks), ready for `tree_from_choices`.
    """
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
    total = 1.0
    for path in choices:
        if len(path) > len(rows) or max(path) >= len(rows[0]):
            raise ValueError(
                f"path {list(path)} needs an accuracy table of at least [{len(path)}, {max(path) + 1}], "
                f"got {list(accuracy.shape)}"
            )
        total += math.prod(rows[d][r] for d, r in enumerate(path))
    return total


@torch.inference_mode()
def measure_topk_accuracy(
    model: PreTrainedModel,
    head: MedusaHead,
    sequences: list[torch.Tensor],
    topk: int,
    starts: Sequence[int] | None = None,
    chunk: int = 512,
    depth: int | None = None,
) -> torch.Tensor:
    """accuracy [num_heads, topk]: accuracy[k, r] = share of positions where head k's r-th candidate
    is the sequence's token t+2+k. (`depth` is not read: a Medusa head set drafts num_heads depths; it
    is there so every family's accuracy is measured with the same call, see heads/families.py.)

    Each sequence [T] is run once through the target (the runner's prefill, capturing the head's layer). Head k
    at position t sees the target state of token t and guesses token t+2+k, so position t counts for
    head k when t+2+k < T. To mirror greedy decoding the sequences must be the target's OWN greedy
    continuations of prompts: then token t+1 is the target's greedy token (the root a decoding step
    starts from) and token t+2+k is exactly what a drafted node at depth k+1 must equal. `starts[i]`
    = index of the first generated token of sequence i (its prompt length): only positions
    t >= starts[i] - 1 count, so prompt tokens never serve as references (default 0: all count).
    Counts are pooled over all sequences; `chunk` bounds the [chunk, V] logits held at a time.
    """
    num_heads, layer = head.num_heads, head.config.target_layers[0]
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    starts = [0] * len(sequences) if starts is None else list(starts)
    if len(starts) != len(sequences):
        raise ValueError(f"got {len(starts)} starts for {len(sequences)} sequences")
    dtype = next(head.parameters()).dtype
    hits = torch.zeros(num_heads, topk, dtype=torch.long)
    counts = torch.zeros(num_heads, dtype=torch.long)
    runner = TargetRunner(model, (layer,))
    for seq, start in zip(sequences, starts):
        seq = seq.reshape(-1).long().cpu()  # [T]
        first = max(start - 1, 0)  # first position t whose references are all generated
        if len(seq) - first < 3:
            continue  # not even head 0 has a reference
        state = runner.prefill([seq])[1][0][layer].to(dtype)  # [T, H]
        for k in range(num_heads):
            stop = len(seq) - 2 - k  # positions t in [first, stop) have token t+2+k
            for lo in range(first, stop, chunk):
                hi = min(lo + chunk, stop)
                logits = head.head_logits(k, state[None, lo:hi])[0]  # [n, V]
                cand = logits.topk(topk, dim=-1).indices.cpu()  # [n, topk]
                target = seq[lo + 2 + k : hi + 2 + k]  # [n]
                hits[k] += (cand == target[:, None]).sum(0)
                counts[k] += hi - lo
    if int(counts.min()) == 0:
        raise ValueError(
            f"sequences too short: head(s) {[k for k in range(num_heads) if counts[k] == 0]} have no "
            "position with a generated reference token; generate more tokens"
        )
    return hits.double().div(counts[:, None]).float()


@torch.inference_mode()
def measure_eagle_accuracy(
    model: PreTrainedModel,
    head: EagleHead | Eagle3Head,
    sequences: list[torch.Tensor],
    depth: int,
    topk: int,
    starts: Sequence[int] | None = None,
    chunk: int = 512,
) -> torch.Tensor:
    """accuracy [depth, topk] of an EAGLE head: accuracy[d, r] = share of depth-(d+1) draft steps whose
    r-th candidate is the sequence's next token, when the steps before it drafted the true tokens.

    Each sequence [T] (the target's own greedy continuation, as for `measure_topk_accuracy`) is run once
    through the target; the head is then unrolled `depth` steps over all positions at once on its own
    features (heads.unroll.ttt_forward, the attention a depth-d tree node has when decoding). Step j at
    position t continues the root context ending at t - j and guesses token t + 2; it counts when
    t - j >= starts[i] - 1 (references generated, not prompt) and t + 2 < T. Tokens outside an EAGLE-3
    draft vocab are misses. `chunk` bounds the logits rows held at a time.
    """
    if topk < 1 or depth < 1:
        raise ValueError(f"topk and depth must be >= 1, got topk={topk}, depth={depth}")
    starts = [0] * len(sequences) if starts is None else list(starts)
    if len(starts) != len(sequences):
        raise ValueError(f"got {len(starts)} starts for {len(sequences)} sequences")
    layers = tuple(head.config.target_layers)
    weight = head.fc.weight
    hits = torch.zeros(depth, topk, dtype=torch.long)
    counts = torch.zeros(depth, dtype=torch.long)
    runner = TargetRunner(model, layers)
    for seq, start in zip(sequences, starts):
        seq = seq.reshape(-1).long().cpu()  # [T]
        first = max(start - 1, 0)
        hidden = runner.prefill([seq])[1][0]  # {l: [T, H]}
        states = [hidden[layer].to(weight.device, weight.dtype)[None] for layer in layers]  # each [1, T, H]
        fused = head.features(states)  # [1, T, H] (EAGLE-3: fused)
        outputs = ttt_forward(head, fused, seq[None].to(weight.device), None, depth)  # depth x [1, T, H]
        for j, out in enumerate(outputs):
            for lo in range(first + j, len(seq) - 2, chunk):
                hi = min(lo + chunk, len(seq) - 2)  # positions t in [lo, hi) guess token t + 2
                cand = head.logits(out[:, lo:hi])[0].topk(topk, dim=-1).indices.cpu()  # [n, topk]
                ref = seq[lo + 2 : hi + 2]  # [n] target ids
                ref = head.target_to_draft(
                    ref.to(weight.device)
                ).cpu()  # EAGLE-3: -1 (never a hit) if outside
                hits[j] += (cand == ref[:, None]).sum(0)
                counts[j] += hi - lo
    if int(counts.min()) == 0:
        raise ValueError(f"sequences too short for depth {depth}: generate more tokens or lower --depth")
    return hits.double().div(counts[:, None]).float()


def interpolate_cost(cost_by_size: dict[int, float], size: int) -> float:
    """Verification time of a `size`-node tree from measured {size: time}, linear between points."""
    points = sorted((int(k), float(v)) for k, v in cost_by_size.items())
    if not points:
        raise ValueError("the cost profile has no measured tree sizes")
    (x0, y0), (x1, y1) = (points[0], points[1]) if len(points) > 1 else (points[0], points[0])
    for a, b in zip(points, points[1:]):
        (x0, y0), (x1, y1) = a, b
        if size <= b[0]:
            break
    if x1 == x0:
        return y0
    return y0 + (y1 - y0) * (size - x0) / (x1 - x0)  # beyond the last point: the last slope


def expected_speedup(
    accuracy: torch.Tensor,
    choices: Sequence[Sequence[int]],
    verify_ms_by_size: dict[int, float],
    step_ms: float,
    draft_ms: float = 0.0,
    draft_ms_per_depth: float = 0.0,
    pass_ms: float = 0.0,
) -> float:
    """Expected speedup of the static tree `choices` (N nodes, depth D) on measured hardware:
    expected_accept_length * step_ms / (verify(N + 1) + draft_ms + draft_ms_per_depth * D + pass_ms),
    verify() interpolated from `verify_ms_by_size` (tree sizes counting the root, as scripts/benchmark.py
    measures them). Medusa drafts every depth in one pass (draft_ms); an EAGLE head runs once per depth
    (draft_ms_per_depth); pass_ms is what every pass costs whatever the tree (the target's commit of the
    accepted path, an EAGLE head's accept step)."""
    cost = (
        interpolate_cost(verify_ms_by_size, len(choices) + 1)
        + draft_ms
        + draft_ms_per_depth * max(map(len, choices), default=0)
        + pass_ms
    )
    return expected_accept_length(accuracy, choices) * step_ms / cost


def ranked_choices_for_cost(
    accuracy: torch.Tensor,
    verify_ms_by_size: dict[int, float],
    step_ms: float,
    draft_ms: float = 0.0,
    max_nodes: int = 128,
    draft_ms_per_depth: float = 0.0,
    pass_ms: float = 0.0,
) -> list[tuple[list[list[int]], float]]:
    """The best tree of every size 1..max_nodes for `accuracy` with its `expected_speedup` on measured
    hardware, best first (equal speedups: the smaller tree first)."""
    ranked = []
    costs = (verify_ms_by_size, step_ms, draft_ms, draft_ms_per_depth, pass_ms)
    for n in range(1, max_nodes + 1):
        choices = best_choices(accuracy, n)
        if len(choices) < n:  # the accuracy table allows no bigger tree
            break
        ranked.append((choices, expected_speedup(accuracy, choices, *costs)))
    return sorted(ranked, key=lambda pair: -pair[1])  # stable: ties keep the smaller tree first
