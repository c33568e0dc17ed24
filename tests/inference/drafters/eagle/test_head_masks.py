"""HeadMasks: the eager head masks from kept pieces equal masks filled from scratch."""

from __future__ import annotations

import torch

from spechead.inference.drafters.eagle.head_masks import HeadMasks

MIN = torch.finfo(torch.float32).min


def reference(block: torch.Tensor, committed: int) -> torch.Tensor:
    """[1, 1, q, C + w]: zeros over the committed entries, then the block."""
    q, w = block.shape
    mask = torch.zeros(1, 1, q, committed + w)
    mask[0, 0, :, committed:] = block
    return mask


def test_kept_and_unkept_masks_equal_filled_ones_as_the_cache_grows():
    masks = HeadMasks(min_rows=4)
    block = torch.tensor([[0.0, MIN, MIN], [0.0, 0.0, MIN]])  # [q = 2, w = 3]
    for slots, committed in ((16, 0), (16, 5), (16, 13), (64, 40), (64, 61), (16, 9)):
        for key in (None, "depth-2"):
            got = masks.after_committed(block, committed, slots, key=key)
            assert torch.equal(got, reference(block, committed)), (slots, committed, key)
    assert masks.wide["depth-2"].shape == (1, 1, 2, 16 + 3)  # made again for the last, smaller cache


def test_off_the_cpu_a_kept_block_gives_fresh_masks_not_views_at_an_arbitrary_column():
    """CUDA's attention needs a 16-element-aligned mask start (a view at column S_max - C crashed with
    'misaligned address' on an H200): off the CPU the mask is made whole; meta device = CUDA's path."""
    masks = HeadMasks(min_rows=4)
    block = torch.zeros(2, 3, device="meta")  # [q, w]
    for committed in (5, 13, 9):
        got = masks.after_committed(block, committed, 64, key="depth-2")  # [1, 1, q, C + w]
        assert got.shape == (1, 1, 2, committed + 3) and got.storage_offset() == 0 and got.is_contiguous()
    assert not masks.wide


def test_causal_block_is_kept_per_size_and_follows_the_dtype():
    masks = HeadMasks(min_rows=4)
    block = masks.causal_block(3, torch.zeros(1))
    assert (block == 0).tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    assert masks.causal_block(3, torch.zeros(1)) is block
    double = masks.causal_block(3, torch.zeros(1, dtype=torch.float64))
    assert double.dtype == torch.float64 and (double == 0).tolist() == (block == 0).tolist()
