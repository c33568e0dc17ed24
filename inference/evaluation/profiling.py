"""Where a part of a pass spends its time: wall clock against the device's kernels (torch.profiler).
wall - kernels is what host work, launches and syncs cost (what CUDA graphs remove); on a CPU the host
ops are counted instead.
"""

from __future__ import annotations

import statistics
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from spechead.inference.phase_clock import seconds_between, stamper


class Timer:
    """Median ms of fn() over `iters` runs after `warmup` ones, `setup` untimed before each; stamps
    (`phase_clock.stamper`) read after the last call: no sync between calls."""

    def __init__(self, device: torch.device, iters: int, warmup: int) -> None:
        self.device, self.iters, self.warmup = device, iters, warmup

    def ms(self, fn: Callable[[], object], setup: Callable[[], object] | None = None) -> float:
        setup = setup or (lambda: None)
        for _ in range(self.warmup):
            setup()
            fn()
        stamp, spans = stamper(self.device), []
        for _ in range(self.iters):
            setup()
            start = stamp()
            fn()
            spans.append((start, stamp()))
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # (the events were recorded on the current device)
        return statistics.median(1e3 * seconds_between(start, end) for start, end in spans)


def copy_bandwidth(device: torch.device, timer: Timer, nbytes: int) -> float:
    """Device copy bandwidth in bytes/s: read + write of an nbytes buffer."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / (timer.ms(lambda: dst.copy_(src)) / 1e3)


@dataclass
class PartProfile:
    """One part's profile, per call: wall ms, device kernel ms and kernel count (None on a CPU), host
    ops, and the most expensive kernels (or ops) as (name, ms per call, launches per call)."""

    wall_ms: float
    device_ms: float | None
    kernels: float | None
    host_ops: float
    top: list[tuple[str, float, float]] = field(default_factory=list)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall_ms(fn: Callable[[], object], device: torch.device, iters: int, warmup: int = 0) -> float:
    """Median wall ms (the host's clock) of fn() over `iters` calls after `warmup` untimed ones, the device
    synchronised around each: what decoding pays (CPU time would miss torch's intra-op threads)."""

    def synced() -> None:
        fn()
        _sync(device)

    return Timer(torch.device("cpu"), iters, warmup).ms(synced, setup=lambda: _sync(device))


def profile_part(
    fn: Callable[[], object], device: torch.device, iters: int = 5, top: int = 30
) -> PartProfile:
    """fn()'s PartProfile per call over `iters` calls after an untimed one, with its `top` dearest kernels."""
    wall = wall_ms(fn, device, iters, warmup=1)
    cuda = device.type == "cuda"
    _sync(device)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(iters):
            fn()
        _sync(device)
    events = prof.key_averages()
    ops = [e for e in events if e.key.startswith("aten::")]
    # CUDA: kernels (device memcpy / memset too) by own device time; a CPU: aten ops by self CPU time
    rows = [e for e in events if e.device_type == DeviceType.CUDA] if cuda else ops
    cost = {e.key: e.self_device_time_total if cuda else e.self_cpu_time_total for e in rows}
    ranked = sorted(rows, key=lambda e: cost[e.key], reverse=True)[:top]
    return PartProfile(
        wall_ms=wall,
        device_ms=sum(cost.values()) / 1e3 / iters if cuda else None,
        kernels=sum(e.count for e in rows) / iters if cuda else None,
        host_ops=sum(e.count for e in ops) / iters,
        top=[(e.key[:80], cost[e.key] / 1e3 / iters, e.count / iters) for e in ranked],
    )


def render_profiles(profiles: dict[str, PartProfile], top: int = 8) -> list[str]:
    """Text lines: one row per part (wall, kernels, idle = wall - kernels), then each part's `top` kernels."""
    lines = [
        "profile (per call) | wall ms | kernel ms | idle ms (host, launches, syncs) | kernels | host ops"
    ]
    for name, p in profiles.items():
        busy = "-" if p.device_ms is None else f"{p.device_ms:.3f}"
        idle = "-" if p.device_ms is None else f"{p.wall_ms - p.device_ms:.3f}"
        kernels = "-" if p.kernels is None else f"{p.kernels:.0f}"
        lines.append(
            f"{name:18s} | {p.wall_ms:7.3f} | {busy:9s} | {idle:31s} | {kernels:7s} | {p.host_ops:.0f}"
        )
    for name, p in profiles.items():
        lines.append(f"  {name} top: " + "; ".join(f"{k} {ms:.3f} ms x{n:.0f}" for k, ms, n in p.top[:top]))
    return lines


def count_syncs(device: torch.device, fn: Callable[[], object]) -> tuple[object, int]:
    """fn() and how many times it made the host wait for the GPU (sync debug mode warnings); 0 off CUDA."""
    if device.type != "cuda":
        return fn(), 0
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            out = fn()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    return out, sum("synchroniz" in str(w.message) for w in seen)
