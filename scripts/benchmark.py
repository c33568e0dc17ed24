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
from tqdm.auto import tqdm

from spechead.data.prompt_sets import EvalPrompt, load_prompt_set
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


def _add(totals: dict, stats) -> None:
    totals["new_tokens"] += stats.new_tokens
    totals["wall_total"] += stats.wall_time
    totals["target_passes"] += stats.target_passes
    totals["wall"] += stats.wall_time - stats.prefill_time  # decoding only: prefill is the same for all
    totals["draft"] += stats.draft_time
    totals["verify"] += stats.verify_time
    totals["lengths"] += stats.accept_lengths


def _empty() -> dict:
    return {
        "new_tokens": 0,
        "target_passes": 0,
        "wall": 0.0,
        "wall_total": 0.0,
        "draft": 0.0,
        "verify": 0.0,
        "lengths": [],
    }


def run(gen: SpeculativeGenerator, prompts: list[EvalPrompt], max_new_tokens: int) -> dict:
    """Greedy-decode every prompt (multi-turn: answers fed back); totals overall and per category."""
    totals, by_category, outputs = _empty(), {}, []
    for prompt in prompts:
        messages = []
        for turn in prompt.turns:
            messages.append({"role": "user", "content": turn})
            r = gen.generate(messages=messages, max_new_tokens=max_new_tokens)
            messages.append({"role": "assistant", "content": r.text})
            outputs.append(r.token_ids)
            _add(totals, r.stats)
            _add(by_category.setdefault(prompt.category, _empty()), r.stats)
    for t in [totals, *by_category.values()]:
        t["tau"] = sum(t["lengths"]) / max(len(t["lengths"]), 1)
        t["tokens_per_s"] = t["new_tokens"] / max(t["wall"], 1e-9)
    totals["outputs"] = outputs
    totals["by_category"] = by_category
    return totals


def hf_baseline(model, tokenizer, prompts: list[EvalPrompt], max_new_tokens: int, **generate_kwargs) -> dict:
    """Hugging Face `generate` (greedy) on the same prompts: whole-call tokens/s and the outputs."""
    new, wall, outputs = 0, 0.0, []
    for prompt in prompts:
        messages = []
        for turn in prompt.turns:
            messages.append({"role": "user", "content": turn})
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
            start = time.perf_counter()
            out = model.generate(
                torch.tensor([ids], device=model.device), max_new_tokens=max_new_tokens, do_sample=False,
                pad_token_id=tokenizer.pad_token_id, **generate_kwargs,
            )  # fmt: skip
            wall += time.perf_counter() - start
            generated = out[0, len(ids) :].tolist()
            messages.append(
                {"role": "assistant", "content": tokenizer.decode(generated, skip_special_tokens=True)}
            )
            outputs.append(generated)
            new += len(generated)
    return {"tokens_per_s": new / max(wall, 1e-9), "outputs": outputs}


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
    p.add_argument("--prompt-set", default="demo", help="'demo' or a JSONL file of {category, turns}")
    p.add_argument("--prompts", type=int, default=12, help="at most this many prompts")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--assistant", default=None, help="a small draft model for HF assisted generation")
    p.add_argument("--repeats", type=int, default=1, help="runs per drafter; speedup is their median")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", type=Path, default=Path("outputs/benchmark"))
    return p.parse_args(argv)


def acceptance_by_depth(lengths: list[int], depth: int) -> list[float]:
    """P(at least d drafted tokens accepted in a pass), d = 1..depth, from per-pass accept lengths."""
    n = max(len(lengths), 1)
    return [sum(length - 1 >= d for length in lengths) / n for d in range(1, depth + 1)]


def measure(name: str, spec: str, args, prompts, base: dict, t_step: float) -> dict:
    """One drafter: `args.repeats` runs against plain decoding of the same loaded target."""
    path, options = drafter_options(spec)
    gen = SpeculativeGenerator.from_pretrained(
        args.target, path, device=args.device, dtype=args.dtype, **options
    )
    plain = SpeculativeGenerator(gen.target, gen.tokenizer, None)  # e.g. with a Medusa-2 adapter merged
    speedups, res, reference = [], None, None
    for _ in range(args.repeats):
        reference = run(plain, prompts, args.max_new_tokens)
        res = run(gen, prompts, args.max_new_tokens)
        speedups.append((res["new_tokens"] / res["wall"]) / (reference["new_tokens"] / reference["wall"]))
    passes = max(res["target_passes"], 1)
    t_verify, t_draft = res["verify"] / passes, res["draft"] / passes
    mismatches = sum(a != b for a, b in zip(res["outputs"], reference["outputs"]))
    if mismatches:
        print(f"!!! {name}: {mismatches} outputs differ from plain greedy decoding", file=sys.stderr)
    return {
        "drafter": name, "spec": spec, "tau": res["tau"],
        "tau_distribution": {str(k): res["lengths"].count(k) for k in sorted(set(res["lengths"]))},
        "acceptance_by_depth": acceptance_by_depth(res["lengths"], max(res["lengths"], default=1) - 1),
        "passes_per_token": res["target_passes"] / max(res["new_tokens"], 1),
        "tokens_per_s": res["new_tokens"] / res["wall"],
        "speedup": statistics.median(speedups), "speedup_min": min(speedups), "speedup_max": max(speedups),
        "t_step_ms": 1e3 * t_step, "t_verify_ms": 1e3 * t_verify, "t_draft_ms": 1e3 * t_draft,
        "ideal_speedup": res["tau"] * t_step / (t_verify + t_draft),
        "greedy_mismatches": mismatches,
        "tau_by_category": {c: t["tau"] for c, t in res["by_category"].items()},
        "speedup_by_category": {
            c: t["tokens_per_s"] / base["by_category"][c]["tokens_per_s"] for c, t in res["by_category"].items()
        },
    }  # fmt: skip


def measure_baselines(args, plain: SpeculativeGenerator, prompts, base: dict) -> list[dict]:
    """Hugging Face generate, its prompt lookup and (with --assistant) assisted generation."""
    baselines = {"hf_generate": {}, "hf_prompt_lookup": {"prompt_lookup_num_tokens": 10}}
    if args.assistant:
        from transformers import AutoModelForCausalLM

        assistant = AutoModelForCausalLM.from_pretrained(args.assistant).to(args.device)
        baselines["hf_assisted"] = {"assistant_model": assistant}
    ours_total = base["new_tokens"] / max(base["wall_total"], 1e-9)  # whole calls, prefill included, like HF
    rows = []
    for name, kwargs in baselines.items():
        res = hf_baseline(plain.target, plain.tokenizer, prompts, args.max_new_tokens, **kwargs)
        rows.append({
            "method": name, "tokens_per_s": res["tokens_per_s"], "vs_spechead_plain": res["tokens_per_s"] / ours_total,
            "greedy_mismatches": sum(a != b for a, b in zip(res["outputs"], base["outputs"])),
        })  # fmt: skip
    return rows


def render(
    args, prompts, base: dict, t_step: float, rows: list[dict], hf_rows: list[dict], costs: dict
) -> str:
    """The Markdown report."""
    plain_tps = base["new_tokens"] / base["wall"]
    lines = [
        f"plain greedy decoding: {plain_tps:,.1f} tokens/s, {1e3 * t_step:.2f} ms per step "
        f"({len(prompts)} prompts, max_new_tokens={args.max_new_tokens}, {args.device}, {args.dtype}, "
        f"speedup = median of {args.repeats} repeat(s) [min, max])",
        "",
        "| drafter | tau | target passes/token | tokens/s | speedup | t_verify ms | t_draft ms | ideal speedup | greedy == plain |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        same = "yes" if not r["greedy_mismatches"] else f"NO ({r['greedy_mismatches']})"
        lines.append(
            f"| {r['drafter']} | {r['tau']:.2f} | {r['passes_per_token']:.3f} | {r['tokens_per_s']:,.1f} | "
            f"{r['speedup']:.2f}x [{r['speedup_min']:.2f}, {r['speedup_max']:.2f}] | {r['t_verify_ms']:.2f} | "
            f"{r['t_draft_ms']:.2f} | {r['ideal_speedup']:.2f}x | {same} |"
        )
    lines += ["", "P(at least d drafts accepted per pass), d = 1, 2, ...:", ""]
    lines += [
        f"- {r['drafter']}: " + ", ".join(f"{a:.2f}" for a in r["acceptance_by_depth"][:8]) for r in rows
    ]
    if hf_rows:
        ours_total = base["new_tokens"] / max(base["wall_total"], 1e-9)
        lines += ["", f"Hugging Face baselines (whole calls incl. prefill; spechead plain: {ours_total:,.1f} tokens/s):", "",
                  "| method | tokens/s | vs spechead plain | greedy == plain |", "|---|---:|---:|---|"]  # fmt: skip
        for r in hf_rows:
            same = "yes" if not r["greedy_mismatches"] else f"NO ({r['greedy_mismatches']})"
            lines.append(
                f"| {r['method']} | {r['tokens_per_s']:,.1f} | {r['vs_spechead_plain']:.2f}x | {same} |"
            )
    if rows:
        lines += [
            "",
            "tau (speedup) by category:",
            "",
            "| category | " + " | ".join(r["drafter"] for r in rows) + " |",
        ]
        lines.append("|---|" + "---:|" * len(rows))
        for c in sorted(base["by_category"]):
            cells = [f"{r['tau_by_category'][c]:.2f} ({r['speedup_by_category'][c]:.2f}x)" for r in rows]
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
    if costs:
        sizes = ", ".join(f"{n}: {1e3 * t:.2f} ms" for n, t in costs.items())
        lines += ["", f"verification pass by tree size (context 128): {sizes}"]
    return "\n".join(lines)


def plot(out: Path, rows: list[dict]) -> None:
    """speedup_by_category.png and acceptance_by_depth.png (matplotlib, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows:
        return
    categories = sorted(rows[0]["speedup_by_category"])
    fig, ax = plt.subplots(figsize=(min(14, max(6, 0.2 * len(categories) * len(rows))), 4.5))
    width = 0.8 / len(rows)
    for i, r in enumerate(rows):
        xs = [j + i * width for j in range(len(categories))]
        ax.bar(xs, [r["speedup_by_category"][c] for c in categories], width, label=r["drafter"])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(categories))], categories, rotation=45, ha="right")
    ax.set_ylabel("speedup vs plain decoding")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "speedup_by_category.png", dpi=120)
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        acc = r["acceptance_by_depth"]
        ax.plot(range(1, len(acc) + 1), acc, marker="o", label=f"{r['drafter']} (tau {r['tau']:.2f})")
    ax.set_xlabel("draft depth d")
    ax.set_ylabel("P(at least d drafts accepted per pass)")
    ax.set_ylim(0, 1)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "acceptance_by_depth.png", dpi=120)
    plt.close("all")


def write(args, prompts, base, t_step, rows, hf_rows, costs) -> str:
    """Markdown, JSON (every number and the settings and versions) and plots, into args.out."""
    import transformers

    args.out.mkdir(parents=True, exist_ok=True)
    text = render(args, prompts, base, t_step, rows, hf_rows, costs)
    (args.out / "decoding.md").write_text(text + "\n")
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    versions = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
    }
    payload = {
        "plain_tokens_per_s": base["new_tokens"] / base["wall"], "t_step_ms": 1e3 * t_step, "rows": rows,
        "hf_baselines": hf_rows, "verify_ms_by_size": {k: 1e3 * v for k, v in costs.items()},
        "settings": settings, "versions": versions,
    }  # fmt: skip
    (args.out / "decoding.json").write_text(json.dumps(payload, indent=1))
    plot(args.out, rows)
    return text


def main(argv=None) -> int:
    args = parse(argv)
    torch.manual_seed(0)
    specs = dict(d.split("=", 1) for d in args.drafter) or {
        "prompt_lookup": "prompt_lookup",
        **{name: path for name, path in DEMO_HEADS.items() if Path(path).is_dir()},
    }
    prompts = load_prompt_set(args.prompt_set, args.prompts)
    plain = SpeculativeGenerator.from_pretrained(args.target, None, device=args.device, dtype=args.dtype)
    run(plain, prompts[:2], 8)  # warm-up
    base = run(plain, prompts, args.max_new_tokens)
    t_step = base["verify"] / max(base["target_passes"], 1)
    rows, hf_rows, costs = [], [], {}
    try:
        for name, spec in tqdm(specs.items(), desc="drafters", disable=not sys.stderr.isatty()):
            rows.append(measure(name, spec, args, prompts, base, t_step))
            write(args, prompts, base, t_step, rows, hf_rows, costs)  # partial results survive an interrupt
        hf_rows = measure_baselines(args, plain, prompts, base)
        costs = verify_cost(plain.target, [1, 2, 4, 8, 16, 32, 64], context=128, repeats=5)
    except KeyboardInterrupt:
        print(f"interrupted: partial results in {args.out}", file=sys.stderr)
        write(args, prompts, base, t_step, rows, hf_rows, costs)
        return 130
    print(write(args, prompts, base, t_step, rows, hf_rows, costs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
