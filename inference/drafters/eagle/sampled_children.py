"""Children drawn from an EAGLE head's distribution when decoding samples, verified by rule C.

Rule A accepts a head's top-k child with the target's probability of it; rules B/C accept a drawn child x
with min(1, p(x) / q(x)), on average 1 - TV(p, q): more at temperatures near 1 (docs/PERFORMANCE.md).
Each expanded node's children are k draws WITHOUT replacement from q = softmax(head logits / T) (no top-k
or top-p: a truncated q is no better and costs a sort), in draw order: a tree's rank-r child is the r-th
draw, and `acceptance.sample_accept` tries them in that order. q is floored above zero so that k draws
never run out of ids; the acceptance gets the very q the draws used.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from spechead.inference.drafters.eagle.static_plan import StaticPlan
from spechead.inference.sampling import SamplingParams, inverse_cdf

FLOOR = 1e-30  # every id's least draft probability (fp32 keeps it; Vd * FLOOR is no mass at all)


def draft_probs(logits: Tensor, temperature: float, floor: bool = True) -> Tensor:
    """q [..., Vd] fp32 that children are drawn from: softmax(logits / temperature), floored at FLOOR
    (needed by k > 1 draws only: one draw by inverse CDF never picks an id of no mass)."""
    x = logits.float() if temperature == 1.0 else logits.float() / temperature
    q = torch.softmax(x, dim=-1)
    return q.clamp_min_(FLOOR) if floor else q


def draw_without_replacement(q: Tensor, k: int, generator: torch.Generator | None) -> Tensor:
    """[..., k] ids: k draws without replacement from each row of q [..., Vd] (weights > 0, need not sum
    to 1), in draw order: one draw by inverse CDF; k > 1 the ids of the k largest q / Exp(1) keys (fp64)."""
    if k == 1:  # (a chain's every depth: a quarter of the ops over [E, Vd] that the races take)
        return inverse_cdf(q, generator)  # [..., 1]
    uniform = torch.rand(q.shape, dtype=torch.float64, device=q.device, generator=generator)  # [..., Vd]
    races = uniform.log_().neg_()  # Exp(1) (a U of 0 gives inf: that id's key 0, odds 2**-53 an id)
    return torch.topk(q.double() / races, k, dim=-1).indices  # (exponential_ costs 4x this on a CPU)


class SampledChildren:
    """Each depth's children of an eager static draft (rows.py, a batch of one) drawn from the head instead
    of its top-k; it keeps each depth's q for `q_rows`."""

    def __init__(
        self,
        head_logits: Callable[[Tensor], Tensor],
        sampling: SamplingParams,
        generator: torch.Generator | None,
        vocab: int,
    ) -> None:
        self.head_logits, self.generator = head_logits, generator
        self.temperature = sampling.temperature  # q's (top-k and top-p stay the target's alone)
        self.vocab = vocab  # V: the target's vocabulary, which q rows span
        self.q_by_depth: list[Tensor] = []  # per depth: q [1, E, Vd] of the nodes it expanded

    def top(self, features: Tensor, k: int) -> Tensor:
        """Output features [1, E, H] -> k drawn head-vocab ids per node [1, E, k], in draw order."""
        logits = self.head_logits(features)  # [1, E, Vd]
        q = draft_probs(logits, self.temperature, floor=k > 1)  # [1, E, Vd]
        generator = self.generator if self.generator is None or self.generator.device == q.device else None
        self.q_by_depth.append(q)
        return draw_without_replacement(q, k, generator)  # [1, E, k]

    def q_rows(self, plan: StaticPlan, d2t: Tensor | None) -> Tensor:
        """q [N, V] over the target's vocabulary for the emitted tree: row i = the distribution node i's
        children were drawn from (zero for leaves); d2t [Vd] maps head ids to target ids (None: the
        same). Summed where two head ids map to one target id."""
        many = len(self.q_by_depth) > 1
        rows = (torch.cat(self.q_by_depth, dim=1) if many else self.q_by_depth[0])[0]  # [sum E, Vd]
        q = rows.new_zeros(len(plan.order), rows.shape[1])  # [N, Vd]
        q[plan.expanded] = rows
        if d2t is None and rows.shape[1] == self.vocab:
            return q
        assert d2t is not None  # (a head over fewer ids than the target's maps them)
        return q.new_zeros(len(q), self.vocab).index_add_(1, d2t, q)  # [N, V]
