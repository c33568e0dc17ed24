"""EAGLE-2 dynamic tree growth for one sequence, as tensors on the head's device.

Per depth the `top_k` frontier nodes of highest cumulative draft log-prob are expanded together (one
head call over all of them), each with its `top_k` best children; after the last depth the best
`total_tokens - 1` nodes are kept. The frontier, the scores and the ancestors' speculative slots stay
tensors: no host round trip inside the depth loop (B rows at once: rows.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def grow_dynamic(
    feature: Tensor,
    root: Tensor,
    sizes: tuple[int, int, int],
    step_fn: Callable[..., Tensor],
    top_fn: Callable[[Tensor, int], tuple[Tensor, Tensor]],
    to_target: Callable[[Tensor], Tensor],
) -> tuple[Tensor, Tensor, Tensor]:
    """The tree from the root's output feature [1, H] and token [1, 1]; sizes = (top_k, depth,
    total_tokens). step_fn(parent features [1, q, H], ids [1, q], allowed [q, S + q] bool, depth - 1) ->
    [1, q, H]; top_fn(features [1, q, H], k) -> log-probs, head ids [q, k]; to_target maps
    head ids to target ids. Returns tokens, parents, scores [N] (scores float64, root 0)."""
    k, depth, total_tokens = sizes
    device = feature.device
    values, ids = top_fn(feature[None], k)  # [1, k] each
    tokens = [root[0], to_target(ids[0])]  # node tokens, by depth
    parents = [torch.full((1,), -1, device=device), torch.zeros(k, dtype=torch.long, device=device)]
    scores = [torch.zeros(1, dtype=torch.float64, device=device), values[0].double()]
    count = 1 + k  # nodes so far; the depth-1 nodes are ids 1..k
    frontier = torch.arange(1, 1 + k, device=device)  # [k] node ids to expand next
    front_feat = feature.expand(k, -1)  # [k, H] features of their parents
    front_tok, front_score = tokens[1], scores[1]  # [k] each
    anc = torch.zeros(k, 0, dtype=torch.bool, device=device)  # [k, S] ancestors' speculative slots
    eye = torch.eye(k, dtype=torch.bool, device=device)
    for d in range(2, depth + 1):
        allowed = torch.cat([anc, eye], dim=1)  # [k, S + k]
        out = step_fn(front_feat[None], front_tok[None], allowed, d - 1)  # [1, k, H]
        values, ids = top_fn(out, k)  # [k, k] each
        new_score = (front_score[:, None] + values.double()).reshape(-1)  # [k * k]
        new_tok = to_target(ids).reshape(-1)  # [k * k]
        tokens.append(new_tok)
        parents.append(frontier.repeat_interleave(k))
        scores.append(new_score)
        if d < depth:  # the next frontier: best k new nodes (ties: lower id), in id order
            pick = torch.sort(-new_score, stable=True).indices[:k].sort().values  # [k]
            row = pick // k  # which expanded node each one hangs from
            anc = torch.cat([anc[row], eye[row]], dim=1)  # [k, S + k]
            frontier, front_feat = count + pick, out[0, row]
            front_tok, front_score = new_tok[pick], new_score[pick]
        count += k * k
    all_tokens, all_parents, all_scores = torch.cat(tokens), torch.cat(parents), torch.cat(scores)  # [M]
    budget = min(total_tokens - 1, count - 1)
    # Scores never grow along a path (log-probs <= 0) and ties go to the lower id (a parent), so the
    # best `budget` nodes are closed under ancestors: `tree.select_best` reduces to this sort.
    keep = torch.sort(-all_scores[1:], stable=True).indices[:budget].sort().values + 1
    keep = torch.cat([keep.new_zeros(1), keep])  # [N] ascending, root first
    index = torch.full((count,), -1, dtype=torch.long, device=device)
    index[keep] = torch.arange(keep.numel(), device=device)
    kept_parents = torch.where(all_parents[keep] >= 0, index[all_parents[keep].clamp(min=0)], -1)
    return all_tokens[keep], kept_parents, all_scores[keep]
