"""Decoding benchmark: drafters and Hugging Face baselines against plain decoding of the same target.

    python scripts/benchmark.py                       # the demo target with the heads found in outputs/
    python scripts/benchmark.py --target data/demo/target --drafter eagle3=outputs/eagle3-demo/head \\
        --drafter prompt_lookup=prompt_lookup --prompt-set demo --prompts 24 --repeats 3
    python scripts/benchmark.py --target meta-llama/Llama-3.1-8B-Instruct --device cuda --dtype bfloat16 \\
        --drafter eagle3=USER/HEAD --prompt-set spec_bench/question.jsonl --temperature 1.0

Per drafter: tau (emitted tokens per target pass, pooled over all passes of the prompt set: total
tokens / total passes, as vLLM and SGLang count it, not a mean of per-prompt taus) and its
distribution, acceptance by depth, target passes per token, tokens/s, speedup over plain decoding
(median of --repeats [min, max]) overall and per category, and the time split (verification pass,
draft work, other) with the ideal speedup
tau * t_step / (t_verify + t_draft). Baselines in the same process: HF generate, HF prompt lookup and
HF assisted generation with a small draft model (--assistant; for the demo target the shipped demo
draft model). Greedy outputs are checked against plain decoding and any
mismatch is reported loudly. Writes OUT/decoding.md, OUT/decoding.json (every number, the settings and
versions) and OUT/speedup_by_category.png, OUT/acceptance_by_depth.png; partial results survive Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from spechead.configs import demo_asset
from spechead.data.errors import DataError
from spechead.data.prompt_sets import EvalPrompt, load_prompt_set
from spechead.heads.files import unwritable_reason
from spechead.inference.compiling import AUTO, compile_option, resolve_compile_args
from spechead.inference.cuda_graphs import GraphCaptureError
from spechead.inference.devices import DTYPE_CHOICES, DTYPE_HELP, check_device
from spechead.inference.drafter_specs import check_spec, drafter_options
from spechead.inference.drafters.layer_skip import read_drafter_file
from spechead.inference.evaluation.measure import (
    DEFINITIONS,
    DecodeSettings,
    PromptSetRun,
    decode_prompts,
    mismatches,
    summarize,
)
from spechead.inference.evaluation.report import plot_acceptance_by_depth, plot_speedup_by_category, render
from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.tuning.calibrate import verify_cost_ms

DEMO_HEADS = {
    "medusa": "outputs/bench-heads/medusa/head",
    "medusa2": "outputs/bench-heads/medusa2/head",
    "eagle": "outputs/bench-heads/eagle/head",
    "eagle3": "outputs/eagle3-demo/head",
}
TREE_SIZES = [1, 2, 4, 8, 16, 32, 64]
# our engine's plain decoding, whole calls, timed turn by turn beside HF generate (same load)
OURS_PLAIN = "spechead_plain (ours)"


def warmup_settings(args: argparse.Namespace) -> DecodeSettings:
    """Untimed warm-up decoding: 8 tokens, or with --compile whole answers, so that every graph (tree
    buckets, accepted lengths) is compiled before timing starts: compiling is not decoding."""
    return DecodeSettings(max_new_tokens=args.max_new_tokens if args.compile or args.compile_draft else 8)


def compiled_note(compile: bool | str, draft_compile: bool | str = False) -> str:
    """', compiled (BACKEND)' / ', drafters compiled (BACKEND)' for the report's settings line, '' when eager."""
    backend = lambda c: f" ({c})" if isinstance(c, str) else ""  # noqa: E731
    if compile:
        return ", compiled" + backend(compile)
    return ", drafters compiled" + backend(draft_compile) if draft_compile else ""


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--target", default=demo_asset("target"), help="target model directory or Hub id (default: demo)"
    )
    p.add_argument(
        "--drafter", action="append", default=[],
        help="NAME=SPEC[@key=value,...]: a head dir/Hub id, a draft model, a cascade, prompt_lookup or lookahead; "
        "options go to the drafter, e.g. eagle3=outputs/eagle3-demo/head@top_k=8,depth=6,total_tokens=48 or "
        "la=lookahead@window=5,ngram=4,candidates=5 or "
        "eagle3=HEAD@tree=tree.json (a static tree, any head) or "
        "draft=DRAFT_MODEL@width=4x2x2x1,rule=without_replacement or casc=cascade:TINY+MEDIUM@num_draft=8,tiny_draft=4 "
        "(plain `cascade`: the demo tiny+medium pair) or the target itself with layers skipped: "
        "skip=layer_skip@skip=2+3+6, exit=early_exit@layer=4, skip=outputs/skip.json (scripts/search_skip.py) "
        "(repeatable)",
    )  # fmt: skip
    p.add_argument(
        "--prompt-set", default="demo",
        help="built in: demo (Spec-Bench categories), demo-mt (two turns), demo-kinds (demo task kinds); "
        "or a JSONL file / directory / Hub dataset id with {category, turns} rows",
    )  # fmt: skip
    p.add_argument("--prompts", type=int, default=24, help="at most this many prompts")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (outputs checked against plain)"
    )
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0, help="sampling seed of the first turn (turn i: seed + i)")
    p.add_argument(
        "--assistant", default="auto",
        help="a small draft model for HF assisted generation; auto = the demo draft model with the demo target, "
        "else none; none = skip",
    )  # fmt: skip
    p.add_argument(
        "--hf-early-exit", default="auto",
        help="exit layer for HF's self-speculative mode (generate(assistant_early_exit=N)); auto = the layer of "
        "an early_exit drafter given with --drafter, else none; none = skip",
    )  # fmt: skip
    p.add_argument("--repeats", type=int, default=1, help="runs per drafter; speedup is their median")
    p.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="prompts decoded once before timing (whole answers "
        "with --compile; use as many as --prompts there: a graph compiled while timing is counted)",
    )
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face baselines")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    p.add_argument(
        "--compile", nargs="?", const=True, default=AUTO, type=compile_option, metavar="BACKEND",
        help="torch.compile our verify pass and draft steps (plain decoding too): auto (the default: graphs on "
        "CUDA, off elsewhere), off (eager), inductor (plain --compile; CUDA: CUDA graphs of our own), "
        "max-autotune (the same, GEMMs autotuned), graphs (no compiler: the eager passes as our CUDA graphs, "
        "ready in seconds), reduce-overhead (torch.compile's CUDA graphs) or a backend name, e.g. cudagraphs. "
        "HF baselines stay eager",
    )  # fmt: skip
    p.add_argument(
        "--compile-draft", nargs="?", const=True, default=False, type=compile_option, metavar="BACKEND",
        help="torch.compile the drafters only (EAGLE: the whole draft as one graph); the target and plain "
        "decoding stay eager (on a CPU the fastest setting)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("outputs/benchmark"))
    args = p.parse_args(argv)
    try:  # (compile_given goes to from_pretrained; compile, resolved for --device, to what depends on it)
        resolve_compile_args(args)
    except ValueError as err:
        p.error(str(err))
    if args.prompts < 1 or args.repeats < 1 or args.max_new_tokens < 1 or args.warmup < 0:
        p.error("--prompts, --repeats and --max-new-tokens must be >= 1, --warmup >= 0")
    if args.hf_early_exit not in ("auto", "none") and not (
        args.hf_early_exit.isdigit() and int(args.hf_early_exit) > 0
    ):
        p.error(f"--hf-early-exit takes auto, none or a layer number >= 1, got {args.hf_early_exit!r}")
    return args


def measure(name: str, spec: str, args, prompts: list[EvalPrompt], settings: DecodeSettings) -> dict:
    """One drafter: `args.repeats` runs, each against a plain decoding run of the same loaded target."""
    path, options = drafter_options(spec)
    gen = SpeculativeGenerator.from_pretrained(
        args.target, path, device=args.device, dtype=args.dtype, compile=args.compile_given,
        draft_compile=args.compile_draft or None, **options,
    )  # fmt: skip
    plain = SpeculativeGenerator(gen.target, gen.tokenizer, None, compile=gen.compile)  # Medusa-2: merged
    for warm in (gen, plain):  # both: with --compile each has its own graphs to compile before timing
        decode_prompts(warm, prompts[: args.warmup], warmup_settings(args))
    runs, plains = [], []
    for i in range(args.repeats):
        plains.append(decode_prompts(plain, prompts, settings, desc=f"plain ({i + 1}/{args.repeats})"))
        runs.append(decode_prompts(gen, prompts, settings, desc=f"{name} ({i + 1}/{args.repeats})"))
    row = {
        "drafter": name,
        "spec": spec,
        **summarize(runs, plains, settings),
        "draft_weights": gen.draft_weights,
    }
    if gen.calibration is not None:  # the tree this load picked (it can differ between loads)
        choices = gen.calibration["choices"]
        row["calibrated_tree"] = {"nodes": len(choices), "depth": max(map(len, choices)),
                                  "expected_speedup": gen.calibration["expected_speedup"]}  # fmt: skip
    if row["greedy_mismatches"]:
        print(
            f"!!! {name}: {row['greedy_mismatches']} outputs differ from plain greedy decoding",
            file=sys.stderr,
        )
    return row


def hf_generate(
    gen: SpeculativeGenerator,
    prompts,
    settings: DecodeSettings,
    ours: SpeculativeGenerator | None = None,
    **kwargs,
) -> tuple[float, list, tuple[float, list] | None]:
    """Hugging Face `generate` on the same prompts: whole-call tokens/s and the generated ids per turn.

    With `ours` (our engine's plain decoding), each turn is also decoded by it right after HF's call,
    on the same ids and timed the same way (whole call, prefill included), so both see the same load:
    its tokens/s and outputs come third (None without `ours`)."""
    model, tok = gen.target, gen.tokenizer
    sampling = {} if settings.greedy else {"temperature": settings.temperature, "top_p": settings.top_p,
                                           "top_k": settings.top_k}  # fmt: skip
    new, wall, outputs = 0, 0.0, []
    ours_new, ours_wall, ours_outputs = 0, 0.0, []
    for prompt in prompts:
        messages = []
        for turn in prompt.turns:
            messages.append({"role": "user", "content": turn})
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
            seed = settings.seed + len(outputs)
            torch.manual_seed(seed)
            start = time.perf_counter()
            out = model.generate(
                torch.tensor([ids], device=model.device), max_new_tokens=settings.max_new_tokens,
                do_sample=not settings.greedy, pad_token_id=tok.pad_token_id, **sampling, **kwargs,
            )  # fmt: skip
            wall += time.perf_counter() - start
            generated = out[0, len(ids) :].tolist()
            if ours is not None:
                r = ours.generate(
                    input_ids=ids, max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                    top_p=settings.top_p, top_k=settings.top_k, seed=seed,
                )  # fmt: skip
                ours_new, ours_wall = ours_new + r.stats.new_tokens, ours_wall + r.stats.wall_time
                ours_outputs.append(r.token_ids)
            messages.append({"role": "assistant", "content": tok.decode(generated, skip_special_tokens=True)})
            outputs.append(generated)
            new += len(generated)
    mine = (ours_new / max(ours_wall, 1e-9), ours_outputs) if ours is not None else None
    return new / max(wall, 1e-9), outputs, mine


def measure_baselines(args, plain: SpeculativeGenerator, prompts, settings, base: PromptSetRun) -> list[dict]:
    """HF generate (beside our own plain decoding, turn by turn), HF prompt lookup decoding and (with
    --assistant) HF assisted generation."""
    baselines = {"hf_generate": {}, "hf_prompt_lookup": {"prompt_lookup_num_tokens": 10}}
    if assistant_path := _assistant(args):
        from transformers import AutoModelForCausalLM

        dtype = plain.target.dtype  # (the target's: --dtype auto resolved)
        assistant = AutoModelForCausalLM.from_pretrained(assistant_path, dtype=dtype).to(args.device)
        baselines["hf_assisted"] = {"assistant_model": assistant}
    if exit_layer := _hf_early_exit(args, plain.target):
        baselines[f"hf_early_exit@{exit_layer}"] = {"assistant_early_exit": exit_layer}
    rows, reference = [], None
    for name, kwargs in baselines.items():
        ours = plain if reference is None else None
        tokens_per_s, outputs, mine = hf_generate(plain, prompts, settings, ours=ours, **kwargs)
        reference = reference or tokens_per_s
        first = len(rows)
        rows.append({
            "method": name, "tokens_per_s": tokens_per_s, "speedup_vs_hf_generate": tokens_per_s / reference,
            "greedy_mismatches": mismatches(outputs, base.outputs) if settings.greedy else None,
        })  # fmt: skip
        if mine is not None:  # our plain decoding, timed turn by turn beside HF generate
            rows.append({
                "method": OURS_PLAIN, "tokens_per_s": mine[0], "speedup_vs_hf_generate": mine[0] / reference,
                "greedy_mismatches": mismatches(mine[1], base.outputs) if settings.greedy else None,
            })  # fmt: skip
        for row in rows[first:]:
            if row["greedy_mismatches"]:
                print(f"!!! {row['method']}: {row['greedy_mismatches']} outputs differ from plain greedy decoding",
                      file=sys.stderr)  # fmt: skip
    return rows


def _hf_early_exit(args, target) -> int | None:
    """The exit layer of HF's early-exit baseline (see --hf-early-exit): given, or an early_exit drafter's."""
    if args.hf_early_exit == "none":
        return None
    if args.hf_early_exit != "auto":
        return int(args.hf_early_exit)
    for spec in args.drafter:
        path, options = drafter_options(spec.split("=", 1)[-1])
        saved = read_drafter_file(Path(path)) or {}
        if path == "early_exit" or saved.get("drafter") == "early_exit":
            default = saved.get("exit_layer", len(target.get_decoder().layers) // 2)
            return int(options.get("layer", options.get("exit_layer", default)))
    return None


def _assistant(args) -> str | None:
    """The assistant model for HF assisted generation (see --assistant)."""
    if args.assistant == "none":
        return None
    if args.assistant != "auto":
        return args.assistant
    demo = Path(demo_asset("target"))
    same = Path(args.target).expanduser().resolve() == demo.resolve()
    return demo_asset("draft") if same and Path(demo_asset("draft")).is_dir() else None


def verify_cost(model, sizes: list[int], context: int, repeats: int) -> dict[int, float]:
    """Seconds of one verification pass through our engine's runner (a chain of `size` nodes after
    `context` tokens): the same measurement the load-time tree calibration makes (calibrate.py)."""
    return {n: ms / 1e3 for n, ms in verify_cost_ms(model, sizes, context, repeats).items()}


def write(args, prompts, base: PromptSetRun, rows, hf_rows, costs) -> str:
    """Markdown, JSON (every number and the settings and versions) and plots, into args.out."""
    import transformers

    args.out.mkdir(parents=True, exist_ok=True)
    t_step = base.total.verify_time / max(base.total.target_passes, 1)
    header = (
        f"plain decoding: {base.total.tokens_per_s:,.1f} tokens/s, {1e3 * t_step:.2f} ms per step "
        f"({len(prompts)} prompts, {len(base.outputs)} turns, max_new_tokens={args.max_new_tokens}, "
        f"temperature={args.temperature}, {args.device}, {args.dtype}{compiled_note(args.compile, args.compile_draft)}; "
        f"speedup = median of {args.repeats} "
        "repeat(s) [min, max])"
    )
    text = render(header, rows, hf_rows, costs)
    (args.out / "decoding.md").write_text(text + "\n")
    payload = {
        "plain_tokens_per_s": base.total.tokens_per_s,
        "t_step_ms": 1e3 * t_step,
        "categories": sorted(base.by_category),
        "definitions": DEFINITIONS,
        "rows": rows,
        "hf_baselines": hf_rows,
        "verify_ms_by_size": {k: 1e3 * v for k, v in costs.items()},
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": sys.version.split()[0], "device_name": _device_name(args.device)},
    }  # fmt: skip
    (args.out / "decoding.json").write_text(json.dumps(payload, indent=1))
    if rows:
        plot_speedup_by_category(rows, args.out / "speedup_by_category.png")
        plot_acceptance_by_depth(rows, args.out / "acceptance_by_depth.png")
    return text


def _device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return "cpu"


def main(argv=None) -> int:
    args = parse(argv)
    specs = dict(d.split("=", 1) for d in args.drafter if "=" in d)
    if len(specs) != len(args.drafter):
        print(
            "error: --drafter takes NAME=SPEC, e.g. --drafter eagle3=outputs/eagle3-demo/head",
            file=sys.stderr,
        )
        return 2
    specs = specs or {
        "prompt_lookup": "prompt_lookup",
        **{name: path for name, path in DEMO_HEADS.items() if Path(path).is_dir()},
    }
    for name, spec in specs.items():  # every drafter's options, before the first one's long run
        try:
            check_spec(spec)
        except (ValueError, OSError) as err:
            print(f"error: drafter {name}={spec}: {str(err).splitlines()[0]}", file=sys.stderr)
            return 2
    unwritable = unwritable_reason(args.out)  # before the long run, not when its results are written
    if unwritable:
        print(
            f"error: --out {args.out} is not a writable directory ({unwritable}): choose another",
            file=sys.stderr,
        )
        return 2
    try:
        check_device(args.device)
        settings = DecodeSettings(args.max_new_tokens, args.temperature, args.top_p, args.top_k, args.seed)
        prompts = load_prompt_set(args.prompt_set, args.prompts)
        plain = SpeculativeGenerator.from_pretrained(
            args.target, None, device=args.device, dtype=args.dtype, compile=args.compile_given
        )
        args.compile = plain.compile  # (auto: as resolved, eager where the graphs could not be captured)
        args.dtype = str(plain.target.dtype).removeprefix("torch.")  # (auto: what it resolved to)
        decode_prompts(plain, prompts[: args.warmup], warmup_settings(args))
        base = decode_prompts(plain, prompts, settings, desc="plain")
    except (DataError, ValueError, OSError) as err:
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    rows, hf_rows, costs = [], [], {}
    try:
        for name, spec in specs.items():
            try:
                rows.append(measure(name, spec, args, prompts, settings))
            except (ValueError, OSError, GraphCaptureError) as err:  # (the last: compile= asked for graphs)
                print(f"error: drafter {name}={spec}: {str(err).splitlines()[0]}", file=sys.stderr)
                return 2
            write(args, prompts, base, rows, hf_rows, costs)  # partial results survive an interrupt
        if not args.no_hf:
            hf_rows = measure_baselines(args, plain, prompts, settings, base)
        costs = verify_cost(plain.target, TREE_SIZES, context=128, repeats=5)
    except KeyboardInterrupt:
        write(args, prompts, base, rows, hf_rows, costs)
        print(f"interrupted: partial results in {args.out}", file=sys.stderr)
        return 130
    print(write(args, prompts, base, rows, hf_rows, costs))
    print(f"\nwrote {args.out}/decoding.md, decoding.json and the plots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
