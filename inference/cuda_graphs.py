"""Fixed-shape functions captured once as CUDA graphs and replayed with no Python in between.

torch.compile's "reduce-overhead" checks dynamo's guards on the host every call while the device idles;
`GraphedFunction` captures each fixed-shape call itself (as SGLang does):

    graphed = GraphedFunction(torch.compile(fn, dynamic=False), state=lambda: cache.generation)
    out = graphed(x, mask=m)    # first call of this signature: runs fn for real, then captures it
    out = graphed(x2, mask=m2)  # later calls: copy the tensors into the captured inputs, one replay

A call's signature is its tensors' shapes and dtypes plus every other argument's value. What fn reads
besides its arguments (a KV cache's buffers) is baked in by address: when `state()` changes (a cache
reallocated), every graph is dropped and recaptured. Outputs come back as copies (a replay overwrites them).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import torch
from torch import Tensor


def copy_outputs(x: Any) -> Any:
    """Tensors (also inside tuples) copied; anything else as it is."""
    if isinstance(x, Tensor):
        return x.clone()
    if isinstance(x, tuple):
        return tuple(copy_outputs(y) for y in x)
    return x


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """Python's garbage collection off inside the block: a collection during a capture may destroy a dead
    generator's graphs (reference cycles: a runner holds its GraphedFunction, whose fn is the runner's
    method), which CUDA refuses while a stream captures ("operation not permitted when stream is
    capturing"); torch.cuda.graph no longer collects before capturing."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class GraphCaptureError(RuntimeError):
    """A call that runs eagerly but cannot be captured as a CUDA graph (a host read such as `.item()`, a
    shape that depends on values, a collective inside the model's forward), in one line that names the fix."""

    def __init__(self, fn: Callable[..., Any], cause: BaseException) -> None:
        name = getattr(fn, "__qualname__", type(fn).__name__)
        first = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        self.what = f"{name} runs but cannot be captured as a CUDA graph ({type(cause).__name__}: {first})"
        super().__init__(
            f"{self.what}; decode this model with compile=False (eager; `--compile off` on the command line)"
        )


class Captured:
    """One captured call: its static input tensors, the graph and the graph's outputs."""

    def __init__(self, inputs: list[Tensor], graph: Any, outputs: Any) -> None:
        self.inputs, self.graph, self.outputs = inputs, graph, outputs


class GraphedFunction:
    """fn(*args, **kwargs) replayed as one CUDA graph per call signature (module doc). state: a hashable
    that changes whenever what fn reads besides its arguments is reallocated; `captures` counts graphs."""

    def __init__(self, fn: Callable[..., Any], state: Callable[[], Hashable] | None = None) -> None:
        self.fn = fn
        self.state = state
        self.captures = 0
        self._graphs: dict[tuple, Captured] = {}
        self._state: Hashable = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        names = tuple(sorted(kwargs))
        values = [*args, *(kwargs[name] for name in names)]  # positional, then keywords by name
        state = self.state() if self.state is not None else None
        if state != self._state:  # the buffers the graphs read moved: none of them may replay
            self._graphs.clear()
            self._state = state
        key = (
            tuple((tuple(v.shape), v.dtype, v.device) if isinstance(v, Tensor) else v for v in values),
            names,
        )
        entry = self._graphs.get(key)
        if entry is None:
            out, self._graphs[key] = self._run_and_capture(values, len(args), names)
            self.captures += 1
            return out
        tensors = iter(entry.inputs)
        for value in values:
            if isinstance(value, Tensor):
                static = next(tensors)
                if static.data_ptr() != value.data_ptr():
                    static.copy_(value)
        self._replay(entry)
        return copy_outputs(entry.outputs)

    def _run_and_capture(
        self, values: list[Any], n_args: int, names: tuple[str, ...]
    ) -> tuple[Any, Captured]:
        """A signature's first call: fn runs for real on dense copies of the call's tensors (the graph's
        inputs from now on), which warms up what must not happen inside a capture (compilation,
        autotuning, lazy allocations), then is captured on the same copies."""
        static = [v.clone() if isinstance(v, Tensor) else v for v in values]

        def call() -> Any:
            return self.fn(*static[:n_args], **dict(zip(names, static[n_args:])))

        out = copy_outputs(call())
        tensors = [v for v in static if isinstance(v, Tensor)]
        try:
            graph, outputs = self._record(call, next((t.device for t in tensors if t.is_cuda), None))
        except Exception as error:  # (the call ran eagerly above: only capturing it failed)
            raise GraphCaptureError(self.fn, error) from error
        return out, Captured(tensors, graph, outputs)

    def _record(self, call: Callable[[], Any], device: torch.device | None) -> tuple[Any, Any]:
        """A CUDA graph of call() (captured on the inputs' device, which need not be the current one) and
        the outputs it writes at every replay."""
        graph = torch.cuda.CUDAGraph()
        guard = torch.cuda.device(device) if device is not None else contextlib.nullcontext()
        with guard, collection_paused(), torch.cuda.graph(graph):
            outputs = call()
        return graph, outputs

    def _replay(self, entry: Captured) -> None:
        entry.graph.replay()
