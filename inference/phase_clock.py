"""Wall time per decoding phase (prefill, draft, verify, other), without synchronising inside the loop."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

import torch


class PhaseClock:
    """Time between marks, attributed to the named phase (the later mark's), read once at the end."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, Any]] = []  # (phase, its stamp)
        self._stamp = stamper(device)
        self.start: Any = self._stamp()

    def mark(self, phase: str) -> None:
        self.marks.append((phase, self._stamp()))

    def totals(self) -> dict[str, float]:
        """Seconds per phase (prefill, draft, verify, other) since the clock started."""
        self.mark("other")
        if self.cuda:
            torch.cuda.synchronize()
        out = dict.fromkeys(("prefill", "draft", "verify", "other"), 0.0)
        for (_, start), (phase, end) in itertools.pairwise([("", self.start), *self.marks]):
            out[phase] += seconds_between(start, end)
        return out


def stamper(device: torch.device) -> Callable[[], Any]:
    """What stamps a moment on `device`: CUDA, an event recorded on the current stream (resolved after one
    synchronisation, so timing never stalls the device); a CPU, perf_counter itself (no call between)."""
    return _event if device.type == "cuda" else time.perf_counter


def seconds_between(start: Any, end: Any) -> float:
    """Seconds from one stamp to a later one (CUDA events: after a synchronisation)."""
    return start.elapsed_time(end) / 1e3 if isinstance(start, torch.cuda.Event) else end - start


def _event() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event
