"""KV-cache bookkeeping for tree verification (transformers 5 `DynamicCache`).

A verification pass appends the N tree nodes' keys/values at cache positions past_len..past_len+N-1
(in node order). After acceptance only the accepted path's entries must stay, contiguous after the
prefix, so that the cache again equals that of a plain sequential run over prefix + path.

Supported: caches whose layers are full-attention `DynamicLayer`s (`cache.layers[i].keys/.values`
[B, kv_heads, S, D]), i.e. `DynamicCache` for dense decoders. NOT supported yet (NotImplementedError):
`StaticCache` (fixed slots: would need copying accepted K/V into place and setting the length),
sliding-window layers (positions are relative to a rolling window), quantized and indexed layers.
Sliding-window MODELS still decode: `croppable_cache` gives them plain layers that keep every position,
and every target pass applies the window in its sliding layers' masks (sliding.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import cast

import torch
from transformers.cache_utils import (
    BaseQuantizedLayer,
    Cache,
    CacheLayerMixin,
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


# ---- preallocated back-end -----------------------------------------------------------------------

# every allocation of a SlotCache's buffers gets a new number (`SlotCache.generation`): a CUDA graph that
# read the old buffers must not replay over the new ones (cuda_graphs.py)
_ALLOCATIONS = itertools.count(1)


def new_generation() -> int:
    """A number no buffer allocation had before (caches record theirs as `generation`)."""
    return next(_ALLOCATIONS)


class SlotLayer(CacheLayerMixin):
    """One layer's PREALLOCATED keys/values [B, kv_heads, S_max, D], written at explicit slots.

    `length` is the number of valid positions; `update` writes the new entries at slots
    length..length+n-1 (in place, no concatenation) and returns views [B, kv, length + n, D]. Entries
    past `length` are scratch (rejected drafts are simply overwritten by the next pass).

    static_shapes (for torch.compile / CUDA graphs): the write slots come from `length_t`, a 0-d device
    tensor, and `update` returns the WHOLE buffers [B, kv, S_max, D], so one compiled graph serves every
    length; the caller's 4D mask hides the slots past the valid ones and `SlotCache.set_length` (outside
    the graph) moves the length after each pass. Otherwise the buffers are views of the owning cache's
    one buffer for every layer (`SlotCache.storage`) when the shapes allow it.
    """

    is_compileable = True
    is_sliding = False
    keys: torch.Tensor  # None until lazy_initialization allocates it (read once is_initialized)
    values: torch.Tensor

    def __init__(
        self, max_length: int, static_shapes: bool = False, owner: SlotCache | None = None, index: int = 0
    ) -> None:
        super().__init__()
        self.max_length = max_length
        self.length = 0
        self.static_shapes = static_shapes
        self.length_t: torch.Tensor | None = None  # static_shapes: `length` on the buffers' device
        self._owner, self._index = owner, index  # the cache whose one buffer may hold this layer's

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, k_dim = key_states.shape
        shared = None
        if self._owner is not None and not self.static_shapes:
            shared = self._owner.buffer.views(
                self._index, key_states, value_states, key_states.shape[0], self.max_length
            )
        if shared is not None:
            self.keys, self.values = shared  # views of the owner's [L, 2, B, kv, S_max, D]
        else:
            shape = (batch, heads, self.max_length)
            self.keys = key_states.new_zeros(*shape, k_dim)  # [B, kv, S_max, D]
            self.values = value_states.new_zeros(*shape, value_states.shape[-1])  # [B, kv, S_max, Dv]
        self.is_initialized = True
        if self._owner is not None:
            self._owner.generation = next(_ALLOCATIONS)
        if self.static_shapes:
            device = key_states.device
            if self._owner is not None:  # one length tensor per cache (and device): one fill a set_length
                self.length_t = self._owner.length_tensor(self.length, device)
            else:
                self.length_t = torch.tensor(self.length, dtype=torch.long, device=device)
            if not torch.compiler.is_compiling():  # fixed addresses: CUDA graphs may replay over them
                for buffer in (self.keys, self.values, self.length_t):
                    torch._dynamo.mark_static_address(buffer)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write key/value states [B, kv, n, D] at slots length.. and return the valid views."""
        if not self.is_initialized or self.keys.shape[0] != key_states.shape[0]:
            self.lazy_initialization(key_states, value_states)
        if self.static_shapes:
            assert self.length_t is not None  # lazy_initialization made it
            slots = torch.arange(key_states.shape[-2], device=key_states.device) + self.length_t  # [n]
            self.keys.index_copy_(2, slots, key_states)
            self.values.index_copy_(2, slots, value_states)
            return self.keys, self.values  # [B, kv, S_max, D]: the mask hides invalid slots
        start, n = self.length, key_states.shape[-2]
        end = start + n
        if end > self.max_length:
            raise ValueError(
                f"preallocated KV cache full: {start} + {n} positions > max_length {self.max_length}"
            )
        self.keys[:, :, start:end].copy_(key_states)
        self.values[:, :, start:end].copy_(value_states)
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return (self.max_length if self.static_shapes else self.length + query_length), 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.max_length

    def reset(self) -> None:
        self.set_length(0)

    def set_length(self, length: int) -> None:
        """The first `length` slots are valid (static_shapes: the device copy follows, no sync)."""
        self.length = length
        if self.length_t is not None:
            self.length_t.fill_(length)


class LayerBuffer:
    """One buffer `storage` [L, 2, B, kv, S_max, D] whose slices are every layer's keys and values, when
    all L layers share one shape: a commit (or a batch's row drop) then moves the entries of every layer
    with one op instead of ops per layer (each op costs on a CPU). Layers of another shape keep
    buffers of their own (no L-fold copies per shape)."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.storage: torch.Tensor | None = None  # [L, 2, B, kv, S_max, D]
        self.bound: set[int] = set()  # layers whose buffers are views of `storage`

    def views(
        self, index: int, key_states: torch.Tensor, value_states: torch.Tensor, batch: int, max_length: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer `index`'s keys and values [B, kv, S_max, D] as views of `storage` (made for these states'
        heads, dim, dtype and device); None (the layer keeps buffers of its own) when keys and values
        differ in shape or dtype, or layers of another shape hold the storage."""
        self.bound.discard(index)  # its earlier views (if any) are being replaced
        if key_states.shape != value_states.shape or value_states.dtype != key_states.dtype:
            return None
        _, heads, _, dim = key_states.shape
        shape = (self.num_layers, 2, batch, heads, max_length, dim)
        st = self.storage
        if st is None or st.shape != shape or st.dtype != key_states.dtype or st.device != key_states.device:
            if self.bound:  # held by layers of another shape
                return None
            st = self.storage = key_states.new_zeros(shape)
        self.bound.add(index)
        return st[index, 0], st[index, 1]

    def whole(self) -> torch.Tensor | None:
        """`storage` when every layer's keys and values are views of it, else None."""
        return self.storage if len(self.bound) == self.num_layers else None

    def reset(self) -> None:
        """Forget the storage (the next layer to ask makes a new one: a grown cache)."""
        self.storage, self.bound = None, set()


class SlotCache(Cache):
    """A preallocated KV cache for `num_layers` full-attention layers (buffers allocated on first use).

    Verification writes the N tree entries at slots past_len..past_len+N-1; `commit_path` copies the
    accepted path's entries into place and sets the length: no concatenation, no reallocation.

    Without static_shapes every layer's keys and values are views of ONE buffer `storage`
    [L, 2, B, kv, S_max, D] (when they all have one shape): a commit then moves the accepted entries of
    every layer with one gather and one copy instead of four ops per layer (each op costs on a CPU).
    """

    def __init__(self, num_layers: int, max_length: int, static_shapes: bool = False) -> None:
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        layers = [SlotLayer(max_length, static_shapes, self, i) for i in range(num_layers)]
        super().__init__(layers=cast(list, layers))  # (the same list object: HF keeps it)
        # `layers` itself, typed (read several times a pass: an attribute, not a property and a cast)
        self.slot_layers: list[SlotLayer] = layers
        self.max_length = max_length
        self.static_shapes = static_shapes
        self.buffer = LayerBuffer(num_layers)  # every layer's keys and values in one buffer, when they can
        self.generation = next(_ALLOCATIONS)  # a new number whenever a layer's buffers are (re)allocated
        # static_shapes: the 0-d device length every layer on that device writes after (shared: moving
        # it is one kernel, not one per layer; kept for the cache's life, so graphs may bake it in)
        self._lengths_t: dict[torch.device, torch.Tensor] = {}

    def length_tensor(self, length: int, device: torch.device) -> torch.Tensor:
        """The shared 0-d device length on `device` (made, at `length`, the first time a layer asks)."""
        found = self._lengths_t.get(device)
        if found is None:
            found = self._lengths_t[device] = torch.tensor(length, dtype=torch.long, device=device)
        return found

    @property
    def storage(self) -> torch.Tensor | None:
        """The one buffer [L, 2, B, kv, S_max, D] (see `LayerBuffer`), if made."""
        return self.buffer.storage

    def shared_storage(self) -> torch.Tensor | None:
        """`storage` [L, 2, B, kv, S_max, D] when every layer's keys and values are views of it, else None."""
        return self.buffer.whole()

    def grow(self, max_length: int) -> None:
        """Reallocate every layer to `max_length` slots, keeping the valid entries (rare: amortised doubling)."""
        self.max_length = max_length
        self.buffer.reset()  # the first layer to re-bind makes it at the new size
        for layer in self.slot_layers:
            layer.max_length = max_length
            if layer.is_initialized:
                keys, values = layer.keys, layer.values
                layer.lazy_initialization(keys, values)
                layer.keys[:, :, : layer.length] = keys[:, :, : layer.length]
                layer.values[:, :, : layer.length] = values[:, :, : layer.length]

    def device_length(self) -> torch.Tensor:
        """static_shapes: the 0-d device tensor every layer writes after (a graph reads it, no sync)."""
        length = self.slot_layers[0].length_t
        assert length is not None, "device_length needs static_shapes and a first update"
        return length

    def write_at(self, slot: torch.Tensor) -> None:
        """static_shapes: the next update writes at the device-side 0-d `slot`, inside a captured graph
        (no host sync); the host-side `length` stays (`set_length` sets both again)."""
        for layer in self.slot_layers:
            assert layer.length_t is not None, "write_at needs static_shapes and a first update"
        for length_t in self._lengths_t.values():  # (every layer's, shared)
            length_t.copy_(slot)

    def crop_to(self, length: int) -> None:
        """`set_length(length)`, skipped when the layers are there already: an eager layer moves its own
        length as it writes (the first layer first), so after a kept write there is nothing to drop (a
        loop over the layers saved, every decoding pass). With static_shapes it always sets."""
        if self.static_shapes or self.slot_layers[0].length != length:
            self.set_length(length)

    def set_length(self, length: int) -> None:
        """Declare the first `length` slots valid in every layer (later slots become scratch)."""
        if not 0 <= length <= self.max_length:
            raise ValueError(f"length must be in [0, {self.max_length}], got {length}")
        for layer in self.slot_layers:
            layer.length = length
        for length_t in self._lengths_t.values():  # static_shapes: the layers' shared device lengths
            length_t.fill_(length)


def commit_path(cache: Cache, past_len: int, path: torch.Tensor, contiguous: bool = False) -> None:
    """Keep prefix [0, past_len) + the tree entries of nodes `path` [K] (ascending), any back-end.

    SlotCache: entries past_len + path are copied to slots past_len..past_len+K-1 (skipped when
    `contiguous`, i.e. path == arange(K)) and the length set; DynamicCache: `keep_positions`.
    """
    if not isinstance(cache, SlotCache):
        keep_positions(cache, past_len, path)
        return
    k = int(path.numel())
    if not contiguous:
        src = host_to_device(path, cache.slot_layers[0].keys.device) + past_len  # [K] the accepted slots
        shared = cache.shared_storage()  # [L, 2, B, kv, S_max, D]
        if shared is not None:  # every layer at once
            shared[..., past_len : past_len + k, :] = shared.index_select(-2, src)
            cache.set_length(past_len + k)
            return
        for layer in cache.slot_layers:
            layer.keys[:, :, past_len : past_len + k] = layer.keys.index_select(2, src)
            layer.values[:, :, past_len : past_len + k] = layer.values.index_select(2, src)
    cache.set_length(past_len + k)
