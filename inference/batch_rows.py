"""A row of a batch while it decodes (the batch loops' shared state: batch_decode.py, batch_plain_ahead.py,
batch_spec_ahead.py), and every row's target probabilities."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from spechead.inference.sampling import SamplingParams, torch_probs

if TYPE_CHECKING:
    from spechead.inference.stats import GenerationStats


@dataclass
class Row:
    """One sequence of the batch while it decodes."""

    index: int  # its place in the batch as given
    prompt: torch.Tensor  # [T]
    max_new: int
    params: SamplingParams
    generator: torch.Generator | None
    stats: GenerationStats
    root: int = 0
    pending: list[int] = field(default_factory=list)
    verified: bool = False  # whether `pending` came from a verify pass (the prefill emits the first root)


def row_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Every row's target probs [B, N, V] from logits [B, N, V]: one call when the rows share their
    transform (their seeds aside), else row by row."""
    transform = {(p.temperature, p.top_k, p.top_p) for p in params}
    if len(transform) == 1:
        return torch_probs(logits, params[0])
    return torch.stack([torch_probs(row, p) for row, p in zip(logits, params)])
