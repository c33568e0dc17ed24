"""PhaseClock: the time between two marks goes to the phase named by the later mark, and totals() closes
the last stretch as "other", so the phases add up to the whole time since the clock started."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import torch

from spechead.inference import phase_clock
from spechead.inference.phase_clock import PhaseClock


def test_each_stretch_goes_to_its_phase_and_the_phases_add_up(monkeypatch):
    """With a clock that ticks one second per reading: start 0, prefill 1, draft 2, verify 3, draft 4,
    then totals() marks "other" at 5: prefill 1 s, draft 2 s, verify 1 s, other 1 s (5 s in all)."""
    ticks = itertools.count()
    monkeypatch.setattr(phase_clock, "time", SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    clock = PhaseClock(torch.device("cpu"))
    for phase in ("prefill", "draft", "verify", "draft"):
        clock.mark(phase)
    totals = clock.totals()
    assert totals == {"prefill": 1.0, "draft": 2.0, "verify": 1.0, "other": 1.0}
    assert sum(totals.values()) == 5.0
