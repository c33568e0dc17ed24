"""Checkpoints: accelerate state (head, optimizer, scheduler, RNG) + our step counters, written atomically.

A checkpoint directory only gets its final name after every process has written its part, so a run
killed mid-save leaves a `.tmp-*` directory that is ignored (and later overwritten), never a half
checkpoint that resume would trust.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import DistributedType

STATE_FILE = "trainer_state.json"


@dataclass
class TrainState:
    """Where the loop stands; enough to continue exactly (data order comes from seed + epoch)."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    batch_in_epoch: int = 0  # micro-batches of `epoch` already consumed
    tokens: int = 0  # tokens seen on all processes
    best_tau: float = 0.0


def checkpoint_root(output_dir: Path) -> Path:
    return output_dir / "checkpoints"


def list_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    done = [p for p in root.glob("step-*") if (p / STATE_FILE).is_file()]
    return sorted(done, key=lambda p: int(p.name.split("-")[1]))


def save(accelerator: Accelerator, output_dir: Path, state: TrainState, keep: int) -> Path:
    """Save everything needed to resume at `state.step`; keep the newest `keep` checkpoints."""
    root = checkpoint_root(output_dir)
    final = root / f"step-{state.step:08d}"
    tmp = root / f".tmp-step-{state.step:08d}"
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    # DeepSpeed ZeRO-2 would otherwise also write every frozen parameter (under Medusa-2, the whole
    # target) into each checkpoint; the frozen ones come from the target's own files on resume.
    deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
    accelerator.save_state(str(tmp), **({"exclude_frozen_parameters": True} if deepspeed else {}))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=1))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        for old in list_checkpoints(output_dir)[:-keep]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def load(accelerator: Accelerator, path: Path) -> TrainState:
    """Restore accelerate state from `path` and return the loop counters saved with it."""
    accelerator.load_state(str(path))
    return TrainState(**json.loads((path / STATE_FILE).read_text()))
