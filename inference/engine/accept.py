"""Acceptance of every row's verified tree: read on the host now (`accept_rows`), or left on the device
for a read later (`accept_queued`: the loop queues the commits and the next draft first). The rules
themselves are pure functions (acceptance.py on the host, queued_acceptance.py on the device)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from spechead.inference.acceptance import Acceptance, greedy_accept, greedy_walk, sample_accept
from spechead.inference.devices import host_to_device
from spechead.inference.drafters.base import BatchDraft
from spechead.inference.engine.rows import Row
from spechead.inference.queued_acceptance import QueuedAcceptance
from spechead.inference.sampling import TargetRows, argmax_ids, torch_probs


def accept_rows(
    draft: BatchDraft, logits: torch.Tensor, ancestors: torch.Tensor, rows: Sequence[Row], on_device: bool
) -> list[Acceptance]:
    """Each row's acceptance of its tree from verify logits [B, N, V] and ancestors [B, N, N], read now.

    On an accelerator (`on_device`) rows `queues` allows take the batched device walk; all greedy on a
    CPU, one argmax and a walk of each row's real nodes in host lists (a dozen tensor ops cost more
    there); otherwise row by row, each drawing from its own generator as it would alone."""
    if all(r.params.is_greedy for r in rows) and not on_device:
        best, trees, links = argmax_ids(logits), draft.tokens.tolist(), draft.parents.tolist()  # [B, N]
        return [greedy_walk(t[:size], p[:size], b) for t, p, b, size in zip(trees, links, best, draft.sizes)]
    if on_device and queues(rows, draft.rule):  # the one device result, read now
        return accept_queued(draft, logits, ancestors, rows, 0).result()
    out = []
    for b, row in enumerate(rows):
        tree, row_logits = draft.tree(b), logits[b, : draft.sizes[b]]  # [N_b, V]
        if row.params.is_greedy:
            out.append(greedy_accept(tree, row_logits))
        else:
            q = draft.q[b, : tree.size] if draft.q is not None else None  # [N_b, V]
            out.append(sample_accept(tree, TargetRows(row_logits, row.params), draft.rule, q, row.generator))
    return out


def queues(rows: Sequence[Row], rule: str) -> bool:
    """Whether the rows' acceptance can stay on the device: all greedy, or all sampled over
    deterministic children (rule A)."""
    greedy = [r.params.is_greedy for r in rows]
    return all(greedy) or (not any(greedy) and rule == "deterministic")


def accept_queued(
    draft: BatchDraft, logits: torch.Tensor, ancestors: torch.Tensor, rows: Sequence[Row], size: int
) -> QueuedAcceptance:
    """Every row's acceptance of its tree left on the device (paths at least `size` long; padding nodes
    never accepted), read later with `result()`; the rows as `queues` allows, or plain steps."""
    tokens = host_to_device(draft.masked_tokens(), logits.device)  # [B, N] (padding nodes -1)
    params, generators = [r.params for r in rows], [r.generator for r in rows]
    if tokens.shape[1] == 1:  # plain steps: greedy and sampled rows may mix
        return QueuedAcceptance.plain(tokens, logits[:, 0], params, generators, size)
    parents = host_to_device(draft.parents, logits.device)  # [B, N]
    if params[0].is_greedy:
        return QueuedAcceptance.greedy(tokens, parents, ancestors, logits, size)
    if len({(p.temperature, p.top_k, p.top_p) for p in params}) == 1:  # one transform (seeds aside)
        probs = torch_probs(logits, params[0])  # [B, N, V] every node's (rule A)
    else:
        probs = torch.stack([torch_probs(x, p) for x, p in zip(logits, params)])
    return QueuedAcceptance.sampled(tokens, parents, ancestors, probs, generators, size, draft.sizes)
