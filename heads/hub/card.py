"""The model card (README.md) of a published head: Hub metadata, what the head is, how it was trained,
how well it drafts, and how to load it with spechead.

Pure text from plain dicts (the head's config.json, the run's config.yaml / metrics.json, the
benchmark's decoding.json / decoding.md), so it can be checked without a Hub or a model.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from huggingface_hub import ModelCardData

from spechead.heads.errors import HeadError
from spechead.heads.families import Family, family_of

LIBRARY = "spechead"
BENCHMARK_PLOTS = ("speedup_by_category.png", "acceptance_by_depth.png")
# A Hub model id: namespace/name (a local path has more parts, or exists on disk).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# Config fields shown in the head table (others are in the uploaded config.json).
_HEAD_FIELDS = ("num_heads", "num_layers", "share_lm_head", "draft_vocab_size", "ttt_steps", "lora_adapter")


@dataclass
class RunInfo:
    """What a training run left beside its head directory (empty dicts when absent)."""

    config: dict[str, Any] = field(default_factory=dict)  # OUTPUT_DIR/config.yaml (resolved settings)
    metrics: dict[str, Any] = field(default_factory=dict)  # OUTPUT_DIR/metrics.json (final evaluation)


@dataclass
class BenchmarkInfo:
    """scripts/benchmark.py output: decoding.json data, decoding.md text, plot file names present."""

    data: dict[str, Any] = field(default_factory=dict)
    table: str = ""
    plots: list[str] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)  # the rows that decoded with this head


def hub_id_or_none(name: str) -> str | None:
    """`name` when it reads as a Hub model id (and is not a local path), else None."""
    if not name or not _HUB_ID.fullmatch(name) or Path(name).expanduser().exists():
        return None
    return name


def family(head_config: dict[str, Any]) -> Family | None:
    """The registered family of a head's config.json (None for a family this install does not know)."""
    try:
        return family_of(head_config)
    except HeadError:
        return None


def card_metadata(
    head_config: dict[str, Any], *, base_model: str | None, license: str | None
) -> ModelCardData:
    """The card's YAML metadata: base_model (a Hub id only), library, tags, license (omitted if None)."""
    fam = family(head_config)
    tags = [LIBRARY, "speculative-decoding", "draft-head"]
    tags += list(fam.tags) if fam else [str(head_config.get("family", ""))]
    return ModelCardData(base_model=base_model, library_name=LIBRARY, license=license, tags=tags)


def render_card(
    head_config: dict[str, Any],
    *,
    repo_id: str,
    files: list[str],
    num_parameters: int,
    run: RunInfo,
    benchmark: BenchmarkInfo | None = None,
    base_model: str | None = None,
    license: str | None = None,
    revision: str | None = None,
) -> str:
    """The whole README.md: YAML front matter + body."""
    meta = card_metadata(head_config, base_model=base_model, license=license)
    target = base_model or str(head_config.get("target_name_or_path", ""))
    sections = [
        _intro(head_config, repo_id, target, base_model),
        _usage(head_config, repo_id, base_model, revision),
        _head_table(head_config, files, num_parameters),
        _training(run),
        _simulated(run.metrics),
    ]
    if benchmark is not None:
        sections.append(_measured(benchmark))
    body = "\n\n".join(s for s in sections if s)
    return f"---\n{meta.to_yaml()}\n---\n\n{body}\n"


def _intro(cfg: dict, repo_id: str, target: str, base_model: str | None) -> str:
    fam = family(cfg)
    what = fam.summary if fam else f"a {cfg.get('family')} head"
    link = f"[{base_model}](https://huggingface.co/{base_model})" if base_model else f"`{target or '?'}`"
    text = (
        f"# {repo_id.split('/')[-1]}\n\nA speculative-decoding draft head for {link}, trained with "
        f"spechead: {what}. The target verifies every drafted "
        "token tree in one forward pass and keeps only what it would have generated itself, so greedy "
        "output equals the target's plain greedy output and sampling keeps the target's distribution."
    )
    if not base_model:
        text += (
            f"\n\nThe head was trained on a local copy of its target (`{target}`); load it with the same "
            "target model (same weights, layer count, hidden size and vocabulary)."
        )
    if fam and fam.trains_target:
        text += (
            f"\n\nThe head also adapts the target: `{cfg.get('lora_adapter')}/` holds a peft LoRA adapter that "
            "spechead merges into the target when it loads this head; decoding is lossless with respect to "
            "that adapted target."
        )
    return text


def _usage(cfg: dict, repo_id: str, base_model: str | None, revision: str | None) -> str:
    target = base_model or "PATH/TO/TARGET"
    head, fetch = f'"{repo_id}"', ""
    if revision:  # from_pretrained's `revision` is the target's: fetch the head's revision first
        head = "head"
        fetch = (
            f'from huggingface_hub import snapshot_download\n\nhead = snapshot_download("{repo_id}", '
            f'revision="{revision}")\n'
        )
    return (
        "## Use it with spechead\n\n```python\n"
        f"from spechead.inference import SpeculativeGenerator\n{fetch}\n"
        f'gen = SpeculativeGenerator.from_pretrained("{target}", {head}, device="cuda")  # or "cpu"\n'
        'out = gen.generate(messages=[{"role": "user", "content": "Hello!"}], max_new_tokens=128)\n'
        "print(out.text, out.stats.tau)  # tau: tokens emitted per target forward pass\n```\n\n"
        "On a GPU it loads the target in its checkpoint's dtype and decodes with CUDA graphs by default "
        '(`dtype="auto"`, `compile="auto"`). '
        f"`spechead.heads.load_head({head})` loads the head module alone (config.json + safetensors, "
        "no pickle)."
    )


def _head_table(cfg: dict, files: list[str], num_parameters: int) -> str:
    fam = family(cfg)
    rows = [
        ("family", fam.name if fam else cfg.get("family", "")),
        ("target", cfg.get("target_name_or_path", "")),
        ("target architecture", cfg.get("target_architecture", "")),
        (
            "target layers / hidden states read",
            f"{cfg.get('target_num_layers')} / {cfg.get('target_layers')}",
        ),
        ("hidden size / vocabulary", f"{cfg.get('hidden_size')} / {cfg.get('vocab_size')}"),
        *((name, cfg[name]) for name in _HEAD_FIELDS if cfg.get(name) not in (None, "")),
        ("parameters (head only)", f"{num_parameters:,}"),
        ("spechead version", cfg.get("spechead_version", "")),
        ("files", ", ".join(f"`{f}`" for f in files)),
    ]
    return "## Head\n\n| | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)


def _training(run: RunInfo) -> str:
    if not run.config:
        return "## Training\n\nNo `config.yaml` was found beside the head directory."
    data, trainer = run.config.get("data", {}), run.config.get("trainer", {})
    head, model = run.config.get("head", {}), run.config.get("model", {})
    steps = run.metrics.get("step", trainer.get("max_steps"))
    rows = [
        ("data", f"{data.get('name')} (`{data.get('path')}`, {data.get('format')} format)"),
        ("target dtype", model.get("dtype")),
        ("steps", steps),
        ("batch size x grad accumulation", f"{trainer.get('batch_size')} x {trainer.get('grad_accum')}"),
        ("max length", trainer.get("max_length")),
        ("learning rate / schedule", f"{trainer.get('lr')} / {trainer.get('schedule')}"),
        ("mixed precision", trainer.get("mixed_precision")),
        ("head loss", json.dumps(head.get("loss", {}))),
        ("seed", trainer.get("seed")),
    ]
    if "seconds" in run.metrics:
        rows.append(("training time", f"{run.metrics['seconds']:.0f} s"))
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    full = yaml.safe_dump(run.config, sort_keys=False).strip()
    return (
        f"## Training\n\n| | |\n|---|---|\n{table}\n\n<details><summary>Full training config "
        f"(<code>train.py</code> overrides resolved)</summary>\n\n```yaml\n{full}\n```\n\n</details>"
    )


def _simulated(metrics: dict) -> str:
    if "tau" not in metrics:
        return ""
    depth = [(k, v) for k, v in metrics.items() if k.startswith("acc/")]
    rows = "\n".join(f"| {k} | {v:.4f} |" for k, v in depth)
    table = f"\n\n| held-out metric | value |\n|---|---:|\n{rows}" if rows else ""
    return (
        f"## Simulated acceptance (held-out data, end of training)\n\nSimulated tau = **{metrics['tau']:.3f}** "
        "tokens per target pass: the teacher-forced greedy chain of the head's top-1 drafts, accepted "
        f"tokens + the target's own token.{table}"
    )


def _measured(bench: BenchmarkInfo) -> str:
    settings = bench.data.get("settings", {})
    where = (
        f"{settings.get('device', '?')}, {settings.get('dtype', '?')}, prompt set `{settings.get('prompt_set')}` "
        f"({settings.get('prompts')} prompts, max_new_tokens={settings.get('max_new_tokens')})"
    )
    parts = [f"## Measured decoding (`scripts/benchmark.py`)\n\nGreedy decoding on {where}."]
    if bench.rows:
        rows = "\n".join(
            f"| {r.get('drafter')} | {_options(r)} | {_num(r, 'tau', '.2f')} | {_num(r, 'speedup', '.2f')}x | "
            f"{_num(r, 'tokens_per_s', '.1f')} | {'yes' if r.get('greedy_mismatches', 0) == 0 else 'NO'} |"
            for r in bench.rows
        )
        parts.append(
            "This head:\n\n| drafter | options | measured tau | speedup | tokens/s | greedy == plain |\n"
            f"|---|---|---:|---:|---:|---|\n{rows}"
        )
    if bench.table:
        parts.append(
            f"<details><summary>Full benchmark report</summary>\n\n{bench.table.strip()}\n\n</details>"
        )
    parts += [f"![{name[:-4].replace('_', ' ')}]({name})" for name in bench.plots]
    return "\n\n".join(parts)


def _options(row: dict) -> str:
    """The drafter options of a benchmark row (`SPEC@top_k=4,...`), or "default"."""
    spec = str(row.get("spec", ""))
    return f"`{spec.split('@', 1)[1]}`" if "@" in spec else "default"


def _num(row: dict, key: str, fmt: str) -> str:
    value = row.get(key)
    return format(value, fmt) if isinstance(value, int | float) else "?"
