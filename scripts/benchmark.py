"""Decoding benchmark: every drafter against plain greedy decoding of the same target, same process.

    python scripts/benchmark.py                       # the demo target with the heads found in outputs/
    python scripts/benchmark.py --target data/demo/target --drafter eagle3=outputs/eagle3-demo/head \\
        --drafter prompt_lookup=prompt_lookup --prompts 12 --max-new-tokens 96

Prints, per drafter: tau (emitted tokens per target pass), target passes per token, tokens/s, speedup
over plain decoding, and the cost split (plain step, verification pass, draft work per pass) with
the ideal speedup tau * t_step / (t_verify + t_draft) beside the measured one; then verification
cost by tree size. Greedy outputs are checked against plain decoding; any mismatch is reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from spechead.data.demo import make_conversations
from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.kv_cache import keep_positions
from spechead.inference.tree import TokenTree
from spechead.inference.verify import prefill, verify_tree

DEMO_HEADS = {
    "medusa": "outputs/bench-heads/medusa/head",
    "medusa2": "outputs/bench-heads/medusa2/head",
    "eagle": "outputs/bench-heads/eagle/head",
    "eagle3": "outputs/eagle3-demo/head",
}


def demo_prompts(n: int) -> list[list[dict]]:
    """First user turns of demo conversations the heads never trained on (another seed)."""
    convs = make_conversations(n, seed=2027)
    return [[m for m in c["messages"] if m["role"] != "assistant"][:2] for c in convs]


def run(gen: SpeculativeGenerator, prompts, max_new_tokens: int) -> dict:
    """Greedy-decode every prompt; totals of the stats and the token ids."""
    totals = {"new_tokens": 0, "target_passes": 0, "accepted": 0, "wall": 0.0, "draft": 0.0, "verify": 0.0}
    outputs, lengths = [], []
    for messages in prompts:
        r = gen.generate(messages=messages, max_new_tokens=max_new_tokens)
        s = r.stats
        outputs.append(r.token_ids)
        lengths += s.accept_lengths
        totals["new_tokens"] += s.new_tokens
        totals["target_passes"] += s.target_passes
        totals["wall"] += s.wall_time - s.prefill_time  # decoding only: prefill is the same for all
        totals["draft"] += s.draft_time
        totals["verify"] += s.verify_time
    totals["tau"] = sum(lengths) / max(len(lengths), 1)
    totals["outputs"] = outputs
    return totals


def drafter_options(spec: str) -> tuple[str, dict]:
    """'PATH@key=value,key=value' -> (PATH, {key: int value}), e.g. 'head@top_k=4,depth=5,total_tokens=16'."""
    path, _, opts = spec.partition("@")
    return path, {k: int(v) for k, v in (kv.split("=", 1) for kv in opts.split(",") if kv)}


def verify_cost(model, sizes: list[int], context: int, repeats: int) -> dict[int, float]:
    """Median seconds of one tree verification pass (a chain of `size` nodes) after `context` tokens."""
    ids = torch.randint(5, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
    out = {}
    for size in sizes:
        times = []
        for _ in range(repeats):
            cache, _, _ = prefill(model, ids.to(model.device))
            tree = TokenTree(torch.randint(5, 100, (size,)), torch.arange(-1, size - 1))
            start = time.perf_counter()
            verify_tree(model, cache, tree, context)
            keep_positions(cache, context, torch.tensor([0]))
            times.append(time.perf_counter() - start)
        out[size] = statistics.median(times)
    return out


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="data/demo/target")
    p.add_argument(
        "--drafter", action="append", default=[], help="NAME=SPEC (head dir/id, draft model, prompt_lookup)"
    )
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", type=Path, default=Path("outputs/benchmark"))
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    torch.manual_seed(0)
    specs = dict(d.split("=", 1) for d in args.drafter) or {
        "prompt_lookup": "prompt_lookup",
        **{name: path for name, path in DEMO_HEADS.items() if Path(path).is_dir()},
    }
    prompts = demo_prompts(args.prompts)
    plain = SpeculativeGenerator.from_pretrained(args.target, None, device=args.device, dtype=args.dtype)
    run(plain, prompts[:2], 8)  # warm-up
    base = run(plain, prompts, args.max_new_tokens)
    t_step = base["verify"] / max(base["target_passes"], 1)
    rows = []
    for name, spec in specs.items():
        path, options = drafter_options(spec)
        gen = SpeculativeGenerator.from_pretrained(
            args.target, path, device=args.device, dtype=args.dtype, **options
        )
        reference = run(SpeculativeGenerator(gen.target, gen.tokenizer, None), prompts, args.max_new_tokens)
        res = run(gen, prompts, args.max_new_tokens)
        passes = max(res["target_passes"], 1)
        t_verify, t_draft = res["verify"] / passes, res["draft"] / passes
        mismatches = sum(a != b for a, b in zip(res["outputs"], reference["outputs"]))
        rows.append({
            "drafter": name, "spec": spec, "tau": res["tau"],
            "passes_per_token": res["target_passes"] / max(res["new_tokens"], 1),
            "tokens_per_s": res["new_tokens"] / res["wall"],
            "speedup": (res["new_tokens"] / res["wall"]) / (base["new_tokens"] / base["wall"]),
            "t_step_ms": 1e3 * t_step, "t_verify_ms": 1e3 * t_verify, "t_draft_ms": 1e3 * t_draft,
            "ideal_speedup": res["tau"] * t_step / (t_verify + t_draft),
            "greedy_mismatches": mismatches,
        })  # fmt: skip
        if mismatches:
            print(f"!!! {name}: {mismatches} outputs differ from plain greedy decoding", file=sys.stderr)
    costs = verify_cost(plain.target, [1, 2, 4, 8, 16, 32, 64], context=128, repeats=5)
    plain_tps = base["new_tokens"] / base["wall"]
    lines = [
        f"plain greedy decoding: {plain_tps:,.1f} tokens/s, {1e3 * t_step:.2f} ms per step "
        f"({len(prompts)} prompts, max_new_tokens={args.max_new_tokens}, {args.device}, {args.dtype})",
        "",
        "| drafter | tau | target passes/token | tokens/s | speedup | t_verify ms | t_draft ms | ideal speedup | greedy == plain |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['drafter']} | {r['tau']:.2f} | {r['passes_per_token']:.3f} | {r['tokens_per_s']:,.1f} | "
            f"{r['speedup']:.2f}x | {r['t_verify_ms']:.2f} | {r['t_draft_ms']:.2f} | {r['ideal_speedup']:.2f}x | "
            f"{'yes' if not r['greedy_mismatches'] else 'NO (' + str(r['greedy_mismatches']) + ')'} |"
        )
    lines += [
        "",
        "verification pass by tree size (context 128): "
        + ", ".join(f"{n}: {1e3 * t:.2f} ms" for n, t in costs.items()),
    ]
    text = "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decoding.md").write_text(text + "\n")
    (args.out / "decoding.json").write_text(json.dumps({"plain_tokens_per_s": plain_tps, "t_step_ms": 1e3 * t_step,
                                                        "rows": rows, "verify_ms_by_size": {k: 1e3 * v for k, v in costs.items()},
                                                        "settings": vars(args) | {"out": str(args.out)}}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
