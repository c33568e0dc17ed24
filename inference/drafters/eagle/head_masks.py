"""Additive masks for an EAGLE head's eager steps, made from kept pieces.

Every eager accept and every masked draft depth needs a mask [1, 1, q, C + w]: q rows that see the C
committed entries of the head's cache, then a block [q, w] over the speculative slots. Filling one per
call costs several ops, and each op costs on a CPU; so the zeros and the blocks are kept, and a block
that repeats (the causal block of K accepted tokens, a static tree's depth) keeps its whole mask over
the cache [1, 1, q, S_max + w], from which every call takes ONE view.
"""

from __future__ import annotations

import torch
from torch import Tensor


class HeadMasks:
    """Kept mask pieces of one drafter (see the module doc). min_rows: zeros are made for at least this
    many rows (the largest eager accept), so they are rarely made again."""

    def __init__(self, min_rows: int) -> None:
        self.min_rows = min_rows
        self.zeros: Tensor | None = None  # [R, S_max] the committed columns of unkept blocks' masks
        self.causal: dict[int, Tensor] = {}  # k -> additive causal block [k, k]
        self.wide: dict[object, Tensor] = {}  # key -> [1, 1, q, S_max + w]: zeros, then the block

    def after_committed(self, block: Tensor, committed: int, slots: int, key: object = None) -> Tensor:
        """Additive mask [1, 1, q, C + w] over a cache of `slots` (S_max): each of q rows sees the C =
        `committed` entries, then block [q, w] (0 = attend, finfo.min = blocked) over slots C..C+w-1.

        key: the block is kept under it, so the mask is one view of its kept whole-cache mask (made
        again when the cache, the dtype or the device changes); on the CPU only, as the target's verify
        mask (target/tree_inputs.TreeInputs.mask: CUDA's attention needs a 16-element-aligned mask start)."""
        q = block.shape[0]
        if key is not None and block.is_cpu:
            wide = self.wide.get(key)
            if wide is None or wide.shape[-1] != slots + block.shape[1] or not _same_kind(wide, block):
                wide = self.wide[key] = torch.cat([block.new_zeros(q, slots), block], dim=1)[None, None]
            return wide[..., slots - committed :]
        zeros = self.zeros
        if zeros is None or not _covers(zeros, block, slots):  # first use, or the cache grew
            rows = max(q, self.min_rows, zeros.shape[0] if zeros is not None else 0)
            zeros = self.zeros = block.new_zeros(rows, slots)  # [R, S_max]
        return torch.cat([zeros[:q, :committed], block], dim=1)[None, None]

    def causal_block(self, k: int, like: Tensor) -> Tensor:
        """Additive causal mask [k, k] among k consecutive entries, in `like`'s dtype and device (made
        once per k, and again if the head moved)."""
        block = self.causal.get(k)
        if block is None or not _same_kind(block, like):
            block = torch.full((k, k), torch.finfo(like.dtype).min, dtype=like.dtype, device=like.device)
            self.causal[k] = block = block.triu(1)
        return block


def _same_kind(a: Tensor, b: Tensor) -> bool:
    """Same dtype and device (a kept piece still fits the head's)."""
    return a.dtype == b.dtype and a.device == b.device


def _covers(zeros: Tensor, block: Tensor, columns: int) -> bool:
    """Whether zeros [R, S] can give the committed columns of a mask with block [q, w]'s rows, dtype
    and device over a cache of `columns` slots."""
    return _same_kind(zeros, block) and zeros.shape[0] >= block.shape[0] and zeros.shape[1] >= columns
