"""The batch rows of scripts/bench_gpu.py: batch 1, 4, 16 plain steps and tree verifies on the target, whole
passes decoded through the engine generate_batch runs (eager, or with the target's batch passes compiled and,
on CUDA, the draft as graphs),
their projections at a given tau and their two tables. Imported by bench_gpu.py (a sibling module)."""

from __future__ import annotations

import torch

from spechead.inference.drafters.eagle import EagleDrafter
from spechead.inference.evaluation.profiling import Timer
from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.target.cache import RowCache
from spechead.inference.tree import tree_inputs_on_device
from spechead.inference.tuning.accuracy import assumed_eagle_accuracy
from spechead.inference.tuning.tree_search import best_choices


def random_parents(n: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    """Parents [batch, n] of one random tree (node i hangs from a node < i; root -1), repeated per row."""
    gen = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    return torch.tensor(parents, dtype=torch.long)[None].expand(batch, n).contiguous()


@torch.inference_mode()
def batch_row(model, b: int, ctx: int, n: int, timer: Timer) -> dict:
    """Batch b: a plain [b, 1] step and a [b, n] tree verify, HF forward on a RowCache (eager, every row
    written in a row: the rows' prompts are one length)."""
    device, cache = next(model.parameters()).device, RowCache(model.config.num_hidden_layers, b, ctx + n)
    ids = torch.randint(0, model.config.vocab_size, (b, ctx + n), generator=torch.Generator().manual_seed(b))
    ids = ids.to(device)
    model(input_ids=ids[:, :ctx], cache=cache, use_cache=True, logits_to_keep=1)
    mask, positions, _ = tree_inputs_on_device(random_parents(n, b).to(device), ctx, torch.bfloat16)
    step_pos = torch.full((b, 1), ctx, dtype=torch.long, device=device)

    def forward(tokens: torch.Tensor, **kwargs) -> None:
        cache.set_length(ctx)
        model(input_ids=tokens, cache=cache, use_cache=True, **kwargs)

    step_ms = timer.ms(lambda: forward(ids[:, ctx : ctx + 1], position_ids=step_pos))
    verify_ms = timer.ms(lambda: forward(ids[:, ctx:], attention_mask=mask, position_ids=positions))
    return {"batch": b, "plain_step_ms": step_ms, "plain_tokens_per_s": 1e3 * b / step_ms, "verify_ms": verify_ms}  # fmt: skip


@torch.inference_mode()
def decoded_batch(model, head, b: int, ctx: int, new_tokens: int = 32, compile: bool | str = False) -> dict:
    """Batch b decoded through the engine generate_batch runs (engine/loop.py: the target runner, the
    batched EAGLE-3 drafter, acceptance, commits): ms per pass, plain and with a static tree of max(4, 64 // b)
    nodes per row (the size loading.drafter_for_batch compares up to). Random weights accept about nothing, so a
    pass here commits about one token: its cost, not its tau, is what this measures. compile: the
    target's batch passes and (on CUDA) the EAGLE batch draft and accept compiled (target/graphs.py,
    drafters/eagle/graphs.py, as generate_batch with compile=...); the first, untimed run compiles and
    captures."""
    device, nodes = next(model.parameters()).device, max(4, 64 // b)
    choices = best_choices(assumed_eagle_accuracy(head), nodes - 1)
    prompts = list(
        torch.randint(0, model.config.vocab_size, (b, ctx), generator=torch.Generator().manual_seed(b))
    )
    out = {"decoded_tree_nodes": len(choices) + 1}
    # as the engine runs them (on CUDA each plain step queued before the last one's tokens are read;
    # with a compiled drafter each next draft before the acceptance is read: engine/loop.py) and
    # reading first (each step, or each next draft, after the host's read)
    kinds = (
        ("plain", None, None),
        ("plain_stepwise", None, False),
        ("spec", EagleDrafter(head, tree=choices), None),
        ("spec_stepwise", EagleDrafter(head, tree=choices), False),
    )
    for name, drafter, ahead in kinds:
        times = []
        if compile and drafter is not None:
            drafter.use_compile(compile)  # (on CUDA) it drafts every row as one graph
        # one generator a kind: its kept runner, so the timed run replays what the warm-up captured
        gen = SpeculativeGenerator(model, None, drafter, compile=compile, draft_compile=False)
        gen.eos = set()  # random weights: never stop early
        gen.ahead = gen.ahead if ahead is None else ahead
        for _ in range(2):  # the first run warms up (allocations, the plan); the second is timed
            results = gen.generate_batch(input_ids=prompts, max_new_tokens=new_tokens, tree_for_batch=False)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            stats = results[0].stats
            times.append(1e3 * (stats.wall_time - stats.prefill_time) / max(stats.target_passes, 1))
        out[f"decoded_{name}_pass_ms"] = times[-1]
        if drafter is not None:  # whether every row's draft ran as graphs (drafters/eagle/graphs.py: CUDA)
            out["draft_graphs"] = drafter._rows is not None and drafter._rows is drafter._graphs
    return out


def decoded_or_error(model, head, b: int, ctx: int, compile: bool | str = False) -> dict:
    """decoded_batch, or {"decoded_error": what failed} (a compile or capture failure must not lose the
    other rows' and the batch-1 numbers)."""
    try:
        return decoded_batch(model, head, b, ctx, compile=compile)
    except Exception as err:  # noqa: BLE001 - reported in the table and the JSON
        first = str(err).strip().splitlines()[:1]
        return {"decoded_error": f"{type(err).__name__}: {first[0] if first else ''}"[:300]}


def project_batch(row: dict, extra_ms: float, tau: float) -> dict:
    """Projected speculative numbers of a batch row: pass = verify(b, N) + the batch-1 draft/commit/accept."""
    pass_ms = row["verify_ms"] + extra_ms
    out = {**row, "projected_pass_ms": pass_ms, "projected_row_tokens_per_s": 1e3 * tau / pass_ms,
           "projected_tokens_per_s": 1e3 * row["batch"] * tau / pass_ms,
           "projected_speedup": tau * row["plain_step_ms"] / pass_ms}  # fmt: skip
    if "decoded_spec_pass_ms" in row:  # the whole decoded pass, engine and batched drafter included
        spec, plain = row["decoded_spec_pass_ms"], row["decoded_plain_pass_ms"]
        out.update(decoded_tokens_per_s=1e3 * row["batch"] * tau / spec, decoded_speedup=tau * plain / spec)
    return out


def render_batch(r: dict) -> list[str]:
    """The batch rows' two tables (projected from a batched verify; decoded through the engine)."""
    lines = ["batch (eager HF forward, RowCache) | plain step ms | plain tok/s | verify(N) ms | projected spec tok/s (per row) | vs plain"]  # fmt: skip
    for row in r["batch"]:
        lines.append(
            f"{row['batch']:35d} | {row['plain_step_ms']:13.3f} | {row['plain_tokens_per_s']:11.1f} | "
            f"{row['verify_ms']:12.3f} | {row['projected_tokens_per_s']:10.1f} ({row['projected_row_tokens_per_s']:.1f})"
            f" | {row['projected_speedup']:.2f}x"
        )
    target = f"target compiled: {r['compile_batch']}" if r.get("compile_batch") else "eager"
    graphed = [row["batch"] for row in r["batch"] if row.get("draft_graphs")]
    if graphed:  # (a compiled batch of one drafts as graphs anywhere; more rows on CUDA by default)
        every = len(graphed) == len(r["batch"])
        target += ", the draft as graphs" + ("" if every else f" at B={','.join(map(str, graphed))}")
    lines.append(
        f"batch, decoded (the engine of generate_batch; {target}) | tree nodes | plain pass ms"
        " (token by token) | spec pass ms (reading first) | projected spec tok/s | vs plain"
    )
    for row in r["batch"]:
        if "decoded_error" in row:
            lines.append(f"{row['batch']:58d} | failed: {row['decoded_error']}")
            continue
        lines.append(
            f"{row['batch']:58d} | {row['decoded_tree_nodes']:10d} | {row['decoded_plain_pass_ms']:13.3f}"
            f" ({row.get('decoded_plain_stepwise_pass_ms', float('nan')):.3f}) | "
            f"{row['decoded_spec_pass_ms']:12.3f} ({row.get('decoded_spec_stepwise_pass_ms', float('nan')):.3f}) | "
            f"{row['decoded_tokens_per_s']:20.1f} | {row['decoded_speedup']:.2f}x"
        )
    return [*lines, r["batch_speculative"]]
