"""Build a static tree from a head's measured top-k accuracies and save it as HEAD/tree.json.

    python scripts/build_tree.py --target data/demo/target --head outputs/bench-heads/medusa/head \
        --nodes 60 --prompts 32 --max-new-tokens 128
    python scripts/build_tree.py --target data/demo/target --head outputs/eagle3-demo/head \
        --depth 6 --cost-profile outputs/benchmark/decoding.json

The target greedily answers N chat prompts turn by turn (the built-in prompt set demo-tune: the demo
benchmark's categories from another held-out draw, never the benchmark's own prompts; or --prompts-file,
a prompt-set JSONL: {"turns": [...]} or {"prompt": ...} per line); on those answers the head's top-k
accuracy by depth is measured (Medusa: per head; EAGLE: per unrolled draft step), the best tree of
--nodes drafted nodes is chosen (or, with --cost-profile, the node count with the best expected speedup
on that hardware), and its expected accept length is compared with the default tree's. Decoding with
the new tree is then measured on the same prompts (in-sample). Medusa and EAGLE drafters load
HEAD/tree.json by default (EAGLE: instead of the dynamic tree; pass tree="dynamic" to get that back).
A training run tunes the same way for its own device at the end (`trainer.tree_tune_prompts`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from spechead.data.prompt_sets import EvalPrompt, load_prompt_set
from spechead.heads.directory import write_tree
from spechead.heads.errors import HeadError
from spechead.heads.families import family_of
from spechead.inference.evaluation.measure import DecodeSettings, decode_prompts
from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.tuning.tree_search import (
    best_choices,
    expected_accept_length,
    ranked_choices_for_cost,
)
from spechead.inference.tuning.tree_tuning import measure_accuracy


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="target model directory or Hub id")
    p.add_argument("--head", required=True, help="local Medusa head directory (tree.json is written there)")
    p.add_argument("--nodes", type=int, default=60, help="drafted nodes in the tree (root not counted)")
    p.add_argument("--prompts", type=int, default=32, help="number of prompts to continue")
    p.add_argument(
        "--prompts-file", default=None, help='prompt-set JSONL: {"turns": [...]} or {"prompt": ...} per line'
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--topk", type=int, default=10, help="candidates measured per depth")
    p.add_argument("--depth", type=int, default=6, help="EAGLE heads: draft steps measured (tree depth)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--cost-profile", default=None,
        help="decoding.json from scripts/benchmark.py on this hardware: pick the node count that maximises the "
        "expected speedup (overrides --nodes)",
    )  # fmt: skip
    p.add_argument("--no-check", action="store_true", help="skip decoding again with the new tree")
    return p.parse_args(argv)


def load_prompts(n: int, path: str | None) -> tuple[list[EvalPrompt], str]:
    """N prompts (their user turns) and a description of where they came from."""
    if path is None:
        return load_prompt_set("demo-tune", n), "built-in prompt set demo-tune"
    return load_prompt_set(path, n), str(path)


def format_table(accuracy: torch.Tensor) -> str:
    """The accuracy table [heads, k] as fixed-width text, one row per head."""
    head = "depth" + "".join(f"{f'top{r}':>7}" for r in range(accuracy.shape[1]))
    rows = [f"{k + 1:>5}" + "".join(f"{x:7.3f}" for x in row) for k, row in enumerate(accuracy.tolist())]
    return "\n".join([head, *rows])


def read_cost_profile(path: str) -> dict:
    """A decoding.json of scripts/benchmark.py (verify_ms_by_size, t_step_ms); ValueError in one line
    when it cannot be read or lacks either (checked before any measuring, not after minutes of it)."""
    try:
        profile = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"--cost-profile {path}: cannot read it ({type(err).__name__})") from None
    if not isinstance(profile, dict) or not profile.get("verify_ms_by_size") or "t_step_ms" not in profile:
        raise ValueError(
            f"--cost-profile {path} holds no verify_ms_by_size and t_step_ms: pass scripts/benchmark.py's decoding.json"
        )
    return profile


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if min(args.nodes, args.prompts, args.topk, args.depth) < 1:
            raise ValueError("--nodes, --prompts, --topk and --depth must be >= 1")
        if not Path(args.head).is_dir():
            raise ValueError(f"--head {args.head} is not a local directory (tree.json is saved there)")
        profile = read_cost_profile(args.cost_profile) if args.cost_profile else None
        prompts, source = load_prompts(args.prompts, args.prompts_file)
        # The default tree decodes the prompts (greedy = lossless, so the continuations are the
        # target's own) and gives the baseline tau. An existing tree.json is ignored for this.
        config = json.loads((Path(args.head) / "config.json").read_text())
        try:
            fam = family_of(config)
        except HeadError as err:
            raise ValueError(f"--head {args.head} is not a spechead head ({err})") from None
        gen = SpeculativeGenerator.from_pretrained(
            args.target, args.head, device=args.device, dtype=args.dtype, **fam.default_tree
        )
        default = gen.drafter.choices  # the default tree's rank paths (None: EAGLE's dynamic tree)
        settings = DecodeSettings(max_new_tokens=args.max_new_tokens, fit_context=True)
        answers = decode_prompts(gen, prompts, settings)
        tau_default, draft_ms = answers.total.tau, answers.total.draft_ms_per_pass
        accuracy = measure_accuracy(gen.target, gen.drafter.head, answers, args.depth, args.topk)
    except (ValueError, OSError) as err:
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    extra = {}
    if profile is not None:
        # Draft cost measured here while decoding with the default tree: Medusa's is one pass for all
        # depths; an EAGLE head runs once per depth of the dynamic tree.
        per_pass = (
            {"draft_ms_per_depth": draft_ms / gen.drafter.depth}
            if fam.drafts_per_depth
            else {"draft_ms": draft_ms}
        )
        choices, speedup = ranked_choices_for_cost(
            accuracy, profile["verify_ms_by_size"], profile["t_step_ms"], **per_pass
        )[0]
        extra = {"expected_speedup": speedup, "cost_profile": str(args.cost_profile), **per_pass}
        print(
            f"cost profile {args.cost_profile}: {len(choices)} nodes give the best expected speedup {speedup:.2f}x"
        )
    else:
        choices = best_choices(accuracy, args.nodes)
    expected = expected_accept_length(accuracy, choices)
    fits = default is not None and all(len(c) <= accuracy.shape[0] and max(c) < args.topk for c in default)
    expected_default = expected_accept_length(accuracy, default) if fits else float("nan")
    positions = answers.total.new_tokens
    print(f"top-{args.topk} accuracy by depth ({fam.name}) over {positions} generated tokens "
          f"({len(prompts)} prompts, {len(answers.outputs)} turns, {source}):")  # fmt: skip
    print(format_table(accuracy))
    print(f"\nchosen tree ({len(choices)} nodes, depth {max(map(len, choices))}): {json.dumps(choices)}")
    if fits:
        print(
            f"expected accept length: chosen {expected:.3f} | default ({len(default)} nodes) {expected_default:.3f}"
        )
    else:
        print(f"expected accept length: chosen {expected:.3f}")
    print(f"measured tau, default tree ({'static' if default else 'dynamic'}): {tau_default:.3f}")
    measured = {"target": str(args.target), "prompts": len(prompts), "prompt_source": source,
                "max_new_tokens": args.max_new_tokens, "generated_tokens": positions, "topk": args.topk}  # fmt: skip
    if not args.no_check:  # the chosen tree's real tau: loading scales the table to it (calibrate.py)
        gen.drafter = gen.drafter.with_tree(choices)
        tau_chosen = decode_prompts(gen, prompts, settings).total.tau
        print(f"measured tau, chosen tree: {tau_chosen:.3f} (same prompts)")
        extra["measured_tau"] = round(tau_chosen, 4)
    path = write_tree(
        args.head,
        choices,
        expected_accept_length=expected,
        default_expected_accept_length=expected_default if fits else None,
        family=fam.head,
        measured_on=measured,
        accuracy=[[round(x, 6) for x in row] for row in accuracy.tolist()],
        **extra,
    )
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
