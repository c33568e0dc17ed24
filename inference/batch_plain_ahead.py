"""Plain batched decoding one step ahead: every row's next step is queued before the host reads its token.

As `plain_ahead.py` for one sequence, over a batch: each row's token stays on the device (the batch's
argmax, or row b's draw of `torch_probs` with its own generator, the draw the token-by-token batch loop
makes on a GPU) and is written into the next step's input there, so the host queues step t + 1 and
only then waits for the tokens of step t (copied to pinned memory, an event recorded behind the copy).

Rows still leave the batch as they stop, one step late for an EOS: a row whose token t is an EOS was
already in step t + 1, whose token for it is dropped unread, and it leaves before step t + 2. A row that
runs out of max_new_tokens leaves before its last step is queued (the host counts the tokens in
flight), so only an EOS costs a step. Each read remembers which rows its step held, in which order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from spechead.inference.batch_rows import Row
from spechead.inference.devices import host_to_device
from spechead.inference.sampling import inverse_cdf, torch_probs
from spechead.inference.stops import until_stop

if TYPE_CHECKING:
    from spechead.inference.batch import BatchRunner


class RowReads:
    """Device ids [B] on their way to the host with the rows they belong to, at most two in flight:
    copied into pinned memory and read after an event recorded behind the copy (CUDA), or at once."""

    def __init__(self, device: torch.device, width: int) -> None:
        self.cuda = device.type == "cuda"
        self.slots = torch.empty(2, width, dtype=torch.long, pin_memory=self.cuda)  # [2, B0]
        self.events = [torch.cuda.Event(), torch.cuda.Event()] if self.cuda else None  # one a slot
        self.pending: deque[tuple[int, list]] = deque()  # (slot, its rows), oldest first
        self.free = 0

    def push(self, ids: Tensor, rows: list) -> None:
        """ids [B] (B <= width) of `rows`, in their order."""
        slot, self.free = self.free, self.free ^ 1
        self.slots[slot, : ids.numel()].copy_(ids, non_blocking=self.cuda)
        if self.events is not None:
            self.events[slot].record()
        self.pending.append((slot, rows))

    def pop(self) -> tuple[list, list[int]]:
        """The oldest read's rows and their ids (waits for that copy only)."""
        slot, rows = self.pending.popleft()
        if self.events is not None:
            self.events[slot].synchronize()  # step t's ids are here; step t + 1 may still run
        return rows, self.slots[slot, : len(rows)].tolist()


def next_row_ids(logits: Tensor, rows: Sequence[Row]) -> Tensor:
    """Every row's next token of logits [B, V] as ids [B] on their device: the batch's argmax when all
    rows are greedy, else row by row (the argmax, or one draw of `torch_probs` with the row's
    generator; V for probs without a positive finite mass)."""
    if all(r.params.is_greedy for r in rows):
        return logits.argmax(-1)
    picked = [
        row_logits.argmax(-1, keepdim=True)
        if r.params.is_greedy
        else inverse_cdf(torch_probs(row_logits, r.params), r.generator)
        for row_logits, r in zip(logits, rows)
    ]
    return torch.cat(picked)  # [B]


def emit_roots(rows: Sequence[Row], eos: set[int]) -> tuple[list[tuple[int, list[int]]], list[Row]]:
    """Each row's prefill token (row.root) as (row index, ids), and the rows that go on after it."""
    emitted, going = [], []
    for row in rows:
        out = until_stop([row.root], eos, row.max_new - row.stats.new_tokens)
        row.stats.new_tokens += len(out)
        emitted.append((row.index, out))
        if out and out[-1] not in eos and row.stats.new_tokens < row.max_new:
            going.append(row)
    return emitted, going


def rows_ahead(
    runner: BatchRunner, rows: Sequence[Row], eos: set[int]
) -> Iterator[list[tuple[int, list[int]]]]:
    """After the runner's prefill of `rows` (each row's root picked): yield the roots, then each step's
    new ids as [(row index, [id])] until every row stops, steps queued one ahead (see the module)."""
    emitted, going = emit_roots(rows, eos)
    yield emitted
    if not going:
        return
    device = runner.device
    stepped = list(rows)  # the runner's rows, in its order (the last step's batch)
    ids = torch.tensor([r.root for r in rows], dtype=torch.long, device=device)[:, None]  # [B, 1]
    parents = torch.full((len(rows), 1), -1, dtype=torch.long, device=device)  # [B0, 1]; [:B] read
    reads = RowReads(device, len(rows))
    flying = {r.index: 0 for r in rows}  # row -> its tokens queued but not read
    done = {r.index for r in rows} - {r.index for r in going}  # rows that stopped (their tokens in
    # flight are dropped)
    vocab = 0

    def queue() -> None:  # one step of the rows that may still want a token after those in flight
        nonlocal vocab, ids, stepped
        wanted = [
            r for r in stepped if r.index not in done and r.stats.new_tokens + flying[r.index] < r.max_new
        ]
        if not wanted:
            return
        if len(wanted) < len(stepped):  # rows leave: the runner's and the input's rows follow
            at = {r.index: i for i, r in enumerate(stepped)}
            kept = [at[r.index] for r in wanted]
            runner.keep(kept)
            ids = ids[host_to_device(torch.tensor(kept), device)]  # [B', 1] (queued after the last step)
            stepped = wanted
        batch = len(wanted)
        logits, _ = runner.verify(ids, parents[:batch])  # [B, 1, V]
        runner.commit([[0]] * batch)
        drawn = next_row_ids(logits[:, 0], wanted)  # [B]
        reads.push(drawn, wanted)
        vocab = logits.shape[-1]
        ids.copy_(drawn.clamp(max=vocab - 1)[:, None])  # (a failed draw is read as drawn: below)
        for r in wanted:
            flying[r.index] += 1

    queue()
    while reads.pending:
        queue()  # the next step first, then the host waits for the last one's tokens
        held, tokens = reads.pop()
        emitted = []
        for row, token in zip(held, tokens):
            flying[row.index] -= 1
            if row.index in done:  # an EOS came before: this step was computed for nothing
                continue
            if token >= vocab:
                raise ValueError(
                    "cannot sample from probs without a positive finite mass (NaN or -inf logits)"
                )
            row.stats.new_tokens += 1
            row.stats.accept_lengths.append(1)
            emitted.append((row.index, [token]))
            if token in eos or row.stats.new_tokens >= row.max_new:
                done.add(row.index)
        if emitted:
            yield emitted
