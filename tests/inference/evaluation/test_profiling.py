"""inference/evaluation/profiling.py on a CPU: medians, host-op counts and the rendered table."""

from __future__ import annotations

import time

import torch

from spechead.inference.evaluation.profiling import (
    PartProfile,
    Timer,
    copy_bandwidth,
    count_syncs,
    profile_part,
    render_profiles,
    wall_ms,
)


def test_timer_takes_the_median_of_its_timed_calls_and_runs_setup_untimed():
    calls = {"setup": 0, "fn": 0}
    durations = iter([0.0, 0.0, 0.06, 0.001, 0.002])  # two warm-ups, then three timed calls

    def fn():
        calls["fn"] += 1
        time.sleep(next(durations))

    def setup():
        calls["setup"] += 1
        time.sleep(0.02)  # untimed: must not show in the median

    ms = Timer(torch.device("cpu"), iters=3, warmup=2).ms(fn, setup)
    assert calls == {"setup": 5, "fn": 5}
    assert (
        2.0 <= ms < 15.0
    )  # the median call slept 2 ms; the 60 ms one (mean: 21 ms) and the setups do not count


def test_profile_counts_host_ops_per_call_and_ranks_them():
    x = torch.randn(32, 32)
    p = profile_part(lambda: (x @ x).relu().sum(), torch.device("cpu"), iters=3)
    assert p.device_ms is None and p.kernels is None and p.wall_ms > 0
    names = [name for name, _, _ in p.top]
    assert {"aten::mm", "aten::relu", "aten::sum"} <= set(names)
    assert all(n == 1 for name, _, n in p.top if name in ("aten::mm", "aten::sum"))  # per call, not per 3
    assert abs(p.host_ops - sum(n for _, _, n in p.top)) < 1e-9  # every aten op ranked (fewer than 30)
    more = profile_part(lambda: (x @ x @ x).relu().sum(), torch.device("cpu"), iters=3)
    assert more.host_ops > p.host_ops
    assert len(profile_part(lambda: (x @ x).relu().sum(), torch.device("cpu"), iters=1, top=2).top) == 2


def test_render_has_a_row_and_a_top_line_per_part():
    x = torch.randn(8, 8)
    lines = render_profiles(
        {
            name: profile_part(fn, torch.device("cpu"), iters=2)
            for name, fn in (("a", lambda: x + 1), ("b", lambda: x * 2))
        }
    )
    assert lines[0].startswith("profile (per call) | wall ms | kernel ms")
    assert lines[1].startswith("a ") and lines[2].startswith("b ")
    # each part's own op among its top ops, not necessarily first: `x + 1` also runs an aten::_to_copy (the
    # Python scalar made a tensor of x's dtype), which once ranked above the add in a full CI run
    assert lines[3].startswith("  a top: ") and "aten::add " in lines[3]
    assert lines[4].startswith("  b top: ") and "aten::mul " in lines[4]
    many = {"c": profile_part(lambda: (x @ x).relu().sum() * 2, torch.device("cpu"), iters=1)}
    assert len(many["c"].top) > 2 and render_profiles(many, top=2)[2].count(" ms x") == 2  # kept, printed


def test_count_syncs_runs_fn_and_counts_nothing_off_cuda():
    calls = []
    out, syncs = count_syncs(torch.device("cpu"), lambda: calls.append(1) or "done")
    assert (out, syncs, calls) == ("done", 0, [1])


def test_wall_ms_is_the_median_call_in_milliseconds():
    durations = iter([0.05, 0.004, 0.006])
    ms = wall_ms(lambda: time.sleep(next(durations)), torch.device("cpu"), iters=3)
    assert 5.0 <= ms < 30.0  # the median call slept 6 ms: not the 50 ms one, not seconds nor microseconds


def test_wall_ms_leaves_the_warm_up_calls_out():
    durations = iter([0.1, 0.004, 0.004, 0.004])
    calls = []
    ms = wall_ms(lambda: calls.append(1) or time.sleep(next(durations)), torch.device("cpu"), 3, warmup=1)
    assert ms < 50.0 and len(calls) == 4  # the 100 ms first call ran untimed, then the 3 timed ones


def test_profile_part_times_after_an_untimed_first_call():
    """The first call (compilation, caches) is run untimed: the single timed call here is a fast one."""
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.06 if len(calls) == 1 else 0.0)

    p = profile_part(fn, torch.device("cpu"), iters=1)
    assert p.wall_ms < 30.0 and len(calls) == 3  # untimed, timed, profiled


def test_profile_part_reports_per_call_op_time_ranked_and_aten_ops_only():
    """host_ops and the top ops' ms are per call (not summed over the iterations), ranked most expensive
    first; a record_function region is not an op."""
    y = torch.randn(384, 384)

    def fn():
        with torch.profiler.record_function("my_region"):
            return (y @ y).relu()

    one, many = (profile_part(fn, torch.device("cpu"), iters=n) for n in (1, 16))
    assert one.host_ops == many.host_ops > 0
    names = [name for name, _, _ in many.top]
    assert names[0] == "aten::mm" and all(name.startswith("aten::") for name in names)
    costs = [ms for _, ms, _ in many.top]
    assert costs == sorted(costs, reverse=True)
    # one matmul's time per call over 16 calls is about one call's (summed over the 16 it is 16 times it;
    # a loose bound, as the two are timed apart on a shared machine)
    assert 0 < costs[0] < 4 * one.top[0][1]


def test_render_a_device_part_shows_kernel_idle_ms_and_kernel_count():
    """A GPU part's row (built by hand: no GPU here): idle is wall - kernel ms, kernels and host ops per call."""
    part = PartProfile(wall_ms=2.5, device_ms=0.75, kernels=12.0, host_ops=30.0, top=[("gemm", 0.5, 2.0)])
    lines = render_profiles({"verify": part})
    assert lines[1].split(" | ") == [
        "verify            ",
        "  2.500",
        "0.750    ",
        f"{'1.750':31s}",
        "12     ",
        "30",
    ]
    assert lines[2] == "  verify top: gemm 0.500 ms x2"


def test_copy_bandwidth_counts_the_read_and_the_write():
    class FixedTimer(Timer):  # the copy runs; its time is fixed, so the bandwidth is exact
        def ms(self, fn, setup=None):
            fn()
            return 4.0

    nbytes = 1 << 20
    assert (
        copy_bandwidth(torch.device("cpu"), FixedTimer(torch.device("cpu"), 1, 0), nbytes)
        == 2 * nbytes / 4e-3
    )
