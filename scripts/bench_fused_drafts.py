"""Draft and accept time of the parallel drafters through their heads' fused chains (heads/fused.py,
heads/fused_block.py: what drafting runs) beside the same heads through their modules, at one target's shape.

    python scripts/bench_fused_drafts.py --target data/demo/target --threads 1

Random-weight heads of the target's width and dtype (times are real, acceptance is not): P-EAGLE of K
--blocks (a pass writes the positions accepted since the last, then the block) and DFlash of those blocks
with --dflash-layers layers (Qwen3 layers: the default), each drafted after a --context-token prompt as
scripts/parallel_drafts.py times it, and its accept (DFlash: the accepted positions' keys / values). The two
paths alternate for --rounds rounds (load changes hit both alike); the table gives, for the draft and the
accept, each path's median over the rounds of its median time, and module / fused.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from parallel_drafts import parallel_heads, target_states, time_dflash, time_peagle
from transformers import AutoModelForCausalLM

from spechead.heads.peagle import PEagleHead
from spechead.inference.evaluation.profiling import Timer


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="data/demo/target", help="a target's directory or Hub id")
    p.add_argument("--blocks", default="8", help="P-EAGLE's K and DFlash's block sizes, e.g. 8,16")
    p.add_argument("--dflash-layers", type=int, default=2, help="DFlash drafter layers (the demo recipe: 2)")
    p.add_argument("--context", type=int, default=128, help="prompt tokens before the draft")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=50, help="timed drafts a path a round")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        blocks = tuple(int(b) for b in args.blocks.split(","))
        if min(blocks) < 2 or args.rounds < 1 or args.iters < 1:
            raise ValueError
    except ValueError:
        print(
            f"error: --blocks are numbers >= 2 (got {args.blocks!r}), --rounds and --iters >= 1",
            file=sys.stderr,
        )
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    prompt = torch.randint(
        0, model.config.vocab_size, (args.context,), generator=torch.Generator().manual_seed(0)
    )
    hidden, root = target_states(model, prompt)
    heads = parallel_heads(model, 32000, blocks, args.dflash_layers)
    timer = Timer(torch.device("cpu"), args.iters, 10)
    times: dict[tuple[str, bool, str], list[float]] = {
        (name, f, part): [] for name in heads for f in (True, False) for part in ("draft_ms", "accept_ms")
    }
    for _ in range(args.rounds):
        for name, head in heads.items():
            layers = {layer: hidden[layer] for layer in head.config.target_layers}
            timed = time_peagle if isinstance(head, PEagleHead) else time_dflash
            for fused in (True, False):
                row = timed(head, prompt, layers, root, timer, fused=fused)
                for part in ("draft_ms", "accept_ms"):
                    times[(name, fused, part)].append(row[part])
    print(f"{args.target}, {torch.get_num_threads()} threads, {args.rounds} rounds x {args.iters} drafts")
    print("| drafter | part | fused ms | modules ms | modules / fused |\n|---|---|---:|---:|---:|")
    for name in heads:
        for part in ("draft_ms", "accept_ms"):
            fused, modules = (statistics.median(times[(name, f, part)]) for f in (True, False))
            print(f"| {name} | {part[:-3]} | {fused:.3f} | {modules:.3f} | {modules / fused:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
