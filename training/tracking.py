"""Experiment tracking through accelerate's W&B tracker, plus a local metrics.jsonl that always exists."""

from __future__ import annotations

import json
import netrc
import os
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from spechead.training.errors import TrainError
from spechead.training.settings import LoggerConfig


def _has_wandb_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def wandb_mode(cfg: LoggerConfig) -> str:
    """The W&B mode to use: explicit config, else WANDB_MODE, else online only when logged in."""
    if cfg.mode != "auto":
        return cfg.mode
    env = os.environ.get("WANDB_MODE", "").lower()
    if env in ("online", "offline", "disabled", "dryrun"):
        return "offline" if env == "dryrun" else env
    return "online" if _has_wandb_key() else "offline"


def check(cfg: LoggerConfig) -> str:
    """Fail early (before any model loads) when W&B cannot log online; returns the mode to use."""
    mode = wandb_mode(cfg)
    if cfg.backend == "wandb" and mode == "online" and not _has_wandb_key():
        raise TrainError(
            "W&B has no API key: run `wandb login` (or set WANDB_API_KEY), "
            "or log offline with logger.mode=offline, or turn it off with logger=none"
        )
    return mode


def log_with(cfg: LoggerConfig) -> list[str]:
    """Tracker names for `Accelerator(log_with=...)`."""
    return ["wandb"] if cfg.backend == "wandb" else []


def start(accelerator: Accelerator, cfg: LoggerConfig, config: dict[str, Any], run_dir: Path) -> str | None:
    """Start the tracker on the main process with the resolved config; returns the W&B mode used."""
    if cfg.backend != "wandb":
        return None
    mode = check(cfg)
    init = {"mode": mode, "dir": str(run_dir), "tags": list(cfg.tags)}
    if cfg.entity:
        init["entity"] = cfg.entity
    if cfg.run_name:
        init["name"] = cfg.run_name
    try:
        accelerator.init_trackers(cfg.project, config=config, init_kwargs={"wandb": init})
    except Exception as err:  # wandb raises its own error types; keep the message, drop the traceback
        raise TrainError(
            f"W&B could not start ({str(err).splitlines()[0]}); use logger=none or logger.mode=offline"
        ) from None
    return mode


def device_memory(device: torch.device) -> dict[str, float]:
    """This process's peak GPU memory so far in GiB: held by tensors (`peak_memory_gib`) and reserved by
    PyTorch's caching allocator (`peak_reserved_gib`, what the GPU sees taken); empty on a CPU."""
    if device.type != "cuda":
        return {}
    return {
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 1024**3,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 1024**3,
    }


class MetricsFile:
    """Append-only JSON lines of every logged metric in output_dir (main process only)."""

    def __init__(self, path: Path, enabled: bool):
        self.path = path
        self.enabled = enabled

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps({"step": step, **metrics}) + "\n")


def log_images(accelerator: Accelerator, images: dict[str, Path], step: int) -> None:
    """Log image files (PNG plots) to W&B when it is the tracker; no-op otherwise."""
    if not images or not accelerator.is_main_process:
        return
    for tracker in accelerator.trackers:
        if tracker.name == "wandb":
            import wandb

            tracker.run.log({k: wandb.Image(str(p)) for k, p in images.items()}, step=step)
