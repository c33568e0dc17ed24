"""Commits: each row's accepted tree entries moved into place after its committed prefix in a `RowCache`
(a verify wrote node i of row b at slot lengths[b] + i), so the cache again equals a plain run over
prefix + path. Every layer at once where they share one buffer."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from spechead.inference.devices import host_ids
from spechead.inference.target.cache import RowCache

Path = Tensor | Sequence[int]  # one row's accepted nodes [K] (ascending, [0] = 0)


def commit_row(cache: RowCache, path: list[int], device: torch.device) -> None:
    """A batch of one's commit: a path in place (0..K-1) moves the length only; another is one gather and
    one copy of every layer (`device`: the cache's)."""
    past, k = cache.lengths[0], len(path)
    if path[-1] != k - 1:  # ascending from 0 and ending at K-1 is 0..K-1: in place
        src = host_ids(path, device) + past  # [K] the slots the verify wrote them at
        for buf in cache.buffers():  # [..., 1, kv, S_max, D]
            buf[..., past : past + k, :] = buf.index_select(-2, src)
    cache.set_length(past + k)


def commit_rows(cache: RowCache, paths: Sequence[list[int]], device: torch.device) -> None:
    """B rows' commits, paths[b] for row b: each padded to the longest by repeating its last node
    (duplicate writes of one value), gathered and scattered into place."""
    lengths, kmax = cache.lengths, max(len(p) for p in paths)
    src = [[n + i for i in p + p[-1:] * (kmax - len(p))] for n, p in zip(lengths, paths)]  # [B, Kmax]
    dst = [[n + min(i, len(p) - 1) for i in range(kmax)] for n, p in zip(lengths, paths)]  # [B, Kmax]
    if src != dst:  # some row's path is not already in place
        _move(cache, host_ids(src, device), host_ids(dst, device))
    cache.set_lengths([n + len(p) for n, p in zip(lengths, paths)])


def padded_paths(paths: Sequence[list[int]], rows: Sequence[int], capacity: int) -> Tensor | None:
    """The fixed-shape commit's nodes [P, K'] for `capacity` physical rows: active row b's path (in
    physical row rows[b]) padded to a power of 2 K' by repeating its last node, idle rows node 0; None
    when every path is in place already (0..K-1: nothing moves)."""
    if all(p == list(range(len(p))) for p in paths):
        return None
    size = 1 << max(max(len(p) for p in paths) - 1, 0).bit_length()  # K' >= K_b: a few graph shapes
    padded = [[0] * size for _ in range(capacity)]  # [P, K']
    for row, p in zip(rows, paths):
        padded[row] = p + p[-1:] * (size - len(p))
    return torch.tensor(padded)


def move_fixed(cache: RowCache, nodes: Tensor) -> None:
    """Inside a graph: copy each row's entries of tree nodes [P, K] to the K slots after its DEVICE length
    (fixed shapes: one graph for every length), in every layer. Padding repeats the last node: its copies
    land past the new length (scratch), clamped to the last slot where the cache ends (the same value)."""
    lengths = cache.lengths_t
    assert lengths is not None  # a static-shape cache after its first write
    src = lengths[:, None] + nodes  # [P, K] slots the verify wrote these nodes at
    dst = (lengths[:, None] + torch.arange(nodes.shape[1], device=nodes.device)).clamp(
        max=cache.max_length - 1
    )
    _move(cache, src, dst)


def _move(cache: RowCache, src: Tensor, dst: Tensor) -> None:
    """Copy every row's slots src [B, K] to slots dst [B, K] in every layer's keys and values; the gather
    copies first, so overlaps are fine."""
    k = src.shape[1]
    for buf in cache.buffers():  # [..., B, kv, S_max, D]
        s_idx = src[:, None, :, None].expand(*buf.shape[:-2], k, buf.shape[-1])
        d_idx = dst[:, None, :, None].expand(*buf.shape[:-2], k, buf.shape[-1])
        buf.scatter_(-2, d_idx, buf.gather(-2, s_idx))
