"""Drafters driven one pass ahead: accept and draft from an acceptance still on the device.

spec_ahead.py queues a drafter's accept of the verified path and its next draft before the host reads
which path was accepted, so both must take that path as device tensors with shapes that do not depend
on it. A drafter that can is wrapped in its `Ahead` form: EAGLE (drafters/eagle_ahead.py, compiled) and
Medusa (drafters/medusa_ahead.py). Their children are deterministic (top-k), so rule A keeps sampling
lossless; drafters that draw children, or hear more than the path, keep the loop that reads first.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from spechead.inference.drafters.base import Draft
from spechead.inference.drafters.eagle_ahead import EagleAhead, runs_ahead
from spechead.inference.drafters.medusa_ahead import MedusaAhead


class Ahead(Protocol):
    """A drafter's queued form. size: the accepted path's length at least that `accept` reads."""

    size: int

    def accept(
        self, hidden: dict[int, Tensor], tokens: Tensor, path: Tensor, k: Tensor, next_token: Tensor
    ) -> None:
        """Queue the drafter's accept: the verified tree's states {layer: [1, N, H]} and tokens [N], the
        path [>= size] (the accepted nodes ascending, the last repeated), K [0-d], the next token [0-d]."""

    def propose(self, root: Tensor) -> Draft:
        """Queue the next draft from the root, a one-element device tensor."""

    def settle(self, k: int, next_token: int) -> None:
        """The host has read K and the next token: its bookkeeping follows."""


def ahead_of(drafter: object, greedy: bool) -> Ahead | None:
    """`drafter`'s queued form where it can run ahead (greedy, or sampled over deterministic children),
    else None."""
    if runs_ahead(drafter) and (greedy or drafter.rule == "deterministic"):
        return EagleAhead(drafter)
    if MedusaAhead.runs_ahead(drafter):
        return MedusaAhead(drafter)
    return None
