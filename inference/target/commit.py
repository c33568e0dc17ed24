"""Commits: each row's accepted tree entries moved into place after its committed prefix in a `RowCache`
(a verify wrote node i of row b at slot lengths[b] + i), so the cache again equals a plain run over
prefix + path. Every layer at once where they share one buffer."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from spechead.inference.devices import host_ids, host_to_device
from spechead.inference.target.cache import RowCache

Path = Tensor | Sequence[int]  # one row's accepted nodes [K] (ascending, [0] = 0)


def commit_row(cache: RowCache, path: Path, device: torch.device) -> None:
    """A batch of one's commit: a path in place (0..K-1) moves the length only; another is one gather and
    one copy of every layer (`device`: the cache's)."""
    past = cache.lengths[0]
    if isinstance(path, list):  # the generator's plain list: no tensor when the path is in place
        k = len(path)
        if k and path[-1] == k - 1:  # ascending from 0, ends at K-1: 0..K-1
            cache.set_length(past + k)
            return
        nodes = host_ids(path, torch.device("cpu"))
    else:
        nodes = torch.as_tensor(path, dtype=torch.long).reshape(-1)
        k = int(nodes.numel())
        if k and int(nodes[-1]) == k - 1:
            cache.set_length(past + k)
            return
    src = host_to_device(nodes, device) + past  # [K] the slots the verify wrote them at
    shared = cache.shared_storage()  # [L, 2, 1, kv, S_max, D]
    if shared is not None:  # every layer at once
        shared[..., past : past + k, :] = shared.index_select(-2, src)
    else:
        for layer in cache.row_layers:
            layer.keys[:, :, past : past + k] = layer.keys.index_select(2, src)
            layer.values[:, :, past : past + k] = layer.values.index_select(2, src)
    cache.set_length(past + k)


def commit_rows(cache: RowCache, paths: Sequence[Path], device: torch.device) -> None:
    """B rows' commits, paths[b] for row b: each padded to the longest by repeating its last node
    (duplicate writes of one value), gathered and scattered into place."""
    if all(isinstance(p, list) and p == list(range(len(p))) for p in paths):  # already in place
        cache.set_lengths([n + len(p) for n, p in zip(cache.lengths, paths)])
        return
    nodes = [torch.as_tensor(p, dtype=torch.long).reshape(-1) for p in paths]
    ks = torch.tensor([p.numel() for p in nodes], dtype=torch.long)  # [B]
    kmax, lengths = int(ks.max()), torch.tensor(cache.lengths)
    src = torch.stack([torch.cat([p, p[-1:].expand(kmax - p.numel())]) for p in nodes])  # [B, Kmax]
    dst = torch.minimum(torch.arange(kmax)[None, :], ks[:, None] - 1)  # [B, Kmax]
    src, dst = src + lengths[:, None], dst + lengths[:, None]
    if not torch.equal(src, dst):  # some row's path is not already in place
        src, dst = host_to_device(src, device), host_to_device(dst, device)
        shared = cache.shared_storage()  # [L, 2, B, kv, S_max, D]
        layers = cache.row_layers
        buffers = [shared] if shared is not None else [b for x in layers for b in (x.keys, x.values)]
        for buf in buffers:  # [..., B, kv, S_max, D]: the gather copies first, so overlaps are fine
            s_idx = src[:, None, :, None].expand(*buf.shape[:-2], kmax, buf.shape[-1])
            d_idx = dst[:, None, :, None].expand(*buf.shape[:-2], kmax, buf.shape[-1])
            buf.scatter_(-2, d_idx, buf.gather(-2, s_idx))
    cache.set_lengths((lengths + ks).tolist())


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
    rows, k = nodes.shape
    src = lengths[:, None] + nodes  # [P, K] slots the verify wrote these nodes at
    dst = (lengths[:, None] + torch.arange(k, device=nodes.device)).clamp(max=cache.max_length - 1)
    for layer in cache.row_layers:
        for buf in (layer.keys, layer.values):
            _, heads, _, dim = buf.shape
            moved = buf.gather(2, src[:, None, :, None].expand(rows, heads, k, dim))  # copies first
            buf.scatter_(2, dst[:, None, :, None].expand(rows, heads, k, dim), moved)
