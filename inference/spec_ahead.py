"""Speculative decoding (greedy, or sampled by rule A) with the next draft queued before the host reads
the acceptance.

The speculative pass waits for the device once: the host reads which path was accepted. In the plain
loop that read comes before the commits and the next draft are launched, so the host's work after it
(the bookkeeping of the tokens, the launches) leaves the device idle. Here everything after the verify
stays on the device until the next draft is queued: the acceptance (greedy, as `greedy_accept_batch`;
sampled, rule A as `sample_accept_batch` computes it, the same draws) gives the accepted path as device
tensors (its nodes [N], the last repeated; its length K; the next token), the target's commit of that
path and the drafter's accept are queued from them (`TargetRunner.commit_queued`, drafters/ahead.py), then
the whole next draft; only then does the host wait for the acceptance's one transfer (pinned memory, an
event behind the copy), and its own work overlaps the draft. A stop (EOS, max_new_tokens) is seen after
that draft was queued: its work is dropped. For compiled EAGLE drafters and Medusa heads (top-k
children, drafters/ahead.py) on a compiled, preallocated target; batch 1; the default on CUDA.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from spechead.inference.acceptance import Acceptance
from spechead.inference.device_sampling import rule_a_on_device
from spechead.inference.drafters.ahead import Ahead
from spechead.inference.phase_clock import PhaseClock
from spechead.inference.sampling import SamplingParams, torch_probs
from spechead.inference.stops import until_stop
from spechead.inference.tree import TokenTree

if TYPE_CHECKING:
    from spechead.inference.runner import TargetRunner
    from spechead.inference.stats import GenerationStats


class QueuedAcceptance:
    """The acceptance of one tree, computed on the device: the path's nodes [size] (ascending, then the
    last repeated), its length K [0-d] and the next token [0-d] stay there for the queued commits; its
    host form comes with ONE transfer into pinned memory, read after an event (CUDA) or at once.
    Made by `greedy` or `sampled`."""

    def __init__(
        self, tokens: Tensor, on_path: Tensor, last: Tensor, next_token: Tensor, size: int, vocab: int
    ):
        """tokens [N] and the accepted nodes as a mask [N], the last of them [0-d] and the token after it
        [0-d] (V: no token could be drawn), all on the tree's device; size: the path's length at least."""
        n = tokens.shape[0]
        self.k = on_path.sum()  # [0-d]
        self.next_token = next_token.clamp(max=vocab - 1)  # (read as drawn: `result` refuses V)
        idx = torch.arange(n, device=tokens.device)
        order = torch.where(on_path, idx, n).sort().values  # [N]: the path's nodes, then n
        if size > n:
            order = torch.cat([order, order.new_full((size - n,), n)])
        self.path = torch.where(order < n, order, last)  # [max(N, size)]
        packed = torch.cat([next_token.view(1), on_path.long(), tokens])  # [1 + 2N]
        cuda = tokens.device.type == "cuda"
        self._host = torch.empty(packed.shape, dtype=torch.long, pin_memory=cuda)
        self._host.copy_(packed, non_blocking=cuda)
        self._event = torch.cuda.Event() if cuda else None
        if self._event is not None:
            self._event.record()
        self._n, self._vocab = n, vocab

    @classmethod
    def greedy(cls, tokens: Tensor, parents: Tensor, ancestors: Tensor, logits: Tensor, size: int):
        """The greedy rule (`greedy_accept_batch`'s) for tokens / parents [N], ancestors [N, N], logits
        [N, V] of a verified tree."""
        best = logits.argmax(-1)  # [N] the target's token after each node
        match = tokens == best[parents.clamp(min=0)]  # [N]: each node is its parent's argmax
        match[0] = True
        ok = ~(ancestors & ~match[None, :]).any(-1)  # [N]: the whole root path matches
        deepest = torch.where(ok, ancestors.sum(-1), 0).argmax()  # [0-d] first among the deepest
        return cls(tokens, ancestors[deepest], deepest, best[deepest], size, logits.shape[-1])

    @classmethod
    def sampled(cls, tokens: Tensor, parents: Tensor, ancestors: Tensor, probs: Tensor, generator, size: int):
        """Rule A over deterministic children (`sample_accept_batch`'s, the same draws from `generator`):
        the target's probs [N, V] at every node."""
        nxt, on_path, last = rule_a_on_device(
            tokens[None], parents[None], ancestors[None], probs[None], [generator]
        )
        return cls(tokens, on_path[0], last[0], nxt[0], size, probs.shape[-1])

    def result(self) -> Acceptance:
        """The acceptance on the host (waits for its transfer only)."""
        if self._event is not None:
            self._event.synchronize()
        row, n = self._host.tolist(), self._n
        if row[0] >= self._vocab:
            raise ValueError("cannot sample the next token: the target's probs hold no positive finite mass")
        path = [i for i, x in enumerate(row[1 : n + 1]) if x]
        return Acceptance(path, int(row[0]), [row[n + 1 + i] for i in path])


def spec_ahead(
    runner: TargetRunner,
    drafter: Ahead,
    root: int,
    first: TokenTree,
    params: SamplingParams,
    generator: torch.Generator | None,
    max_new_tokens: int,
    eos: set[int],
    clock: PhaseClock,
    stats: GenerationStats,
) -> Iterator[list[int]]:
    """After the prefill (its token `root`, already emitted and counted) and the drafter's first tree
    `first` (drafted from `root` by `propose`): yield each pass's new tokens until an EOS or
    max_new_tokens, each next draft queued before the host reads the acceptance (see the module).
    Greedy, or sampled by rule A over the head's top-k children with `generator` (the draws of the
    loop that reads first)."""
    tree = first
    size = drafter.size
    while True:
        n, room = tree.size, runner.room()
        if room is not None and n > room:  # near a fixed cache's end: the first nodes (lossless)
            tree, n = TokenTree.trusted(tree.tokens[:room], tree.parents[:room]), room
        logits, hidden = runner.verify(tree.tokens[None], tree.parents[None])  # [1, N, V], {l: [1, N, H]}
        anc, parents = runner.last_ancestors, runner.last_parents  # [1, N, N], [1, N] on the device
        assert anc is not None and parents is not None  # verify just set them
        if params.is_greedy:
            queued = QueuedAcceptance.greedy(tree.tokens, parents[0], anc[0], logits[0], size)
        else:  # every node's target probs [N, V]: on a GPU about the cost of one row
            probs = torch_probs(logits[0], params)
            queued = QueuedAcceptance.sampled(tree.tokens, parents[0], anc[0], probs, generator, size)
        runner.commit_queued(queued.path[:n])
        clock.mark("verify")  # (on CUDA the device's timeline: the target's pass, acceptance and commit)
        drafter.accept(hidden, tree.tokens, queued.path, queued.k, queued.next_token)
        following = drafter.propose(queued.next_token)  # queued: the next tree
        clock.mark("draft")  # (the drafter's accept and the next draft)
        acc = queued.result()  # the pass's one wait (the draft above runs meanwhile)
        k = len(acc.path)
        runner.advance(k)
        drafter.settle(k, acc.next_token)
        stats.drafted_tokens += n - 1
        pending = [*(acc.path_tokens or [])[1:], acc.next_token]
        out = until_stop(pending, eos, max_new_tokens - stats.new_tokens)
        stats.new_tokens += len(out)
        stats.accept_lengths.append(len(out))
        yield out
        if len(out) < len(pending) or out[-1] in eos or stats.new_tokens >= max_new_tokens:
            return
        clock.mark("other")
        tree = following.tree
