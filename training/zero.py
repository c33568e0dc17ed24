"""DeepSpeed ZeRO under `accelerate launch`: what the trainer adjusts when a DeepSpeed config runs it.

The accelerate config file picks the ZeRO stage (configs/accelerate/zero2.yaml, zero3.yaml, ...);
everything DeepSpeed could also take from that file but the trainer already owns comes from the
trainer settings, filled into DeepSpeed's `"auto"` entries, and a clash is an error, never a silent
override: micro-batch size (`trainer.batch_size`), gradient accumulation (`trainer.grad_accum`),
gradient clipping (`trainer.grad_clip`; DeepSpeed clips inside its step), optimizer and schedule
(spechead's AdamW and `trainer.schedule`, stepped by the loop).

ZeRO-2 shards the head's gradients and optimizer states. ZeRO-3 additionally shards the frozen
target's parameters for inference only (see spechead.training.sharded_target); the head, small next to
the target, still trains under ZeRO-2 so its weights stay whole on every process.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs

from spechead.training.errors import TrainError
from spechead.training.objectives import family_for
from spechead.training.objectives.base import Objective
from spechead.training.settings import TrainSettings

HEAD_STAGE_UNDER_ZERO3 = 2


def launched_with_deepspeed() -> bool:
    """Whether `accelerate launch` was given a DeepSpeed config (distributed_type: DEEPSPEED)."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def device_options() -> dict[str, Any]:
    """`Accelerator` keywords for this machine: GPUs when there are any, else CPU with gloo.

    accelerate ignores DeepSpeed when `cpu=True`, so DeepSpeed on CPU (tests, CI) runs with
    `cpu=False` and an explicit gloo process group instead.
    """
    if torch.cuda.is_available():
        return {"cpu": False}
    if launched_with_deepspeed():
        return {"cpu": False, "kwargs_handlers": [InitProcessGroupKwargs(backend="gloo")]}
    return {"cpu": True}


def zero_stage(accelerator: Accelerator) -> int:
    """The ZeRO stage of the launch's DeepSpeed config; 0 without DeepSpeed (DDP or one process).

    Read it before loading the target: under ZeRO-3 the config is then switched to stage 2 for the head.
    """
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return 0
    return int(plugin.deepspeed_config.get("zero_optimization", {}).get("stage", 0))


def configure(accelerator: Accelerator, s: TrainSettings) -> int:
    """Fill the DeepSpeed config's "auto" entries from `s.trainer`; refuse clashes. Returns the stage."""
    if accelerator.gradient_accumulation_steps != s.trainer.grad_accum:
        raise TrainError(
            f"the accelerate config sets gradient_accumulation_steps={accelerator.gradient_accumulation_steps} "
            f"but trainer.grad_accum={s.trainer.grad_accum}: remove it from the accelerate config and "
            "set trainer.grad_accum"
        )
    stage = zero_stage(accelerator)
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return stage
    config = plugin.deepspeed_config
    for section in ("optimizer", "scheduler"):
        if section in config:
            raise TrainError(
                f"the DeepSpeed config defines a {section!r}: remove it; spechead builds AdamW and the "
                "learning-rate schedule from trainer.lr, trainer.betas, trainer.weight_decay, trainer.schedule"
            )
    fill_auto(config, "train_micro_batch_size_per_gpu", s.trainer.batch_size, "trainer.batch_size")
    fill_auto(config, "gradient_clipping", float(s.trainer.grad_clip), "trainer.grad_clip")
    if stage == 3:
        check_zero3(s)
    return stage


def check_zero3(s: TrainSettings) -> None:
    """What ZeRO-3 (a target sharded for inference only) cannot do, as one clear error each."""
    why = family_for(s.head.family).trains_target
    if why:
        raise TrainError(
            f"head={s.head.family}: {why}, but ZeRO-3 here shards the target for inference only: "
            f"use configs/accelerate/zero2.yaml or ddp.yaml for {s.head.family}"
        )
    if s.data.hidden_states == "offline":
        raise TrainError(
            "data.hidden_states=offline never runs the target, so there is nothing for ZeRO-3 to shard: "
            "use configs/accelerate/zero2.yaml or ddp.yaml"
        )


def fill_auto(config: dict, key: str, value: Any, setting: str) -> None:
    """Set DeepSpeed `config[key]` to the trainer's `value` when "auto" or absent; a different value is an error."""
    current = config.get(key, "auto")
    if current == "auto":
        config[key] = value
    elif current != value:
        raise TrainError(
            f"the DeepSpeed config sets {key}={current} but {setting}={value}: "
            f"remove {key} from the DeepSpeed config (or set it to auto) and set {setting}"
        )


@contextmanager
def owned_storage(module: torch.nn.Module) -> Iterator[None]:
    """Give every parameter its own storage for a while (restored after).

    ZeRO-1/2 turn parameters into views of one flat buffer, which safetensors refuses to save; a
    temporary copy is saved instead, while DeepSpeed keeps updating the original buffer.
    """
    saved = [(p, p.data) for p in module.parameters()]
    for p, data in saved:
        p.data = data.detach().clone()
    try:
        yield
    finally:
        for p, data in saved:
            p.data = data


def save_head(objective: Objective, path: Path) -> Path:
    """`objective.save(path)` that also works while DeepSpeed owns the head's parameters."""
    with owned_storage(objective.module()):
        return objective.save(path)
