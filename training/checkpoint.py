"""Checkpoints: accelerate state (head, optimizer, scheduler, RNG) + our step counters, written atomically.

A checkpoint directory only gets its final name after every process has written its part, so a run
killed mid-save leaves a `.tmp-*` directory that is ignored (and later overwritten), never a half
checkpoint that resume would trust. One damaged later (a truncated file) is set aside as `broken-step-*`
when resuming, which continues from the newest checkpoint that reads back whole. `check_disk` refuses a
run whose checkpoints and head cannot fit before it trains.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import DistributedType

from spechead.heads import directory
from spechead.heads.files import free_bytes, replace_dir, umask_mode
from spechead.training import zero
from spechead.training.errors import TrainError
from spechead.training.objectives import Objective

STATE_FILE = "trainer_state.json"
GB = 1e9


@dataclass
class TrainState:
    """Where the loop stands; enough to continue exactly (data order comes from seed + epoch)."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    batch_in_epoch: int = 0  # micro-batches of `epoch` already consumed
    tokens: int = 0  # tokens seen on all processes
    # OUT/best: the validation metric that picked it (metrics.best_score), its value and step
    best_by: str = ""
    best_tau: float = 0.0
    best_step: int = 0


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
    """Save everything needed to resume at `state.step`; keep the newest `keep` checkpoints.

    A failed write (disk full) removes the partial checkpoint and raises TrainError naming the last
    complete one, from which rerunning the same command resumes."""
    root = checkpoint_root(output_dir)
    final = root / f"step-{state.step:08d}"
    tmp = root / f".tmp-step-{state.step:08d}"
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    # DeepSpeed ZeRO-2 would otherwise also write every frozen parameter (under Medusa-2, the whole
    # target) into each checkpoint; the frozen ones come from the target's own files on resume.
    deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
    try:
        accelerator.save_state(str(tmp), **({"exclude_frozen_parameters": True} if deepspeed else {}))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            (tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=1))
            umask_mode(tmp)  # safetensors writes 0600
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise TrainError(
            f"could not write checkpoint {final} ({err.strerror or type(err).__name__}): "
            f"{_last_words(output_dir)}"
        ) from None
    if accelerator.is_main_process:
        replace_dir(tmp, final)
        for old in list_checkpoints(output_dir)[:-keep]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def save_head(objective: Objective, path: Path, tree: dict | None = None) -> Path:
    """Save the head (with `tree` as its tree.json) at `path` whole or not at all: written to a temporary
    sibling, then renamed into place, so a failed write (disk full) never replaces a good head. TrainError
    then, naming the run's last checkpoint."""
    tmp = path.with_name(f".tmp-{path.name}")
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        zero.save_head(objective, tmp)
        if tree is not None:
            directory.write_tree(tmp, **tree)
        umask_mode(tmp)  # safetensors writes 0600 (the head's and a LoRA adapter's weights)
        replace_dir(tmp, path)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise TrainError(
            f"could not write the head to {path} ({err.strerror or type(err).__name__}): "
            f"{_last_words(path.parent)}"
        ) from None
    return path


def _last_words(output_dir: Path) -> str:
    """Where the run's work is, and how to continue it: for messages about a failed write."""
    found = list_checkpoints(output_dir)
    where = f"the last checkpoint is {found[-1]}" if found else "no checkpoint was written yet"
    return f"{where}; free space (or move the run elsewhere) and rerun the same command to resume"


def resume_hint(output_dir: Path) -> str:
    """One line for an interrupted run: its last checkpoint, and how to continue."""
    found = list_checkpoints(output_dir)
    where = f"last checkpoint at {found[-1]}" if found else f"no checkpoint in {output_dir} yet"
    return f"{where}; rerun the same command to resume"


def load(accelerator: Accelerator, path: Path) -> TrainState:
    """Restore accelerate state from `path` and return the loop counters saved with it."""
    state = TrainState(**json.loads((path / STATE_FILE).read_text()))
    accelerator.load_state(str(path))
    return state


def load_latest(accelerator: Accelerator, candidates: list[Path]) -> tuple[Path, TrainState]:
    """Restore the newest of `candidates` (oldest first) that reads back whole, and its counters.

    A newer one that does not (a truncated model.safetensors, optimizer.bin or trainer_state.json) is
    renamed `broken-step-*`, out of the way of later saves, with a one-line warning; TrainError when
    none can be read. Loading an older one after a failed newer one overwrites all it had restored."""
    broken: list[tuple[Path, str]] = []
    for path in reversed(candidates):
        try:
            state = load(accelerator, path)
        except (
            Exception
        ) as err:  # each library its own error type for a damaged file (safetensors, torch, json)
            broken.append((path, _first_line(err)))
            continue
        break
    else:
        path, reason = broken[0]
        raise TrainError(
            f"no checkpoint in {path.parent} can be read back ({path.name}: {reason}): "
            f"move {path.parent} away to start over, or choose another trainer.output_dir"
        )
    accelerator.wait_for_everyone()  # every process has read its files before they move
    for bad, reason in broken:
        aside = bad.with_name(f"broken-{bad.name}")
        if accelerator.is_main_process:
            if aside.exists():
                shutil.rmtree(aside)
            bad.rename(aside)
        accelerator.print(
            f"warning: checkpoint {bad} is unreadable ({reason}): moved to {aside.name}, resuming from {path.name}"
        )
    accelerator.wait_for_everyone()
    return path, state


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0][:200]}" if lines else type(err).__name__


def disk_needed(output_dir: Path, saved_bytes: int, trainable_bytes: int, keep: int) -> int:
    """Bytes a run still has to write at its peak: `keep` + 1 checkpoints (the newest is complete before the
    oldest goes), each the module's saved weights and AdamW's two moments, plus OUT/head and OUT/best; less
    what an earlier run of the same output directory already holds there."""
    checkpoint_bytes = saved_bytes + 2 * trainable_bytes
    total = (keep + 1) * checkpoint_bytes + 2 * trainable_bytes
    held = sum(
        f.stat().st_size
        for part in (checkpoint_root(output_dir), output_dir / "head", output_dir / "best")
        if part.is_dir()
        for f in part.rglob("*")
        if f.is_file()
    )
    return max(total - held, 0)


def check_disk(output_dir: Path, needed: int) -> None:
    """TrainError, before any training, when `needed` bytes do not fit where `output_dir` is."""
    free = free_bytes(output_dir)
    if needed > free:
        raise TrainError(
            f"trainer.output_dir={output_dir} needs about {needed / GB:.3f} GB for checkpoints and the head "
            f"but {free / GB:.3f} GB are free there: free space, choose another trainer.output_dir, "
            "or keep fewer checkpoints (trainer.keep_checkpoints)"
        )
