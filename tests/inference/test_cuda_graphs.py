"""GraphedFunction's bookkeeping on a CPU (the real capture and replay run in test_cuda.py on a GPU)."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch

from spechead.inference.cuda_graphs import GraphCaptureError, GraphedFunction, collection_paused
from spechead.inference.target.cache import RowCache


def _write(dst, src) -> None:
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    else:
        for d, s in zip(dst, src):
            _write(d, s)


class Recorded(GraphedFunction):
    """A CPU stand-in for a CUDA graph: capturing keeps the call (on the captured inputs), a replay runs
    it again and writes its results into the captured outputs, as a graph's kernels write theirs."""

    def _record(self, call, device):
        self.recorded = getattr(self, "recorded", 0) + 1
        return call, call()

    def _replay(self, entry):
        _write(entry.outputs, entry.graph())


def test_replays_read_each_calls_inputs_and_hand_out_copies():
    calls = []

    def fn(x, *, scale):
        calls.append(x.shape)
        return x * scale, (x + 1,)

    f = Recorded(fn)
    first, (plus,) = f(torch.ones(3), scale=torch.tensor(2.0))
    assert first.tolist() == [2.0] * 3 and plus.tolist() == [2.0] * 3 and f.captures == 1
    second, (plus2,) = f(torch.arange(3.0), scale=torch.tensor(3.0))  # same signature: a replay
    assert second.tolist() == [0.0, 3.0, 6.0] and plus2.tolist() == [1.0, 2.0, 3.0] and f.captures == 1
    assert first.tolist() == [2.0] * 3  # copies: the replay did not overwrite an earlier output
    third, _ = f(torch.arange(3.0), scale=torch.tensor(3.0))
    assert third is not second and third.tolist() == second.tolist()


def test_keyword_arguments_bind_by_name_whatever_order_they_come_in():
    f = Recorded(lambda *, b, a: a - b)
    assert f(b=torch.ones(2), a=torch.full((2,), 5.0)).tolist() == [4.0, 4.0]
    assert f(a=torch.full((2,), 7.0), b=torch.ones(2)).tolist() == [6.0, 6.0] and f.captures == 1


def test_a_new_shape_dtype_or_plain_value_is_a_new_graph():
    f = Recorded(lambda x, k: x[:k] * 2)
    f(torch.ones(4), 2)
    f(torch.ones(4), 2)
    assert f.captures == 1
    f(torch.ones(5), 2)  # shape
    f(torch.ones(4, dtype=torch.float64), 2)  # dtype
    out = f(torch.ones(4), 3)  # a non-tensor argument's value
    assert f.captures == 4 and out.tolist() == [2.0] * 3
    assert f(torch.arange(4.0), 2).tolist() == [0.0, 2.0]  # the first graph, replayed


def test_a_changed_state_drops_every_graph():
    """The graphs read buffers besides their arguments by address: once those move (state changes),
    none may replay; the next call captures again."""
    holder = {"buf": torch.ones(3), "generation": 0}
    f = Recorded(lambda x: x + holder["buf"], state=lambda: holder["generation"])
    f(torch.zeros(3))
    f(torch.zeros(3))
    assert f.captures == 1
    holder.update(buf=torch.full((3,), 5.0), generation=1)
    assert f(torch.zeros(3)).tolist() == [5.0] * 3 and f.captures == 2
    assert len(f._graphs) == 1


def test_an_input_that_is_the_captured_buffer_is_not_copied_onto_itself():
    f = Recorded(lambda x: x * 2)
    f(torch.ones(2))
    (static,) = next(iter(f._graphs.values())).inputs
    static.fill_(4.0)
    assert f(static).tolist() == [8.0, 8.0]


class _Cycle:
    """An object in a reference cycle, counted in `freed` when the collector frees it."""

    def __init__(self, freed: list) -> None:
        self.me, self.freed = self, freed

    def __del__(self) -> None:
        self.freed.append(1)


def test_no_collection_runs_inside_the_pause_and_it_restores_the_collector():
    """A dead cycle (a dead generator's graphs) is not freed inside the pause however much is allocated
    there, and is freed by the next collection after it; the collector comes back as it was."""
    freed: list = []
    assert gc.isenabled()
    with collection_paused():
        _Cycle(freed)
        assert not gc.isenabled()
        junk = [[i] for i in range(50_000)]  # far past the first generation's threshold
        assert freed == []
    del junk
    assert gc.isenabled()
    gc.collect()
    assert freed == [1]
    gc.disable()
    try:
        with collection_paused():
            pass
        assert not gc.isenabled()  # off before: left off
    finally:
        gc.enable()
    with pytest.raises(RuntimeError), collection_paused():
        raise RuntimeError("a failed capture")
    assert gc.isenabled()


def test_the_capture_and_only_it_runs_without_collections(monkeypatch):
    """GraphedFunction pauses collections around the capture, not around the first (warm-up) call or a
    replay. torch.cuda.graph's stand-in runs the call, as capturing does on a GPU."""
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: "graph")
    monkeypatch.setattr(torch.cuda, "graph", lambda graph: contextlib.nullcontext())
    seen = []
    f = GraphedFunction(lambda x: (seen.append(gc.isenabled()), x * 2)[1])
    f._replay = lambda entry: seen.append(("replay", gc.isenabled()))
    f(torch.ones(2))
    f(torch.ones(2))
    assert seen == [True, False, ("replay", True)] and gc.isenabled()


def test_a_call_that_cannot_be_captured_fails_in_one_line_naming_compile_false(monkeypatch):
    """The first call runs for real; if only its capture fails (a host read inside, as `.item()` is on a
    GPU), the error is one line that names the function, the cause and the fix, with the cause chained.
    torch.cuda.graph's stand-in runs the call, as capturing does on a GPU; the call fails when captured."""
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: "graph")
    monkeypatch.setattr(torch.cuda, "graph", lambda graph: contextlib.nullcontext())
    calls = []

    def reads_the_host(x):
        calls.append(x.clone())
        if len(calls) == 2:  # the capture
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore")
        return x * 2

    f = GraphedFunction(reads_the_host)
    with pytest.raises(GraphCaptureError) as caught:
        f(torch.ones(2))
    message = str(caught.value)
    assert "\n" not in message and "reads_the_host" in message and "compile=False" in message
    assert "operation not permitted when stream is capturing" in message
    assert isinstance(caught.value.__cause__, RuntimeError) and f.captures == 0 and len(calls) == 2
    assert gc.isenabled()  # (the collector is back on after the failed capture)


def test_row_cache_generation_changes_with_every_allocation():
    a, b = RowCache(2, 1, 8), RowCache(2, 1, 8)
    assert a.generation != b.generation
    before = a.generation
    k = torch.zeros(1, 2, 3, 4)
    a.update(k, k, 0)  # a layer's first update allocates its buffers
    assert a.generation != before
    a.update(k, k, 1)
    allocated = a.generation
    a.set_length(0)
    a.update(k, k, 0)
    a.set_length(2)
    assert a.generation == allocated  # writes and lengths do not move the buffers
    a.grow(16)
    assert a.generation not in (allocated, before, b.generation)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
def test_compile_function_on_a_cpu_is_plain_torch_compile():
    from spechead.inference.compiling import compile_function

    f = compile_function(lambda x: x + 1, "eager", cuda=False)
    assert not isinstance(f, GraphedFunction) and f(torch.ones(1)).item() == 2.0


def test_cuda_wrapper_returns_copies_of_every_output():
    """A CUDA graph overwrites its outputs at the next replay; the draft loop keeps each depth's output
    for the next call. The wrapper must copy (checked here with a function whose outputs ARE a kept buffer,
    as a graph's are)."""
    from spechead.inference.compiling import compile_function

    buffer = torch.zeros(3)

    def fn(x):
        buffer.copy_(x)
        return buffer, (buffer, 1)

    f = compile_function(fn, "eager", cuda=True)  # the CUDA wrapper, eager backend: runs on a CPU
    out, (nested, one) = f(torch.ones(3))
    assert one == 1 and out is not buffer and nested is not buffer
    f(torch.full((3,), 2.0))
    assert out.tolist() == [1.0, 1.0, 1.0] and nested.tolist() == [1.0, 1.0, 1.0]
