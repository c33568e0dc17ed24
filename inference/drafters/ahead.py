"""A batch-1 drafter's queued form: accept and draft from an acceptance still on the device.

The engine (engine/loop.py) queues a drafter's accept of the verified path and its next draft before the
host reads which path was accepted, so both must take that path as device tensors with shapes that do not
depend on it. A batch-1 drafter that can is driven through its `Ahead` form (drafters/base.py): EAGLE
(drafters/eagle_ahead.py, compiled). Its children are deterministic (top-k), so rule A keeps sampling
lossless; drafters that draw children, or hear more than the path, are read first. (A drafter that is a
`BatchDrafter` itself, Medusa, has its queued form in its own class: `BatchDrafter.queues`.)
"""

from __future__ import annotations

from spechead.inference.drafters.base import Ahead
from spechead.inference.drafters.eagle_ahead import EagleAhead, runs_ahead


def ahead_of(drafter: object, greedy: bool) -> Ahead | None:
    """`drafter`'s queued form where it can run ahead (greedy, or sampled over deterministic children),
    else None."""
    if runs_ahead(drafter) and (greedy or drafter.rule == "deterministic"):
        return EagleAhead(drafter)
    return None
