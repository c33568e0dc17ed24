"""tests/workers.py: `pytest -n auto` starts one worker per CPU the run may use, quota included."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

AFFINITY = len(os.sched_getaffinity(0))


def cgroup(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({}, AFFINITY),  # no cgroup files: the affinity mask
        ({"cpu.max": "max 100000\n"}, AFFINITY),  # v2, no quota
        ({"cpu.max": "100000 100000\n"}, 1),  # v2: one CPU's worth
        ({"cpu.max": "50000 100000\n"}, 1),  # half a CPU: still one worker
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, AFFINITY),  # v1, no quota
        ({"cpu/cpu.cfs_quota_us": "100000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1),  # v1: one CPU
    ],
)
def test_the_quota_caps_the_affinity(workers, tmp_path, files, expected):
    assert workers.usable_cpus(cgroup(tmp_path, files)) == expected


def test_a_quota_above_the_affinity_leaves_it(workers, tmp_path):
    many = f"{100000 * (AFFINITY + 8)} 100000"
    assert workers.usable_cpus(cgroup(tmp_path, {"cpu.max": many})) == AFFINITY


def test_auto_uses_it(workers, pytestconfig):
    assert pytestconfig.hook.pytest_xdist_auto_num_workers(config=pytestconfig) == workers.usable_cpus()


@pytest.mark.xdist_group("one_worker")
def test_a_group_is_sent_to_one_worker(request):
    """pyproject's `--dist loadgroup` sends an `xdist_group`'s tests to one worker, so a module's costly
    fixture is built once (test_bench_gpu's tiny run). xdist names a grouped test `nodeid@group`; a pytest
    where that renaming is lost (9.2 with xdist 3.8) spreads the group silently, and fails here."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        pytest.skip("runs under `pytest -n`")
    assert request.config.getvalue("loadgroup"), "pyproject's addopts lost --dist loadgroup"
    assert request.node.nodeid.endswith("@one_worker"), request.node.nodeid
