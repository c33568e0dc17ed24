"""Plain decoding through the engine with the target's q/k/v and gate/up stacked (inference/stacked.py)
beside the same target unstacked: ms per decode step, the two taking turns round by round (a drifting
machine shifts both alike), and greedy equality of their tokens.

    python scripts/bench_stacked.py --target data/demo/target --rounds 20 --threads 1
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys

import torch
from transformers import AutoModelForCausalLM

from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.stacked import stack_projections


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="a causal LM directory or Hub id")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--rounds", type=int, default=20, help="rounds, each decoding once with each target")
    p.add_argument("--tokens", type=int, default=64, help="new tokens a round (a 64-token prompt)")
    p.add_argument("--threads", type=int, default=0, help="torch threads on a CPU (0: torch's default)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.rounds < 1 or args.tokens < 1:
        print("error: --rounds and --tokens must be at least 1", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(
        args.target, dtype=getattr(torch, args.dtype), attn_implementation="spechead_sdpa"
    ).to(args.device)
    stacked = copy.deepcopy(model)
    groups = stack_projections(stacked)
    gens = {
        "unstacked": SpeculativeGenerator(model, None, None),
        "stacked": SpeculativeGenerator(stacked, None, None),
    }
    prompt = [i % model.config.vocab_size for i in range(10, 74)]
    outputs = {}
    for name, gen in gens.items():
        gen.eos = set()  # every round decodes --tokens steps
        outputs[name] = gen.generate(input_ids=prompt, max_new_tokens=args.tokens).token_ids  # (warm-up)
    ms: dict[str, list[float]] = {name: [] for name in gens}
    for r in range(args.rounds):
        order = list(gens) if r % 2 == 0 else list(gens)[::-1]
        for name in order:
            stats = gens[name].generate(input_ids=prompt, max_new_tokens=args.tokens).stats
            ms[name].append(1e3 * (stats.wall_time - stats.prefill_time) / max(stats.target_passes, 1))
    ratios = [a / b for a, b in zip(ms["unstacked"], ms["stacked"])]
    print(
        f"{args.target}: {groups} groups stacked; {args.rounds} rounds of {args.tokens} tokens, {args.device}"
    )
    for name, times in ms.items():
        print(f"{name:>9}: median {statistics.median(times):.3f} ms a step, min {min(times):.3f}")
    print(f"unstacked / stacked, median of the rounds' ratios: {statistics.median(ratios):.3f}x")
    print(f"greedy tokens equal: {outputs['stacked'] == outputs['unstacked']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
