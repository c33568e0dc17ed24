"""DynamicCache bookkeeping for tree passes of a draft model over its own cache (drafters/draft_model.py,
cascade.py) and for the target's prefill groups (target/prefill.py); the target's own cache is the
preallocated row cache (target/cache.py).

A tree pass appends the N tree nodes' keys/values at cache positions past_len..past_len+N-1 (in node
order). After acceptance only the accepted path's entries must stay, contiguous after the prefix, so that
the cache again equals that of a plain sequential run over prefix + path (`keep_positions`).

Supported: caches whose layers are full-attention `DynamicLayer`s (`cache.layers[i].keys/.values`
[B, kv_heads, S, D]), i.e. `DynamicCache` for dense decoders. NOT supported (NotImplementedError):
`StaticCache`, sliding-window layers (positions are relative to a rolling window), quantized and indexed
layers. Sliding-window MODELS still decode: `croppable_cache` gives them plain layers that keep every
position, and every pass applies the window in its sliding layers' masks (sliding.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from transformers.cache_utils import (
    BaseQuantizedLayer,
    Cache,
    DynamicCache,
    DynamicIndexedLayer,
    DynamicLayer,
)

from spechead.inference.devices import host_to_device
from spechead.inference.sliding import sliding_layout


def croppable_cache(model) -> DynamicCache:
    """A fresh DynamicCache for `model` whose layers `keep_positions` can crop: for a sliding-window model
    plain full layers (they keep every position; the window is applied in the masks, sliding.py), else
    `DynamicCache(config=model.config)`."""
    return DynamicCache() if sliding_layout(model) else DynamicCache(config=model.config)


def cache_length(cache: Cache) -> int:
    """Number of positions held by the cache (layer 0)."""
    return int(cache.get_seq_length())


def _dynamic_layer(i: int, layer: object) -> DynamicLayer:
    """`layer` if it is a full-attention DynamicLayer, else NotImplementedError."""
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
    return cast(DynamicLayer, layer)  # the isinstance check above


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
    indices: dict[torch.device, torch.Tensor] = {}  # [K] per device (layers may sit on several GPUs)
    for i, cache_layer in enumerate(cache.layers):
        layer = _dynamic_layer(i, cache_layer)
        keys, values = layer.keys, layer.values
        if not layer.is_initialized or keys is None or keys.numel() == 0:
            continue  # layer without its own K/V (e.g. shared KV)
        assert values is not None  # a DynamicLayer sets keys and values together
        seq = keys.shape[-2]
        if keep_list and past_len + max(keep_list) >= seq:
            raise ValueError(
                f"layer {i} holds {seq} positions; cannot keep node {max(keep_list)} after past_len={past_len}"
            )
        if past_len > seq:
            raise ValueError(f"layer {i} holds {seq} positions < past_len={past_len}")
        end = past_len + len(keep_list)
        if contiguous:
            layer.keys = keys[..., :end, :]
            layer.values = values[..., :end, :]
            continue
        idx = indices.get(keys.device)
        if idx is None:  # (copied once per device, without waiting for the GPU's queued work)
            idx = indices[keys.device] = host_to_device(
                torch.tensor(keep_list) + past_len, keys.device
            )  # [K]
        layer.keys = torch.cat([keys[..., :past_len, :], keys.index_select(-2, idx)], dim=-2)
        layer.values = torch.cat([values[..., :past_len, :], values.index_select(-2, idx)], dim=-2)
