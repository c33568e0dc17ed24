"""Batch > 1 target runner: B rows with their OWN committed lengths in one preallocated KV cache.

    runner = BatchRunner(model, hidden_layers=(2, 4, 6), max_length=S_max)
    logits, hidden = runner.prefill([ids_0, ids_1, ...])   # ids_b [T_b] -> [B, V], [{l: [T_b, H]}] per row
    logits, hidden = runner.verify(tokens, parents)        # [B, N] each -> [B, N, V], {l: [B, N, H]}
    runner.commit(paths)                                   # per row: accepted node indices [K_b]
    runner.keep(rows)                                      # drop finished rows (the others go on untouched)

Layout: `BatchSlotCache` keeps keys/values [B, kv, S_max, D] per layer and `lengths` [B]. Row b's
committed entries sit at slots [0, len_b). A verify pass writes row b's N tree entries at slots
[len_b, len_b + N) (one scatter per layer) and attends through an additive float mask [B, 1, N, S]
(S = max_b len_b + N) that, for row b, opens slots < len_b plus the node's own ancestors in its tree
and blocks everything else (other rows' longer prefixes, stale scratch). Position ids = len_b + depth.
Trees of different sizes are padded to the batch's max N with dummy children of the root that no real
node attends to. Prefill runs rows of similar prompt lengths together (`length_groups`; right padding,
which causality hides from the real tokens) and copies each row's K/V into its slots. The static
layout only: the dynamic back-end stays batch 1.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from spechead.heads.base import resolve_layers
from spechead.heads.grad import inference_mode
from spechead.inference.devices import host_to_device
from spechead.inference.kv_cache import LayerBuffer, croppable_cache, new_generation
from spechead.inference.runner import _Capture, check_tree_attention
from spechead.inference.sliding import layer_masks, sliding_layout, slot_positions
from spechead.inference.tree import tree_inputs_after

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class BatchSlotLayer(CacheLayerMixin):
    """One layer's preallocated keys/values [B, kv, S_max, D]; writes go to the slots the cache names."""

    is_compileable = False
    is_sliding = False
    keys: Tensor  # None until lazy_initialization allocates it (read once is_initialized)
    values: Tensor

    def __init__(self, owner: BatchSlotCache, index: int) -> None:
        super().__init__()
        self.owner, self.index = owner, index

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        batch, heads, _, k_dim = key_states.shape
        owner = self.owner
        shared = None
        if not owner.static_shapes:  # (fixed shapes: buffers of its own, at fixed addresses)
            shared = owner.buffer.views(self.index, key_states, value_states, owner.batch, owner.max_length)
        if shared is not None:
            self.keys, self.values = shared  # views of the owner's [L, 2, B, kv, S_max, D]
        else:
            shape = (owner.batch, heads, owner.max_length)
            self.keys = key_states.new_zeros(*shape, k_dim)  # [B, kv, S_max, D]
            self.values = value_states.new_zeros(*shape, value_states.shape[-1])  # [B, kv, S_max, Dv]
        self.is_initialized = True
        owner.generation = new_generation()  # graphs that read the old buffers must not replay
        if owner.static_shapes:
            if owner.lengths_t is None or owner.lengths_t.device != key_states.device:
                owner.lengths_t = torch.zeros(owner.batch, dtype=torch.long, device=key_states.device)
            if not torch.compiler.is_compiling():  # fixed addresses: CUDA graphs may replay over them
                for buffer in (self.keys, self.values, owner.lengths_t):
                    torch._dynamo.mark_static_address(buffer)

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs):
        """Scatter key/value states [B, kv, N, D] to slots [B, N]; return views [B, kv, S, D]."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, h, n, d = key_states.shape
        owner = self.owner
        if owner.static_shapes:  # row b writes after its device-side length; the mask hides the rest
            assert owner.lengths_t is not None  # lazy_initialization made it
            offset = owner.write_offset  # (a draft's speculative slots so far)
            slots = owner.lengths_t[:, None] + torch.arange(
                offset, offset + n, device=key_states.device
            )  # [B, N]
            view = owner.max_length
        else:
            assert owner.write_slots is not None  # the runner sets the write slots before every forward
            slots, view = owner.write_slots, owner.view_length  # [B, N], S
        self.keys.scatter_(2, slots[:, None, :, None].expand(b, h, n, d), key_states)
        dv = value_states.shape[-1]
        self.values.scatter_(2, slots[:, None, :, None].expand(b, h, n, dv), value_states)
        return self.keys[:, :, :view], self.values[:, :, :view]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return (self.owner.max_length if self.owner.static_shapes else self.owner.view_length), 0

    def get_seq_length(self) -> int:
        return int(self.owner.view_length)

    def get_max_length(self) -> int:
        return self.owner.max_length

    def reset(self) -> None:
        pass


class BatchSlotCache(Cache):
    """Preallocated KV cache for B rows of different committed lengths (see the module doc)."""

    def __init__(self, num_layers: int, batch: int, max_length: int, static_shapes: bool = False) -> None:
        if max_length < 1 or batch < 1:
            raise ValueError(f"need batch >= 1 and max_length >= 1, got {batch}, {max_length}")
        self.batch, self.max_length = batch, max_length
        # static_shapes (batch_graphs.py): writes after the device lengths, attention over all slots
        self.static_shapes = static_shapes
        self.lengths_t: Tensor | None = None  # static_shapes: [B] committed lengths on the device
        self.write_offset = 0  # static_shapes: the next forward writes at lengths_t + offset + 0..N-1
        self.generation = new_generation()  # a new number at every buffer allocation (cuda_graphs.py)
        self.write_slots: Tensor | None = None  # [B, N] where the next forward writes
        self.view_length = 0  # S: slots the next forward attends over
        super().__init__(layers=[BatchSlotLayer(self, i) for i in range(num_layers)])
        # every layer's keys and values as views of one buffer when they share a shape: a commit then
        # moves the accepted entries of all layers with one gather and one scatter (not 4 ops per layer)
        self.buffer = LayerBuffer(num_layers)

    def shared_storage(self) -> Tensor | None:
        """The one buffer [L, 2, B, kv, S_max, D] when every layer's buffers are views of it, else None."""
        return self.buffer.whole()

    def _rebind(self, storage: Tensor) -> None:
        """Point every layer at `storage` (a reshaped copy of the shared one: rows kept)."""
        self.buffer.storage = storage
        for i, layer in enumerate(self.slot_layers):
            layer.keys, layer.values = storage[i, 0], storage[i, 1]

    @property
    def slot_layers(self) -> list[BatchSlotLayer]:
        """`layers`, as built in __init__ (all BatchSlotLayers)."""
        return cast("list[BatchSlotLayer]", self.layers)

    def keep_rows(self, rows: Sequence[int], used: int | None = None) -> None:
        """Keep only rows [B'] of every layer, in this order. Finished rows dropped (the kept ones in
        ascending order): in place, each moved row's first `used` slots (None: all; past the committed
        lengths only scratch) copied up to its new place, no second buffer (a KV cache can hold most of a
        device's memory); another order: one gather."""
        rows = list(rows)
        self.batch, end = len(rows), self.max_length if used is None else used
        shared = self.shared_storage()
        if rows == sorted(set(rows)):  # rows[j] >= j: row j is written after it was read, never before
            moves = [(j, i) for j, i in enumerate(rows) if i != j]
            if shared is not None:  # every layer at once, along its batch dim (2)
                for j, i in moves:
                    shared[:, :, j, :, :end].copy_(shared[:, :, i, :, :end])
                self._rebind(shared[:, :, : len(rows)])
                return
            self.buffer.reset()  # (the layers' buffers are views of their first B' rows now)
            for layer in self.slot_layers:
                if layer.is_initialized:
                    for j, i in moves:
                        layer.keys[j, :, :end].copy_(layer.keys[i, :, :end])
                        layer.values[j, :, :end].copy_(layer.values[i, :, :end])
                    layer.keys, layer.values = layer.keys[: len(rows)], layer.values[: len(rows)]
            return
        index = torch.tensor(rows, dtype=torch.long)
        if shared is not None:  # one gather for every layer
            self._rebind(shared.index_select(2, host_to_device(index, shared.device)))
            return
        self.buffer.reset()
        for layer in self.slot_layers:
            if layer.is_initialized:
                idx = host_to_device(index, layer.keys.device)  # (no wait)
                layer.keys, layer.values = layer.keys.index_select(0, idx), layer.values.index_select(0, idx)

    def write_rows(self, rows: Tensor, states: Iterable[tuple[Tensor, Tensor]]) -> None:
        """Copy each layer's keys and values [G, kv, T, D] (another cache's G rows, in layer order) into
        rows [G] (long, on the buffers' device), slots 0..T-1; layers get their buffers on first use."""
        for layer, (keys, values) in zip(self.slot_layers, states):
            if not layer.is_initialized:
                layer.lazy_initialization(keys, values)
            layer.keys[rows, :, : keys.shape[2]] = keys
            layer.values[rows, :, : values.shape[2]] = values

    def grow(self, max_length: int) -> None:
        """Reallocate every layer to `max_length` slots, keeping the old ones (rare: amortised doubling)."""
        old, self.max_length = self.max_length, max_length
        self.buffer.reset()  # the first layer to re-bind makes it at the new size
        for layer in self.slot_layers:
            if layer.is_initialized:
                keys, values = layer.keys, layer.values
                layer.lazy_initialization(keys, values)
                layer.keys[:, :, :old], layer.values[:, :, :old] = keys, values


def length_groups(lengths: Sequence[int], waste: float = 0.25, most: int = 8) -> list[list[int]]:
    """Rows 0..B-1 of these prompt lengths in groups to prefill together: by length, longest first, a
    row joining the current group while its padded size (rows x the group's longest) stays within
    1 + waste of its real tokens (mixed lengths do not pay for the longest prompt B times) and the
    group has fewer than `most` rows (a group's logits are kept at every row's last position: rows x
    distinct lengths x V)."""
    groups: list[list[int]] = []
    real = 0  # the current group's real tokens
    for b in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if groups and len(groups[-1]) < most:
            padded = (len(groups[-1]) + 1) * lengths[groups[-1][0]]  # its rows x its longest, with b
            if padded <= (1 + waste) * (real + lengths[b]):
                groups[-1].append(b)
                real += lengths[b]
                continue
        groups.append([b])
        real = lengths[b]
    return groups


class BatchRunner:
    """Prefill, verify and commit B rows at once on the target (static slots; see the module doc)."""

    def __init__(self, model: PreTrainedModel, hidden_layers: Sequence[int] = (), *, max_length: int) -> None:
        check_tree_attention(model)
        self.model = model
        self.sliding = sliding_layout(model)  # sliding-window layers: windowed masks (sliding.py)
        param = next(model.parameters())
        self.device = param.device
        self.dtype = param.dtype if param.dtype.is_floating_point else torch.float32
        self.num_layers = model.config.get_text_config().num_hidden_layers
        self.max_length = max_length
        self._capture = _Capture.of(model)
        canon = resolve_layers(list(hidden_layers), self._capture.num_layers) if hidden_layers else []
        self._capture.want(canon)
        self.layers = dict(zip(tuple(hidden_layers), canon))
        self.cache: BatchSlotCache | None = None
        self.lengths = torch.zeros(0, dtype=torch.long)  # [B] committed positions per row (host)
        self.last_ancestors: Tensor | None = None  # [B, N, N] of the last verify (for acceptance)

    def _forward(self, cache: Cache, **kwargs) -> tuple[Tensor, dict[int, Tensor]]:
        store = self._capture.store
        store.clear()
        self._capture.active = True
        try:
            out = self.model(cache=cache, use_cache=True, **kwargs)
        finally:
            self._capture.active = False
        hidden = {req: store[c] for req, c in self.layers.items()}  # [B, T, H] each
        store.clear()
        return out.logits, hidden

    def check_prompts(self, prompts: Sequence[Tensor]) -> None:
        """ValueError naming the first row whose prompt is not a non-empty 1-D id tensor that fits."""
        for b, ids in enumerate(prompts):
            if ids.dim() != 1 or ids.numel() == 0:
                raise ValueError(f"row {b}: prompt must be a non-empty 1-D id tensor, got {tuple(ids.shape)}")
            if ids.numel() > self.max_length:
                raise ValueError(f"row {b}: prompt of {ids.numel()} tokens > KV cache of {self.max_length}")

    def _prefill_rows(
        self, prompts: Sequence[Tensor], cache: BatchSlotCache
    ) -> tuple[Tensor, list[dict[int, Tensor]]]:
        """Run the prompts ids_b [T_b] (eager, any length) in groups of similar lengths (`length_groups`),
        each group ONE forward right-padded to its longest prompt, and copy each row's K/V into its first
        slots of `cache`: logits [B, V] (fp32, last positions) and [{l: [T_b, H]}].

        No mask: the causal default of a prefill (as at batch 1). The padding sits after every real
        token, so causality alone hides it from them; its entries land in slots past T_b (scratch)."""
        all_logits: list[Tensor] = [torch.empty(0)] * len(prompts)
        hiddens: list[dict[int, Tensor]] = [{} for _ in prompts]
        for group in length_groups([p.numel() for p in prompts]):
            sizes = [prompts[b].numel() for b in group]
            ids = torch.zeros(len(group), max(sizes), dtype=torch.long)  # [G, T] right-padded
            for row, b in enumerate(group):
                ids[row, : sizes[row]] = prompts[b]
            # the logits at the rows' last positions only (a 1-D `logits_to_keep`: every model reads it
            # as positions kept for every row), [G, P, V] for the P distinct ones
            last = sorted({n - 1 for n in sizes})
            group_cache = croppable_cache(self.model)
            logits, hidden = self._forward(
                group_cache,
                input_ids=ids.to(self.device),
                logits_to_keep=host_to_device(torch.tensor(last), self.device),
            )
            for row, b in enumerate(group):
                all_logits[b] = logits[row, last.index(sizes[row] - 1)].float()  # [V]
                hiddens[b] = {k: v[row, : sizes[row]] for k, v in hidden.items()}  # {l: [T_b, H]}
            rows = host_to_device(torch.tensor(group), self.device)  # [G] the group's rows in `cache`
            filled = []
            for layer in group_cache.layers:
                done = cast(DynamicLayer, layer)  # a dense decoder's DynamicCache
                assert done.keys is not None and done.values is not None  # the group's forward filled it
                filled.append((done.keys, done.values))
            cache.write_rows(rows, filled)  # (slots past a row's T_b: its padding's entries, scratch)
        return torch.stack(all_logits), hiddens

    def room(self) -> int:
        """Tree nodes every active row can still take (the padded N must fit after the longest row)."""
        return self.max_length - int(self.lengths.max())

    queues_commits = False  # (eager: no fixed-shape commit to queue)

    @torch.inference_mode()
    def prefill(self, prompts: Sequence[Tensor]) -> tuple[Tensor, list[dict[int, Tensor]]]:
        """Prefill prompts ids_b [T_b] (in length groups, `_prefill_rows`): logits [B, V] (fp32, last
        positions), [{l: [T_b, H]}]."""
        self.check_prompts(prompts)
        self.cache = BatchSlotCache(self.num_layers, len(prompts), self.max_length)
        logits, hiddens = self._prefill_rows(prompts, self.cache)  # [B, V]
        self.lengths = torch.tensor([p.numel() for p in prompts], dtype=torch.long)
        return logits, hiddens

    @inference_mode
    def verify(self, tokens: Tensor, parents: Tensor) -> tuple[Tensor, dict[int, Tensor]]:
        """ONE target forward over trees tokens [B, N] / parents [B, N] (row b on top of its own prefix).

        Returns logits [B, N, V] (fp32) and {l: [B, N, H]}. Padded nodes must be children of earlier
        nodes that no real node descends from; their outputs are garbage and ignored.
        """
        if self.cache is None:
            raise RuntimeError("verify before prefill")
        batch, n = tokens.shape
        if parents.shape != tokens.shape or batch != self.lengths.numel():
            raise ValueError(
                f"tokens and parents must be [B={self.lengths.numel()}, N], got "
                f"{tuple(tokens.shape)}, {tuple(parents.shape)}"
            )
        if n > self.room():
            raise ValueError(f"a tree of {n} nodes does not fit: {self.room()} KV slots left")
        dev = self.device
        tokens, parents = host_to_device(tokens, dev), host_to_device(parents, dev)  # (no wait for the GPU)
        lengths = host_to_device(self.lengths, dev)  # [B]
        view = int(self.lengths.max()) + n  # S
        if n == 1:  # plain step: row b sees its prefix and its own new slot (few ops: the common case)
            return self._step(tokens, lengths, view)
        # the mask over the S = view columns every row needs: [B, 1, N, S]; positions [B, N]
        mask, positions, self.last_ancestors = tree_inputs_after(parents, lengths, view, self.dtype)
        slots = lengths[:, None] + torch.arange(n, device=dev)  # [B, N] where the nodes' entries go
        self.cache.write_slots, self.cache.view_length = slots, view
        keys = slot_positions(lengths, positions, view) if self.sliding else positions  # [B, S]
        masks = layer_masks(self.sliding, mask, positions, keys)
        logits, hidden = self._forward(
            self.cache, input_ids=tokens, attention_mask=masks, position_ids=positions
        )
        return logits.float(), hidden  # [B, N, V]

    def _step(self, tokens: Tensor, lengths: Tensor, view: int) -> tuple[Tensor, dict[int, Tensor]]:
        """`verify` of one token per row (tokens [B, 1]): a causal step at slot length_b."""
        batch = tokens.shape[0]
        self.last_ancestors = torch.ones(batch, 1, 1, dtype=torch.bool, device=tokens.device)
        cols = torch.arange(view, device=tokens.device)  # [S]
        blocked = torch.finfo(self.dtype).min
        mask = torch.where(cols[None, :] <= lengths[:, None], 0.0, blocked).to(self.dtype)  # [B, S]
        cache = self.cache
        assert cache is not None  # verify checked it
        cache.write_slots, cache.view_length = lengths[:, None], view
        # row b's query at position length_b; slot j holds position j (its own new slot: length_b)
        masks = layer_masks(self.sliding, mask[:, None, None, :], lengths[:, None], cols)
        logits, hidden = self._forward(
            cache, input_ids=tokens, attention_mask=masks, position_ids=lengths[:, None]
        )
        return logits.float(), hidden  # [B, 1, V]

    @inference_mode
    def commit(self, paths: Sequence[Tensor | Sequence[int]]) -> None:
        """Row b keeps the accepted nodes paths[b] [K_b] (ascending, paths[b][0] = 0) after its prefix."""
        if len(paths) != self.lengths.numel():
            raise ValueError(f"need one path per row ({self.lengths.numel()}), got {len(paths)}")
        if all(isinstance(p, list) and p == list(range(len(p))) for p in paths):  # already in place
            self.lengths = self.lengths + torch.tensor([len(p) for p in paths], dtype=torch.long)
            return
        nodes = [torch.as_tensor(p, dtype=torch.long) for p in paths]
        ks = torch.tensor([p.numel() for p in nodes], dtype=torch.long)  # [B]
        kmax = int(ks.max())
        # pad each path by repeating its last node: duplicate writes of the same value are harmless
        src = torch.stack([torch.cat([p, p[-1:].expand(kmax - p.numel())]) for p in nodes])  # [B, Kmax]
        dst = torch.minimum(torch.arange(kmax)[None, :], ks[:, None] - 1)  # [B, Kmax]
        src, dst = src + self.lengths[:, None], dst + self.lengths[:, None]
        if not torch.equal(src, dst):  # some row's path is not already in place
            src, dst = host_to_device(src, self.device), host_to_device(dst, self.device)
            assert self.cache is not None  # rows (paths) exist only after prefill
            shared = self.cache.shared_storage()  # [L, 2, B, kv, S_max, D]
            if shared is not None:  # every layer at once
                n_layers, _, b, h, _, d = shared.shape
                s_idx = src[None, None, :, None, :, None].expand(n_layers, 2, b, h, kmax, d)
                d_idx = dst[None, None, :, None, :, None].expand(n_layers, 2, b, h, kmax, d)
                shared.scatter_(4, d_idx, shared.gather(4, s_idx))  # gather copies first: overlap is fine
                self.lengths = self.lengths + ks
                return
            for layer in self.cache.slot_layers:
                for buf in (layer.keys, layer.values):
                    b, h, _, d = buf.shape
                    s_idx = src[:, None, :, None].expand(b, h, kmax, d)  # [B, kv, Kmax, D]
                    d_idx = dst[:, None, :, None].expand(b, h, kmax, d)
                    buf.scatter_(2, d_idx, buf.gather(2, s_idx))  # gather copies first: overlap is fine
        self.lengths = self.lengths + ks

    @inference_mode
    def keep(self, rows: Sequence[int]) -> None:
        """Keep only these rows (in this order), e.g. drop the finished ones."""
        rows = list(rows)
        if rows == list(range(self.lengths.numel())):
            return
        self.lengths = self.lengths[torch.tensor(rows, dtype=torch.long)]
        assert self.cache is not None  # rows exist only after prefill
        self.cache.keep_rows(rows, int(self.lengths.max()))  # (their committed entries: all that matters)
