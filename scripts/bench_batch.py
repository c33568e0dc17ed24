"""Batch decoding benchmark: tokens/s over the batch, speculative vs plain batched decoding.

    python scripts/bench_batch.py --batch-size 1 8 \\
        --drafter eagle3=outputs/bench-heads/eagle3/head --drafter medusa2=outputs/bench-heads/medusa2/head

For each batch size B the prompt set (first user turn of each prompt, chat template) is cut into
batches of B and decoded greedily three ways on the same loaded target: our engine with no drafter
(`generate_batch`, plain batched decoding), Hugging Face `generate` with left padding (tokens counted
up to each row's EOS), and our engine with the drafter (plain and speculative take turns batch by
batch, so a shared machine's drifting load hits both alike; B = 1 runs the single-sequence engine, as
`generate_batch` does for one row). tokens/s = all new tokens / all wall time.
Speculative rows are checked against plain rows (greedy: they must be equal) and mismatches printed.
--temperature T (> 0) samples instead (with --top-p): each prompt seeded by its place in the set (--seed
plus its index), the same seed for every engine, HF `generate` with do_sample; no equality check then.
Prints one line per (drafter, B) and writes OUT/bench_batch.json. --compile [BACKEND] decodes with the
target's batch passes compiled (both engines; e.g. `--device cuda --compile graphs`: our CUDA graphs of the
eager passes; each batch size's first batch is decoded once untimed, to capture) and, on CUDA, the EAGLE
batch draft too; --compile-draft [BACKEND] compiles the drafter only (EAGLE on CUDA: every row's draft and
accept as fixed-shape graphs, eagle_batch_graphs.py; on a CPU the batch draft stays eager); HF `generate`
stays eager.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from spechead.configs import demo_asset
from spechead.data.prompt_sets import load_prompt_set
from spechead.heads.files import unwritable_reason
from spechead.inference.compiling import AUTO, compile_option, resolve_compile_args
from spechead.inference.devices import DTYPE_CHOICES, DTYPE_HELP
from spechead.inference.drafter_specs import check_spec, drafter_options
from spechead.inference.generator import SpeculativeGenerator


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None, help="target model (default: the demo target)")
    p.add_argument("--drafter", action="append", default=[], help="NAME=PATH of a head (repeatable)")
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-set", default="demo")
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--no-hf", action="store_true", help="skip Hugging Face generate")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    p.add_argument(
        "--compile", nargs="?", const=True, default=AUTO, type=compile_option, metavar="BACKEND",
        help="our engines with compile=BACKEND (auto, the default: graphs on CUDA, off elsewhere; off: eager; plain "
        "flag: inductor; graphs: the eager passes as CUDA graphs)",
    )  # fmt: skip
    p.add_argument(
        "--compile-draft", nargs="?", const=True, default=False, type=compile_option, metavar="BACKEND",
        help="the drafter only compiled (draft_compile=BACKEND; plain flag: inductor)",
    )  # fmt: skip
    p.add_argument("--temperature", type=float, default=0.0, help="> 0: decode by sampling (every engine)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="prompt i is sampled with seed SEED + i")
    p.add_argument("--out", type=Path, default=Path("outputs/bench_batch"))
    args = p.parse_args(argv)
    try:  # (compile_given goes to from_pretrained; compile, resolved for --device, to what depends on it)
        resolve_compile_args(args)
    except ValueError as err:
        p.error(str(err))
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        p.error("--temperature >= 0 and 0 < --top-p <= 1, please")
    for flag, values in (("--batch-size", args.batch_size), ("--prompts", [args.prompts]),
                         ("--max-new-tokens", [args.max_new_tokens])):  # fmt: skip
        if min(values) < 1:
            p.exit(2, f"error: {flag} must be at least 1, got {min(values)}\n")
    unwritable = unwritable_reason(args.out)  # before the long run, not when its results are written
    if unwritable:
        p.exit(2, f"error: --out {args.out} is not a writable directory ({unwritable}): choose another\n")
    return args


def sampling(args: argparse.Namespace, first: int, rows: int) -> dict:
    """generate_batch's sampling arguments for prompts first..first + rows - 1 ({} when greedy)."""
    if args.temperature == 0:
        return {}
    seeds = [args.seed + first + i for i in range(rows)]
    return {"temperature": args.temperature, "top_p": args.top_p, "seed": seeds}


def run_engines(
    gens: list, chats: list, batch: int, max_new: int, args: argparse.Namespace
) -> list[tuple[float, list, float]]:
    """Per generator: tokens/s, the outputs per prompt and tau (tokens per target pass, pooled) for
    batches of `batch`. The generators take turns on each batch (a shared machine's load drifts: it
    then hits them alike)."""
    new, wall, outputs, passes = [0] * len(gens), [0.0] * len(gens), [[] for _ in gens], [0] * len(gens)
    for i in range(0, len(chats), batch):
        chunk = chats[i : i + batch]
        for g, gen in enumerate(gens):
            start = time.perf_counter()
            kw = sampling(args, i, len(chunk))
            results = gen.generate_batch(messages=chunk, max_new_tokens=max_new, **kw)
            wall[g] += time.perf_counter() - start
            outputs[g] += [r.token_ids for r in results]
            new[g] += sum(r.stats.new_tokens for r in results)
            passes[g] += sum(r.stats.target_passes for r in results)
    return [
        (new[g] / max(wall[g], 1e-9), outputs[g], (new[g] - len(chats)) / max(passes[g], 1))
        for g in range(len(gens))
    ]


def run_hf(
    gen: SpeculativeGenerator, chats: list, batch: int, max_new: int, args: argparse.Namespace
) -> float:
    """Hugging Face `generate` with left padding (greedy, or sampling as --temperature / --top-p): tokens/s
    counting each row up to its EOS."""
    kw = {"do_sample": False}
    if args.temperature > 0:
        kw = {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p, "top_k": 0}
    model, tok = gen.target, gen.tokenizer
    side, tok.padding_side = tok.padding_side, "left"
    new, wall = 0, 0.0
    try:
        for i in range(0, len(chats), batch):
            texts = [
                tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
                for c in chats[i : i + batch]
            ]
            enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
            start = time.perf_counter()
            out = model.generate(**enc, max_new_tokens=max_new, pad_token_id=tok.pad_token_id, **kw)
            wall += time.perf_counter() - start
            for row in out[:, enc["input_ids"].shape[1] :].tolist():
                stop = next((j + 1 for j, t in enumerate(row) if t in gen.eos), len(row))
                new += stop
    finally:
        tok.padding_side = side
    return new / max(wall, 1e-9)


def main(argv=None) -> int:
    args = parse(argv)
    target = args.target or str(demo_asset("target"))
    prompts = load_prompt_set(args.prompt_set, args.prompts)
    chats = [[{"role": "user", "content": p.turns[0]}] for p in prompts]
    specs = [d.split("=", 1) for d in args.drafter] or [("plain", None)]
    rows = []
    for name, spec in specs:  # every drafter's options, before the first one's runs
        try:
            if spec:
                check_spec(spec)
        except (ValueError, OSError) as err:
            print(f"bench_batch.py: error: --drafter {name}={spec}: {err}", file=sys.stderr)
            return 2
    for name, spec in specs:
        try:
            path, options = (
                drafter_options(spec) if spec else (None, {})
            )  # HEAD@key=value,... as benchmark.py
            gen = SpeculativeGenerator.from_pretrained(
                target, path, device=args.device, dtype=args.dtype, compile=args.compile_given,
                draft_compile=args.compile_draft or None, **options,
            )  # fmt: skip
        except ValueError as err:  # a bad drafter spec or option: one line, exit 2
            print(f"bench_batch.py: error: --drafter {name}={spec}: {err}", file=sys.stderr)
            return 2
        # the same target (e.g. with a Medusa-2 adapter merged)
        plain = SpeculativeGenerator(gen.target, gen.tokenizer, None, compile=gen.compile)
        gen.generate_batch(messages=chats[:2], max_new_tokens=8)  # warm-up
        plain.generate_batch(messages=chats[:2], max_new_tokens=8)
        for batch in args.batch_size:
            compiled = gen.compile or args.compile_draft
            warm = args.max_new_tokens if compiled else 8  # compiled: every shape captured untimed
            gen.generate_batch(
                messages=chats[:batch], max_new_tokens=warm
            )  # picks this size's tree (untimed)
            if gen.compile:
                plain.generate_batch(messages=chats[:batch], max_new_tokens=warm)
            engines = [plain] if path is None else [plain, gen]
            runs = run_engines(engines, chats, batch, args.max_new_tokens, args)
            (plain_tps, plain_out, _), (spec_tps, spec_out, tau) = runs[0], runs[-1]
            tau = 1.0 if path is None else tau
            hf_tps = None if args.no_hf else run_hf(plain, chats, batch, args.max_new_tokens, args)
            sampled = args.temperature > 0  # (samples differ between engines: nothing to compare)
            bad = None if sampled else sum(a != b for a, b in zip(spec_out, plain_out))
            picked = getattr(gen, "batch_calibration", {}).get(batch) if batch > 1 else None
            tree = picked["choices"] if picked else (gen.calibration or {}).get("choices")
            row = {"drafter": name, "batch": batch, "tau": tau, "tree": tree, "plain_tokens_per_s": plain_tps,
                   "hf_tokens_per_s": hf_tps, "spec_tokens_per_s": spec_tps,
                   "speedup_vs_plain": spec_tps / plain_tps, "greedy_mismatches": bad}  # fmt: skip
            rows.append(row)
            hf = "-" if hf_tps is None else f"{hf_tps:.1f}"
            print(
                f"{name:10s} B={batch:<3d} tau {tau:.2f}  plain {plain_tps:.1f} tok/s  HF {hf} tok/s  "
                f"spec {spec_tps:.1f} tok/s  speedup {spec_tps / plain_tps:.2f}x  "
                + ("sampled" if sampled else f"mismatches {bad}")
                + (f"  tree {len(tree)} nodes" if tree else "  no tree (plain pays best)" if picked else ""),
                flush=True,
            )
            if bad:
                print(
                    f"!!! {name} B={batch}: {bad} outputs differ from plain greedy decoding", file=sys.stderr
                )
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    (args.out / "bench_batch.json").write_text(json.dumps({"settings": settings, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
