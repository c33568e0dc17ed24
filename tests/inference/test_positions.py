"""PositionIds: views of one kept arange equal fresh position ids, across growth."""

from __future__ import annotations

import torch

from spechead.inference.positions import PositionIds


def test_position_ids_equal_fresh_ones_as_the_row_grows():
    ids, cpu = PositionIds(), torch.device("cpu")
    for start, count in ((0, 1), (5, 3), (1023, 1), (1500, 4), (7, 1), (2999, 1), (0, 9)):
        got = ids(start, count, cpu)
        assert got.shape == (1, count) and got.tolist() == [list(range(start, start + count))]
    assert ids.row is not None and ids.row.shape[1] >= 3000 and set(ids.singles) == {7, 2999}
    assert ids(42, 1, cpu) is ids(42, 1, cpu)  # a single position: the view made ahead, no new tensor
