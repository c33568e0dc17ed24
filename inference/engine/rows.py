"""What the engine keeps per row while it decodes, and how a row takes the tokens a pass gave it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from spechead.inference.sampling import SamplingParams
from spechead.inference.stops import until_stop

if TYPE_CHECKING:
    from spechead.inference.stats import GenerationStats


@dataclass
class Row:
    """One sequence of the batch (a batch of one is a batch) while it decodes."""

    index: int  # its place in the batch as given (what the loop yields it under)
    prompt: torch.Tensor  # [T]
    max_new: int
    params: SamplingParams
    generator: torch.Generator | None
    stats: GenerationStats
    root: int = 0  # the last emitted token: the next tree's root, not in the target's cache yet
    done: bool = False  # stopped: an EOS or max_new tokens emitted
    flying: int = 0  # passes queued with this row whose tokens the host has not read


def take(row: Row, pending: list[int], eos: set[int], verified: bool = True) -> list[int]:
    """The tokens of `pending` (a pass's accepted tokens and the next root) `row` emits up to its stop,
    counted in its stats (`verified`: from a verify pass, not the prefill); `done` set when it stops."""
    out = until_stop(pending, eos, row.max_new - row.stats.new_tokens)
    row.stats.new_tokens += len(out)
    if verified:
        row.stats.accept_lengths.append(len(out))
    if len(out) < len(pending) or not out or out[-1] in eos or row.stats.new_tokens >= row.max_new:
        row.done = True
    return out
