"""inference/profiling.py on a CPU: medians, host-op counts and the rendered table."""

from __future__ import annotations

import time

import torch

from spechead.inference.profiling import Timer, count_syncs, profile_part, profile_parts, render_profiles


def test_timer_takes_the_median_of_its_timed_calls_and_runs_setup_untimed():
    calls = {"setup": 0, "fn": 0}
    durations = iter([0.0, 0.0, 0.03, 0.001, 0.002])  # two warm-ups, then three timed calls

    def fn():
        calls["fn"] += 1
        time.sleep(next(durations))

    def setup():
        calls["setup"] += 1
        time.sleep(0.02)  # untimed: must not show in the median

    ms = Timer(torch.device("cpu"), iters=3, warmup=2).ms(fn, setup)
    assert calls == {"setup": 5, "fn": 5}
    assert 2.0 <= ms < 15.0  # the median call slept 2 ms; the 30 ms one and the setups do not count


def test_profile_counts_host_ops_per_call_and_ranks_them():
    x = torch.randn(32, 32)
    p = profile_part(lambda: (x @ x).relu().sum(), torch.device("cpu"), iters=3)
    assert p.device_ms is None and p.kernels is None and p.wall_ms > 0
    names = [name for name, _, _ in p.top]
    assert {"aten::mm", "aten::relu", "aten::sum"} <= set(names)
    assert all(n == 1 for name, _, n in p.top if name in ("aten::mm", "aten::sum"))  # per call, not per 3
    more = profile_part(lambda: (x @ x @ x).relu().sum(), torch.device("cpu"), iters=3)
    assert more.host_ops > p.host_ops
    assert len(profile_part(lambda: (x @ x).relu().sum(), torch.device("cpu"), iters=1, top=2).top) == 2


def test_render_has_a_row_and_a_top_line_per_part():
    x = torch.randn(8, 8)
    lines = render_profiles(
        profile_parts({"a": lambda: x + 1, "b": lambda: x * 2}, torch.device("cpu"), iters=2)
    )
    assert lines[0].startswith("profile (per call) | wall ms | kernel ms")
    assert lines[1].startswith("a ") and lines[2].startswith("b ")
    # each part's own op among its top ops, not necessarily first: `x + 1` also runs an aten::_to_copy (the
    # Python scalar made a tensor of x's dtype), which once ranked above the add in a full CI run
    assert lines[3].startswith("  a top: ") and "aten::add " in lines[3]
    assert lines[4].startswith("  b top: ") and "aten::mul " in lines[4]
    many = profile_parts({"c": lambda: (x @ x).relu().sum() * 2}, torch.device("cpu"), iters=1)
    assert len(many["c"].top) > 2 and render_profiles(many, top=2)[2].count(" ms x") == 2  # kept, printed


def test_count_syncs_runs_fn_and_counts_nothing_off_cuda():
    calls = []
    out, syncs = count_syncs(torch.device("cpu"), lambda: calls.append(1) or "done")
    assert (out, syncs, calls) == ("done", 0, [1])
