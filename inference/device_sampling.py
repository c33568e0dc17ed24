"""Rule A (lossless sampling over deterministic children) for a batch of trees, on their device.

`acceptance.sample_accept` walks a tree node by node: on a GPU each child it tries reads a probability
and a coin back to the host (a wait for the device each), and each row it visits is a dozen small
kernels. Here the same rule is a fixed set of batched tensor ops over every node at once, with ONE host
transfer at the end (as `greedy_accept_batch` does for greedy decoding):

- child j of node i (siblings tried in index order) is accepted, when tried, with probability
  p_i(x_j) / (sum(p_i) - mass of the distinct tokens of its earlier siblings), and never when an earlier
  sibling holds its token (rejected: its residual mass is 0). That is the walk's r(x) / sum(r) after
  zeroing the rejected tokens;
- every node gets one coin up front; a node is tried only when its parent is accepted and every earlier
  sibling rejected, so coins of untried nodes are never read and the path is the walk's path;
- the next token is drawn from p at the path's last node with its children's tokens zeroed (every child
  rejected; none at a leaf: the bonus token).

The rows' probabilities must be the target's distribution (`sampling.target_probs`) at every node [N, V]:
on a GPU computing all N rows costs about what one does. Tested against `acceptance.walk` coin by coin.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from spechead.inference.acceptance import Acceptance
from spechead.inference.devices import host_to_device
from spechead.inference.sampling import inverse_cdf


def sample_accept_batch(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    ancestors: torch.Tensor,
    probs: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    sizes: Sequence[int] | None = None,
    coins: torch.Tensor | None = None,
) -> list[Acceptance]:
    """Rule A acceptance of B trees: tokens / parents [B, N], ancestors [B, N, N] (`ancestors_on_device`),
    the target's probs [B, N, V] at every node, one generator per row (on probs' device, or None).
    `sizes`: each row's real nodes (a padded batch: the rest are never accepted nor counted as children;
    None: all N). A row of size s draws its s - 1 coins from its generator, then its next token: a row
    decodes as it would alone. `coins` [B, N] replaces the drawn uniforms (tests). One host transfer."""
    n, vocab = probs.shape[1], probs.shape[2]
    nxt, path_mask, _ = rule_a_on_device(tokens, parents, ancestors, probs, generators, sizes, coins)
    packed = torch.cat([nxt[:, None], path_mask.long(), tokens], dim=1).tolist()  # the one host transfer
    out = []
    for row in packed:  # [next token, on path [N], tokens [N]]
        path = [i for i, x in enumerate(row[1 : n + 1]) if x]
        if row[0] >= vocab:
            raise ValueError("cannot sample the next token: the target's probs hold no positive finite mass")
        out.append(Acceptance(path, int(row[0]), [row[n + 1 + i] for i in path]))
    return out


def rule_a_on_device(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    ancestors: torch.Tensor,
    probs: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    sizes: Sequence[int] | None = None,
    coins: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`sample_accept_batch` (same arguments, the same draws) without the host transfer: each row's next
    token [B] (V when its probs hold no positive finite mass), its path as a mask over the nodes [B, N]
    and its last accepted node [B], all on the device."""
    batch, n, vocab = probs.shape
    device = probs.device
    sizes = [n] * batch if sizes is None else list(sizes)
    idx = torch.arange(n, device=device)
    is_real = idx[None, :] < host_to_device(torch.tensor(sizes), device)[:, None]  # [B, N]
    if coins is None:  # [B, N]: the root's and the padding's never read (1: never below a chance)
        coins = torch.ones(batch, n, device=device)
        for b, (size, g) in enumerate(zip(sizes, generators)):
            if size > 1:  # (no call for a lone root: its generator is left as a plain step leaves it)
                coins[b, 1:size] = torch.rand(size - 1, generator=g, device=device)
    ids = tokens.clamp(min=0)  # [B, N] (padding's -1 read as 0, then masked)
    up = parents.clamp(min=0)  # [B, N]
    # p at the parent for each node's token, and each parent's total mass: [B, N]
    flat = probs.reshape(batch, n * vocab)
    at_parent = torch.gather(flat, 1, up * vocab + ids)  # [B, N]
    total = torch.gather(probs.sum(-1), 1, up)  # [B, N]
    earlier = (parents[:, :, None] == parents[:, None, :]) & (idx[None, None, :] < idx[None, :, None])
    earlier &= is_real[:, None, :]  # [B, N, N]: [b, j, i] iff i is a real sibling tried before j
    same = earlier & (ids[:, :, None] == ids[:, None, :])  # [B, N, N]: an earlier sibling holds j's token
    repeat = same.any(-1)  # [B, N]: j's token was rejected before it (r(x) = 0)
    distinct = earlier & ~repeat[:, None, :]  # [B, N, N]: earlier siblings, each token counted once
    left = total - (distinct * at_parent[:, None, :]).sum(-1)  # [B, N] residual mass when j is tried
    chance = torch.where(left > 0, at_parent / left, at_parent)  # (left <= 0: rounding only)
    chance = torch.where(repeat | ~is_real, 0.0, chance)  # [B, N]
    passed = coins < chance  # [B, N]: accepted if tried
    first = passed & ~(earlier & passed[:, None, :]).any(-1)  # [B, N]: the first sibling that passes
    first[:, 0] = True  # (the root)
    on_path = ~(ancestors & ~first[:, None, :]).any(-1)  # [B, N]: every node from the root passed first
    last = torch.where(on_path, ancestors.sum(-1), 0).argmax(-1)  # [B] the deepest (one chain)
    rows = torch.arange(batch, device=device)
    kids = (parents == last[:, None]) & is_real  # [B, N]: the last node's children, all rejected
    hit = torch.zeros_like(probs[:, 0]).scatter_add_(1, ids, kids.to(probs.dtype)) > 0  # [B, V]
    end = probs[rows, last]  # [B, V]
    residual = end.masked_fill(hit, 0.0)  # [B, V]
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, end)  # (rounding only)
    nxt = torch.cat([inverse_cdf(residual[b], g) for b, g in enumerate(generators)])  # [B]
    return nxt, ancestors[rows, last], last  # [B], [B, N], [B]
