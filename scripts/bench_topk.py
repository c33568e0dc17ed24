"""What one EAGLE draft depth's top-k costs: `torch.topk` against `drafters/topk.py`'s chunked top-k, by
chunk size, eager and compiled, on the draft's own shapes.

    python scripts/bench_topk.py --device cuda --out topk.json     # [1, 32000], [8, 32000], [8, 128256]
    python scripts/bench_topk.py --rows 8 --vocab 2048              # the demo head's shape, on a CPU

Each case times what `EagleDrafter._top` runs at a depth: bf16 logits [rows, V] to fp32, the k best of
each row and their log-probs (minus the row's logsumexp). "one" is one `torch.topk`; a number is
`topk_rows(..., chunk)`. Eager, and (--compile, on by default on CUDA) through torch.compile as the
draft step is compiled. On CUDA each timing is a CUDA graph of --calls calls replayed (what the compiled
draft runs: kernels and the gaps between them, no launch cost) and timed by CUDA events; on a CPU,
perf_counter around --calls calls. Medians of --repeats, in microseconds a call. The JSON names the
fastest chunk per case ("best"), so a GPU script can pass it on to `bench_gpu.py --topk-chunk`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from spechead.inference.drafters.topk import topk_rows


def top(logits: torch.Tensor, k: int, chunk: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`EagleDrafter._top` after the head: logits [q, V] -> log-probs [q, k] and ids [q, k]."""
    x = logits.float()
    values, ids = topk_rows(x, k, chunk)
    return values - torch.logsumexp(x, dim=-1, keepdim=True), ids


def time_calls(fn: Callable[[], object], calls: int, repeats: int, device: torch.device) -> float:
    """Median microseconds a call of fn, over `repeats` runs of `calls` calls (see the docstring)."""
    for _ in range(3):
        fn()
    times = []
    if device.type == "cuda":
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(repeats):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / calls)
        return statistics.median(times)
    for _ in range(repeats):
        begin = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - begin) * 1e6 / calls)
    return statistics.median(times)


def measure(rows: int, vocab: int, k: int, chunks: list[int | None], compiled: bool, args) -> dict:
    """Timings of one [rows, vocab] case: {"eager": {chunk: us}, "compiled": {...}, "best": chunk}."""
    device = torch.device(args.device)
    g = torch.Generator(device=device).manual_seed(rows * vocab)
    logits = (torch.randn(rows, vocab, generator=g, device=device) * 3).to(torch.bfloat16)  # [q, V]
    want = top(logits, k, None)[0]
    out: dict = {"rows": rows, "vocab": vocab, "k": k, "eager": {}, "compiled": {}}
    for chunk in chunks:
        name = "one" if chunk is None else str(chunk)
        assert torch.allclose(top(logits, k, chunk)[0], want), (rows, vocab, chunk)  # the same values
        out["eager"][name] = time_calls(lambda c=chunk: top(logits, k, c), args.calls, args.repeats, device)
        if compiled:
            torch._dynamo.reset()  # each chunk its own compiled function, nothing recompiled under a limit
            fn = torch.compile(top, fullgraph=True, dynamic=False)
            out["compiled"][name] = time_calls(
                lambda c=chunk, f=fn: f(logits, k, c), args.calls, args.repeats, device
            )
    timed = out["compiled"] or out["eager"]
    best = min(timed, key=timed.get)
    out["best"] = None if best == "one" else int(best)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8], help="frontier rows (q): 1, then top_k")
    p.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256], help="draft vocabularies")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--chunks", type=int, nargs="+", default=[32, 64, 128, 256])
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="also time torch.compile'd (default: on CUDA)")  # fmt: skip
    p.add_argument("--calls", type=int, default=20, help="calls a timed run (a CUDA graph's length)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default=None, help="also write every timing to this JSON file")
    args = p.parse_args(argv)
    if min(args.rows) < 1 or args.top_k < 1 or min(args.chunks) < 1 or args.calls < 1 or args.repeats < 1:
        p.error("--rows, --top-k, --chunks, --calls and --repeats must be >= 1")
    if min(args.vocab) <= args.top_k:
        p.error(f"--vocab must be larger than --top-k ({args.top_k})")
    device = torch.device(args.device)
    compiled = device.type == "cuda" if args.compile is None else args.compile
    chunks: list[int | None] = [None, *args.chunks]
    print(
        f"top-{args.top_k} of bf16 logits with log-probs, {args.device}, us a call (median of {args.repeats})"
    )
    print("rows x V | mode | " + " | ".join("one" if c is None else f"chunk {c}" for c in chunks))
    cases = []
    for vocab in args.vocab:
        for rows in args.rows:
            case = measure(rows, vocab, args.top_k, chunks, compiled, args)
            cases.append(case)
            for mode in ("eager", "compiled"):
                if case[mode]:
                    cells = " | ".join(f"{us:.1f}" for us in case[mode].values())
                    print(f"{rows} x {vocab} | {mode} | {cells}")
            print(f"{rows} x {vocab} | fastest: {case['best'] or 'one topk'}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": args.device, "top_k": args.top_k, "cases": cases}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
