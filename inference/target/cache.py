"""The preallocated KV cache of B rows, each with its own committed length: the target runner's cache and
the EAGLE heads' own (B = 1 is a batch of one, not another class).

    cache = RowCache(num_layers, batch=B, max_length=S_max)   # buffers [B, kv, S_max, D] per layer

Row b's committed entries sit at slots [0, lengths[b]); later slots are scratch. A layer's `update` writes
a forward's n new entries one of three ways:
- in a row (`write_slots` None): at slots length.. of the layer's own cursor, one slice copy, the views
  ending there (a batch of one's passes: no scatter, and a causal step needs no mask);
- scattered (`write_slots` [B, n], set by the caller): row b at its own slots, the views `view_length`
  slots long, the caller's mask hiding what a row must not see;
- static_shapes (compiled graphs): row b at lengths_t[b] + write_offset + 0..n-1 (device lengths [B]),
  the views the whole buffers, so one graph serves every length.

Without static_shapes, layers of one shape are views of ONE buffer [L, 2, B, kv, S_max, D] (`LayerBuffer`):
a commit or a row drop moves every layer with one op (each op costs on a CPU).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import cast

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from spechead.inference.devices import host_to_device

# every allocation of a cache's buffers gets a new number (`RowCache.generation`): a CUDA graph that read
# the old buffers must not replay over the new ones (cuda_graphs.py)
_ALLOCATIONS = itertools.count(1)


class LayerBuffer:
    """One buffer `storage` [L, 2, B, kv, S_max, D] whose slices are every layer's keys and values when all
    L layers share one shape (layers of another shape keep their own)."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.storage: Tensor | None = None  # [L, 2, B, kv, S_max, D]
        self.bound: set[int] = set()  # layers whose buffers are views of `storage`

    def views(
        self, index: int, key_states: Tensor, value_states: Tensor, batch: int, max_length: int
    ) -> tuple[Tensor, Tensor] | None:
        """Layer `index`'s keys and values [B, kv, S_max, D] as views of `storage` (made for these states);
        None (buffers of its own) when keys and values differ, or layers of another shape hold it."""
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

    def whole(self) -> Tensor | None:
        """`storage` when every layer's keys and values are views of it, else None."""
        return self.storage if len(self.bound) == self.num_layers else None


class RowLayer(CacheLayerMixin):
    """One layer's preallocated keys/values [B, kv, S_max, D], written as its `RowCache` says (module doc)."""

    is_compileable = True
    is_sliding = False
    keys: Tensor  # None until lazy_initialization allocates it (read once is_initialized)
    values: Tensor

    def __init__(self, owner: RowCache, index: int) -> None:
        super().__init__()
        self.owner, self.index = owner, index
        self.length = 0  # written in a row: the slot the next write starts at (moves as it writes)

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        owner = self.owner
        shared = None
        if not owner.static_shapes:  # (fixed shapes: buffers of its own, at fixed addresses)
            shared = owner.buffer.views(self.index, key_states, value_states, owner.batch, owner.max_length)
        if shared is not None:
            self.keys, self.values = shared  # views of the owner's [L, 2, B, kv, S_max, D]
        else:
            shape = (owner.batch, key_states.shape[1], owner.max_length)
            self.keys = key_states.new_zeros(*shape, key_states.shape[-1])  # [B, kv, S_max, D]
            self.values = value_states.new_zeros(*shape, value_states.shape[-1])  # [B, kv, S_max, Dv]
        self.is_initialized = True
        owner.generation = next(_ALLOCATIONS)  # graphs that read the old buffers must not replay
        if owner.static_shapes:
            if owner.lengths_t is None:  # (a graph's owner may have made it ahead: its address)
                owner.lengths_t = torch.tensor(owner.lengths, dtype=torch.long, device=key_states.device)
            if not torch.compiler.is_compiling():  # fixed addresses: CUDA graphs may replay over them
                for buffer in (self.keys, self.values, owner.lengths_t):
                    torch._dynamo.mark_static_address(buffer)

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Write key/value states [B, kv, n, D] (see the module doc) and return the views to attend over."""
        owner = self.owner
        if owner.write_slots is None and not owner.static_shapes and self.is_initialized:
            # in a row (a batch of one's every pass: the fewest ops first): slots length.., a slice copy
            start, n = self.length, key_states.shape[-2]
            end = start + n
            if end > owner.max_length:
                raise ValueError(
                    f"preallocated KV cache full: {start} + {n} positions > max_length {owner.max_length}"
                )
            self.keys[:, :, start:end].copy_(key_states)
            self.values[:, :, start:end].copy_(value_states)
            self.length = end
            return self.keys[:, :, :end], self.values[:, :, :end]  # [B, kv, end, D]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            return self.update(key_states, value_states)
        b, h, n, d = key_states.shape
        if b != owner.batch:
            raise ValueError(f"a cache of {owner.batch} rows got states of {b} rows")
        slots = owner.write_slots  # [B, n] each row at its own slots
        if owner.static_shapes:  # row b after its device-side length; the mask hides the rest
            lengths = cast(Tensor, owner.lengths_t)  # [B] (made by lazy_initialization)
            offset = owner.write_offset  # (a draft's speculative slots so far)
            slots = lengths[:, None] + torch.arange(offset, offset + n, device=key_states.device)  # [B, n]
        assert slots is not None  # (in a row: above)
        self.keys.scatter_(2, slots[:, None, :, None].expand(b, h, n, d), key_states)
        self.values.scatter_(2, slots[:, None, :, None].expand(b, h, n, value_states.shape[-1]), value_states)
        if owner.static_shapes:
            return self.keys, self.values  # [B, kv, S_max, D]
        view = owner.view_length
        return self.keys[:, :, :view], self.values[:, :, :view]  # [B, kv, S, D]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        owner = self.owner
        if owner.static_shapes:
            return owner.max_length, 0
        return (self.length + query_length if owner.write_slots is None else owner.view_length), 0

    def get_seq_length(self) -> int:
        return self.length if self.owner.write_slots is None else self.owner.view_length

    def get_max_length(self) -> int:
        return self.owner.max_length

    def reset(self) -> None:
        self.owner.set_length(0)


class RowCache(Cache):
    """Preallocated KV cache for B rows of their own committed lengths `lengths` (see the module doc)."""

    def __init__(self, num_layers: int, batch: int, max_length: int, static_shapes: bool = False) -> None:
        if max_length < 1 or batch < 1:
            raise ValueError(f"need batch >= 1 and max_length >= 1, got {batch}, {max_length}")
        self.batch, self.max_length = batch, max_length
        self.static_shapes = static_shapes
        self.lengths = [0] * batch  # committed positions per row (host)
        self.write_slots: Tensor | None = None  # [B, n] where the next forward writes (None: in a row)
        self.view_length = 0  # S: slots a scattered forward attends over
        self.write_offset = 0  # static_shapes: the next forward writes at lengths_t + offset + 0..n-1
        self.generation = next(_ALLOCATIONS)  # a new number at every buffer allocation (cuda_graphs.py)
        # static_shapes: the committed lengths [B] on the device, made by a layer's first write (shared by
        # the layers: moving them is one kernel; kept for the cache's life, so graphs may bake them in)
        self.lengths_t: Tensor | None = None
        layers = [RowLayer(self, i) for i in range(num_layers)]
        super().__init__(layers=cast(list, layers))  # (the same list object: HF keeps it)
        self.row_layers: list[RowLayer] = layers  # `layers`, typed (read several times a pass)
        self.buffer = LayerBuffer(num_layers)

    # ---- lengths -------------------------------------------------------------------------------

    def set_length(self, length: int) -> None:
        """Every row holds `length` committed entries (later slots become scratch)."""
        if not 0 <= length <= self.max_length:
            raise ValueError(f"length must be in [0, {self.max_length}], got {length}")
        self.set_lengths([length] * self.batch)

    def set_lengths(self, lengths: Sequence[int]) -> None:
        """Row b holds lengths[b] committed entries (the device copies follow: one copy, no wait)."""
        self.lengths = list(lengths)
        for layer in self.row_layers:  # (in a row: only a batch of one writes that way)
            layer.length = self.lengths[0]
        if self.lengths_t is not None:
            self.lengths_t.copy_(host_to_device(torch.tensor(self.lengths), self.lengths_t.device))

    # ---- storage -------------------------------------------------------------------------------

    def buffers(self) -> list[Tensor]:
        """Every allocated layer's keys and values: the one shared buffer [L, 2, B, kv, S_max, D] (one op
        moves them all), else each layer's [B, kv, S_max, D]."""
        shared = self.buffer.whole()
        if shared is not None:
            return [shared]
        return [b for x in self.row_layers if x.is_initialized for b in (x.keys, x.values)]

    def keep_rows(self, rows: Sequence[int], used: int | None = None, capacity: int | None = None) -> None:
        """Keep only rows [B'] of every layer, in this order (their lengths too). Ascending: in place, each
        moved row's first `used` slots (None: all) copied up, no second buffer (a KV cache can hold most of
        a device's memory); another order: one gather. capacity: the buffers keep this many rows (>= B': a
        compiled graph's shape), the rows past B' idle at length 0."""
        rows = list(rows)
        size = len(rows) if capacity is None else capacity
        self.batch, end = size, self.max_length if used is None else used
        if size:
            self.set_lengths([self.lengths[i] for i in rows] + [0] * (size - len(rows)))
        shared = self.buffer.whole()
        pick: slice | Tensor = slice(0, size)  # the kept rows' views after an in-place move, else a gather
        if rows == sorted(set(rows)):  # ascending: row j is read (rows[j] >= j) before it is written
            for buffer in self.buffers():
                by_row = buffer.movedim(-4, 0)  # [B, ..., S_max, D]
                for j, i in enumerate(rows):
                    if i != j:
                        by_row[j, ..., :end, :].copy_(by_row[i, ..., :end, :])
        else:
            pick = torch.tensor(rows + [0] * (size - len(rows)), dtype=torch.long)  # (idle: row 0's copy)
            self.generation = next(_ALLOCATIONS)  # (a gather: new buffers; graphs of the old must not replay)
        if shared is not None:  # every layer at once
            storage = self.buffer.storage = shared[:, :, _on(pick, shared.device)]
            for i, layer in enumerate(self.row_layers):
                layer.keys, layer.values = storage[i, 0], storage[i, 1]
            return
        self.buffer = LayerBuffer(len(self.row_layers))  # (the layers' buffers are their own now)
        for layer in self.row_layers:
            if layer.is_initialized:
                at = _on(pick, layer.keys.device)
                layer.keys, layer.values = layer.keys[at], layer.values[at]

    def write_rows(self, rows: Tensor, states: Iterable[tuple[Tensor, Tensor]]) -> None:
        """Copy each layer's keys and values [G, kv, T, D] (another cache's G rows, in layer order) into
        rows [G] (long, on the buffers' device), slots 0..T-1; layers get their buffers on first use."""
        for layer, (keys, values) in zip(self.row_layers, states):
            if not layer.is_initialized:
                layer.lazy_initialization(keys, values)
            layer.keys[rows, :, : keys.shape[2]] = keys
            layer.values[rows, :, : values.shape[2]] = values

    def grow(self, need: int, step: int = 1) -> None:
        """Room for `need` slots: when short, every layer reallocated (its entries kept) to at least twice
        its slots, a multiple of `step` (rare: amortised doubling)."""
        if need <= self.max_length:
            return
        old, self.max_length = self.max_length, -(-max(need, 2 * self.max_length) // step) * step
        self.buffer = LayerBuffer(len(self.row_layers))  # the first layer to re-bind: at the new size
        for layer in self.row_layers:
            if layer.is_initialized:
                keys, values = layer.keys, layer.values
                layer.lazy_initialization(keys, values)
                layer.keys[:, :, :old], layer.values[:, :, :old] = keys, values


def _on(pick: slice | Tensor, device: torch.device) -> slice | Tensor:
    return pick if isinstance(pick, slice) else host_to_device(pick, device)  # (no wait)
