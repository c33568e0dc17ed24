"""Our engine beside the EAGLE authors' engine: the same target, the same EAGLE-1 head weights, the same
prompts and trees, greedy, both eager on the same machine.

    python3 -m venv /tmp/ref && /tmp/ref/bin/pip install torch==2.13.0 "transformers==4.36.2" accelerate \\
        && /tmp/ref/bin/pip install --no-deps eagle-llm==1.2.1
    python scripts/bench_reference.py --ref-python /tmp/ref/bin/python --head outputs/eagle-ref-demo/head
    # on a GPU: the reference's packages in a folder of their own, on the machine's python and torch
    python3 -m pip install --no-deps --target /tmp/refsite transformers==4.36.2 tokenizers==0.15.2 \
        huggingface_hub==0.36.2 eagle-llm==1.2.1
    python3 scripts/bench_reference.py --ref-python python3 --ref-path /tmp/refsite --device cuda \
        --compile graphs --head outputs/eagle-ref-demo/head

The head must be an EAGLE-1 head in the authors' architecture (layer 0 without an input norm:
`python train.py head=eagle +head.first_layer_input_norm=false`); it is exported with
`--format eagle` (scripts/export.py) for the reference, which runs in its own environment
(scripts/reference_eagle.py: eagle-llm needs transformers 4.x). Per repeat the reference process
runs first, then ours, so drift of a shared machine falls on both. Configurations:
- "reference tree": the reference's default tree (mc_sim_7b_63: 25 drafted nodes, depth 5), both engines;
- "our calibrated tree": the static tree our loader picks for this head on this machine, both engines;
- ours with its defaults (`SpeculativeGenerator.from_pretrained(target, head)`), and plain decoding in
  each engine (ours; the reference's `naive_generate`);
- with --compile [BACKEND], ours again compiled (plain and defaults; on CUDA our CUDA graphs), which
  the reference has no counterpart of: the other rows compare the two engines eager against eager.
Tokens are counted up to EOS / --max-new-tokens in both; every output is compared with our plain
greedy decoding. Writes OUT/reference.json and OUT/reference.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from spechead.configs import demo_asset
from spechead.data.prompt_sets import load_prompt_set
from spechead.heads import HeadError, load_head
from spechead.heads.formats import export_head
from spechead.heads.formats.weights import target_embedding
from spechead.inference.devices import check_device
from spechead.inference.generator import SpeculativeGenerator

REF_TREE, OUR_TREE = "reference tree", "our calibrated tree"


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ref-python", required=True, help="python of the environment holding eagle-llm")
    p.add_argument(
        "--ref-path", default=None,
        help="a folder put first on the reference's PYTHONPATH (its transformers 4.x beside the machine's torch)",
    )  # fmt: skip
    p.add_argument("--device", default="cpu", help="cpu or cuda (both engines)")
    p.add_argument(
        "--compile", nargs="?", const=True, default=False, metavar="BACKEND",
        help="also our engine compiled (plain, defaults): inductor (plain flag) or e.g. graphs (CUDA graphs of the "
        "eager passes); every prompt is decoded once untimed first, so shapes are compiled before timing",
    )  # fmt: skip
    p.add_argument("--head", required=True, help="spechead EAGLE-1 head (authors' architecture)")
    p.add_argument("--target", default=demo_asset("target"), help="target directory (default: demo)")
    p.add_argument("--prompt-set", default="demo", help="prompt set (first turns are decoded)")
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=2, help="alternating runs of both engines (median kept)")
    p.add_argument("--out", default="outputs/bench_reference")
    return p.parse_args(argv)


def run_reference(
    python: str, job: dict, workdir: Path, path: str | None = None, runner: str = "reference_eagle.py"
) -> dict:
    """Run scripts/`runner` (reference_eagle.py; reference_medusa.py) in the reference environment
    (`path`: first on its PYTHONPATH); its JSON result."""
    job_file, out_file = workdir / "job.json", workdir / "ref.json"
    job_file.write_text(json.dumps(job))
    script = Path(__file__).with_name(runner)
    env = dict(os.environ)
    if path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [path, env.get("PYTHONPATH")]))
    done = subprocess.run(
        [python, str(script), str(job_file), str(out_file)], capture_output=True, text=True, env=env
    )
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"the reference engine failed: {tail[0]} (run {script} by hand to see all)")
    return json.loads(out_file.read_text())


def run_ours(gen: SpeculativeGenerator, prompts: list[list[int]], max_new: int) -> list[dict]:
    """Decode every prompt (one untimed warm-up first): new ids, seconds and target passes each."""
    out = []
    for ids in [prompts[0], *prompts]:
        start = time.perf_counter()
        r = gen.generate(input_ids=ids, max_new_tokens=max_new)
        seconds = time.perf_counter() - start
        out.append({"ids": r.token_ids, "s": seconds, "passes": max(len(r.stats.accept_lengths), 1)})
    return out[1:]


def summary(runs: list[list[dict]], plain_ids: list[list[int]]) -> dict:
    """tokens/s (median over repeats, with min and max), tau and mismatches against our plain decoding,
    and each prompt's target passes (the first repeat: greedy, every repeat decodes alike)."""
    rates = [sum(len(p["ids"]) for p in run) / sum(p["s"] for p in run) for run in runs]
    first = runs[0]
    return {
        "tok_s": statistics.median(rates),
        "tok_s_range": [min(rates), max(rates)],
        "tau": sum(len(p["ids"]) for p in first) / sum(p["passes"] for p in first),
        "mismatches": sum(p["ids"] != want for p, want in zip(first, plain_ids)),
        "tokens": sum(len(p["ids"]) for p in first),
        "passes": [p["passes"] for p in first],
    }


def main(argv=None) -> int:
    return guarded(bench, parse(argv))


def guarded(bench, args: argparse.Namespace) -> int:
    """bench(args), or one error line and exit status 2 for what the user can fix: a head the authors'
    layout cannot hold, a device this machine lacks, a bad option, the reference engine failing."""
    try:
        return bench(args)
    except (HeadError, RuntimeError, OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def first_turns(tokenizer, prompt_set: str, n: int) -> list[list[int]]:
    """The first turns of `n` prompts of `prompt_set` as chat-template ids, ready to decode."""
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p.turns[0]}], add_generation_prompt=True, return_dict=False
        )
        for p in load_prompt_set(prompt_set, n)
    ]


def bench(args: argparse.Namespace) -> int:
    check_device(args.device)
    work = Path(tempfile.mkdtemp(prefix="bench_reference_"))
    # the reference reads the head in its authors' layout: refused here first if it cannot hold it
    export_head(load_head(args.head), "eagle", work / "head", embedding=target_embedding(args.target))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # eager unless asked (compile=...), as the reference engine runs
    load = lambda head=None, **kw: SpeculativeGenerator.from_pretrained(  # noqa: E731
        args.target, head, device=args.device, **{"compile": False, **kw}
    )
    plain = load()
    prompts = first_turns(plain.tokenizer, args.prompt_set, args.prompts)
    ours = load(args.head)  # our defaults: calibrated tree
    calibrated = (ours.calibration or {}).get("choices")
    job = {
        "target": str(Path(args.target).resolve()),
        "head": str(work / "head"),
        "eos": sorted(plain.eos)[0],
        "max_new_tokens": args.max_new_tokens,
        "prompts": prompts,
        "trees": {REF_TREE: None, **({OUR_TREE: calibrated} if calibrated else {})},
        "plain": True,
        "device": args.device,
    }
    ref_runs: dict[str, list] = {}
    our_runs: dict[str, list] = {}
    gens: dict[str, SpeculativeGenerator] = {"plain": plain, "defaults": ours}
    if args.compile:  # every shape compiled (captured) before any timing: all prompts once, untimed
        gens["plain, compiled"] = load(compile=args.compile)
        gens["defaults, compiled"] = load(args.head, compile=args.compile)
        for name in ("plain, compiled", "defaults, compiled"):
            run_ours(gens[name], prompts, args.max_new_tokens)
    for r in range(args.repeats):
        print(f"repeat {r + 1}/{args.repeats}: reference engine ...", flush=True)
        ref = run_reference(args.ref_python, job, work, args.ref_path)
        for name, runs in {**ref["trees"], "plain": ref["plain"]}.items():
            ref_runs.setdefault(name, []).append(runs)
        for name, choices in ref["choices"].items():
            if name not in gens:
                gens[name] = load(args.head, tree=choices)
        print(f"repeat {r + 1}/{args.repeats}: our engine ...", flush=True)
        for name, gen in gens.items():
            our_runs.setdefault(name, []).append(run_ours(gen, prompts, args.max_new_tokens))
    plain_ids = [p["ids"] for p in our_runs["plain"][0]]
    result = {
        "settings": vars(args),
        "reference_versions": {k: ref[k] for k in ("torch", "transformers", "threads")},
        "trees": ref["choices"],
        "reference": {k: summary(v, plain_ids) for k, v in ref_runs.items()},
        "ours": {k: summary(v, plain_ids) for k, v in our_runs.items()},
    }
    (out / "reference.json").write_text(json.dumps(result, indent=2))
    table = render(result)
    (out / "reference.md").write_text(table)
    print(table)
    return 0


def where(device: str) -> str:
    """The device in words: CPU (threads) or the GPU's name."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"CPU ({torch.get_num_threads()} threads)"


def render(result: dict) -> str:
    """A markdown table: tokens/s and speedups against both engines' plain decoding."""
    ours_plain, ref_plain = result["ours"]["plain"]["tok_s"], result["reference"]["plain"]["tok_s"]
    s = result["settings"]
    versions = result["reference_versions"]
    lines = [
        f"the EAGLE authors' engine (eagle-llm, transformers {versions['transformers']}) beside spechead: "
        f"{s['prompts']} prompts of {s['prompt_set']}, up to {s['max_new_tokens']} new tokens, greedy, "
        f"{where(s.get('device', 'cpu'))}, median of {s['repeats']} alternating repeats",
        "",
        "| configuration | engine | tau | tok/s [min, max] | x our plain | x reference plain | mismatches |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for engine, rows in (("reference", result["reference"]), ("spechead", result["ours"])):
        for name, row in rows.items():
            lo, hi = row["tok_s_range"]
            lines.append(
                f"| {name} | {engine} | {row['tau']:.2f} | {row['tok_s']:.1f} [{lo:.1f}, {hi:.1f}] | "
                f"{row['tok_s'] / ours_plain:.2f}x | {row['tok_s'] / ref_plain:.2f}x | {row['mismatches']} |"
            )
    trees = ", ".join(f"{k}: {len(v)} drafted nodes" for k, v in result["trees"].items())
    tokens = result["ours"]["plain"]["tokens"]
    return "\n".join([*lines, "", f"trees: {trees}; {tokens} tokens a run", ""])


if __name__ == "__main__":
    sys.exit(main())
