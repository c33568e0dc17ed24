"""bench_gpu.py's report: the numbers derived from the timed parts (roofline fractions, multiples of a
decode step, projected speedups), the issue's GPU goals, and the printed lines."""

from __future__ import annotations

import statistics

from gpu_batch_rows import render_batch
from gpu_stream_rows import render_stream

from spechead.inference.evaluation.profiling import PartProfile, render_profiles

TAUS = (3.0, 4.0, 5.0, 5.4, 6.0)
ACCEPTED = 5  # tokens committed per pass when timing commit/accept (about tau)
COMPARED = ("decode_step_ms", "roofline_fraction", "verify_64_x_step", "draft_ms", "draft_x_step",
            "draft_depth_ms", "pass_ms", "speedup_tau_5.4")  # fmt: skip
GOALS = {  # name: (JSON value it reads, bound, "min" = value >= bound / "max" = value <= bound)
    "plain decode >= 70% of roofline": ("roofline_fraction", 0.70, "min"),
    "verify(64) <= 1.3x a decode step": ("verify_64_x_step", 1.3, "max"),
    "depth-7 EAGLE-3 draft <= 25% of a decode step": ("draft_x_step", 0.25, "max"),
    "projected speedup at tau 5.4 >= 3x": ("speedup_tau_5.4", 3.0, "min"),
    # issue 56: one parallel forward per pass (absent with --no-parallel or --blocks without 8 / 16)
    "block-16 DFlash draft <= 8% of a plain step": ("dflash_16_draft_x_step", 0.08, "max"),
    "K=8 P-EAGLE draft <= 8% of a plain step": ("peagle_8_draft_x_step", 0.08, "max"),
    "projected speedup at tau 6 >= 5x (block-16 DFlash)": ("speedup_tau_6_dflash_16", 5.0, "min"),
    "projected speedup at tau 6 >= 5x (K=8 P-EAGLE)": ("speedup_tau_6_peagle_8", 5.0, "min"),
}
GOAL_SHAPE = "Llama-3.1-8B shape (random weights)"  # the goals are GPU goals at this target


def summarize(
    args, parts: dict, bandwidth: float, weight_bytes: int, streamed_bytes: int, head_bytes: int
) -> dict:
    """Derived numbers: roofline fractions, multiples of the step, projected speedups, goals."""
    step = parts["verify_ms"][1]
    draft = parts["propose_ms"][args.depth]
    pass_ms = parts["verify_ms"][args.tree_size] + parts["commit_ms"] + draft + parts["accept_ms"]
    out = {
        "decode_step_ms": step, "copy_bandwidth_GBps": bandwidth / 1e9, "weight_bytes": weight_bytes,
        "streamed_bytes": streamed_bytes, "roofline_ms": 1e3 * weight_bytes / bandwidth,
        "roofline_fraction": 1e3 * weight_bytes / bandwidth / step,
        "roofline_fraction_streamed": 1e3 * streamed_bytes / bandwidth / step,
        "verify_x_step": {n: t / step for n, t in parts["verify_ms"].items()},
        "draft_ms": draft, "draft_x_step": draft / step,
        "draft_ms_per_depth": {d: t - parts["propose_ms"][d - 1] if d > 1 else t
                               for d, t in parts["propose_ms"].items() if d == 1 or d - 1 in parts["propose_ms"]},
        "pass_ms": pass_ms, "projected_speedup": {str(tau): tau * step / pass_ms for tau in TAUS},
    }  # fmt: skip
    first, depth = parts["propose_ms"][1], args.depth  # depth 1: no head call (the root's top-k)
    head_steps = [(draft - first) / (depth - 1)] if depth > 1 else [draft]
    out["draft_depth_ms"] = statistics.mean(head_steps)  # one head call + top-k over the frontier
    out["draft_depth_x_step"] = out["draft_depth_ms"] / step
    # the draft's own roofline: its weight bytes at the copy bandwidth (what no engine can beat)
    out["draft_bytes"] = head_bytes
    out["draft_floor_ms"] = 1e3 * head_bytes / bandwidth
    out["draft_floor_x_step"] = out["draft_floor_ms"] / step
    out["draft_roofline_fraction"] = out["draft_floor_ms"] / draft
    out["verify_64_x_step"] = out["verify_x_step"][64]
    out["speedup_tau_5.4"] = out["projected_speedup"]["5.4"]
    return out


def parallel_goal_keys(rows: dict) -> dict:
    """The parallel goals' values from bench_gpu's parallel rows: K=8 P-EAGLE's and block-16 DFlash's draft
    as a share of a plain step and their projected speedup at tau 6 (those of the rows measured)."""
    out = {}
    for name in ("peagle-8", "dflash-16"):
        if name in rows:
            key = name.replace("-", "_")
            out[f"{key}_draft_x_step"] = rows[name]["draft_x_step"]
            out[f"speedup_tau_6_{key}"] = rows[name]["projected_speedup"]["6.0"]
    return out


def goals(report: dict) -> dict:
    """{goal: {value, bound, met}} for the issue's GPU goals whose value the run measured."""
    met = lambda value, bound, kind: value >= bound if kind == "min" else value <= bound  # noqa: E731
    return {name: {"value": report[key], "bound": bound, "met": met(report[key], bound, kind)}
            for name, (key, bound, kind) in GOALS.items() if report.get(key) is not None}  # fmt: skip


def render_parallel(r: dict) -> list[str]:
    """The parallel drafters' lines: one forward per pass beside EAGLE-3's depth-D draft."""
    rows, step = r["parallel"], r["decode_step_ms"]
    modes = sorted({str(row.get("draft_compile", "eager")) for row in rows.values()})
    lines = [
        f"parallel drafting, ONE head forward per pass (bf16 heads, draft {' / '.join(modes)}, DFlash "
        f"{r['parallel_layers']} layers, P-EAGLE {r.get('peagle_layers', 1)}; "
        "P-EAGLE's pass also writes the 5 positions accepted since the last; chains verified):",
        f"  eagle3 depth {r['depth']} (tree {r['tree_size']}): draft {r['draft_ms']:.3f} ms = {r['draft_x_step']:.1%} "
        f"of a step; pass {r['pass_ms']:.3f} ms; tau 6: {r['projected_speedup']['6.0']:.2f}x",
    ]  # fmt: skip
    for name, row in rows.items():
        tau6 = row["projected_speedup"]["6.0"]
        lines.append(
            f"  {name} ({row['drafts']} drafts): draft {row['draft_ms']:.3f} ms = {row['draft_ms'] / step:.1%} "
            f"of a step ({row['draft_ms'] / r['draft_ms']:.2f}x EAGLE-3's); accept {row['accept_ms']:.3f} ms; "
            f"verify({row['nodes']}-chain) {row['verify_ms']:.3f} ms; pass {row['pass_ms']:.3f} ms; tau 6: "
            + ("n/a" if tau6 is None else f"{tau6:.2f}x")
        )
    return lines


def render(r: dict) -> str:
    gb = 1e9
    lines = [
        f"device: {r['device_name']} ({r['device']}); target {r['target']}, bf16, context {r['context']}; "
        f"compile: {r['compile']}",
        f"EAGLE-3 head{' (per-depth layers FP8 e4m3)' if r.get('draft_fp8') else ''}: draft vocab "
        f"{r['draft_vocab']}, EAGLE-2 dynamic top_k {r['top_k']}, depth {r['depth']}, "
        f"tree {r['tree_size']} nodes; drafting {r['draft_status']}"
        + (f"; top-k in chunks of {r['topk_chunk']}" if r.get("topk_chunk") else "")
        + ("; few-query attention as matmuls" if r.get("draft_attention") == "matmul" else ""),
        f"target attention: {r.get('target_attention')}"
        + (f"; q/k/v and gate/up stacked, one GEMM each ({r['target_stacked']} groups)" if r.get("target_stacked") else ""),
        f"copy bandwidth {r['copy_bandwidth_GBps']:.0f} GB/s; weights {r['weight_bytes'] / gb:.3g} GB -> roofline "
        f"{r['roofline_ms']:.3f} ms",
        f"plain decode step {r['decode_step_ms']:.3f} ms = {r['roofline_fraction']:.1%} of roofline "
        f"({r['roofline_fraction_streamed']:.1%} counting streamed bytes: no embedding table, + KV)",
        "verify by tree size:  " + "  ".join(
            f"{n}: {t:.2f} ms ({r['verify_x_step'][n]:.2f}x)" for n, t in r["verify_ms"].items()),
        "draft (propose) by depth, total ms:  " + "  ".join(f"{d}: {t:.2f}" for d, t in r["propose_ms"].items()),
        f"depth-{r['depth']} draft {r['draft_ms']:.3f} ms = {r['draft_x_step']:.1%} of a step; per depth "
        + ", ".join(f"{t:.2f}" for t in r["draft_ms_per_depth"].values())
        + f" ms (a head depth {r['draft_depth_ms']:.3f} ms = {r['draft_depth_x_step']:.1%} of a step)",
        f"draft roofline: its weights read {r['draft_bytes'] / gb:.3g} GB -> {r['draft_floor_ms']:.3f} ms = "
        f"{r['draft_floor_x_step']:.1%} of a step; the draft runs at {r['draft_roofline_fraction']:.1%} of it",
        f"commit (target, {r['commit_path_len']}-node path) {r['commit_ms']:.3f} ms; drafter accept of "
        f"{ACCEPTED} tokens {r['accept_ms']:.3f} ms; pass = verify + commit + draft + accept = {r['pass_ms']:.3f} ms",
        "projected speedup tau * t_step / t_pass:  " + "  ".join(
            f"tau {t}: {s:.2f}x" for t, s in r["projected_speedup"].items()),
    ]  # fmt: skip
    lines += render_parallel(r) if "parallel" in r else []
    lines += render_stream(r)
    if r["batch"]:
        lines += render_batch(r)
    if "compare" in r:
        c = r["compare"]
        lines.append(f"compare: compile {c['compile']}")
        lines.append("compare: " + "  ".join(f"{key} {c[key]:.3f} (vs {r[key]:.3f})" for key in COMPARED))
    if "profile" in r:
        lines += render_profiles({name: PartProfile(**p) for name, p in r["profile"].items()})
    on_goal_shape = r["device"].startswith("cuda") and r["target"] == GOAL_SHAPE
    lines.append(
        "goals: the issue's GPU goals (a GPU, the 8B shape)"
        + ("" if on_goal_shape else f"; this run ({r['device']}, {r['target']}) does not test them")
    )
    lines += [f"goal: {name}: {g['value']:.3f} -> {'met' if g['met'] else 'NOT met'}" for name, g in r["goals"].items()]  # fmt: skip
    return "\n".join(lines)
