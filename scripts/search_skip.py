"""Search the decoder layers a self-speculative drafter skips, for the best measured speedup.

    python scripts/search_skip.py                                  # demo target, 24 demo prompts
    python scripts/search_skip.py --target data/demo/target --prompts 16 --max-new-tokens 96 \\
        --beam 4 --out outputs/skip/demo_target.json
    python scripts/benchmark.py --drafter skip=outputs/skip/demo_target.json

1. The target decodes the prompts greedily (first user turn, chat template): the reference outputs.
2. Costs, timed on this machine: a target step (1 token), a target verification of k + 1 tokens
   (k = 1..--max-draft) and one draft step for every number of kept layers.
3. Beam search over skip sets (one layer more per round, --beam best kept), plus every early exit:
   per candidate ONE draft forward over prompt + reference gives the exact greedy acceptance of
   chains of every length (inference/tuning/skip_search.py); expected speedup =
   tau * t_step / (t_verify(k + 1) + k * t_draft).
4. The best layer-skip set and the best early exit are decoded for real through SpeculativeGenerator
   (their tau must equal the predicted one; speedup = plain time per token / their time per token,
   noisy on a shared machine), and the best skip set is saved as a drafter file (JSON) for
   `--drafter` / `SpeculativeGenerator.from_pretrained`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import transformers

from spechead.configs import demo_asset
from spechead.data.errors import DataError
from spechead.data.prompt_sets import load_prompt_set
from spechead.inference.devices import check_device
from spechead.inference.drafters.layer_skip import LayerSkipDrafter, save_drafter_file, skip_view
from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.tuning.calibrate import verify_cost_ms
from spechead.inference.tuning.skip_search import (
    Candidate,
    Costs,
    beam_search,
    best_chain,
    draft_matches,
    linear_fit,
    time_draft,
)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=demo_asset("target"), help="target model directory or Hub id")
    p.add_argument("--prompt-set", default="demo", help="built-in set or JSONL/dataset, as in benchmark.py")
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--max-draft", type=int, default=6, help="chain lengths tried: 1..this")
    p.add_argument("--beam", type=int, default=4, help="skip sets kept per round")
    p.add_argument("--max-skip", type=int, default=None, help="most layers skipped (default L - 1)")
    p.add_argument("--top", type=int, default=12, help="table rows")
    p.add_argument("--no-check", action="store_true", help="skip the real decoding of the winners")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--out", type=Path, default=Path("outputs/skip/skip.json"), help="the drafter file")
    args = p.parse_args(argv)
    if min(args.prompts, args.max_new_tokens, args.max_draft, args.beam, args.top) < 1:
        p.error("--prompts, --max-new-tokens, --max-draft, --beam and --top must be >= 1")
    if args.max_skip is not None and args.max_skip < 1:
        p.error("--max-skip must be >= 1")
    if args.out.suffix != ".json":
        p.error(f"--out is a drafter file and must end in .json, got {args.out}")
    return args


def reference_outputs(gen: SpeculativeGenerator, prompts, max_new: int) -> tuple[list[list[int]], list[int]]:
    """Prompt + greedy continuation per prompt (first user turn, chat template) and the prompt lengths."""
    sequences, lengths = [], []
    for prompt in prompts:
        ids = gen.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt.turns[0]}], add_generation_prompt=True, return_dict=False
        )
        sequences.append(ids + gen.generate(input_ids=ids, max_new_tokens=max_new).token_ids)
        lengths.append(len(ids))
    return sequences, lengths


def measure_costs(target, num_layers: int, max_draft: int, rounds: int = 3) -> Costs:
    """Target step and verify passes, and a drafter pass per (kept layers, chain length): see Costs.
    Timed in interleaved rounds (medians over them), drafter passes smoothed by a line over kept layers per k
    (shared CPUs are noisy). Which layers are kept hardly matters (equal layers): early exits stand in."""
    samples: dict = {}
    drafters = {
        (kept, k): LayerSkipDrafter(target, list(range(kept, num_layers)), num_draft=k)
        for kept in range(1, num_layers + 1)
        for k in range(1, max_draft + 1)
    }
    for _ in range(rounds):
        verify_ms = verify_cost_ms(target, sizes=tuple(range(1, max_draft + 2)), repeats=3)  # {k + 1: ms}
        for k in range(max_draft + 1):  # k = 0: the plain step (1 token)
            samples.setdefault(("verify", k), []).append(verify_ms[k + 1] / 1e3)
        for key, drafter in drafters.items():
            samples.setdefault(key, []).append(time_draft(drafter, repeats=3))
    median = {key: statistics.median(v) for key, v in samples.items()}
    draft = {}
    for k in range(1, max_draft + 1):
        kept = list(range(1, num_layers + 1))
        draft |= dict(zip([(n, k) for n in kept], linear_fit(kept, [median[n, k] for n in kept])))
    verify = {k: median["verify", k] for k in range(1, max_draft + 1)}
    return Costs(median["verify", 0], verify, draft)


def decode_times(gens: list[SpeculativeGenerator], sequences, lengths) -> list[tuple[float, float, list]]:
    """Per generator: seconds per new token (prefill excluded), tau and the greedy outputs; the
    generators take turns on each prompt so that a shared machine's load drifts on all alike."""
    totals = [[0.0, 0, 0, 0, []] for _ in gens]  # wall, new tokens, emitted, passes, outputs
    for seq, p in zip(sequences, lengths):
        for gen, total in zip(gens, totals):
            r = gen.generate(input_ids=seq[:p], max_new_tokens=len(seq) - p)
            total[0] += r.stats.wall_time - r.stats.prefill_time
            total[1] += r.stats.new_tokens
            total[2] += sum(r.stats.accept_lengths)
            total[3] += r.stats.target_passes
            total[4].append(r.token_ids)
    return [(w / max(n, 1), e / max(passes, 1), out) for w, n, e, passes, out in totals]


def label(skip: tuple[int, ...], num_layers: int) -> str:
    """A skip set as a --drafter spec."""
    if skip and skip == tuple(range(skip[0], num_layers)):
        return f"early_exit@layer={skip[0]}"
    return "layer_skip@skip=" + "+".join(map(str, skip)) if skip else "(nothing skipped)"


def table(rows: list[Candidate], num_layers: int) -> str:
    lines = [
        "| drafter spec | kept layers | chain k | tau (exact, greedy) | expected speedup |",
        "|---|---|---|---|---|",
    ]
    for c in rows:
        lines.append(
            f"| {label(c.skip, num_layers)} | {num_layers - len(c.skip)} | {c.num_draft} | {c.tau:.2f} | "
            f"{c.speedup:.2f}x |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse(argv)
    transformers.utils.logging.disable_progress_bar()
    try:
        check_device(args.device)
        prompts = load_prompt_set(args.prompt_set, args.prompts)
        plain = SpeculativeGenerator.from_pretrained(  # eager, as the skip sets are timed and decoded
            args.target, None, device=args.device, dtype=args.dtype, compile=False
        )
    except (DataError, ValueError, OSError) as err:
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    target = plain.target
    num_layers = len(target.get_decoder().layers)
    if num_layers < 2:
        print(
            f"error: the target has {num_layers} decoder layer(s); skipping layers needs at least 2",
            file=sys.stderr,
        )
        return 2
    start = time.perf_counter()
    sequences, lengths = reference_outputs(plain, prompts, args.max_new_tokens)
    costs = measure_costs(target, num_layers, args.max_draft)

    def evaluate(skip: tuple[int, ...]) -> Candidate:
        matches = draft_matches(skip_view(target, skip), sequences, lengths)
        return best_chain(skip, matches, costs, num_layers)

    found = beam_search(evaluate, num_layers, beam=args.beam, max_skip=args.max_skip)
    for k in range(1, num_layers):
        exit_skip = tuple(range(k, num_layers))
        found[exit_skip] = found.get(exit_skip) or evaluate(exit_skip)
    ranked = sorted(found.values(), key=lambda c: -c.speedup)
    exits = [c for c in ranked if label(c.skip, num_layers).startswith("early_exit")]
    print(
        f"{len(found)} skip sets on {len(prompts)} prompts x {args.max_new_tokens} tokens in "
        f"{time.perf_counter() - start:.0f} s; ms per target step {1e3 * costs.step:.2f}, per verify of k + 1 "
        + ", ".join(f"k={k}: {1e3 * t:.2f}" for k, t in costs.verify.items())
        + "; per drafter pass at k=2 by kept layers: "
        + ", ".join(
            f"{kept}: {1e3 * t:.2f}" for (kept, k), t in costs.draft.items() if k == min(2, args.max_draft)
        )
    )
    print(table(ranked[: args.top], num_layers) + "\n\nearly exits:\n" + table(exits, num_layers))
    best = next(c for c in ranked if c.skip)
    drafter = LayerSkipDrafter(target, list(best.skip), num_draft=best.num_draft)
    info = {"tau": round(best.tau, 4), "expected_speedup": round(best.speedup, 4)}
    if not args.no_check:
        winners = {"best skip set": best, "best early exit": exits[0]}
        gens = [plain] + [
            SpeculativeGenerator(
                target, plain.tokenizer, LayerSkipDrafter(target, list(c.skip), num_draft=c.num_draft)
            )
            for c in winners.values()
        ]
        (t_plain, _, reference), *measured = decode_times(gens, sequences, lengths)
        for (name, c), (t, tau, outputs) in zip(winners.items(), measured):
            same = (
                "equal to plain" if outputs == reference else "DIFFERENT from plain greedy decoding (a bug)"
            )
            print(
                f"{name} {label(c.skip, num_layers)} k={c.num_draft}: decoded tau {tau:.2f} (predicted {c.tau:.2f}), "
                f"measured speedup {t_plain / t:.2f}x (noisy), outputs {same}"
            )
            if c is best:
                info |= {"decoded_tau": round(tau, 4), "measured_speedup": round(t_plain / t, 4)}
    info |= {"prompt_set": args.prompt_set, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens}
    save_drafter_file(args.out, drafter, **info)
    print(f"wrote {args.out}: use --drafter {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
