"""DynamicCache bookkeeping for tree passes of a draft model over its own cache (drafters/draft_model.py,
cascade.py) and for the target's prefill groups (target/prefill.py); the target's own cache is the
preallocated row cache (target/cache.py).

A tree pass appends the N tree nodes' keys/values at cache positions past_len..past_len+N-1 (in node
order). Afterwards only committed tokens may stay, so that the cache again equals that of a plain
sequential run: every caller keeps a prefix (a draft model drops its whole tree; a cascade's medium keeps
its accepted chain, the first entries), so `crop` is all the bookkeeping there is.

Supported: caches whose layers are full-attention `DynamicLayer`s (`cache.layers[i].keys/.values`
[B, kv_heads, S, D]), i.e. `DynamicCache` for dense decoders. NOT supported (NotImplementedError):
`StaticCache`, sliding-window layers (positions are relative to a rolling window), quantized and indexed
layers. Sliding-window MODELS still decode: `croppable_cache` gives them plain layers that keep every
position, and every pass applies the window in its sliding layers' masks (sliding.py).
"""

from __future__ import annotations

from typing import cast

from transformers.cache_utils import (
    BaseQuantizedLayer,
    Cache,
    DynamicCache,
    DynamicIndexedLayer,
    DynamicLayer,
)

from spechead.inference.sliding import sliding_layout


def croppable_cache(model) -> DynamicCache:
    """A fresh DynamicCache for `model` whose layers `crop` can cut: for a sliding-window model
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
            f"crop supports full-attention DynamicLayer caches only; layer {i} is "
            f"{type(layer).__name__} (StaticCache, sliding-window, quantized and indexed layers are not supported yet)"
        )
    return cast(DynamicLayer, layer)  # the isinstance check above


def crop(cache: Cache, length: int) -> None:
    """Keep the first `length` positions of every layer (keys/values [B, kv_heads, S, D] -> [..., length, :]),
    in place: a tree pass's speculative entries dropped, or an accepted chain's kept (they are the first
    ones after the prefix). ValueError when a layer holds fewer than `length` positions."""
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    for i, cache_layer in enumerate(cache.layers):
        layer = _dynamic_layer(i, cache_layer)
        keys, values = layer.keys, layer.values
        if not layer.is_initialized or keys is None or keys.numel() == 0:
            continue  # layer without its own K/V (e.g. shared KV)
        assert values is not None  # a DynamicLayer sets keys and values together
        if length > keys.shape[-2]:
            raise ValueError(f"layer {i} holds {keys.shape[-2]} positions < length={length}")
        layer.keys, layer.values = keys[..., :length, :], values[..., :length, :]
