"""Train each head family with its default recipe on a target and print one comparison table.

    python scripts/bench_heads.py                          # every family on the demo target
    python scripts/bench_heads.py --heads medusa eagle3 -- trainer.max_steps=100 model=llama3-8b-instruct

Each family trains in its own output directory (OUT/<family>) through the same code path as
train.py; the table (Markdown) and every number (JSON) are written to OUT.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from hydra import compose, initialize_config_module

from spechead.configs import register_resolvers
from spechead.training.cli import settings_from_config
from spechead.training.trainer import train

FAMILIES = ["medusa", "eagle", "eagle3", "medusa2"]


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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--heads", nargs="+", default=FAMILIES, choices=FAMILIES)
    parser.add_argument("--out", type=Path, default=Path("outputs/bench-heads"))
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


if __name__ == "__main__":
    main()
