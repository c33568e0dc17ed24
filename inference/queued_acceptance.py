"""Acceptance of B verified trees on their device: ONE result type (`QueuedAcceptance`) whose host form
comes with ONE transfer, read at once or after the loop queued the commits and the next draft from it.

The host's rules (acceptance.py) as batched tensor ops over every node, so a GPU never waits for the host
inside a walk. Greedy: a node is accepted iff every node on its root path equals the argmax at its
parent; the deepest wins (ties: lowest index). Rule A over deterministic children: child j of node i,
when tried, passes with probability p_i(x_j) / (sum(p_i) - the mass of its earlier siblings' distinct
tokens), never when an earlier sibling holds its token. Every node gets one coin up front, but a node is
tried only when its parent is accepted and every earlier sibling rejected, so untried coins are never
read and the path is the walk's (tested coin by coin). The next token is drawn from p at the path's last
node with its children's tokens zeroed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from spechead.inference.acceptance import Acceptance
from spechead.inference.devices import host_to_device
from spechead.inference.sampling import SamplingParams, inverse_cdf, torch_probs


class QueuedAcceptance:
    """Rows' accepted paths on the device in fixed shapes: path [B, max(N, size)] (its nodes ascending,
    then the last repeated), k [B], next_token [B]; `result()` reads them on the host (one copy into
    pinned memory behind an event)."""

    def __init__(
        self, tokens: Tensor, on_path: Tensor, last: Tensor, next_token: Tensor, size: int, vocab: int
    ):
        """tokens [B, N], the accepted nodes as a mask [B, N], the last of them [B] and the token after it
        [B] (V: none could be drawn), on the trees' device; size: the path's length at least."""
        batch, n = tokens.shape
        self.k = on_path.sum(-1)  # [B]
        self.next_token = next_token.clamp(max=vocab - 1)  # [B] (read as drawn: `result` refuses V)
        idx = torch.arange(n, device=tokens.device)
        order = torch.where(on_path, idx, n).sort(-1).values  # [B, N]: each path's nodes, then n
        if size > n:
            order = torch.cat([order, order.new_full((batch, size - n), n)], dim=1)
        self.path = torch.where(order < n, order, last[:, None])  # [B, max(N, size)]
        packed = torch.cat([next_token[:, None], on_path.long(), tokens], dim=1)  # [B, 1 + 2N]
        cuda = tokens.device.type == "cuda"
        self._host = torch.empty(packed.shape, dtype=torch.long, pin_memory=cuda)
        self._host.copy_(packed, non_blocking=cuda)
        self._event = torch.cuda.Event() if cuda else None
        if self._event is not None:
            self._event.record()
        self._n, self._vocab = n, vocab

    @classmethod
    def greedy(cls, tokens: Tensor, parents: Tensor, ancestors: Tensor, logits: Tensor, size: int = 0):
        """The greedy rule for tokens / parents [B, N], ancestors [B, N, N] (`tree.ancestors_on_device`),
        logits [B, N, V] of verified trees (padding nodes: token -1, never accepted)."""
        best = logits.argmax(-1)  # [B, N] the target's token after each node
        match = tokens == best.gather(1, parents.clamp(min=0))  # [B, N]: each node is its parent's argmax
        match[:, 0] = True
        ok = ~(ancestors & ~match[:, None, :]).any(-1)  # [B, N]: the whole root path matches
        deepest = torch.where(ok, ancestors.sum(-1), 0).argmax(-1)  # [B] first among the deepest
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        return cls(tokens, ancestors[rows, deepest], deepest, best[rows, deepest], size, logits.shape[-1])

    @classmethod
    def sampled(
        cls,
        tokens: Tensor,
        parents: Tensor,
        ancestors: Tensor,
        probs: Tensor,
        generators: Sequence[torch.Generator | None],
        size: int = 0,
        sizes: Sequence[int] | None = None,
        coins: Tensor | None = None,
    ):
        """Rule A over deterministic children: the target's probs [B, N, V] at every node, one generator
        per row (on probs' device, or None); sizes: each row's real nodes (None: N). A row of size s draws
        s - 1 coins, then its next token, as it would alone. `coins` [B, N]: given uniforms (tests)."""
        batch, n, vocab = probs.shape
        device = probs.device
        sizes = [n] * batch if sizes is None else list(sizes)
        idx = torch.arange(n, device=device)
        is_real = idx[None, :] < host_to_device(torch.tensor(sizes), device)[:, None]  # [B, N]
        if coins is None:  # [B, N]: the root's and the padding's never read (1: never below a chance)
            coins = torch.ones(batch, n, device=device)
            for b, (real, g) in enumerate(zip(sizes, generators)):
                if real > 1:  # (no call for a lone root: its generator is left as a plain step leaves it)
                    coins[b, 1:real] = torch.rand(real - 1, generator=g, device=device)
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
        return cls(tokens, ancestors[rows, last], last, nxt, size, vocab)

    @classmethod
    def plain(
        cls,
        tokens: Tensor,
        logits: Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        size: int,
    ):
        """Plain steps (one-node trees tokens [B, 1]): each row's own next token of logits [B, V], the
        argmax or one draw of `torch_probs` with its generator (`pick`'s draw: one uniform a step)."""
        if all(p.is_greedy for p in params):
            nxt = logits.argmax(-1)  # [B]
        else:
            nxt = torch.cat([
                row.argmax(-1, keepdim=True) if p.is_greedy else inverse_cdf(torch_probs(row, p), g)
                for row, p, g in zip(logits, params, generators)
            ])  # fmt: skip
        on_path = torch.ones_like(tokens, dtype=torch.bool)  # [B, 1]
        return cls(tokens, on_path, torch.zeros_like(nxt), nxt, size, logits.shape[-1])

    def result(self) -> list[Acceptance]:
        """Each row's acceptance on the host (waits for its transfer only)."""
        if self._event is not None:
            self._event.synchronize()
        out, n = [], self._n
        for row in self._host.tolist():
            if row[0] >= self._vocab:
                raise ValueError(
                    "cannot sample the next token: the target's probs hold no positive finite mass"
                )
            path = [i for i, x in enumerate(row[1 : n + 1]) if x]
            out.append(Acceptance(path, int(row[0]), [row[n + 1 + i] for i in path]))
        return out
