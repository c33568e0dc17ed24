"""Our engine beside the Medusa authors' engine: the same target, the same Medusa-1 head weights, the same
prompts and trees, greedy, both eager on the same machine.

    python train.py head=medusa trainer.output_dir=outputs/medusa-demo    # a Medusa-1 head (2 min)
    PIP_CONSTRAINT="" pip install --no-deps --target /tmp/refsite transformers==4.36.2 tokenizers==0.15.2 \\
        huggingface_hub==0.36.2 medusa-llm==0.1
    python scripts/bench_reference_medusa.py --ref-python .venv/bin/python --ref-path /tmp/refsite \\
        --head outputs/medusa-demo/head

The reference is medusa-llm 0.1, the Medusa release on PyPI (`MedusaModel.medusa_generate`): its trees
are cartesian, `medusa_choices` [1, k1, k2, ...] = the target's top-1, then every combination of head
1's top-k1, head 2's top-k2, ... ([1, 7, 6]: 7 + 42 drafted nodes, its default). Its head is exported
with `--format fasterdecoding` (scripts/export.py) and runs in its own environment
(scripts/reference_medusa.py: its Llama copy needs transformers 4.x). Per repeat the reference process
runs first, then ours. Configurations:
- each --trees tree ("7x6": medusa_choices [1, 7, 6]), in both engines (ours: the same rank paths, the
  head's float weights: `draft_int8=False`);
- ours with its defaults (`SpeculativeGenerator.from_pretrained(target, head)`: the tree calibrated here
  when the head has a tree.json, else the family's default; on a CPU the projections in int8), and our
  plain decoding (medusa-llm 0.1 has
  no plain decoding of its own; speedups are against ours).
Every output is compared with our plain greedy decoding. Writes OUT/reference_medusa.json and .md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch
from bench_reference import first_turns, guarded, run_ours, run_reference, summary, where
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from spechead.configs import demo_asset
from spechead.heads import load_head
from spechead.heads.formats import export_head
from spechead.inference.devices import check_device
from spechead.inference.generator import SpeculativeGenerator

DEFAULT_TREES = ["7x6", "3x2", "1x1", "2x2x1", "1x1x1", "2x1x1x1", "1x1x1x1"]


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ref-python", required=True, help="python of the environment holding medusa-llm")
    p.add_argument("--ref-path", default=None, help="a folder put first on the reference's PYTHONPATH")
    p.add_argument("--device", default="cpu", help="cpu or cuda (both engines)")
    p.add_argument("--head", required=True, help="spechead Medusa-1 head (no adapter: the target is frozen)")
    p.add_argument("--target", default=demo_asset("target"), help="target directory (default: demo)")
    p.add_argument(
        "--trees", nargs="+", default=DEFAULT_TREES,
        help="cartesian trees, the top-k of each head: 7x6 = the reference's default [1, 7, 6]",
    )  # fmt: skip
    p.add_argument("--prompt-set", default="demo", help="prompt set (first turns are decoded)")
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=2, help="alternating runs of both engines (median kept)")
    p.add_argument("--out", default="outputs/bench_reference_medusa")
    return p.parse_args(argv)


def cartesian(spec: str) -> tuple[list[int], list[list[int]]]:
    """'7x6' -> (the reference's medusa_choices [1, 7, 6], our rank paths of the same tree: every
    [i1, ..., id] with i_j < k_j, depth by depth)."""
    try:
        ks = [int(k) for k in spec.split("x")]
    except ValueError:
        ks = []
    if not ks or min(ks) < 1:
        raise ValueError(f"tree {spec!r}: give each head's top-k joined by x, e.g. 7x6")
    paths = [list(p) for d in range(1, len(ks) + 1) for p in itertools.product(*(range(k) for k in ks[:d]))]
    return [1, *ks], paths


def with_heads(exported: Path, depth: int, target: str, out: Path) -> Path:
    """The exported head directory as medusa-llm loads it for trees of `depth`: its first `depth` heads
    (config medusa_num_heads; the weights file is shared: its loader skips the other heads' tensors),
    base_model_name_or_path `target`."""
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((exported / "config.json").read_text())
    config.update(medusa_num_heads=depth, base_model_name_or_path=str(Path(target).resolve()))
    (out / "config.json").write_text(json.dumps(config))
    weights = out / "medusa_lm_head.pt"
    if not weights.exists():
        weights.symlink_to((exported / "medusa_lm_head.pt").resolve())
    return out


def with_full_kv_heads(target: str, out: Path) -> Path:
    """`target` itself, or when it groups its key/value heads (GQA), a copy in `out` whose k/v projections
    repeat each group's head for its query heads: the same function, in the layout medusa-llm 0.1's cache
    holds (it allocates one key/value head per query head)."""
    config = AutoConfig.from_pretrained(target)
    heads, kv = (
        config.num_attention_heads,
        getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
    )
    if kv == heads:
        return Path(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    for layer in model.model.layers:
        for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
            grouped = proj.weight.data.view(kv, dim, -1)  # [kv, D, H]: group g serves query heads g*r..
            proj.weight = torch.nn.Parameter(
                grouped.repeat_interleave(heads // kv, 0).reshape(heads * dim, -1)
            )
            if proj.bias is not None:
                proj.bias = torch.nn.Parameter(
                    proj.bias.data.view(kv, dim).repeat_interleave(heads // kv, 0).flatten()
                )
            proj.out_features = heads * dim
    model.config.num_key_value_heads = heads
    for layer in model.model.layers:
        layer.self_attn.num_key_value_groups = 1
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(target).save_pretrained(out)
    return out


def main(argv=None) -> int:
    return guarded(bench, parse(argv))


def bench(args: argparse.Namespace) -> int:
    check_device(args.device)
    trees = {spec: cartesian(spec) for spec in args.trees}
    head = load_head(args.head)
    if head.family != "medusa":
        raise ValueError(
            f"--head must be a Medusa head (this one is {head.family}): train one with head=medusa"
        )
    if len(max(args.trees, key=lambda t: t.count("x")).split("x")) > head.config.num_heads:
        raise ValueError(f"a tree deeper than the head's {head.config.num_heads} heads: shorten --trees")
    work = Path(tempfile.mkdtemp(prefix="bench_reference_medusa_"))
    target = str(with_full_kv_heads(args.target, work / "target"))  # both engines decode this one
    exported = export_head(head, "fasterdecoding", work / "head")  # refused here if it cannot hold the head
    # medusa-llm 0.1 drafts with every head it loads, one tree depth each: a head directory per depth
    depths = sorted({len(choices) - 1 for choices, _ in trees.values()})
    heads = {d: with_heads(exported, d, target, work / f"head{d}") for d in depths}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # eager unless asked (compile=...), as the reference engine runs
    load = lambda head=None, **kw: SpeculativeGenerator.from_pretrained(  # noqa: E731
        target, head, device=args.device, **{"compile": False, **kw}
    )
    plain = load()
    prompts = first_turns(plain.tokenizer, args.prompt_set, args.prompts)
    gens = {"plain": plain, "defaults": load(args.head)}
    # the same trees with the same float weights (draft_int8=False): the engines compared, not precisions
    gens.update(
        {spec: load(args.head, choices=paths, draft_int8=False) for spec, (_, paths) in trees.items()}
    )
    jobs = [
        {
            "head": str(heads[d]),
            "eos": sorted(plain.eos)[0],
            "max_new_tokens": args.max_new_tokens,
            "prompts": prompts,
            "trees": {spec: choices for spec, (choices, _) in trees.items() if len(choices) - 1 == d},
            "device": args.device,
        }
        for d in depths
    ]
    ref_runs: dict[str, list] = {}
    our_runs: dict[str, list] = {}
    for r in range(args.repeats):
        print(f"repeat {r + 1}/{args.repeats}: reference engine ...", flush=True)
        for job in jobs:
            ref = run_reference(args.ref_python, job, work, args.ref_path, runner="reference_medusa.py")
            for name, runs in ref["trees"].items():
                ref_runs.setdefault(name, []).append(runs)
        print(f"repeat {r + 1}/{args.repeats}: our engine ...", flush=True)
        for name, gen in gens.items():
            our_runs.setdefault(name, []).append(run_ours(gen, prompts, args.max_new_tokens))
    plain_ids = [p["ids"] for p in our_runs["plain"][0]]
    defaults = gens["defaults"].drafter
    result = {
        "settings": vars(args),
        "reference_versions": {k: ref[k] for k in ("torch", "transformers", "threads")},
        "trees": {spec: len(paths) for spec, (_, paths) in trees.items()},
        "default_tree": len(getattr(defaults, "choices", None) or []),
        "reference": {k: summary(v, plain_ids) for k, v in ref_runs.items()},
        "ours": {k: summary(v, plain_ids) for k, v in our_runs.items()},
    }
    (out / "reference_medusa.json").write_text(json.dumps(result, indent=2))
    table = render(result)
    (out / "reference_medusa.md").write_text(table)
    print(table)
    return 0


def render(result: dict) -> str:
    """A markdown table: each tree in both engines, tokens/s against our plain decoding and each other."""
    ours, ref = result["ours"], result["reference"]
    plain = ours["plain"]["tok_s"]
    s, versions = result["settings"], result["reference_versions"]
    lines = [
        f"the Medusa authors' engine (medusa-llm 0.1, transformers {versions['transformers']}) beside spechead: "
        f"{s['prompts']} prompts of {s['prompt_set']}, up to {s['max_new_tokens']} new tokens, greedy, "
        f"{where(s.get('device', 'cpu'))}, median of {s['repeats']} alternating repeats",
        "",
        "| tree (drafted nodes) | engine | tau | tok/s [min, max] | x our plain | ours / reference | mismatches |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for spec, nodes in result["trees"].items():
        for engine, row in (("reference", ref[spec]), ("spechead", ours[spec])):
            lo, hi = row["tok_s_range"]
            ratio = f"{ours[spec]['tok_s'] / ref[spec]['tok_s']:.2f}x" if engine == "spechead" else ""
            lines.append(
                f"| {spec} ({nodes}) | {engine} | {row['tau']:.2f} | {row['tok_s']:.1f} [{lo:.1f}, {hi:.1f}] | "
                f"{row['tok_s'] / plain:.2f}x | {ratio} | {row['mismatches']} |"
            )
    best_ref = max(ref.values(), key=lambda r: r["tok_s"])["tok_s"]
    for name in ("defaults", "plain"):
        row = ours[name]
        lo, hi = row["tok_s_range"]
        nodes = f" ({result['default_tree']})" if name == "defaults" and result["default_tree"] else ""
        lines.append(
            f"| our {name}{nodes} | spechead | {row['tau']:.2f} | {row['tok_s']:.1f} [{lo:.1f}, {hi:.1f}] | "
            f"{row['tok_s'] / plain:.2f}x | {row['tok_s'] / best_ref:.2f}x the reference's best tree | "
            f"{row['mismatches']} |"
        )
    gaps = [f"{spec} {pass_gaps(ref[spec]['passes'], ours[spec]['passes'])}" for spec in result["trees"]]
    return "\n".join(
        [*lines, "", f"{ours['plain']['tokens']} tokens a run", "",
         "passes per prompt, the reference's minus ours (difference: prompts): " + "; ".join(gaps), ""]
    )  # fmt: skip


def pass_gaps(reference: list[int], ours: list[int]) -> str:
    """How many prompts took the reference k more target passes than ours, as 'k: prompts' by k."""
    counts = Counter(r - o for r, o in zip(reference, ours))
    return ", ".join(f"{k:+d}: {n}" for k, n in sorted(counts.items()))


if __name__ == "__main__":
    sys.exit(main())
