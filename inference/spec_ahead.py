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

from spechead.inference.drafters.ahead import Ahead
from spechead.inference.phase_clock import PhaseClock
from spechead.inference.queued_acceptance import QueuedAcceptance
from spechead.inference.sampling import SamplingParams, torch_probs
from spechead.inference.stops import until_stop
from spechead.inference.tree import TokenTree

if TYPE_CHECKING:
    from spechead.inference.runner import TargetRunner
    from spechead.inference.stats import GenerationStats


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
        tokens = tree.tokens[None]  # [1, N]
        if params.is_greedy:
            queued = QueuedAcceptance.greedy(tokens, parents, anc, logits, size)
        else:  # every node's target probs [1, N, V]: on a GPU about the cost of one row
            probs = torch_probs(logits, params)
            queued = QueuedAcceptance.sampled(tokens, parents, anc, probs, [generator], size)
        path, k, next_token = queued.path[0], queued.k[0], queued.next_token[0]  # [max(N, size)], 0-d, 0-d
        runner.commit_queued(path[:n])
        clock.mark("verify")  # (on CUDA the device's timeline: the target's pass, acceptance and commit)
        drafter.accept(hidden, tree.tokens, path, k, next_token)
        following = drafter.propose(next_token)  # queued: the next tree
        clock.mark("draft")  # (the drafter's accept and the next draft)
        (acc,) = queued.result()  # the pass's one wait (the draft above runs meanwhile)
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
