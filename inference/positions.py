"""Position ids as views of one kept arange: eager decoding asks for a few positions per call, and on a
CPU making a tensor (`torch.full`, `torch.arange`) costs several times a view of one already made."""

from __future__ import annotations

import torch
from torch import Tensor


class PositionIds:
    """`ids(start, count, device)` -> positions start..start + count - 1 as [1, count], a view of a kept
    arange [1, S] (made again, twice as long, when a position outgrows it or the device changes).
    Read-only: a caller must not write into the view."""

    def __init__(self) -> None:
        self.row: Tensor | None = None  # [1, S] 0..S-1

    def __call__(self, start: int, count: int, device: torch.device) -> Tensor:
        row, end = self.row, start + count
        if row is None or row.shape[1] < end or row.device != device:
            row = self.row = torch.arange(max(2 * end, 1024), device=device)[None]
        return row[:, start:end]
