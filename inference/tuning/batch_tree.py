"""The tree follows the batch: at batch B every row's tree is verified in one target forward of B x N
tokens, so a tree nearly free at batch 1 can cost several decode steps at batch 8 on a compute-bound
device. `drafter_for_batch` (plugged in by loading.py) picks generate_batch's tree once per batch
size, as calibrate.py does at load time for batch 1, or none when no tree beats plain batched decoding.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from spechead.heads.families import family_of
from spechead.inference.tuning.calibrate import (
    EAGER,
    SIZES,
    TimedAs,
    _drafter_ms,
    _noise,
    best_for_costs,
    compiled_depth_cost_ms,
    eagle_depth_cost_ms,
    propose_timer,
    verify_cost_ms,
)
from spechead.inference.tuning.pass_timing import decoded_choice

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def choices_for_batch(
    model: PreTrainedModel,
    drafter,
    accuracy: torch.Tensor,
    batch: int,
    max_tokens: int = 64,
    timed_as: TimedAs = EAGER,
) -> tuple[list[list[int]], dict]:
    """The static tree with the best expected speedup at `batch` rows on this device, and what was
    measured (the parts compiled as `timed_as` says). Trees are compared up to max(4, max_tokens // batch)
    nodes per row. The draft is timed after 128 committed tokens: Medusa one propose (draft_ms); EAGLE
    one depth over one node a row (draft_ms_per_depth: the trees that pay at batch > 1 are narrow, and
    the commit of the accepted tokens costs about one such step), compiled: what a chain of 4 adds to a
    chain of 1, / 3."""
    max_nodes = max(4, max_tokens // batch)
    sizes = sorted({s for s in SIZES if s <= max_nodes} | {max_nodes + 1})
    verify = verify_cost_ms(model, sizes, repeats=5, compile=timed_as.target, batch=batch)
    info: dict = {"batch": batch, "verify_ms_by_size": verify, "step_ms": verify[1]}
    info["timed_as"] = {"target": timed_as.target, "draft": timed_as.draft}
    if not family_of(drafter.head.config).drafts_per_depth:
        info["draft_ms"] = _drafter_ms(drafter, propose_timer(drafter, _noise(drafter), batch), 7)
    elif timed_as.draft:
        info["draft_ms_per_depth"] = compiled_depth_cost_ms(drafter, timed_as.draft, 4, 7, 1, batch)
    else:
        info["draft_ms_per_depth"] = eagle_depth_cost_ms(drafter, 1, 7, batch)
    return best_for_costs(accuracy, info, max_nodes), info


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
    The part-by-part costs rank the trees (`choices_for_batch`), the best few are then decoded at this
    batch size (pass_timing.decoded_choice), each part timed as a generator with these compile settings
    runs it (`TimedAs.of`)."""
    timed_as = TimedAs.of(model.device, compile, draft_compile)
    _, info = choices_for_batch(model, drafter, accuracy, batch, timed_as=timed_as)
    choices, info = decoded_choice(model, drafter, accuracy, info, batch=batch, timed_as=timed_as)
    pays = info["expected_speedup"] > 1  # drafting must beat plain batched decoding to be worth it
    return (drafter.with_tree(choices) if pays else None), {"choices": choices if pays else [], **info}
