"""Choosing the layers a self-speculative drafter skips (scripts/search_skip.py): acceptance from one
teacher-forced pass per candidate, cost from timed forwards, a beam search over skip sets.

Exact greedy acceptance without decoding: a greedy chain keeps a draft only while every earlier one
matched the target's continuation, so every draft sees the target's tokens, and one forward of the draft
over prompt + greedy continuation gives every prediction the decoder would see (`draft_matches`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import takewhile
from typing import TYPE_CHECKING

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import PreTrainedModel

from spechead.inference import stats
from spechead.inference.evaluation.profiling import wall_ms
from spechead.inference.sampling import SamplingParams

if TYPE_CHECKING:
    from spechead.inference.drafters.draft_model import DraftModelDrafter


@torch.inference_mode()
def draft_matches(
    draft: PreTrainedModel, sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int], batch: int = 8
) -> list[torch.Tensor]:
    """Per sequence (prompt [P] + generated [n]): bool [n - 1], the draft's argmax at generated token j
    (position P + j) == generated token j + 1. Right-padded batches of `batch` sequences."""
    out = []
    for start in range(0, len(sequences), batch):
        rows = sequences[start : start + batch]
        # [B, T]; the zeros padding a row never reach its own predictions
        ids = pad_sequence([torch.as_tensor(r, dtype=torch.long) for r in rows], batch_first=True)
        predicted = draft(input_ids=ids.to(draft.device), use_cache=False).logits.argmax(-1).cpu()  # [B, T]
        for b, row in enumerate(rows):
            p = prompt_lengths[start + b]
            out.append(predicted[b, p : len(row) - 1] == ids[b, p + 1 : len(row)])  # [n - 1]
    return out


def chain_accept_lengths(match: torch.Tensor, k: int) -> list[int]:
    """Tokens each target pass emits (accepted drafts + 1, the last pass clipped) when a chain of `k`
    drafts decodes the n = len(match) + 1 generated tokens; the prefill emitted token 0."""
    hits = match.tolist()
    n, emitted, root, lengths = len(hits) + 1, 1, 0, []
    while emitted < n:
        accepted = len(list(takewhile(bool, hits[root : root + k])))  # the leading hits of k drafts
        step = min(accepted + 1, n - emitted)
        lengths.append(step)
        emitted += step
        root += accepted + 1
    return lengths


def pooled_tau(matches: Sequence[torch.Tensor], k: int) -> float:
    """Emitted tokens per target pass over every pass of every sequence (as the benchmark pools it)."""
    return stats.pooled_tau([x for m in matches for x in chain_accept_lengths(m, k)])


@torch.inference_mode()
def time_draft(drafter: DraftModelDrafter, context: int = 128, repeats: int = 9) -> float:
    """Median seconds of one greedy drafter pass (accept one draft + the bonus, then propose) after
    `context` committed tokens and a warm-up: its forwards and its Python / cache work."""
    vocab = drafter.model.config.vocab_size
    prompt = torch.randint(5, vocab, (context,), generator=torch.Generator().manual_seed(0))
    drafter.start(prompt, {}, 7)
    greedy = SamplingParams()
    draft = drafter.propose(7, greedy, None)

    def run() -> None:
        nonlocal draft
        drafter.accept(draft.tree.tokens[:2], {}, 9)
        draft = drafter.propose(9, greedy, None)

    return wall_ms(run, drafter.model.device, repeats, warmup=1) / 1e3


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> list[float]:
    """Least-squares line through (xs, ys), evaluated at xs (smooths a linearly growing cost's timings)."""
    x = torch.tensor(xs, dtype=torch.float64)
    design = torch.stack([torch.ones_like(x), x], 1)  # [n, 2]
    coef = torch.linalg.lstsq(design, torch.tensor(ys, dtype=torch.float64).unsqueeze(1)).solution  # [2, 1]
    return (design @ coef).squeeze(1).tolist()


@dataclass(frozen=True)
class Costs:
    """Seconds, timed through the real engine: a plain target step (1 token), a verification pass of a
    chain of k drafts [k + 1 tokens] by k, and a drafter pass by (kept layers, k)."""

    step: float
    verify: dict[int, float]
    draft: dict[tuple[int, int], float]

    def speedup(self, tau: float, k: int, kept: int) -> float:
        """Expected speedup over plain decoding: tau * t_step / (t_verify(k + 1) + t_draft(kept, k))."""
        return tau * self.step / (self.verify[k] + self.draft[kept, k])


@dataclass(frozen=True)
class Candidate:
    skip: tuple[int, ...]
    num_draft: int
    tau: float
    speedup: float


def best_chain(
    skip: tuple[int, ...], matches: Sequence[torch.Tensor], costs: Costs, num_layers: int
) -> Candidate:
    """The chain length (one of costs.verify) with the highest expected speedup for this skip set."""
    kept = num_layers - len(skip)
    speedup, k = max((costs.speedup(pooled_tau(matches, k), k, kept), k) for k in sorted(costs.verify))
    return Candidate(skip, k, pooled_tau(matches, k), speedup)


def beam_search(
    evaluate: Callable[[tuple[int, ...]], Candidate],
    num_layers: int,
    beam: int = 4,
    max_skip: int | None = None,
) -> dict[tuple[int, ...], Candidate]:
    """Grow skip sets one layer at a time, keeping the `beam` best per size (up to `max_skip` layers,
    default L - 1); returns every candidate evaluated, by skip set."""
    seen: dict[tuple[int, ...], Candidate] = {}
    frontier: list[tuple[int, ...]] = [()]
    for _ in range(max_skip if max_skip is not None else num_layers - 1):
        grown = sorted({tuple(sorted((*s, i))) for s in frontier for i in range(num_layers) if i not in s})
        seen.update({skip: evaluate(skip) for skip in grown if skip not in seen})
        frontier = sorted(grown, key=lambda s: -seen[s].speedup)[:beam]
    return seen
