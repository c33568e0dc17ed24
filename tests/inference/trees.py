"""Tree structure oracles for the tests: plain Python walks over a parents list [N], to check the batched
device builders (`tree.ancestors_on_device`, `tree_inputs_on_device`) and drafters' trees against."""

from __future__ import annotations

import torch


def depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth of each node: LongTensor [N] for parents [N], root depth 0."""
    par = parents.tolist()
    depth = [0] * len(par)
    for i, p in enumerate(par[1:], start=1):
        depth[i] = depth[p] + 1
    return torch.tensor(depth, dtype=torch.long, device=parents.device)


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """BoolTensor [N, N] for parents [N]: [i, j] is True iff j is i or an ancestor of i."""
    par = parents.tolist()
    mask = torch.zeros(len(par), len(par), dtype=torch.bool)
    for i, p in enumerate(par):
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    return mask.to(parents.device)
