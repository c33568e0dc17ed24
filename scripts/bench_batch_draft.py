"""The EAGLE drafter's batch drafting alone: ms per pass (one propose + one accept) by batch size and
compile mode.

    python scripts/bench_batch_draft.py --drafter outputs/eagle3-demo/head --batch-size 1 8
    python scripts/bench_batch_draft.py --drafter HEAD --target TARGET --device cuda --dtype bfloat16 \\
        --modes eager graphs inductor --batch-size 1 4 16

Loads the target and head as `SpeculativeGenerator.from_pretrained` does (the target only gives the
head its embeddings and lm_head), then for each mode and batch size B: `start` on B random prompts of
--context tokens (random target states), then --iters passes of `propose` (every row's static tree,
--choices) and `accept` of 2 tokens per row, after --warmup untimed passes (compiling and capturing).
Modes: eager (one head call per depth over all rows: `EagleRows`, a batch of one too), and any `compile` value (graphs, inductor = True, or a torch.compile backend): `GraphRows`, every
row's draft and accept as fixed-shape graphs (forced here on a CPU too for B > 1, where generate_batch
keeps the eager rows: `EagleDrafter.batch_graphs`). Prints one line per (mode, B), naming where the rows
lived (`rows_kind`), and writes OUT/bench_batch_draft.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from spechead.configs import demo_asset
from spechead.inference.drafters.eagle import EagleDrafter
from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.sampling import SamplingParams


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", required=True, help="an EAGLE / EAGLE-3 head (a folder or a Hub id)")
    p.add_argument("--target", default=None, help="the target (default: the demo target)")
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 8])
    p.add_argument("--modes", nargs="+", default=["eager", "graphs"])
    p.add_argument(
        "--choices", default="[[0], [0, 0], [1], [0, 0, 0]]", help="the static tree (JSON rank paths)"
    )
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--out", type=Path, default=Path("outputs/bench_batch_draft"))
    return p.parse_args(argv)


def compile_value(mode: str) -> bool | str:
    return True if mode == "inductor" else mode


def pass_ms(
    drafter, batch: int, context: int, iters: int, warmup: int, hidden: int, vocab: int, seed: int = 0
) -> float:
    """ms per propose + accept(2 tokens a row) of the EAGLE drafter at `batch` rows after `context`."""
    g = torch.Generator().manual_seed(seed)
    device = next(drafter.head.parameters()).device
    prompts = [torch.randint(0, vocab, (context,), generator=g) for _ in range(batch)]
    states = [{layer: torch.randn(context, hidden, generator=g) for layer in drafter.hidden_layers}] * batch
    drafter.start(prompts, states, [1] * batch)
    new = {layer: torch.randn(batch, 2, hidden, generator=g).to(device) for layer in drafter.hidden_layers}

    def one() -> None:
        # (brings the trees to the host: a sync)
        draft = drafter.propose([1] * batch, [SamplingParams()] * batch, [None] * batch)
        drafter.accept(draft.tokens[:, :2], [2] * batch, new, [1] * batch)

    for _ in range(warmup):
        one()
    start = time.perf_counter()
    for _ in range(iters):
        one()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 1e3 * (time.perf_counter() - start) / iters


def rows_kind(drafter: EagleDrafter) -> str:
    """Where the started drafter keeps its rows: "GraphRows" (compiled) or "EagleRows" (eager)."""
    return type(drafter._rows).__name__


def main(argv=None) -> None:
    args = parse(argv)
    target = args.target or str(demo_asset("target"))
    gen = SpeculativeGenerator.from_pretrained(  # eager: each mode below compiles its own drafter
        target, args.drafter, device=args.device, dtype=args.dtype, compile=False
    )
    if not isinstance(gen.drafter, EagleDrafter):
        raise SystemExit(
            f"error: {args.drafter} is not an EAGLE / EAGLE-3 head: this measures EAGLE batch drafting"
        )
    choices = json.loads(args.choices)
    text = gen.target.config.get_text_config()
    hidden, vocab = text.hidden_size, text.vocab_size
    rows = []
    for mode in args.modes:
        for batch in args.batch_size:
            drafter = gen.drafter.with_tree(choices)
            if mode != "eager":
                drafter.use_compile(compile_value(mode))
                drafter.batch_graphs = True
            ms = pass_ms(drafter, batch, args.context, args.iters, args.warmup, hidden, vocab)
            kind = rows_kind(drafter)
            rows.append({"mode": mode, "batch": batch, "pass_ms": ms, "drafter": kind})
            print(f"{mode:10s} B={batch:<3d} {ms:8.3f} ms a pass (propose + accept)  {kind}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    (args.out / "bench_batch_draft.json").write_text(
        json.dumps({"settings": settings, "rows": rows}, indent=1)
    )


if __name__ == "__main__":
    main()
