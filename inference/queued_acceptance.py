"""The acceptance of B verified trees computed on the device, its host form read later (one transfer).

The engine one draft ahead (engine/loop.py) queues the commits and the next
draft from the accepted paths before the host knows them, so the acceptance leaves each row's path on
the device with fixed shapes: its nodes ascending then the last one repeated [B, P], its length K [B]
and the next token [B]. The host form comes with ONE copy into pinned memory, read after an event
behind it (CUDA) or at once. The rules are the host's: greedy (`greedy_accept_batch`'s) or rule A over
deterministic children (`sample_accept_batch`'s, the same draws).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from spechead.inference.acceptance import Acceptance
from spechead.inference.device_sampling import rule_a_on_device
from spechead.inference.sampling import SamplingParams, inverse_cdf, torch_probs


class QueuedAcceptance:
    """Rows' accepted paths on the device: path [B, max(N, size)], k [B], next_token [B]; `result()`
    gives them on the host. Made by `greedy` or `sampled`."""

    def __init__(
        self, tokens: Tensor, on_path: Tensor, last: Tensor, next_token: Tensor, size: int, vocab: int
    ):
        """tokens [B, N] and the accepted nodes as a mask [B, N], the last of them [B] and the token after
        it [B] (V: no token could be drawn), all on the trees' device; size: the path's length at least."""
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
    def greedy(cls, tokens: Tensor, parents: Tensor, ancestors: Tensor, logits: Tensor, size: int):
        """The greedy rule (`greedy_accept_batch`'s) for tokens / parents [B, N], ancestors [B, N, N],
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
        size: int,
        sizes: Sequence[int] | None = None,
    ):
        """Rule A over deterministic children (`sample_accept_batch`'s, the same draws from each row's
        generator): the target's probs [B, N, V] at every node; sizes: each row's real nodes (None: N)."""
        nxt, on_path, last = rule_a_on_device(tokens, parents, ancestors, probs, generators, sizes)
        return cls(tokens, on_path, last, nxt, size, probs.shape[-1])

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
        batch = tokens.shape[0]
        on_path = torch.ones(batch, 1, dtype=torch.bool, device=tokens.device)
        return cls(tokens, on_path, nxt.new_zeros(batch), nxt, size, logits.shape[-1])

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
