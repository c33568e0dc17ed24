"""Compatibility shim, to be deleted with the decode loops that still import it (generator.py,
batch_spec_ahead.py): `CompiledBatchRunner` is the one runner (spechead.inference.target.TargetRunner,
whose `TargetRunner(model, hidden_layers, max_length=S, capacity=P, compile=...)` is the old compiled
batch runner), a subclass only so the old loops' annotations keep telling it from the eager one; and the
generator's `kept_runner`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from spechead.inference.target.runner import TargetRunner, batch_capacity

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["CompiledBatchRunner", "batch_capacity", "kept_runner"]


class CompiledBatchRunner(TargetRunner):
    """The one runner with `capacity` fixed rows and compiled passes (nothing of its own)."""


def kept_runner(
    kept: dict[tuple, CompiledBatchRunner],
    target: PreTrainedModel,
    hidden_layers: Sequence[int],
    batch: int,
    max_length: int,
    compile: bool | str,
) -> CompiledBatchRunner:
    """The compiled runner in `kept` for `batch` rows of up to `max_length` slots, made (and kept) when
    none fits: one per capacity and captured layers, grown to the longest batch seen (its graphs, and
    on CUDA its captures, are reused by every later call that fits)."""
    key = (batch_capacity(batch), tuple(hidden_layers))
    runner = kept.get(key)
    if runner is None or (runner.max_length or 0) < max_length:
        length = max(max_length, (runner.max_length or 0) if runner is not None else 0)
        runner = CompiledBatchRunner(
            target, hidden_layers, max_length=length, capacity=key[0], compile=compile
        )
        kept[key] = runner
    return runner
