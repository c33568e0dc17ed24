"""The tree follows the hardware: a head's accuracy table [depth, k] (HEAD/tree.json) belongs to the head
and the data, what a tree costs to the machine. `calibrated_choices` times the target's verify by tree
size and the draft here, as the generator compiles them (`TimedAs`), and ranks trees by expected speedup;
pass_timing.py decodes the best few to pick one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from itertools import accumulate
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from spechead.heads.directory import read_tree
from spechead.heads.families import family_of
from spechead.inference.drafters.eagle.rows import EagleRows
from spechead.inference.drafters.per_row import rows_drafter
from spechead.inference.evaluation.profiling import wall_ms
from spechead.inference.sampling import SamplingParams
from spechead.inference.target.runner import TargetRunner, batch_capacity
from spechead.inference.tuning.tree_search import covers, expected_accept_length, ranked_choices_for_cost

if TYPE_CHECKING:
    from transformers import PreTrainedModel

SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
CANDIDATES = 3  # trees pass_timing.py decodes (its cost grows with them), of different sizes (`spread`)


@dataclass(frozen=True)
class TimedAs:
    """How calibration runs the target's passes and the draft: False (eager) or a compile mode."""

    target: bool | str = False
    draft: bool | str = False

    @classmethod
    def of(cls, device: torch.device, compile: bool | str, draft_compile: bool | str | None) -> TimedAs:
        """For a generator built with these settings: each part it compiles is timed as "graphs" (on CUDA
        most of what compiling buys is the launches a graph removes). A CPU's draft stays eager: compiling
        per tree is too slow there, and fixed shapes alone cost more than eager."""
        draft = compile if draft_compile is None else draft_compile
        return cls("graphs" if compile else False, "graphs" if draft and device.type == "cuda" else False)


EAGER = TimedAs()  # every part eager (the default)


def saved_accuracy(saved: str | Path | dict | None) -> torch.Tensor | None:
    """accuracy [depth, k] from HEAD_DIR/tree.json or its fields (None without one), fitted to the tree's
    `measured_tau` when it has one (`fit_accuracy`)."""
    tree = saved if isinstance(saved, dict) or saved is None else read_tree(saved)
    if not tree or not tree.get("accuracy"):
        return None
    accuracy = torch.tensor(tree["accuracy"], dtype=torch.float64)
    tau = tree.get("measured_tau")
    return fit_accuracy(accuracy, tree["choices"], float(tau)) if tau else accuracy


def fit_accuracy(accuracy: torch.Tensor, choices: list[list[int]], measured_tau: float) -> torch.Tensor:
    """accuracy [depth, k] times the one factor f (bisection; every depth's total stays <= 1) that makes
    `choices`' expected accept length equal the measured tau. The product-of-accuracies estimate runs
    ahead of real decoding; f shrinks a node by f**depth, so deep trees, the over-promised ones, pay most."""
    if not covers(accuracy, choices):
        return accuracy  # a table that does not cover its own tree: nothing to fit
    expected = lambda f: float(expected_accept_length(accuracy * f, choices))  # noqa: E731
    low, high = 0.0, 1.0 / max(float(accuracy.sum(-1).max()), 1e-9)
    if expected(high) <= measured_tau:
        return accuracy * high
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if expected(mid) < measured_tau else (low, mid)
    return accuracy * low


@torch.inference_mode()
def verify_cost_ms(
    model: PreTrainedModel,
    sizes=SIZES,
    context: int = 128,
    repeats: int = 15,
    compile: bool | str = False,
    batch: int = 1,
) -> dict[int, float]:
    """{tree size: ms} of one verify of `batch` rows (chains of that size) after `context` tokens, the
    target compiled by `compile` as decoding compiles it (padded to its bucket, over the batch's capacity)."""
    runner = TargetRunner(model, compile=compile, capacity=batch_capacity(batch) if compile else None)
    runner.reserve([context] * batch, [max(sizes) + 1] * batch)
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (batch, context + max(sizes)), generator=torch.Generator().manual_seed(0))
    runner.prefill(list(ids[:, :context]))
    chain = lambda n: torch.arange(-1, n - 1)[None].expand(batch, n)  # noqa: E731  (parents [B, n])
    calls = {n: (lambda n=n: runner.verify(ids[:, context : context + n], chain(n))) for n in sizes}
    return size_costs_ms(calls, repeats, runner.device)


def size_costs_ms(calls: dict, repeats: int, device: torch.device) -> dict[int, float]:
    """{size: ms} of `calls` {size: fn}: round-robin `repeats` times (load changes hit every size alike),
    the minimum per size (noise only adds), made non-decreasing in size."""
    times: dict[int, list[float]] = {n: [] for n in calls}
    for _ in range(repeats):
        for n, call in calls.items():
            times[n].append(wall_ms(call, device, 1))
    sizes = sorted(calls)
    return dict(zip(sizes, accumulate((min(times[n]) for n in sizes), max)))


def _noise(drafter, length: int = 128) -> dict[int, torch.Tensor]:
    """`length` random target states {layer: [length, H]} for a drafter reading target states."""
    hidden, device = drafter.head.config.hidden_size, next(drafter.head.parameters()).device
    return {layer: torch.randn(length, hidden, device=device) for layer in drafter.hidden_layers}


def propose_timer(drafter, states: dict[int, torch.Tensor], batch: int = 1) -> Callable[[], object]:
    """One draft of any drafter as decoding runs it (`rows_drafter`), `batch` rows on states {layer: [T, H]}."""
    rows = rows_drafter(drafter)
    length = next(iter(states.values())).shape[0] if states else 1
    rows.start([torch.zeros(length, dtype=torch.long)] * batch, [states] * batch, [0] * batch)
    return lambda: rows.propose([0] * batch, [SamplingParams()] * batch, [None] * batch)


def _drafter_ms(drafter, fn, repeats: int) -> float:
    """Min ms of fn() over `repeats` calls after a warm-up."""
    fn()
    return min(wall_ms(fn, next(drafter.head.parameters()).device, 1) for _ in range(repeats))


@torch.inference_mode()
def eagle_depth_cost_ms(drafter, width: int, repeats: int = 9, batch: int = 1) -> float:
    """ms of one eager EAGLE draft depth (head step, logits, top-k) over `width` nodes a row of `batch`
    rows after 128 committed (`EagleRows`)."""
    rows = EagleRows(drafter)
    rows.start([torch.zeros(128, dtype=torch.long)] * batch, [_noise(drafter)] * batch, [0] * batch)
    weight = drafter.head.fc.weight
    feats = torch.randn(
        batch, width, drafter.head.config.hidden_size, device=weight.device, dtype=weight.dtype
    )
    ids = torch.zeros(batch, width, dtype=torch.long, device=weight.device)  # [B, E]
    own = torch.eye(width, dtype=torch.bool, device=weight.device).expand(batch, width, width)  # itself
    offsets = torch.zeros(width, dtype=torch.long, device=weight.device)  # [E]: depth 2's position C + 0

    def depth() -> None:  # (its speculative slots are scratch: every call writes the same ones)
        out = rows._run(feats, ids, rows._inputs(own, offsets))
        rows._top(out, min(width, 4), scores=False)  # (a static tree's depth: the ids, no log-probs)

    return _drafter_ms(drafter, depth, repeats)


@torch.inference_mode()
def compiled_depth_cost_ms(
    drafter, compile: bool | str, depth: int = 4, repeats: int = 9, width: int = 4, batch: int = 1
) -> float:
    """ms a depth adds to the compiled draft of `batch` rows: static trees of `width` nodes a depth, 1 and
    `depth` deep, their difference / (depth - 1) (compiled, the depths are one graph: none times alone)."""
    ms = []
    for d in (1, depth):
        timed = drafter.with_tree([[0] * level + [rank] for level in range(d) for rank in range(width)])
        timed.use_compile(compile)
        ms.append(_drafter_ms(timed, propose_timer(timed, _noise(timed), batch), repeats))
    return max(ms[1] - ms[0], 0.0) / (depth - 1)


@torch.inference_mode()
def eagle_accept_cost_ms(drafter, tokens: int = 3, nodes: int = 8, repeats: int = 9) -> float:
    """ms of an EAGLE drafter's accept step (`accept_paths` of a `tokens`-node path of a verified
    `nodes`-node tree) after 128 committed, on the rows the drafter keeps."""
    states = _noise(drafter)
    drafter.start([torch.zeros(128, dtype=torch.long)], [states], [0])
    verified = {layer: state[None, :nodes] for layer, state in states.items()}  # [1, N, H]
    path, rows = list(range(tokens)), drafter._rows

    def accept() -> None:
        rows.rewind(128)  # every accept lands after the same 128 entries
        drafter.accept_paths([[0] * tokens], verified, [path], [0])

    return _drafter_ms(drafter, accept, repeats)


@torch.inference_mode()
def commit_cost_ms(
    model: PreTrainedModel, context: int = 128, repeats: int = 7, compile: bool | str = False
) -> float:
    """ms of the target's commit of the path [0, 2, 3] of a 4-node tree (K/V moved), compiled by `compile`."""
    runner = TargetRunner(model, compile=compile)
    runner.reserve([context], [8])
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (1, context), generator=torch.Generator().manual_seed(0))
    runner.prefill(list(ids))
    parents, path = torch.tensor([[-1, 0, 0, 2]]), torch.tensor([0, 2, 3])  # not contiguous: copies
    times = []
    for _ in range(repeats):
        runner.lengths = [context]  # (the last commit dropped: every pass after the same context)
        runner.verify(ids[:, :4], parents)
        times.append(wall_ms(lambda: runner.commit([path]), runner.device, 1))
    return min(times)


def calibrated_choices(
    model: PreTrainedModel,
    drafter,
    accuracy: torch.Tensor,
    max_nodes: int = 64,
    timed_as: TimedAs = EAGER,
    batch: int = 1,
) -> tuple[list[list[int]], dict]:
    """The static tree with the best expected speedup for `batch` rows measured on this device, and what
    was measured; the target's passes and the draft run as `timed_as` says (eager by default)."""
    sizes = tuple(s for s in SIZES if s <= max_nodes + 1)
    verify = verify_cost_ms(model, sizes, compile=timed_as.target, batch=batch)
    info: dict = {"verify_ms_by_size": verify, "step_ms": verify[1], "timed_as": asdict(timed_as)}
    info["pass_ms"] = commit_cost_ms(model, compile=timed_as.target)
    if family_of(drafter.head.config).drafts_per_depth and timed_as.draft:
        info["draft_ms_per_depth"] = compiled_depth_cost_ms(drafter, timed_as.draft, batch=batch)
        compiled = drafter.with_tree([[0]])
        compiled.use_compile(timed_as.draft)
        info["pass_ms"] += eagle_accept_cost_ms(compiled)  # (its commit as one graph)
    elif family_of(drafter.head.config).drafts_per_depth:
        info["draft_ms_per_depth"] = eagle_depth_cost_ms(drafter, width=4, batch=batch)
        info["pass_ms"] += eagle_accept_cost_ms(drafter)
    else:  # Medusa, P-EAGLE, DFlash: one pass for every depth, whatever the tree
        info["draft_ms"] = _drafter_ms(drafter, propose_timer(drafter, _noise(drafter, 1), batch), 7)
    return best_for_costs(accuracy, info, max_nodes), info


def spread(ranked: list[list[list[int]]], count: int) -> list[list[list[int]]]:
    """`count` trees of `ranked` (best first): the best of each size class (N nodes in (2^(c-1), 2^c]: a
    padded verify's bucket), then the next best. Neighbouring sizes cost alike, so decoding three of them
    tells little, and a misranked bucket (one noisy verify time) would go unchecked."""
    best: dict[int, list[list[int]]] = {}
    for choices in ranked:  # the first (best) of each size class, in ranked order
        best.setdefault(len(choices).bit_length(), choices)
    taken = list(best.values())[:count]
    return taken + [c for c in ranked if c not in taken][: count - len(taken)]


def best_for_costs(accuracy: torch.Tensor, info: dict, max_nodes: int) -> list[list[int]]:
    """The static tree with the best expected speedup for the costs in `info` (verify_ms_by_size, step_ms,
    draft_ms or draft_ms_per_depth, pass_ms); adds to `info` its expected_speedup and `ranked`: the
    CANDIDATES best trees, best first (what pass_timing.decoded_choice decodes)."""
    costs = {k: info.get(k, 0.0) for k in ("draft_ms", "draft_ms_per_depth", "pass_ms")}
    table, verify, step = accuracy.float(), info["verify_ms_by_size"], info["step_ms"]
    ranked = ranked_choices_for_cost(table, verify, step, max_nodes=max_nodes, **costs)
    choices, speedup = ranked[0] if ranked else ([], 0.0)
    info["ranked"] = spread([c for c, _ in ranked], CANDIDATES)
    info["expected_speedup"] = speedup
    return choices
