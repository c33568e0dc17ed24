"""The tree follows the batch: B rows' trees are verified in one target forward of B x N tokens, so a
tree nearly free at batch 1 can cost several decode steps at batch 8 on a compute-bound device.
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
    """(the drafter with the tree measured best for `batch` rows here, None when none is expected to beat
    plain batched decoding; what was measured): generator.BatchTreePicker, plugged in by loading.py. Trees
    of up to max(4, 64 // batch) nodes a row are ranked by their parts' costs and the best few decoded,
    each part timed as a generator with these compile settings runs it (`TimedAs.of`)."""
    timed_as = TimedAs.of(model.device, compile, draft_compile)
    _, info = calibrated_choices(model, drafter, accuracy, max(4, 64 // batch), timed_as, batch)
    choices, info = decoded_choice(model, drafter, accuracy, info, batch=batch, timed_as=timed_as)
    pays = info["expected_speedup"] > 1  # drafting must beat plain batched decoding to be worth it
    return (drafter.with_tree(choices) if pays else None), {
        "batch": batch,
        "choices": choices if pays else [],
        **info,
    }
