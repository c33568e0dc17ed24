"""torch.compile and CUDA graphs for the engine's fixed-shape functions: one entry point, `compile_function`
(looked up here at each compile, so tests can swap in stand-in graphs on a CPU)."""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

from spechead.inference.cuda_graphs import GraphedFunction, copy_outputs

AUTO = "auto"  # from_pretrained's default compile: see resolve_compile


def resolve_compile(compile: bool | str, device: torch.device) -> bool | str:
    """`compile` checked, "auto" made concrete for `device`: "graphs" on CUDA (an eager step pays a host
    launch per kernel; capturing takes seconds where inductor takes minutes), False on a CPU (no launches
    to save). from_pretrained falls back to eager where "auto" chose graphs that cannot be captured."""
    check_compile(compile)
    if compile != AUTO:
        return compile
    return "graphs" if device.type == "cuda" else False


MODES = ("auto", "graphs", "inductor", "max-autotune", "reduce-overhead")  # ours, beside torch's backends


def check_compile(compile: bool | str | None, name: str = "compile") -> None:
    """ValueError in one line unless `compile` is a bool, None, one of MODES or a torch.compile backend."""
    if compile is None or isinstance(compile, bool) or compile in MODES:
        return
    if not isinstance(compile, str) or compile not in torch._dynamo.list_backends(exclude_tags=()):
        raise ValueError(
            f"{name}={compile!r} is not a compile mode: use False (eager), True, {', '.join(MODES)} or a "
            "torch.compile backend (cudagraphs, eager, aot_eager, ...)"
        )


def resolve_compile_args(args) -> None:
    """A command line's --compile / --compile-draft checked (ValueError); `args.compile_given` keeps the
    value as given (for from_pretrained), `args.compile` is resolved for --device (warm-ups, notes)."""
    args.compile_given = args.compile
    args.compile = resolve_compile(args.compile, torch.device(args.device))
    check_compile(args.compile_draft, "--compile-draft")


def compile_option(text: str) -> bool | str:
    """A command line's --compile value: "off" (or "false", "none") is False, "on" / "true" True (inductor),
    anything else as written ("auto", "graphs", a backend name)."""
    lowered = text.lower()
    if lowered in ("off", "false", "none"):
        return False
    return True if lowered in ("on", "true") else text


def compile_function(
    fn,
    compile: bool | str,
    cuda: bool = False,
    fullgraph: bool = False,
    state: Callable[[], Hashable] | None = None,
):
    """`fn` compiled for fixed shapes as `compile` says (on CUDA every call returns copies of the outputs):

    - True / "inductor": inductor, on CUDA then captured as our own graphs (`GraphedFunction`; `state`:
      see cuda_graphs.py);
    - "graphs": the eager `fn` captured as our graphs on CUDA, elsewhere `fn` itself;
    - "max-autotune": inductor's "max-autotune-no-cudagraphs" (a longer compile), then our graphs;
    - "reduce-overhead": inductor with torch.compile's own CUDA graphs (guards checked every call);
    - another string: that torch.compile backend ("eager" / "aot_eager": the CPU tests count graphs).

    fullgraph: a graph break is an error."""
    # graphs per function: buckets x (with / without hidden states); dynamo's default limit of 8 per
    # function would silently send the rest back to eager
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    if compile == "graphs":
        return GraphedFunction(fn, state) if cuda else fn
    modes: dict[bool | str, str | None] = {"max-autotune": "max-autotune-no-cudagraphs"}
    modes["reduce-overhead"] = "reduce-overhead" if cuda else None
    backend = compile if isinstance(compile, str) and compile not in MODES else "inductor"
    compiled = torch.compile(fn, dynamic=False, fullgraph=fullgraph, mode=modes.get(compile), backend=backend)
    if not cuda:
        return compiled
    if backend == "inductor" and compile != "reduce-overhead":
        return GraphedFunction(compiled, state)

    # torch's own graphs or another backend: each call a new step, its outputs copies (a CUDA graph rewrites
    # its output buffers at every replay, and the draft loop keeps each depth's outputs for the next)
    def run(*args, **kwargs):
        torch.compiler.cudagraph_mark_step_begin()
        return copy_outputs(compiled(*args, **kwargs))

    return run
