"""Position ids as views of one kept arange: on a CPU making a tensor (`torch.arange`) costs several times
a view of one already made, and eager decoding asks for a few positions every call."""

from __future__ import annotations

import torch
from torch import Tensor


class PositionIds:
    """`ids(start, count, device)` -> positions start..start + count - 1 as [1, count]: a read-only view of
    a kept arange [1, S] (remade twice as long when outgrown or on another device)."""

    def __init__(self) -> None:
        self.row: Tensor | None = None  # [1, S] 0..S-1
        self.singles: dict[int, Tensor] = {}  # position p -> its [1, 1] view of row

    def __call__(self, start: int, count: int, device: torch.device) -> Tensor:
        row, end = self.row, start + count
        if row is None or row.shape[1] < end or row.device != device:
            row = self.row = torch.arange(max(2 * end, 1024), device=device)[None]
            self.singles = {}
        if count != 1:
            return row[:, start:end]
        single = self.singles.get(start)
        if single is None:
            single = self.singles[start] = row[:, start:end]
        return single
