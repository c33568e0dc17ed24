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


def test_position_ids_past_the_rows_end_or_on_another_device_come_from_a_new_row():
    ids, cpu, meta = PositionIds(), torch.device("cpu"), torch.device("meta")
    assert ids(0, 1, cpu).tolist() == [[0]]  # a row of 1024
    assert ids(1020, 8, cpu).tolist() == [list(range(1020, 1028))]  # starts inside the row, ends past it
    assert ids(1023, 1, cpu).tolist() == [[1023]]
    for count in (1, 3):  # asked on another device: positions there, not the kept row's views
        assert ids(1023, count, meta).device == meta and ids(1023, count, meta).shape == (1, count)
    assert ids(1023, 1, cpu).device == cpu and ids(5, 2, cpu).tolist() == [[5, 6]]
