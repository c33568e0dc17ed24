"""Benchmark results as a Markdown table and matplotlib PNG plots (no display needed). Rows are
`measure.summarize`'s dicts with a "drafter" name added; every table showing tau says it is pooled.
"""

from __future__ import annotations

from pathlib import Path

from spechead.inference.stats import TAU


def _same(mismatches: int | None) -> str:
    if mismatches is None:
        return "n/a (sampling)"
    return "yes" if not mismatches else f"NO ({mismatches})"


def render(header: str, rows: list[dict], hf_rows: list[dict], costs: dict[int, float]) -> str:
    """The Markdown report: drafters, acceptance by depth, HF baselines, per category, tree costs."""
    lines = [
        header,
        "",
        "| drafter | tau (pooled) | target passes/token | tokens/s | speedup [min, max] | t_verify ms | t_draft ms "
        "| t_other ms | ideal speedup | greedy == plain |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['drafter']} | {r['tau']:.2f} | {r['passes_per_token']:.3f} | {r['tokens_per_s']:,.1f} | "
            f"{r['speedup']:.2f}x [{r['speedup_min']:.2f}, {r['speedup_max']:.2f}] | {r['t_verify_ms']:.2f} | "
            f"{r['t_draft_ms']:.2f} | {r['t_other_ms']:.2f} | {r['ideal_speedup']:.2f}x | "
            f"{_same(r['greedy_mismatches'])} |"
        )
    calibrated = [r for r in rows if r.get("calibrated_tree")]
    if calibrated:
        lines += ["", "Trees calibrated at load (this load's pick):", ""]
        lines += [f"- {r['drafter']}: {t['nodes']} drafted nodes, depth {t['depth']}, expected "
                  f"{t['expected_speedup']:.2f}x" for r in calibrated for t in [r["calibrated_tree"]]]  # fmt: skip
    quantized = [f"{r['drafter']} {r['draft_weights']}" for r in rows if r.get("draft_weights")]
    if quantized:  # (from_pretrained's draft_int8 / draft_fp8)
        note = "Draft layers quantized (lossless: the target verifies every token)"
        lines += ["", f"{note}: {', '.join(quantized)}"]
    if rows:
        lines += ["", f"tau = {TAU}."]
        lines += ["", "P(at least d drafts accepted per pass), d = 1, 2, ...:", ""]
        lines += [
            f"- {r['drafter']}: " + ", ".join(f"{a:.2f}" for a in r["acceptance_by_depth"][:8]) for r in rows
        ]
    if hf_rows:
        lines += [
            "",
            "Hugging Face baselines (same target and prompts; whole generate() calls incl. prefill):",
            "",
            "| method | tokens/s | speedup vs HF generate | greedy == plain |",
            "|---|---:|---:|---|",
        ]
        for r in hf_rows:
            lines.append(
                f"| {r['method']} | {r['tokens_per_s']:,.1f} | {r['speedup_vs_hf_generate']:.2f}x | "
                f"{_same(r['greedy_mismatches'])} |"
            )
    if rows:
        lines += [
            "",
            "tau, pooled per category (speedup):",
            "",
            "| category | " + " | ".join(r["drafter"] for r in rows) + " |",
        ]
        lines.append("|---|" + "---:|" * len(rows))
        for c in sorted(rows[0]["tau_by_category"]):
            cells = [f"{r['tau_by_category'][c]:.2f} ({r['speedup_by_category'][c]:.2f}x)" for r in rows]
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
    if costs:
        sizes = ", ".join(f"{n}: {1e3 * t:.2f} ms" for n, t in costs.items())
        lines += ["", f"verification pass by tree size: {sizes}"]
    return "\n".join(lines)


def plot_speedup_by_category(rows: list[dict], path: Path) -> Path:
    """Grouped bars: speedup over plain decoding per category, one bar per drafter."""
    plt = _pyplot()
    categories = sorted(rows[0]["speedup_by_category"])
    fig, ax = plt.subplots(figsize=(min(14, max(6, 0.2 * len(categories) * len(rows))), 4.5))
    width = 0.8 / len(rows)
    for i, r in enumerate(rows):
        xs = [j + i * width for j in range(len(categories))]
        ax.bar(xs, [r["speedup_by_category"][c] for c in categories], width, label=r["drafter"])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(categories))], categories, rotation=30, ha="right")
    ax.set_ylabel("speedup vs plain decoding")
    ax.legend()
    return _save(fig, path)


def plot_acceptance_by_depth(rows: list[dict], path: Path) -> Path:
    """One line per drafter: P(at least d drafts accepted per pass) against d."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        acc = r["acceptance_by_depth"]
        ax.plot(range(1, len(acc) + 1), acc, marker="o", label=f"{r['drafter']} (pooled tau {r['tau']:.2f})")
    ax.set_xlabel("draft depth d")
    ax.set_ylabel("P(at least d drafts accepted per pass)")
    ax.set_ylim(0, 1)
    ax.legend()
    return _save(fig, path)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: works without a display
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path
