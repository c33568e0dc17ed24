"""spechead.configs: the Hydra config tree (train.yaml + groups), shipped as package data.

`register_resolvers()` adds `${demo:NAME}`, the absolute path of a shipped demo asset, so the demo
presets work from any working directory and from an installed wheel, and `${basename:PATH}`, the last
part of a directory or Hub id (model=local names its run after model.path).
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from omegaconf import OmegaConf


def demo_asset(name: str) -> str:
    """Absolute path of `data/demo/NAME` inside the installed spechead.data package."""
    return str(Path(str(files("spechead.data"))) / "demo" / name)


def basename(path: str) -> str:
    """Last part of a directory or Hub id: '/models/my-llama/' -> 'my-llama', 'org/name' -> 'name'."""
    return Path(str(path).rstrip("/\\")).name or "local"


def register_resolvers() -> None:
    """Register spechead's OmegaConf resolvers (idempotent)."""
    if not OmegaConf.has_resolver("demo"):
        OmegaConf.register_new_resolver("demo", demo_asset)
    if not OmegaConf.has_resolver("basename"):
        OmegaConf.register_new_resolver("basename", basename)
