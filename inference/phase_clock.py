"""Wall time per decoding phase (prefill, draft, verify, other), without synchronising inside the loop."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


class PhaseClock:
    """Time between marks, attributed to the named phase. CPU: perf_counter. CUDA: events, resolved
    once at the end (no synchronisation inside the decoding loop)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, Any]] = []  # (phase, an event or a float)
        # a stamp: a recorded CUDA event, or on a CPU perf_counter itself (no Python call in between)
        self._stamp: Callable[[], Any] = _event if self.cuda else time.perf_counter
        self.start: Any = self._stamp()

    def mark(self, phase: str) -> None:
        self.marks.append((phase, self._stamp()))

    def totals(self) -> dict[str, float]:
        """Seconds per phase (prefill, draft, verify, other) since the clock started."""
        self.mark("other")
        if self.cuda:
            torch.cuda.synchronize()
        out = dict.fromkeys(("prefill", "draft", "verify", "other"), 0.0)
        last = self.start
        for phase, stamp in self.marks:
            out[phase] += last.elapsed_time(stamp) / 1e3 if self.cuda else stamp - last
            last = stamp
        return out


def _event() -> torch.cuda.Event:
    """A CUDA event recorded now on the current stream (timed)."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event
