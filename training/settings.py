"""Typed settings below the CLI: the composed Hydra config becomes these dataclasses, strictly.

Every section is checked key by key, so a typo in a YAML file or a `+key=value` override fails with
a message that names the key instead of being silently ignored.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spechead.data.conversations import DataConfig
from spechead.training.errors import TrainError
from spechead.training.target import TargetConfig

SCHEDULES = ("cosine", "linear", "constant")
PRECISIONS = ("no", "bf16", "fp16")
RESUME = ("auto", "true", "false")


@dataclass
class TrainerConfig:
    """The `trainer` group: steps, optimisation, evaluation and checkpointing."""

    output_dir: str = "outputs/run"
    epochs: int = 1
    max_steps: int = -1  # > 0 overrides epochs; counts optimizer steps
    batch_size: int = 8  # per process
    grad_accum: int = 1
    max_length: int = 2048
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    schedule: str = "cosine"
    warmup_ratio: float = 0.03
    grad_clip: float = 1.0
    mixed_precision: str = "no"
    eval_every: int = 200  # optimizer steps; the final step is always evaluated
    eval_batches: int = -1  # -1 = the whole validation split
    save_every: int = 200
    keep_checkpoints: int = 2
    log_every: int = 10
    resume: str | bool = "auto"  # auto: continue if output_dir has a checkpoint; true: must; false: must not
    seed: int = 0
    num_workers: int = 0
    decode_eval_every: int = 0  # > 0: real decoding of a prompt set every N steps (and at the end)
    decode_eval_prompt_set: str = "demo"  # built-in set name, JSONL file or Hub dataset id
    decode_eval_prompts: int = 6
    decode_eval_max_new_tokens: int = 64
    tree_tune_prompts: int = 0  # > 0: at the end, tune HEAD/tree.json for this device on this many prompts
    tree_tune_prompt_set: str = "demo-tune"  # built-in set name, JSONL file or Hub dataset id
    push_to_hub: str | None = None  # NAMESPACE/NAME: publish the final head (scripts/publish.py) at the end
    push_private: bool = False

    def __post_init__(self) -> None:
        self.resume = str(self.resume).lower()
        checks = [
            (self.schedule in SCHEDULES, f"trainer.schedule must be one of {SCHEDULES}"),
            (self.mixed_precision in PRECISIONS, f"trainer.mixed_precision must be one of {PRECISIONS}"),
            (self.resume in RESUME, "trainer.resume must be auto, true or false"),
            (
                self.batch_size >= 1 and self.grad_accum >= 1,
                "trainer.batch_size and trainer.grad_accum must be >= 1",
            ),
            (self.max_length >= 8, "trainer.max_length must be >= 8"),
            (self.epochs >= 1 or self.max_steps > 0, "set trainer.epochs >= 1 or trainer.max_steps > 0"),
            (self.lr > 0, "trainer.lr must be > 0"),
            (
                self.eval_every >= 1 and self.save_every >= 1,
                "trainer.eval_every and trainer.save_every must be >= 1",
            ),
            (self.keep_checkpoints >= 1, "trainer.keep_checkpoints must be >= 1"),
            (self.log_every >= 1, "trainer.log_every must be >= 1"),
            (self.decode_eval_every >= 0, "trainer.decode_eval_every must be >= 0 (0 = off)"),
            (self.tree_tune_prompts >= 0, "trainer.tree_tune_prompts must be >= 0 (0 = off)"),
            (
                self.decode_eval_prompts >= 1 and self.decode_eval_max_new_tokens >= 1,
                "trainer.decode_eval_prompts and trainer.decode_eval_max_new_tokens must be >= 1",
            ),
        ]
        for ok, msg in checks:
            if not ok:
                raise TrainError(msg)


@dataclass
class LoggerConfig:
    """The `logger` group: where metrics go besides the console and metrics.jsonl."""

    backend: str = "none"  # wandb | none
    project: str = "spechead"
    entity: str | None = None
    run_name: str | None = None
    mode: str = "auto"  # auto (online if logged in, else offline) | online | offline
    tags: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.backend not in ("wandb", "none"):
            raise TrainError(f"logger.backend={self.backend!r}: use logger=wandb or logger=none")
        if self.mode not in ("auto", "online", "offline"):
            raise TrainError(f"logger.mode={self.mode!r}: use auto, online or offline")


@dataclass
class HeadSettings:
    """The `head` group: family + architecture keys (checked later against the family's config)."""

    name: str
    family: str
    layers: list[int] | None  # None = the family's default
    arch: dict[str, Any]
    loss: dict[str, Any]


@dataclass
class TrainSettings:
    head: HeadSettings
    model: TargetConfig
    data: DataConfig
    trainer: TrainerConfig
    logger: LoggerConfig
    resolved: dict[str, Any]  # the whole resolved config, for logging and the run directory
    tuning: str | None = None  # the tuning file applied (e.g. "tuning/demo.yaml"), None = trainer defaults


def build(cls: type, values: dict[str, Any], where: str):
    """Instantiate dataclass `cls` from `values`, rejecting keys it does not have."""
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise TrainError(f"unknown key {where}.{unknown[0]} (valid keys for {where}: {', '.join(names)})")
    hints = typing.get_type_hints(cls)
    for key, value in values.items():
        _check_type(f"{where}.{key}", value, hints[key])
    try:
        return cls(**values)
    except TypeError as err:  # a required field is missing
        raise TrainError(f"{where}: {err}") from None


def _check_type(name: str, value: Any, hint: Any) -> None:
    """Reject obviously wrong scalar types (a string where a number goes) with the key's name."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    expected = [t for t in (typing.get_args(hint) if union else (hint,)) if t is not type(None)]
    if value is None or any(typing.get_origin(t) is not None for t in expected):
        return  # containers are checked by the code that uses them
    if float in expected and isinstance(value, int) and not isinstance(value, bool):
        return
    if not isinstance(value, tuple(t for t in expected if isinstance(t, type))):
        names = " or ".join(t.__name__ for t in expected if isinstance(t, type))
        raise TrainError(f"{name}={value!r} should be {names}")


def from_dict(cfg: dict[str, Any]) -> TrainSettings:
    """Typed settings from a resolved config dict (the composed Hydra config as plain containers)."""
    expected = {"head", "model", "data", "trainer", "logger"}
    unknown = sorted(set(cfg) - expected - {"tuning"})
    if unknown:
        raise TrainError(f"unknown top-level key {unknown[0]!r} (valid: {', '.join(sorted(expected))})")
    missing = sorted(expected - set(cfg))
    if missing:
        raise TrainError(f"config has no {missing[0]!r} section: pick one with {missing[0]}=NAME")
    head = dict(cfg["head"])
    for key in ("name", "family"):
        if key not in head:
            raise TrainError(f"head config lacks {key!r}: every head preset needs name and family")
    model = build(TargetConfig, cfg["model"], "model")
    tuning = _check_tuning(cfg.get("tuning"), model)
    layers = head.pop("layers", None)
    head_settings = HeadSettings(
        name=head.pop("name"),
        family=head.pop("family"),
        layers=None if layers is None else list(layers),
        loss=dict(head.pop("loss", {}) or {}),
        arch=head,
    )
    return TrainSettings(
        head=head_settings,
        model=model,
        data=build(DataConfig, cfg["data"], "data"),
        trainer=build(TrainerConfig, cfg["trainer"], "trainer"),
        logger=build(LoggerConfig, cfg["logger"], "logger"),
        resolved=cfg,
        tuning=tuning,
    )


def _check_tuning(tuning: dict[str, Any] | None, model: TargetConfig) -> str | None:
    """The applied tuning file's name; a tuning made for one target refuses any other model.path."""
    if not tuning:
        return None
    target = tuning.get("target")
    if target is not None and not _same_path(str(target), model.path):
        raise TrainError(
            f"model.path={model.path} is not the target {tuning.get('file')} is for, yet model={model.name} "
            f"applies it ({tuning.get('about')}): for your own model use model=local model.path={model.path}"
        )
    head_file = tuning.get("head_file")  # a head_tuning/ file applied beside it
    return f"{tuning.get('file')} + {head_file}" if head_file else str(tuning.get("file"))


def _same_path(a: str, b: str) -> bool:
    """Whether two model paths name the same directory (relative paths from the working directory)."""
    return a == b or Path(a).expanduser().resolve() == Path(b).expanduser().resolve()
