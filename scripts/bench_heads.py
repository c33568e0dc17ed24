"""Train each head family with its default recipe on a target and print one comparison table.

    python scripts/bench_heads.py                          # every family on the demo target
    python scripts/bench_heads.py --heads medusa eagle3 -- trainer.max_steps=100 model=llama3-8b-instruct

Each family trains in its own output directory (OUT/<family>) through the same code path as
train.py; the table (Markdown) and every number (JSON) are written to OUT. Per family: head parameters,
training time, steps, tokens/s, greedy accuracy by depth and simulated tau (P-EAGLE's depths are its block's
K slots, DFlash's its block's positions). Then, at the same target's shape, the draft time of ONE
parallel forward (P-EAGLE K, DFlash block K with --dflash-layers layers, K = 8 and 16) beside EAGLE-3's
depth-7 draft (random-weight heads after a --draft-context prompt; scripts/parallel_drafts.py), written to
OUT/draft.md and OUT/draft.json (--no-draft skips it).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_module
from parallel_drafts import BLOCKS, draft_table

from spechead.configs import register_resolvers
from spechead.inference.evaluation.profiling import Timer
from spechead.training.cli import settings_from_config
from spechead.training.target import load_target
from spechead.training.trainer import train

FAMILIES = ["medusa", "eagle", "eagle3", "medusa2", "peagle", "dflash"]


def run_family(family: str, out: Path, overrides: list[str]) -> dict:
    """Train one family from scratch (its old output directory is removed); returns its table row."""
    shutil.rmtree(out / family, ignore_errors=True)
    with initialize_config_module("spechead.configs", version_base=None):
        cfg = compose("train", overrides=[f"head={family}", f"trainer.output_dir={out / family}", *overrides])
    settings = settings_from_config(cfg)
    started = time.perf_counter()
    result = train(settings)
    seconds = time.perf_counter() - started
    params = sum(t.numel() for t in _saved_tensors(result.head_dir) if t.is_floating_point())
    depths = sorted((k for k in result.metrics if k.startswith("acc/depth")), key=lambda k: int(k[9:]))
    return {
        "family": family,
        "params": params,
        "train_seconds": seconds,
        "steps": result.steps,
        "tokens_per_s": result.tokens_per_second,
        "accuracy_by_depth": [result.metrics[k] for k in depths],
        "tau": result.metrics["tau"],
        "metrics": result.metrics,
    }


def _saved_tensors(head_dir: Path):
    from safetensors.torch import load_file

    return load_file(str(head_dir / "model.safetensors")).values()


def table(rows: list[dict]) -> str:
    """Markdown table of the rows."""
    lines = [
        "| family | head params | train time | steps | tokens/s | greedy accuracy by depth (1, 2, ...) | simulated tau |",
        "|---|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        acc = ", ".join(f"{a:.2f}" for a in r["accuracy_by_depth"])
        lines.append(
            f"| {r['family']} | {r['params'] / 1e6:.2f}M | {r['train_seconds']:.0f} s | {r['steps']} | "
            f"{r['tokens_per_s']:,.0f} | {acc} | {r['tau']:.3f} |"
        )
    return "\n".join(lines)


def draft_rows(
    overrides: list[str], context: int, dflash_layers: int, iters: int = 10, peagle_layers: int = 1
) -> list[dict]:
    """The target of `overrides` (its model.*): EAGLE-3's depth-7 draft and one forward of each parallel head
    (blocks of BLOCKS), medians of `iters` on the GPU if there is one, else the CPU."""
    with initialize_config_module("spechead.configs", version_base=None):
        cfg = compose("train", overrides=["head=eagle3", *overrides])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_target(settings_from_config(cfg).model, device).model
    return draft_table(
        model, Timer(device, iters, 2), context, BLOCKS, dflash_layers, peagle_layers=peagle_layers
    )


def draft_markdown(rows: list[dict]) -> str:
    """Markdown table of draft_rows' rows."""
    lines = [
        "| drafter | drafts | head forwards | draft ms | x EAGLE-3 depth 7 |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += [f"| {r['drafter']} | {r['drafts']} | {r['forwards']} | {r['draft_ms']:.3f} | {r['x_eagle3']:.2f} |"
              for r in rows]  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--heads", nargs="+", default=FAMILIES, choices=FAMILIES)
    parser.add_argument("--out", type=Path, default=Path("outputs/bench-heads"))
    parser.add_argument("--draft-context", type=int, default=64, help="prompt tokens before the timed drafts")
    parser.add_argument(
        "--dflash-layers", type=int, default=5, help="DFlash drafter layers in the draft table"
    )
    parser.add_argument(
        "--peagle-layers", type=int, default=1, help="P-EAGLE decoder layers in the draft table (AWS's: 4)"
    )
    parser.add_argument("--no-draft", action="store_true", help="skip the draft-time table")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run (after --)")
    args = parser.parse_args()
    register_resolvers()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for family in args.heads:
        rows.append(run_family(family, args.out, ["logger=none", *args.overrides]))
        (args.out / "results.json").write_text(json.dumps(rows, indent=1))  # partial results survive
    text = table(rows)
    (args.out / "table.md").write_text(text + "\n")
    print(text)
    if not args.no_draft:
        drafts = draft_rows(
            args.overrides, args.draft_context, args.dflash_layers, peagle_layers=args.peagle_layers
        )
        (args.out / "draft.json").write_text(json.dumps(drafts, indent=1))
        (args.out / "draft.md").write_text(draft_markdown(drafts) + "\n")
        print(f"\ndraft time at the target's shape, random-weight heads after {args.draft_context} tokens:")
        print(draft_markdown(drafts))


if __name__ == "__main__":
    main()
