"""The batch > 1 decoding loop behind `SpeculativeGenerator.generate_batch` and `stream_batch`.

Each row has its own tree, its own accepted length, its own stop (EOS, its max_new_tokens) and, when
sampling, its own generator seeded per row. Per pass: ONE draft call over all active rows (a
`BatchDrafter`: batched head forwards for Medusa/EAGLE, per-row clones otherwise), ONE target forward
verifying every row's tree (`BatchRunner`), acceptance (one batched greedy walk when every row is
greedy; per row with its own generator otherwise), one commit. Every row's drafter and acceptance see
exactly the inputs of its batch-1 run, and random draws come from the row's own generator in the
batch-1 order, so row b's output equals its batch-1 output (greedy: token for token; sampling with
the same seed: the same draws). Finished rows leave the batch (`keep`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from spechead.inference.acceptance import (
    Acceptance,
    greedy_accept,
    greedy_accept_batch,
    greedy_walk,
    sample_accept,
)
from spechead.inference.batch import BatchRunner
from spechead.inference.batch_plain_ahead import rows_ahead
from spechead.inference.batch_rows import Row, row_probs
from spechead.inference.batch_spec_ahead import batch_spec_ahead, queues_ahead
from spechead.inference.device_sampling import sample_accept_batch
from spechead.inference.devices import host_to_device
from spechead.inference.drafters.base import BatchDraft, BatchDrafter, Drafter
from spechead.inference.sampling import (
    SamplingParams,
    TargetRows,
    argmax_ids,
    make_generator,
    pick,
)
from spechead.inference.stops import until_stop

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from spechead.inference.stats import GenerationStats


def accept_rows(
    draft: BatchDraft,
    logits: torch.Tensor,
    ancestors: torch.Tensor,
    rows: Sequence[Row],
    on_device: bool | None = None,
) -> list:
    """Acceptance of every row's tree from verify logits [B, N, V] and ancestors [B, N, N].

    All greedy: on an accelerator one batched walk on the device (padding nodes get token -1 so they
    never match); on a CPU (`on_device` None: where the logits are) one argmax over every row and a
    walk of each row's N_b real nodes in host lists (a dozen tensor ops cost more there). All sampled
    with deterministic children on an accelerator: rule A as batched tensor ops (`sample_accept_batch`,
    one host transfer; each row draws from its generator as at batch 1). Otherwise per row, in row
    order, each with its own generator (the batch-1 draws)."""
    n = draft.tokens.shape[1]
    if n == 1 and all(r.params.is_greedy for r in rows):  # plain steps: each row's argmax
        nexts = argmax_ids(logits[:, 0])
        return [Acceptance([0], t, [r.root]) for t, r in zip(nexts, rows)]
    on_device = logits.device.type != "cpu" if on_device is None else on_device
    if all(r.params.is_greedy for r in rows) and not on_device:
        best, trees, links = argmax_ids(logits), draft.tokens.tolist(), draft.parents.tolist()  # [B, N]
        return [greedy_walk(t[:size], p[:size], b) for t, p, b, size in zip(trees, links, best, draft.sizes)]
    if all(r.params.is_greedy for r in rows):
        real = torch.arange(n)[None, :] < torch.tensor(draft.sizes)[:, None]  # [B, N]
        real = host_to_device(real, draft.tokens.device)  # (the trees may be on the GPU: no wait)
        tokens = host_to_device(torch.where(real, draft.tokens, -1), logits.device)
        return greedy_accept_batch(tokens, host_to_device(draft.parents, logits.device), ancestors, logits)
    if on_device and draft.rule == "deterministic" and not any(r.params.is_greedy for r in rows):
        every = row_probs(logits, [r.params for r in rows])  # [B, N, V] every node's (rule A batched)
        tokens, parents = (host_to_device(x, logits.device) for x in (draft.tokens, draft.parents))
        return sample_accept_batch(
            tokens, parents, ancestors, every, [r.generator for r in rows], draft.sizes
        )
    out = []
    for b, row in enumerate(rows):
        tree, row_logits = draft.tree(b), logits[b, : draft.sizes[b]]  # [N_b, V]
        if tree.size == 1:
            out.append(Acceptance([0], pick(row_logits[0], row.params, row.generator), [row.root]))
        elif row.params.is_greedy:
            out.append(greedy_accept(tree, row_logits))
        else:
            q = draft.q[b, : tree.size] if draft.q is not None else None  # [N_b, V]
            probs = TargetRows(row_logits, row.params)  # [N_b, V], the rows the walk reads
            out.append(sample_accept(tree, probs, draft.rule, q, row.generator))
    return out


def _padded(rows: Sequence[list[int]], k: int) -> torch.Tensor:
    """Host lists as [B, k] (long), each padded by repeating its last entry."""
    return torch.tensor([row + row[-1:] * (k - len(row)) for row in rows], dtype=torch.long)


def padded_paths(accs: Sequence[Acceptance]) -> tuple[torch.Tensor, list[int]]:
    """Accepted paths as [B, K_max] (each padded by repeating its last node) and their lengths."""
    lengths = [len(a.path) for a in accs]
    return _padded([a.path for a in accs], max(lengths)), lengths


def path_tokens(accs: Sequence[Acceptance], draft: BatchDraft, paths: torch.Tensor) -> torch.Tensor:
    """The accepted tokens [B, K] on the host, root first, padded like `padded_paths` (the last one
    repeated): from what the acceptance read (no copy of trees on the GPU), else gathered from the trees."""
    read = [a.path_tokens for a in accs]
    if all(t is not None for t in read):
        return _padded([t for t in read if t is not None], paths.shape[1])
    return draft.tokens.gather(1, host_to_device(paths, draft.tokens.device)).cpu()


def batch_cache_size(drafter: Drafter | None, need: int, max_cache_len: int | None, step: int = 256) -> int:
    """KV slots a batch needs: the longest row's prompt + max_new_tokens (`need`) and a tree's room,
    rounded up to `step`; or the fixed `max_cache_len` (checked by the caller)."""
    tree_room = drafter.max_nodes if drafter else 1
    return max_cache_len or -(-(need + tree_room) // step) * step


def collect(passes: Iterator[list[tuple[int, list[int]]]], rows: int) -> list[list[int]]:
    """Each of `rows` rows' new ids from `batch_passes(...)`, run to the end."""
    out: list[list[int]] = [[] for _ in range(rows)]
    for emitted in passes:
        for b, ids in emitted:
            out[b].extend(ids)
    return out


@torch.inference_mode()
def batch_passes(
    target: PreTrainedModel,
    drafter: Drafter | None,
    prompts: Sequence[torch.Tensor],
    max_new: Sequence[int],
    params: Sequence[SamplingParams],
    eos: set[int],
    stats: Sequence[GenerationStats],
    max_cache_len: int | None = None,
    runner: BatchRunner | None = None,
    on_device: bool | None = None,
    ahead: bool | None = None,
    spec_ahead: bool | None = None,
) -> Iterator[list[tuple[int, list[int]]]]:
    """Decode every prompt [T_b], one pass at a time: yields, after the prefill and after every pass, each
    active row's new ids as (row index into `prompts`, ids) (`collect` gathers them per row).

    Fills stats[b] (GenerationStats) per row: new_tokens, accept_lengths, drafted_tokens; wall/phase times
    are the batch's (shared by all rows), set when the iterator is exhausted. runner: the target's batch
    runner to use (e.g. a kept `CompiledBatchRunner`, whose cache must hold every row's prompt +
    max_new_tokens); None: a new eager one sized for this batch. A cache too small (max_cache_len) raises
    at the first next(). on_device: accept on the logits' device (`accept_rows`; None: where they are).
    ahead: plain decoding (no drafter) with each step queued before the host reads the last one's tokens
    (batch_plain_ahead.py; None: on CUDA, where the host's work then overlaps the device's). spec_ahead:
    with a drafter, each next draft queued before the host reads the acceptance where the runner and the
    drafter can (batch_spec_ahead.py: compiled runner, compiled EAGLE or Medusa batch drafter, rows all
    greedy or all sampled; None: on CUDA)."""
    need = max(len(p) + m for p, m in zip(prompts, max_new))
    if max_cache_len is not None and need > max_cache_len:
        worst = max(range(len(prompts)), key=lambda b: len(prompts[b]) + max_new[b])
        raise ValueError(
            f"KV cache of {max_cache_len} positions is too small for row {worst}: prompt "
            f"({len(prompts[worst])} tokens) + max_new_tokens ({max_new[worst]}): raise max_cache_len or "
            "lower max_new_tokens"
        )
    device = next(target.parameters()).device
    if runner is None:
        size = batch_cache_size(drafter, need, max_cache_len)
        runner = BatchRunner(target, tuple(drafter.hidden_layers) if drafter else (), max_length=size)
    batched: BatchDrafter | None = drafter.batched() if drafter else None
    rows = [
        Row(b, prompts[b], max_new[b], params[b], make_generator(params[b].seed, device), stats[b])
        for b in range(len(prompts))
    ]
    start = time.perf_counter()
    times = dict.fromkeys(("prefill", "draft", "verify"), 0.0)
    logits, hiddens = runner.prefill([r.prompt for r in rows])  # [B, V], [{l: [T_b, H]}]
    for b, row in enumerate(rows):
        row.root = pick(logits[b], row.params, row.generator)
        row.pending = [row.root]
    if batched:
        batched.start([r.prompt for r in rows], hiddens, [r.root for r in rows])
    times["prefill"] = time.perf_counter() - start
    if batched is None and (device.type == "cuda" if ahead is None else ahead):
        yield from rows_ahead(runner, rows, eos)
        times["verify"] = time.perf_counter() - start - times["prefill"]
        _set_times(rows, time.perf_counter() - start, times)
        return
    rule = getattr(drafter, "rule", "deterministic")
    if (device.type == "cuda" if spec_ahead is None else spec_ahead) and queues_ahead(
        runner, batched, rows, rule
    ):
        yield from batch_spec_ahead(runner, batched, rows, eos)  # type: ignore[arg-type]  # (checked)
        times["verify"] = time.perf_counter() - start - times["prefill"]  # (draft and verify overlap)
        _set_times(rows, time.perf_counter() - start, times)
        return
    active, accepted = rows, None  # accepted: what the drafter has yet to hear (tokens, lengths, hidden)
    while True:
        going, emitted = [], []
        for b, row in enumerate(active):
            out = until_stop(row.pending, eos, row.max_new - row.stats.new_tokens)
            row.stats.new_tokens += len(out)
            if row.verified:
                row.stats.accept_lengths.append(len(out))
            emitted.append((row.index, out))
            if not (len(out) < len(row.pending) or out[-1] in eos or row.stats.new_tokens >= row.max_new):
                going.append(b)
        yield emitted
        if not going:
            break
        if len(going) < len(active):  # finished rows leave; the others are untouched
            runner.keep(going)
            if batched:
                batched.keep(going)
            if accepted is not None:
                idx = torch.tensor(going)
                tokens, lengths, hidden = accepted
                accepted = (
                    tokens[idx],
                    [lengths[b] for b in going],
                    {k: v[host_to_device(idx, v.device)] for k, v in hidden.items()},
                )
            active = [active[b] for b in going]
        t0 = time.perf_counter()
        roots = [r.root for r in active]
        if batched:
            if accepted is not None:
                batched.accept(*accepted, roots)
            draft = batched.propose(roots, [r.params for r in active], [r.generator for r in active])
        else:  # plain decoding: every tree is its root
            draft = BatchDraft(
                torch.tensor(roots)[:, None], torch.full((len(roots), 1), -1), [1] * len(roots)
            )
        draft = draft.cut(runner.room())  # near a fixed cache's end: keep the first nodes (lossless)
        t1 = time.perf_counter()
        logits, hidden = runner.verify(draft.tokens, draft.parents)  # [B, N, V], {l: [B, N, H]}
        if batched:
            batched.verified(draft, logits)  # before the next accept (lookahead reads its Jacobi guesses)
        assert runner.last_ancestors is not None  # verify just set it
        accs = accept_rows(draft, logits, runner.last_ancestors, active, on_device)
        paths, lengths = padded_paths(accs)  # [B, K], K_b
        runner.commit([a.path for a in accs])
        tokens = path_tokens(accs, draft, paths)  # [B, K] root + accepted drafts (padded), host
        for row, acc, k, toks, n in zip(active, accs, lengths, tokens.tolist(), draft.sizes):
            row.stats.drafted_tokens += n - 1
            row.root, row.verified = acc.next_token, True
            row.pending = [*toks[1:k], row.root]
        if batched:
            dev_paths = host_to_device(paths, device)  # (no wait for the queued commit)
            gathered = {
                k: v.gather(1, dev_paths[:, :, None].expand(-1, -1, v.shape[-1])) for k, v in hidden.items()
            }
            accepted = (tokens, lengths, gathered)  # {l: [B, K, H]}
        t2 = time.perf_counter()
        times["draft"] += t1 - t0
        times["verify"] += t2 - t1
    _set_times(rows, time.perf_counter() - start, times)


def _set_times(rows: Sequence[Row], wall: float, times: dict[str, float]) -> None:
    """The batch's wall and phase times into every row's stats."""
    for row in rows:
        row.stats.wall_time, row.stats.prefill_time = wall, times["prefill"]
        row.stats.draft_time, row.stats.verify_time = times["draft"], times["verify"]
