"""The one decoding loop, a batch of one is a batch: prefill, then passes of draft -> verify (ONE target
forward over every row's tree) -> accept -> commit (a row's timeline: drafters/base.py).

Each row has its own tree, stop and generator, so row b decodes as it would alone. Where the loop reads
the device is a setting (`depth`), not another loop:
- 0, read first (a CPU's default): accept on the host, then commit, the drafter's accept, the next draft;
- 1, the next draft queued (CUDA, a compiled target, a drafter that drafts from device tensors): the
  commit, the drafter's accept and its next draft are queued from the acceptance left on the device,
  then the host waits for the pass's one transfer while the draft runs;
- 2, the next step queued (plain decoding on CUDA: a step's commit is its one node): a row that stops
  on an EOS was in that step for nothing (its token dropped).
Rows that stop leave the batch (the runner's, the drafter's and a queued draft's rows follow).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from spechead.inference.acceptance import Acceptance
from spechead.inference.devices import host_to_device
from spechead.inference.drafters.base import BatchDraft, Drafter
from spechead.inference.engine.accept import accept_queued, accept_rows, queues
from spechead.inference.engine.rows import Row, take
from spechead.inference.phase_clock import PhaseClock
from spechead.inference.queued_acceptance import QueuedAcceptance
from spechead.inference.sampling import pick
from spechead.inference.target.runner import TargetRunner

Emitted = list[tuple[int, list[int]]]  # (row index as given, its new ids) for the rows a pass emitted


@dataclass
class Flight:
    """A verified pass: its rows, their trees [B, N], the acceptance (on the device until read) and the
    target's states at every node {l: [B, N, H]}; read first with a drafter (`logits` set), what the
    drafter hears before its next draft (only when decoding goes on)."""

    rows: list[Row]
    draft: BatchDraft
    accepted: list[Acceptance] | QueuedAcceptance
    hidden: dict[int, torch.Tensor]
    logits: torch.Tensor | None = None  # [B, N, V] read first: for the drafter's `verified` hook

    def keep(self, keep: Sequence[int]) -> Flight:
        """Read first: only rows `keep` (in this order) of what the drafter is to hear."""
        assert self.logits is not None and isinstance(self.accepted, list)
        index = host_to_device(torch.tensor(list(keep)), self.logits.device)  # (the states' device too)
        hidden = {k: v[index] for k, v in self.hidden.items()}
        rows, accepted = [self.rows[i] for i in keep], [self.accepted[i] for i in keep]
        return Flight(rows, self.draft.rows(keep), accepted, hidden, logits=self.logits[index])


def depth_for(
    runner: TargetRunner, drafter: Drafter | None, rows: Sequence[Row], ahead: bool, on_device: bool
) -> int:
    """The module's `depth` for these rows: 1 only where the commit, the acceptance (`queues`, by how the
    drafter chooses its children) and the drafter can all stay on the device."""
    if not ahead:
        return 0
    if drafter is None:
        return 2
    ok = on_device and runner.static_shapes and queues(rows, drafter.rule) and drafter.queues(len(rows))
    return 1 if ok else 0


@torch.inference_mode()  # (a generator: entered again at every resume)
def decode(
    runner: TargetRunner,
    drafter: Drafter | None,
    rows: list[Row],
    eos: set[int],
    clock: PhaseClock,
    *,
    depth: int = 0,
    on_device: bool = False,
) -> Iterator[Emitted]:
    """Decode every row from its prompt, yielding the new ids of the rows that emitted some after the
    prefill and every pass the host reads; fills each row's stats (the batch's phase times at the end).
    runner: sized for every row; drafter: None for plain decoding; on_device: accept on the device."""
    prompts = [r.prompt for r in rows]
    logits, hiddens = runner.prefill(prompts)  # [B, V], [{l: [T_b, H]}]
    for b, row in enumerate(rows):
        row.root = pick(logits[b], row.params, row.generator)
    if drafter is not None:
        drafter.start(prompts, hiddens, [r.root for r in rows])
    clock.mark("prefill")
    yield [(r.index, take(r, [r.root], eos, verified=False)) for r in rows]
    stepped = list(rows)  # the runner's and the drafter's rows, in their order
    draft: BatchDraft | None = None  # the next trees, already queued (depths 1 and 2)
    heard: Flight | None = None  # read first: the last pass, not yet heard by the drafter
    flights: deque[Flight] = deque()
    while True:
        clock.mark("other")
        wanted = [r for r in stepped if not r.done and r.stats.new_tokens + r.flying < r.max_new]
        if wanted:
            if len(wanted) < len(stepped):  # rows leave; the others go on untouched
                at = {r.index: i for i, r in enumerate(stepped)}
                kept = [at[r.index] for r in wanted]
                runner.keep(kept)
                if drafter is not None:
                    drafter.keep(kept)
                draft = draft.rows(kept) if draft is not None else None
                heard = heard.keep(kept) if heard is not None else None
                stepped = wanted
            if draft is None:
                draft = _propose(drafter, wanted, heard)
                heard = None
                clock.mark("draft")
            flight, draft = _pass(runner, drafter, draft, wanted, depth, on_device, clock)
            flights.append(flight)
            if len(flights) < depth:  # plain decoding queued (2): the next step before this read
                continue
        if not flights:
            break
        emitted, heard = _read(flights.popleft(), runner, drafter, eos)
        if emitted:
            yield emitted
    spent = clock.totals()
    for row in rows:
        row.stats.take_times(spent)


def _propose(drafter: Drafter | None, rows: list[Row], heard: Flight | None) -> BatchDraft:
    """Read first: the drafter hears the last pass, then drafts every row's tree from its root (host)."""
    roots = [r.root for r in rows]
    if drafter is None:  # plain decoding: every tree is its root
        return BatchDraft.plain(torch.tensor(roots)[:, None])
    if heard is not None:
        accs = heard.accepted
        assert heard.logits is not None and isinstance(accs, list)  # (`_read` hands on only these)
        drafter.verified(heard.draft, heard.logits)  # (lookahead reads its Jacobi guesses there)
        tokens, paths = [a.path_tokens for a in accs], [a.path for a in accs]
        drafter.accept_paths(tokens, heard.hidden, paths, [a.next_token for a in accs])
    return drafter.propose(roots, [r.params for r in rows], [r.generator for r in rows])


def _pass(
    runner: TargetRunner, drafter: Drafter | None, draft: BatchDraft, rows: list[Row], depth: int, on_device: bool,
    clock: PhaseClock,
) -> tuple[Flight, BatchDraft | None]:  # fmt: skip
    """Verify every row's tree, accept and commit: read now (depth 0), else left on the device with the
    drafter's accept and next trees queued from it (returned: the next draft)."""
    draft = draft.cut(runner.room())  # near a fixed cache's end: the first nodes (a tree: lossless)
    n = draft.tokens.shape[1]
    logits, hidden = runner.verify(draft.tokens, draft.parents)  # [B, N, V], {l: [B, N, H]}
    for row in rows:
        row.flying += 1
    if depth == 0:
        accs = accept_rows(draft, logits, runner.last_ancestors, rows, on_device)
        runner.commit([a.path for a in accs])
        clock.mark("verify")
        return Flight(rows, draft, accs, hidden, logits=logits if drafter is not None else None), None
    queued = accept_queued(draft, logits, runner.last_ancestors, rows, drafter.commit_width if drafter else 1)
    if n == 1:  # one node a row: the commit is known, nothing moves
        runner.commit([[0]] * len(rows))
    else:
        runner.commit_queued(queued.path[:, :n])
    clock.mark("verify")  # (on CUDA the device's timeline: the target's pass, acceptance and commit)
    if drafter is None:
        following = BatchDraft.plain(queued.next_token[:, None])
    else:
        drafter.accept_queued(hidden, draft.tokens, queued.path, queued.k, queued.next_token)
        following = drafter.propose_queued(queued.next_token)
    clock.mark("draft")
    return Flight(rows, draft, queued, {}), following


def _read(
    flight: Flight, runner: TargetRunner, drafter: Drafter | None, eos: set[int]
) -> tuple[Emitted, Flight | None]:
    """The host reads a pass's acceptance (the pass's one wait): each row takes its tokens, the runner's
    and the drafter's counts follow a queued commit; read first, what the drafter is to hear next."""
    accs = flight.accepted
    if isinstance(accs, QueuedAcceptance):  # the runner's and the drafter's counts follow what was queued
        accs = accs.result()
        ks = [len(a.path) for a in accs]
        if flight.draft.tokens.shape[1] > 1:  # a queued commit that moved nodes (`_pass`)
            runner.advance(ks)
        if drafter is not None:
            drafter.settle(ks)
    emitted = []
    for b, (row, acc) in enumerate(zip(flight.rows, accs)):
        row.flying -= 1
        if row.done:  # stopped on an EOS while this step was queued: computed for nothing
            continue
        row.stats.drafted_tokens += flight.draft.sizes[b] - 1
        row.root = acc.next_token
        emitted.append((row.index, take(row, [*acc.path_tokens[1:], row.root], eos)))
    return emitted, flight if flight.logits is not None else None  # (None: queued, or plain decoding)
