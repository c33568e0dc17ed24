"""Where a speculative pass spends its time: target forwards, head forwards, and everything else.

    python scripts/bench_overhead.py --drafter outputs/eagle3-demo/head
    python scripts/bench_overhead.py --drafter outputs/bench-heads/medusa2/head --prompts 12
    python scripts/bench_overhead.py --drafter outputs/eagle3-demo/head@tree=tree.json  # a fixed tree
    python scripts/bench_overhead.py --drafter outputs/eagle3-demo/head@rule=without_replacement \
        --temperature 1.0 --top-p 0.9                   # sampling, EAGLE's children drawn from the head

Decodes a prompt set greedily twice on the same loaded target, plain and with the drafter, taking
turns prompt by prompt. Timers wrap the target's forward (the runner's one model call per pass) and
the drafter's own network calls (EAGLE: the input features (EAGLE-3's fusion layer), each head step
and each top-k over the head's logits; Medusa: the heads' pass; a draft model: its forwards; those of
the prompt at `start` count with the prefill, not with a pass), so "engine" is whatever a pass spends outside them:
tree building, masks, acceptance, cache commits, bookkeeping. Prints, per pass and as a share of a
plain decoding step: the target forward, the draft networks, the engine, and the draft time per
depth (EAGLE). With --temperature > 0 both decode by sampling (seeded per prompt; EAGLE's drawn
children, `rule=without_replacement`, count their head calls and draws as draft networks; the
acceptance's target distributions are engine). CPU timings (perf_counter): on a GPU the timers would
only see launch times.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

from spechead.configs import demo_asset
from spechead.data.prompt_sets import load_prompt_set
from spechead.inference.drafter_specs import drafter_options
from spechead.inference.drafters.eagle.rows import EagleRows
from spechead.inference.drafters.eagle.sampled_children import SampledChildren
from spechead.inference.generator import SpeculativeGenerator

_DRAWN_TOP, _ROWS_TOP = SampledChildren.top, EagleRows._top


class Timers:
    """Wall time spent inside wrapped callables, by label (nested labels are not subtracted)."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)

    def wrap(self, obj, name: str, label: str) -> None:
        inner, clock, spent = getattr(obj, name), time.perf_counter, self.spent

        def timed(*args, **kwargs):  # lean: its own cost outside the timed span counts as engine
            start = clock()
            try:
                return inner(*args, **kwargs)
            finally:
                spent[label] += clock() - start

        setattr(obj, name, timed)


def instrument(gen: SpeculativeGenerator, timers: Timers) -> None:
    """Time the target forward (verify passes; the prefill's apart) and the drafter's network calls."""
    # the target runner's one model call (the decode loop's compatibility shim, if any, holds the runner)
    timers.wrap(getattr(gen.runner, "one", gen.runner), "_forward", "target")
    prefill = gen.runner.prefill

    def timed_prefill(*args, **kwargs):  # its target forward is not a pass: kept apart
        before = timers.spent["target"]
        try:
            return prefill(*args, **kwargs)
        finally:
            timers.spent["prefill_target"] += timers.spent["target"] - before

    gen.runner.prefill = timed_prefill
    drafter = gen.drafter
    if drafter is None:
        return
    # EAGLE compiled: its rows (`GraphRows`, made at its first start) draft and accept as graphs (head
    # steps, top-k, their masks and the accept's input features, fused): the graph calls are the head's
    # forwards, wrapped once the rows exist (below)
    compiled = bool(getattr(drafter, "_compile", False)) and hasattr(drafter, "_graphs")
    if compiled:
        pass
    elif hasattr(
        drafter, "head_step"
    ):  # EAGLE: features (EAGLE-3 fusion), head steps (commit + depths), top-k
        timers.wrap(drafter, "head_step", "draft_net")
        # its rows' logits + top-k (rows made per start) and drawn children (sampling, made per propose):
        # timed on the classes (functions there: `self` passes through)
        timers.wrap(EagleRows, "_top", "draft_net")
        timers.wrap(drafter.head, "features", "draft_net")  # the name the drafter calls (`fuse` for EAGLE-3)
        timers.wrap(SampledChildren, "top", "draft_net")
    elif hasattr(
        drafter, "head"
    ):  # Medusa: the heads' one pass (the drafter's fused heads where it has them)
        timers.wrap(drafter if hasattr(drafter, "head_logits") else drafter.head, "head_logits", "draft_net")
    elif hasattr(drafter, "model"):  # a draft model
        timers.wrap(drafter.model, "forward", "draft_net")
    start = drafter.start
    graphed: list[object] = []  # the compiled rows whose graphs are wrapped

    def timed_start(*args, **kwargs):  # the prompt's head steps belong to the prefill, not to a pass
        before = timers.spent["draft_net"]
        try:
            return start(*args, **kwargs)
        finally:
            timers.spent["start_draft_net"] += timers.spent["draft_net"] - before
            rows = drafter._graphs if compiled else None  # (kept: wrapped at the start that made them)
            if rows is not None and all(rows is not seen for seen in graphed):
                timers.wrap(rows, "_draft", "draft_net")  # every row's whole draft
                timers.wrap(rows, "_accept", "draft_net")  # every row's accept (the prompt's runs eagerly)
                graphed.append(rows)

    drafter.start = timed_start


def decode(gen, chats, max_new: int, sampling: dict) -> tuple[float, int, int]:
    """(wall s excluding the prefill, verification passes, new tokens) over the chats."""
    wall = passes = tokens = 0
    for ids in chats:
        r = gen.generate(input_ids=ids, max_new_tokens=max_new, **sampling)
        wall += r.stats.wall_time - r.stats.prefill_time
        passes += r.stats.target_passes
        tokens += r.stats.new_tokens
    return wall, passes, tokens


def sampling(args, ids: list[int]) -> dict:
    """generate()'s sampling arguments: greedy, or --temperature / --top-p seeded by the prompt (the same
    seed for the plain and the speculative run of a prompt)."""
    if args.temperature <= 0:
        return {}
    return {"temperature": args.temperature, "top_p": args.top_p, "seed": len(ids) + sum(ids) % 9973}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=str(demo_asset("target")))
    p.add_argument(
        "--drafter", required=True,
        help="a head directory or any other drafter, with options as in benchmark.py: HEAD@tree=tree.json",
    )  # fmt: skip
    p.add_argument("--prompt-set", default="demo")
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--temperature", type=float, default=0.0, help="> 0: decode by sampling (both sides)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--out", type=Path, default=None, help="also write the numbers as JSON here")
    p.add_argument(
        "--compile-draft", nargs="?", const=True, default=False, metavar="BACKEND",
        help="compile the drafter (EAGLE: the whole draft as one graph, timed as the head's forwards)",
    )  # fmt: skip
    args = p.parse_args(argv)
    try:
        path, options = drafter_options(args.drafter)
        gen = SpeculativeGenerator.from_pretrained(
            args.target, path, draft_compile=args.compile_draft, **options
        )
    except ValueError as err:  # a bad drafter spec or option: one line, exit 2
        p.error(f"--drafter {args.drafter}: {err}")
    plain = SpeculativeGenerator(gen.target, gen.tokenizer, None)
    tok = gen.tokenizer
    chats = [
        tok.apply_chat_template([{"role": "user", "content": q.turns[0]}], add_generation_prompt=True,
                                return_dict=False)
        for q in load_prompt_set(args.prompt_set, args.prompts)
    ]  # fmt: skip
    spec_t, plain_t = Timers(), Timers()
    totals = {"plain": [0.0, 0, 0], "spec": [0.0, 0, 0]}
    try:
        instrument(gen, spec_t)
        instrument(plain, plain_t)
        for g in (plain, gen):  # warm-up (compiled: every commit-graph shape, the accepts of 1..16 tokens)
            for ids in chats[: 4 if args.compile_draft else 1]:
                g.generate(input_ids=ids, max_new_tokens=args.max_new_tokens if args.compile_draft else 8)
        for timers in (spec_t, plain_t):  # the warm-up is not measured
            timers.spent.clear()
        for ids in chats:  # taking turns: a drifting load hits both alike
            for name, g in (("plain", plain), ("spec", gen)):
                for i, x in enumerate(decode(g, [ids], args.max_new_tokens, sampling(args, ids))):
                    totals[name][i] += x
    finally:  # the classes are shared: unwrapped for whoever runs next, whether or not decoding raised
        SampledChildren.top = _DRAWN_TOP  # type: ignore[method-assign]
        EagleRows._top = _ROWS_TOP  # type: ignore[method-assign]
    (p_wall, p_passes, p_tokens), (s_wall, s_passes, s_tokens) = totals["plain"], totals["spec"]
    step = p_wall / p_passes
    target = (spec_t.spent["target"] - spec_t.spent["prefill_target"]) / s_passes
    draft_net = (spec_t.spent["draft_net"] - spec_t.spent["start_draft_net"]) / s_passes
    engine = s_wall / s_passes - target - draft_net
    static = getattr(gen.drafter, "_static", None)  # EAGLE: static tree, else the dynamic depth
    depths = int(static.depth.max()) if static is not None else getattr(gen.drafter, "depth", None)
    row = {
        "drafter": args.drafter, "tree": (gen.calibration or {}).get("choices"),
        "plain_step_ms": 1e3 * step, "tau": (s_tokens - len(chats)) / s_passes,
        "speedup": (s_tokens / s_wall) / (p_tokens / p_wall),
        "pass_ms": 1e3 * s_wall / s_passes, "target_forward_ms": 1e3 * target, "draft_networks_ms": 1e3 * draft_net,
        "engine_ms": 1e3 * engine, "engine_share_of_step": engine / step,
        "draft_depths": depths,
        "draft_ms_per_depth": 1e3 * draft_net / depths if depths else None,
    }  # fmt: skip
    if row["draft_ms_per_depth"] is not None:
        row["draft_depth_share_of_step"] = row["draft_ms_per_depth"] / row["plain_step_ms"]
    print(
        f"plain step {row['plain_step_ms']:.2f} ms; {args.drafter}: tau {row['tau']:.2f}, speedup {row['speedup']:.2f}x"
    )
    print(f"per pass {row['pass_ms']:.2f} ms = target forward {row['target_forward_ms']:.2f} + draft networks "
          f"{row['draft_networks_ms']:.2f} + engine {row['engine_ms']:.2f} ms "
          f"({100 * row['engine_share_of_step']:.1f}% of a plain step)")  # fmt: skip
    if depths:
        print(f"draft per depth ({depths} depths, head steps + top-k, the commit step included): "
              f"{row['draft_ms_per_depth']:.2f} ms ({100 * row['draft_depth_share_of_step']:.0f}% of a plain step)")  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(row, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
