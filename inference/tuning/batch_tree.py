"""The tree follows the batch: at batch B every row's tree is verified in one target forward of B x N
tokens, so a tree nearly free at batch 1 can cost several decode steps at batch 8 on a compute-bound
device. `drafter_for_batch` (plugged in by loading.py) picks generate_batch's tree once per batch
size, as calibrate.py does at load time for batch 1, or none when no tree beats plain batched decoding.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from spechead.inference.tuning.calibrate import TimedAs, calibrated_choices
from spechead.inference.tuning.pass_timing import decoded_choice

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def drafter_for_batch(
    model: PreTrainedModel,
    drafter,
    accuracy: torch.Tensor,
    batch: int,
    compile: bool | str,
    draft_compile: bool | str | None,
) -> tuple:
    """(the drafter with the tree measured best for `batch` rows here, or None when no tree is expected to
    beat plain batched decoding; what was measured): generator.BatchTreePicker, plugged in by loading.py.
    The part-by-part costs rank the trees of up to max(4, 64 // batch) nodes a row (`calibrated_choices`),
    the best few are then decoded at this batch size (pass_timing.decoded_choice), each part timed as a
    generator with these compile settings runs it (`TimedAs.of`)."""
    timed_as = TimedAs.of(model.device, compile, draft_compile)
    _, info = calibrated_choices(model, drafter, accuracy, max(4, 64 // batch), timed_as, batch)
    choices, info = decoded_choice(model, drafter, accuracy, info, batch=batch, timed_as=timed_as)
    pays = info["expected_speedup"] > 1  # drafting must beat plain batched decoding to be worth it
    return (drafter.with_tree(choices) if pays else None), {
        "batch": batch,
        "choices": choices if pays else [],
        **info,
    }
