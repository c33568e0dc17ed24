"""Measure the offline hidden-state cache: size per token, build throughput, training speed vs online.

    python scripts/bench_offline.py                                   # EAGLE-3 on the demo target
    python scripts/bench_offline.py --steps 40 --dtype float32 -- head=eagle data.max_examples=600

Builds a cache in OUT/cache, then trains the same head for --steps steps online (target run every
step) and offline (from the cache) with the same seed, and prints one table: bytes/token on disk vs
the computed estimate, cache build tokens/s, training tokens/s of both runs, and the largest
difference between the two heads' weights (0 up to rounding with --dtype float32 on an fp32 target).
Every number also goes to OUT/bench_offline.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from hydra import compose, initialize_config_module
from safetensors.torch import load_file

from spechead.configs import register_resolvers
from spechead.training.cli import USER_ERRORS, settings_from_config
from spechead.training.hidden_cache.build import CacheConfig, build_cache
from spechead.training.trainer import train

DEFAULTS = ["head=eagle3", "model=demo", "data=demo", "logger=none", "data.max_examples=400"]


def settings(overrides: list[str]):
    with initialize_config_module("spechead.configs", version_base=None):
        return settings_from_config(compose("train", overrides=overrides))


def head_difference(a: Path, b: Path) -> float:
    """Largest absolute difference between two saved heads' tensors."""
    x, y = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return max(float((x[k].double() - y[k].double()).abs().max()) for k in x)


def run(out: Path, steps: int, dtype: str, overrides: list[str]) -> dict:
    """Build the cache, train online and offline; returns every measured number."""
    shutil.rmtree(out, ignore_errors=True)
    cache = out / "cache"
    loop = [f"trainer.max_steps={steps}", f"trainer.eval_every={steps}", f"trainer.save_every={steps}"]
    base = [*DEFAULTS, *loop, *overrides]
    started = time.perf_counter()
    report = build_cache(settings([*base, f"data.cache_dir={cache}"]), CacheConfig(dtype=dtype))
    build_seconds = time.perf_counter() - started
    online = train(settings([*base, f"trainer.output_dir={out / 'online'}"]))
    offline = train(
        settings(
            [
                *base,
                f"trainer.output_dir={out / 'offline'}",
                "data.hidden_states=offline",
                f"data.cache_dir={cache}",
            ]
        )
    )
    return {
        "overrides": base,
        "cache_dtype": dtype,
        "cache_tokens": report.tokens,
        "cache_bytes_on_disk": report.disk_bytes,
        "bytes_per_token_measured": report.disk_bytes / report.tokens,
        "bytes_per_token_computed": report.estimate_bytes / report.tokens,
        "cache_build_tokens_per_s": report.tokens_per_s,
        "cache_build_seconds_total": build_seconds,
        "steps": steps,
        "online_train_tokens_per_s": online.tokens_per_second,
        "offline_train_tokens_per_s": offline.tokens_per_second,
        "online_seconds": online.seconds,
        "offline_seconds": offline.seconds,
        "online_tau": online.metrics.get("tau"),
        "offline_tau": offline.metrics.get("tau"),
        "max_head_weight_difference": head_difference(online.head_dir, offline.head_dir),
    }


def table(r: dict) -> str:
    rows = [
        ("cache bytes/token (measured on disk)", f"{r['bytes_per_token_measured']:,.1f}"),
        ("cache bytes/token (computed)", f"{r['bytes_per_token_computed']:,.1f}"),
        ("cache build tokens/s", f"{r['cache_build_tokens_per_s']:,.0f}"),
        (f"online training tokens/s ({r['steps']} steps)", f"{r['online_train_tokens_per_s']:,.0f}"),
        (f"offline training tokens/s ({r['steps']} steps)", f"{r['offline_train_tokens_per_s']:,.0f}"),
        (
            "offline / online speed",
            f"{r['offline_train_tokens_per_s'] / r['online_train_tokens_per_s']:.2f}x",
        ),
        ("tau online / offline", f"{r['online_tau']:.4f} / {r['offline_tau']:.4f}"),
        ("max |online head - offline head|", f"{r['max_head_weight_difference']:.3g}"),
    ]
    return "\n".join(["| measure | value |", "|---|---:|", *(f"| {k} | {v} |" for k, v in rows)])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_offline"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--dtype", default="bfloat16", help="cache dtype: bfloat16 | float16 | float32")
    parser.add_argument("overrides", nargs="*", help="train.py overrides after --")
    args = parser.parse_args(argv)
    register_resolvers()
    try:
        result = run(args.out, args.steps, args.dtype, args.overrides)
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    (args.out / "bench_offline.json").write_text(json.dumps(result, indent=1))
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
