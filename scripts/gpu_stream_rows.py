"""The batch-1 decoded row of scripts/bench_gpu.py: whole passes through SpeculativeGenerator (plain, as the
engine runs it and token by token, and EAGLE-3 with the benchmark's dynamic tree, as the engine runs it
and reading each acceptance before the next draft), measured as they run, host work and waits included, beside
the sum of the parts bench_gpu times apart; and, on CUDA, how often a pass waits for the device.
Imported by bench_gpu.py (a sibling module)."""

from __future__ import annotations

import statistics

import torch

from spechead.inference.drafters.eagle import EagleDrafter
from spechead.inference.evaluation.profiling import count_syncs, profile_part
from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.target.runner import TargetRunner

NEW_TOKENS = 48  # tokens per timed generate (random weights accept about nothing: about 48 passes)
# tokens of the two profiled generates: 16 passes apart are enough for per-pass kernel counts and costs,
# and torch.profiler's parse of each event in Python (most of a --tiny run's time at 48) stays short
PROFILED_TOKENS = (8, 24)


@torch.inference_mode()
def decoded_stream(
    model, head, args, compile: bool | str, runner: TargetRunner, drafter: EagleDrafter, repeats: int = 3
) -> dict:
    """ms per pass of batch-1 decoding through the engine (the median of `repeats` generates after a
    warm-up), plain and EAGLE-3, and the host's waits per pass. EAGLE-3 decodes with the runner and the
    drafter bench_gpu measured (their graphs: no second compile of the 8B target); plain decoding with a
    runner of its own (no hidden states captured: its step compiles once more)."""
    device, ctx = next(model.parameters()).device, args.context
    prompt = torch.randint(0, model.config.vocab_size, (ctx,), generator=torch.Generator().manual_seed(1))
    out: dict = {"stream_new_tokens": NEW_TOKENS}
    for name in ("plain", "plain_stepwise", "spec", "spec_stepwise"):
        if not name.startswith(
            "spec"
        ):  # plain decoding as the engine runs it (on CUDA one step ahead), and token by token
            gen = SpeculativeGenerator(model, None, None, compile=compile)
            gen.ahead = gen.ahead and name == "plain"
        else:  # (compile=False: the drafter keeps its graphs; the measured runner is the batch of one's)
            gen = SpeculativeGenerator(model, None, drafter)
            gen.runner = runner
            # as the engine runs it (on CUDA the next draft queued before the acceptance is read,
            # engine/loop.py), and reading each acceptance before the commits and the next draft
            gen.ahead = gen.ahead and name == "spec"
        gen.eos = set()  # random weights: never stop early

        def run(gen=gen):
            return gen.generate(input_ids=prompt, max_new_tokens=NEW_TOKENS).stats

        run()  # warm-up: compiles, captures the graphs, allocates
        times, phases = [], []
        for _ in range(repeats):
            stats = run()
            per_pass = 1e3 / max(stats.target_passes, 1)
            times.append((stats.wall_time - stats.prefill_time) * per_pass)
            phases.append((stats.draft_time * per_pass, stats.verify_time * per_pass))
        stats, syncs = count_syncs(device, run)
        out[f"stream_{name}_pass_ms"] = statistics.median(times)
        # a pass by phase (the generator's PhaseClock: on CUDA events, so the device's timeline): draft
        # (the drafter's accept and propose), verify (the target's pass, the acceptance and the commit), and
        # the rest (the loop's host work between a pass's result and the next draft)
        draft, verify = (statistics.median(p[i] for p in phases) for i in (0, 1))
        out[f"stream_{name}_phase_ms"] = {"draft": draft, "verify": verify,
                                          "other": out[f"stream_{name}_pass_ms"] - draft - verify}  # fmt: skip
        out[f"stream_{name}_passes"] = stats.target_passes
        out[f"stream_{name}_syncs"] = syncs  # the whole generate's, prefill included
        out[f"stream_{name}_tau"] = stats.tau
        if name in ("plain", "spec"):  # as the engine runs them: what the device does in a pass
            out[f"stream_{name}_device"] = device_per_pass(gen, prompt, device)
    return out


def device_per_pass(gen: SpeculativeGenerator, prompt: torch.Tensor, device: torch.device) -> dict:
    """A decoded pass's device work (torch.profiler): kernel ms and kernels a pass (None on a CPU) and host
    ops a pass, from two generates of PROFILED_TOKENS tokens (the difference drops the prefill and the
    end), and the kernels (host ops on a CPU) that cost most a pass. The pass's wall time minus its kernel
    time is the device idle: waiting for the host's launches and reads."""
    runs = []
    for n in PROFILED_TOKENS:
        kept: list = []

        def run(n: int = n, kept: list = kept) -> None:
            kept.append(gen.generate(input_ids=prompt, max_new_tokens=n).stats)

        runs.append((profile_part(run, device, iters=1, top=40), kept[-1].target_passes))
    (short, a), (long, b) = runs
    passes = max(b - a, 1)

    def per_pass(x: float | None, y: float | None) -> float | None:
        return None if x is None or y is None else (x - y) / passes

    before = {name: ms for name, ms, _ in short.top}
    costs = [(name, (ms - before.get(name, 0.0)) / passes) for name, ms, _ in long.top]
    return {
        "kernel_ms": per_pass(long.device_ms, short.device_ms),
        "kernels": per_pass(long.kernels, short.kernels),
        "host_ops": per_pass(long.host_ops, short.host_ops),
        "top": sorted(costs, key=lambda c: -c[1])[:8],
    }


def stream_or_error(
    model, head, args, compile: bool | str, runner: TargetRunner, drafter: EagleDrafter
) -> dict:
    """decoded_stream, or {"stream_error": what failed} (the other rows' numbers must not be lost)."""
    try:
        return decoded_stream(model, head, args, compile, runner, drafter)
    except Exception as err:  # noqa: BLE001 - reported in the table and the JSON
        first = str(err).strip().splitlines()[:1]
        return {"stream_error": f"{type(err).__name__}: {first[0] if first else ''}"[:300]}


def project_stream(row: dict, parts_pass_ms: float, tau: float) -> dict:
    """The decoded passes' projection at `tau` and what the parts timed apart missed (host work, waits)."""
    if "stream_error" in row:
        return row
    spec, plain = row["stream_spec_pass_ms"], row["stream_plain_pass_ms"]
    return {**row, "stream_speedup": tau * plain / spec, "stream_tau": tau,
            "stream_gap_ms": spec - parts_pass_ms}  # fmt: skip


def render_stream(r: dict) -> list[str]:
    """Two lines: the decoded passes and their projection, the host's waits per pass."""
    row = r.get("stream") or {}
    if not row:
        return []
    if "stream_error" in row:
        return [f"batch 1, decoded (SpeculativeGenerator): failed: {row['stream_error']}"]
    return [
        f"batch 1, decoded (SpeculativeGenerator, {row['stream_new_tokens']} tokens, random weights so about "
        f"one a pass): plain {row['stream_plain_pass_ms']:.3f} ms a pass (token by token, the host reading each "
        f"before the next step: {row['stream_plain_stepwise_pass_ms']:.3f}), EAGLE-3 {row['stream_spec_pass_ms']:.3f} "
        f"ms (reading each acceptance before the next draft: {row.get('stream_spec_stepwise_pass_ms', float('nan')):.3f}; "
        f"{row['stream_gap_ms']:+.3f} ms against the parts' sum); projected at tau {row['stream_tau']}: "
        f"{row['stream_speedup']:.2f}x the decoded plain passes",
        f"host waits for the GPU (whole generate, prefill included): plain {row['stream_plain_syncs']} in "
        f"{row['stream_plain_passes']} passes, EAGLE-3 {row['stream_spec_syncs']} in {row['stream_spec_passes']}",
        "a decoded pass on the device (torch.profiler; wall - kernels = the device idle, waiting for the host): "
        + "; ".join(_device_line(label, row[f"stream_{name}_pass_ms"], row[f"stream_{name}_device"])
                    for name, label in (("plain", "plain"), ("spec", "EAGLE-3"))
                    if f"stream_{name}_device" in row),
        "a decoded pass by phase, ms (draft / verify, accept and commit / the loop's other work): "
        + "; ".join(f"{label} " + " / ".join(f"{row[f'stream_{name}_phase_ms'][k]:.3f}" for k in
                                             ("draft", "verify", "other"))
                    for name, label in (("plain", "plain"), ("plain_stepwise", "plain token by token"),
                                        ("spec", "EAGLE-3"), ("spec_stepwise", "EAGLE-3 reading first"))
                    if f"stream_{name}_phase_ms" in row),
    ]  # fmt: skip


def _device_line(label: str, pass_ms: float, dev: dict) -> str:
    """One engine's decoded pass: wall, kernel and idle ms, kernels a pass, the costliest kernels."""
    top = ", ".join(f"{k[:40]} {ms:.3f}" for k, ms in dev["top"][:5])
    if dev["kernel_ms"] is None:  # a CPU: no device kernels, the host ops instead
        return f"{label} {pass_ms:.3f} ms wall, {dev['host_ops']:.0f} host ops (costliest: {top})"
    return (f"{label} {pass_ms:.3f} ms wall, {dev['kernel_ms']:.3f} ms in {dev['kernels']:.0f} kernels, idle "
            f"{pass_ms - dev['kernel_ms']:.3f} (costliest ms: {top})")  # fmt: skip
