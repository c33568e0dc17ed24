"""How many pytest workers `-n auto` starts (tests/conftest.py's pytest_xdist_auto_num_workers)."""

from __future__ import annotations

import os
from pathlib import Path


def usable_cpus(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """CPUs this process may run on: its affinity mask, capped by the cgroup's CPU quota (v2 `cpu.max`,
    v1 `cpu/cpu.cfs_quota_us`), rounded down, at least 1."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = None
    try:
        fields = (cgroup / "cpu.max").read_text().split()  # "max 100000" or "200000 100000"
        if fields[0] != "max":
            quota = int(fields[0]) / int(fields[1])
    except (OSError, ValueError, IndexError):
        try:
            q = int((cgroup / "cpu" / "cpu.cfs_quota_us").read_text())
            if q > 0:
                quota = q / int((cgroup / "cpu" / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            pass
    return max(1, min(n, int(quota)) if quota is not None else n)
