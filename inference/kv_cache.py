"""KV-cache bookkeeping for tree verification (transformers 5 `DynamicCache`).

A verification pass appends the N tree nodes' keys/values at cache positions past_len..past_len+N-1
(in node order). After acceptance only the accepted path's entries must stay, contiguous after the
prefix, so that the cache again equals that of a plain sequential run over prefix + path.

Supported: caches whose layers are full-attention `DynamicLayer`s (`cache.layers[i].keys/.values`
[B, kv_heads, S, D]), i.e. `DynamicCache` for dense decoders. NOT supported yet (NotImplementedError):
`StaticCache` (fixed slots: would need copying accepted K/V into place and setting the length),
sliding-window layers (positions are relative to a rolling window), quantized and indexed layers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import BaseQuantizedLayer, Cache, DynamicIndexedLayer, DynamicLayer


def cache_length(cache: Cache) -> int:
    """Number of positions held by the cache (layer 0)."""
    return int(cache.get_seq_length())


def _check_layer(i: int, layer: object) -> None:
    bad = (
        not isinstance(layer, DynamicLayer)
        or getattr(layer, "is_sliding", False)
        or isinstance(layer, (BaseQuantizedLayer, DynamicIndexedLayer))
    )
    if bad:
        raise NotImplementedError(
            f"keep_positions supports full-attention DynamicLayer caches only; layer {i} is "
            f"{type(layer).__name__} (StaticCache, sliding-window, quantized and indexed layers are not supported yet)"
        )


def keep_positions(cache: Cache, past_len: int, keep: torch.Tensor | Sequence[int]) -> None:
    """Keep the prefix [0, past_len) plus the tree entries of nodes `keep` [K], dropping the rest.

    `keep` holds tree NODE indices (entry past_len + k for node k), in the order they must end up
    (ascending root-to-leaf path order, e.g. Acceptance.path). Afterwards every layer holds
    past_len + K positions. An empty `keep` crops the cache back to past_len. In place, all layers.
    """
    keep_list = [int(k) for k in (keep.tolist() if isinstance(keep, torch.Tensor) else keep)]
    if any(k < 0 for k in keep_list):
        raise ValueError(f"keep must hold node indices >= 0, got {keep_list}")
    if past_len < 0:
        raise ValueError(f"past_len must be >= 0, got {past_len}")
    contiguous = keep_list == list(range(len(keep_list)))  # e.g. a chain: a plain crop, no copy
    for i, layer in enumerate(cache.layers):
        _check_layer(i, layer)
        if not layer.is_initialized or layer.keys is None or layer.keys.numel() == 0:
            continue  # layer without its own K/V (e.g. shared KV)
        seq = layer.keys.shape[-2]
        if keep_list and past_len + max(keep_list) >= seq:
            raise ValueError(
                f"layer {i} holds {seq} positions; cannot keep node {max(keep_list)} after past_len={past_len}"
            )
        if past_len > seq:
            raise ValueError(f"layer {i} holds {seq} positions < past_len={past_len}")
        end = past_len + len(keep_list)
        if contiguous:
            layer.keys = layer.keys[..., :end, :]
            layer.values = layer.values[..., :end, :]
            continue
        idx = torch.tensor(keep_list, dtype=torch.long, device=layer.keys.device) + past_len  # [K]
        layer.keys = torch.cat([layer.keys[..., :past_len, :], layer.keys.index_select(-2, idx)], dim=-2)
        layer.values = torch.cat(
            [layer.values[..., :past_len, :], layer.values.index_select(-2, idx)], dim=-2
        )
