"""Run the frozen target once over a dataset and store the hidden states a head family trains on.

    python scripts/cache_hidden_states.py head=eagle3 model=demo data=demo data.cache_dir=cache/eagle3-demo
    python train.py head=eagle3 model=demo data=demo data.hidden_states=offline data.cache_dir=cache/eagle3-demo

Takes train.py's Hydra overrides (head, model, data, trainer.max_length, trainer.seed fix what is
cached), plus `cache.dtype=bfloat16|float16|float32`, `cache.shard_mb=1024`, `cache.batch_size=N`,
`cache.max_shards=N` (stop early; a rerun continues) and `--force` (= cache.allow_low_disk=true).
Prints the disk it needs and refuses to start without room. Rerun the same command to resume a
killed build; under `accelerate launch` every process writes its own shards.
"""

from __future__ import annotations

import sys
from dataclasses import fields

import yaml
from hydra import compose, initialize_config_module
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from spechead.configs import register_resolvers
from spechead.training.cli import USER_ERRORS, settings_from_config
from spechead.training.errors import TrainError
from spechead.training.hidden_cache.build import CacheConfig, CacheReport, build_cache
from spechead.training.settings import build


def parse(argv: list[str]) -> tuple[list[str], CacheConfig]:
    """Split argv into Hydra overrides for the training config and the cache options."""
    overrides, cache = [], {}
    names = [f.name for f in fields(CacheConfig)]
    for arg in argv:
        if arg == "--force":
            cache["allow_low_disk"] = True
        elif arg.startswith("cache."):
            key, sep, value = arg[len("cache.") :].partition("=")
            if not sep:
                raise TrainError(f"{arg}: write cache.KEY=VALUE (keys: {', '.join(names)})")
            cache[key] = yaml.safe_load(value)
        elif arg.startswith("-"):
            raise TrainError(f"unknown option {arg} (options: --force; see --help)")
        else:
            overrides.append(arg)
    return overrides, build(CacheConfig, cache, "cache")


def summary(report: CacheReport) -> str:
    """Lines about the build: size on disk vs the estimate, throughput, and what to run next."""
    per_token = report.disk_bytes / max(report.tokens, 1)
    lines = [
        f"built {report.built_tokens:,} tokens in {report.seconds:.1f} s ({report.tokens_per_s:,.0f} tokens/s"
        " in this process)",
    ]
    if report.complete:
        lines += [
            f"cache complete in {report.directory}: {report.disk_bytes:,} bytes on disk for "
            f"{report.tokens:,} tokens = {per_token:,.1f} bytes/token "
            f"(estimate {report.estimate_bytes / max(report.tokens, 1):,.1f}; "
            f"measured/estimate {report.disk_bytes / max(report.estimate_bytes, 1):.4f})",
            f"train from it: python train.py ... data.hidden_states=offline data.cache_dir={report.directory}",
        ]
    else:
        lines.append(f"cache in {report.directory} is unfinished: rerun the same command to continue it")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    register_resolvers()
    try:
        overrides, cache = parse(argv)
        with initialize_config_module("spechead.configs", version_base=None):
            cfg = compose("train", overrides=overrides)
        report = build_cache(settings_from_config(cfg), cache)
    except (HydraException, OmegaConfBaseException) as err:
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if report.main:
        print(summary(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
