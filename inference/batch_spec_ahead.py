"""Batched speculative decoding one draft ahead: every row's next draft is queued before the host reads
the acceptance.

As spec_ahead.py at batch 1, over a batch: after the verify of every row's tree, the acceptance stays on
the device (queued_acceptance.py: greedy when every row is greedy, rule A with each row's generator when
every row samples over deterministic children), the target's commit of each row's path
(`CompiledBatchRunner.commit_queued`) and the drafter's accept of it (`accept_queued`: the compiled EAGLE
batch drafter's commit graph, or Medusa's gather of each row's last state) are queued from those tensors,
then the whole next draft of every row (`propose_queued`); only then does the host wait for the
acceptance's one transfer, and its bookkeeping overlaps the draft. Rows stop as in the loop that reads
first (EOS, their max_new_tokens), one pass late for the draft: a row that stops was in the next draft,
whose tree for it is dropped before the verify (the rows leave with `keep`). Each row's tokens, accepted
lengths and drafted counts are those of the loop that reads first.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from spechead.inference.batch_plain_ahead import emit_roots
from spechead.inference.batch_rows import Row, row_probs
from spechead.inference.devices import host_to_device
from spechead.inference.drafters.base import BatchDraft
from spechead.inference.drafters.eagle_commit import GRAPH_COMMIT
from spechead.inference.queued_acceptance import QueuedAcceptance
from spechead.inference.stops import until_stop

if TYPE_CHECKING:
    from spechead.inference.batch_graphs import CompiledBatchRunner


def queues_ahead(runner: object, drafter: object, rows: Sequence[Row], rule: str) -> bool:
    """Whether `batch_spec_ahead` can decode: a runner that queues commits, a batch drafter that accepts
    and drafts from device tensors, and rows all greedy or all sampled over deterministic children."""
    if not (getattr(runner, "queues_commits", False) and hasattr(drafter, "accept_queued")):
        return False
    greedy = [r.params.is_greedy for r in rows]
    same_rule = all(greedy) or (not any(greedy) and rule == "deterministic")
    return same_rule and drafter.commit_width <= GRAPH_COMMIT  # type: ignore[attr-defined]


def _acceptance(draft: BatchDraft, logits, ancestors, rows: Sequence[Row], size: int) -> QueuedAcceptance:
    """Every row's acceptance of its tree, on the device (padding nodes never accepted)."""
    device = logits.device
    tokens, parents = (host_to_device(x, device) for x in (draft.tokens, draft.parents))  # [B, N] each
    n = tokens.shape[1]
    if rows[0].params.is_greedy:
        real = torch.arange(n)[None, :] < torch.tensor(draft.sizes)[:, None]  # [B, N]
        tokens = torch.where(host_to_device(real, device), tokens, -1)
        return QueuedAcceptance.greedy(tokens, parents, ancestors, logits, size)
    probs = row_probs(logits, [r.params for r in rows])  # [B, N, V] every node's (rule A)
    return QueuedAcceptance.sampled(
        tokens, parents, ancestors, probs, [r.generator for r in rows], size, draft.sizes
    )


def batch_spec_ahead(
    runner: CompiledBatchRunner, drafter, rows: Sequence[Row], eos: set[int]
) -> Iterator[list[tuple[int, list[int]]]]:
    """After the prefill and the drafter's start (each row's root picked): yield the roots, then each
    pass's new ids as [(row index, ids)] until every row stops, each next draft queued before the host
    reads the acceptance (see the module). `queues_ahead` must hold."""
    emitted, going = emit_roots(rows, eos)
    yield emitted
    if not going:
        return
    active = list(rows)
    if len(going) < len(active):  # rows whose prefill token ended them leave first
        on = {r.index for r in going}
        kept = [i for i, r in enumerate(active) if r.index in on]
        runner.keep(kept)
        drafter.keep(kept)
        active = going
    size = drafter.commit_width
    draft = drafter.propose(
        [r.root for r in active], [r.params for r in active], [r.generator for r in active]
    )
    while True:
        draft = draft.cut(runner.room())  # near a fixed cache's end: the first nodes (lossless)
        logits, hidden = runner.verify(draft.tokens, draft.parents)  # [B, N, V], {l: [B, N, H]}
        assert runner.last_ancestors is not None  # verify just set it
        queued = _acceptance(draft, logits, runner.last_ancestors, active, size)
        runner.commit_queued(queued.path[:, : draft.tokens.shape[1]])
        drafter.accept_queued(hidden, draft.tokens, queued.path, queued.k, queued.next_token)
        following = drafter.propose_queued(queued.next_token)  # queued: every row's next tree
        accs = queued.result()  # the pass's one wait (the draft above runs meanwhile)
        ks = [len(a.path) for a in accs]
        runner.advance(ks)
        drafter.settle(ks)
        emitted, kept = [], []
        for i, (row, acc, n) in enumerate(zip(active, accs, draft.sizes)):
            row.stats.drafted_tokens += n - 1
            row.root = acc.next_token
            pending = [*(acc.path_tokens or [])[1:], acc.next_token]
            out = until_stop(pending, eos, row.max_new - row.stats.new_tokens)
            row.stats.new_tokens += len(out)
            row.stats.accept_lengths.append(len(out))
            emitted.append((row.index, out))
            if not (len(out) < len(pending) or out[-1] in eos or row.stats.new_tokens >= row.max_new):
                kept.append(i)
        yield emitted
        if not kept:
            return
        if len(kept) < len(active):  # finished rows leave; their queued trees are dropped
            runner.keep(kept)
            drafter.keep(kept)
            pick = host_to_device(torch.tensor(kept), following.tokens.device)
            following = BatchDraft(
                following.tokens[pick], following.parents[pick], [following.sizes[i] for i in kept],
                following.rule, following.q[pick] if following.q is not None else None,
            )  # fmt: skip
            active = [active[i] for i in kept]
        draft = following
