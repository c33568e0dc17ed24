"""DynamicCache bookkeeping for a draft model's own cache (drafters/draft_model.py, cascade.py) and the
target's prefill groups (target/prefill.py). After a tree pass every caller keeps a prefix (a draft model
drops its tree, a cascade's medium keeps its accepted chain), so `crop` is all there is. Only
full-attention `DynamicLayer`s can be cropped: a sliding-window model gets plain layers from
`croppable_cache` and its masks apply the window (sliding.py).
"""

from __future__ import annotations

from transformers.cache_utils import (
    BaseQuantizedLayer,
    Cache,
    DynamicCache,
    DynamicIndexedLayer,
    DynamicLayer,
)

from spechead.inference.sliding import sliding_layout


def croppable_cache(model) -> DynamicCache:
    """A fresh DynamicCache for `model` whose layers `crop` can cut (a sliding-window model: plain full
    layers that keep every position)."""
    return DynamicCache() if sliding_layout(model) else DynamicCache(config=model.config)


def crop(cache: Cache, length: int) -> None:
    """Keep the first `length` (>= 0) positions of every layer (keys/values [B, kv_heads, S, D] -> [..., length, :]),
    in place. ValueError when a layer holds fewer; NotImplementedError for a layer that is not a
    full-attention DynamicLayer (StaticCache, sliding-window, quantized, indexed)."""
    for i, layer in enumerate(cache.layers):
        if (
            not isinstance(layer, DynamicLayer)
            or getattr(layer, "is_sliding", False)
            or isinstance(layer, (BaseQuantizedLayer, DynamicIndexedLayer))
        ):
            raise NotImplementedError(
                f"crop supports full-attention DynamicLayer caches only; layer {i} is "
                f"{type(layer).__name__} (StaticCache, sliding-window, quantized and indexed layers are not supported yet)"
            )
        keys, values = layer.keys, layer.values
        if not layer.is_initialized or keys is None or keys.numel() == 0:
            continue  # layer without its own K/V (e.g. shared KV)
        assert values is not None  # a DynamicLayer sets keys and values together
        if length > keys.shape[-2]:
            raise ValueError(f"layer {i} holds {keys.shape[-2]} positions < length={length}")
        layer.keys, layer.values = keys[..., :length, :], values[..., :length, :]
