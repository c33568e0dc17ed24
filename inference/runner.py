"""The target runner: the one place that owns the target's KV cache and hidden-state capture.

    runner = TargetRunner(model, hidden_layers=(2, 4, 6), cache="static")
    logits, hidden = runner.prefill(ids)                  # ids [B, T] -> [B, V] (last position), {l: [B, T, H]}
    logits, hidden = runner.verify(tokens, parents)       # [B, N] each -> [B, N, V], {l: [B, N, H]}
    runner.commit(path)                                   # accepted node indices [K] (ascending, path[0] = 0)

Back-ends: "dynamic" (transformers `DynamicCache`, any HF causal LM; commit = index_select + cat) and
"static" (`SlotCache`: preallocated [B, kv, S_max, D] buffers; verify writes the N tree entries at
slots past_len.., commit copies the accepted path's entries into place; no concatenation, no
reallocation). Tree masks and positions are built on the device from `parents` (`tree_inputs_on_device`),
optionally padded to fixed tree-size `buckets` (for captured graphs; pure waste on a CPU, so off there).
Capture hooks are installed once per model and only record while the runner runs a forward.

compile: the static back-end with fixed shapes (`SlotCache(static_shapes=True)`: writes at a device-side
length, attention over the whole buffer behind a [B, 1, N, S_max] mask) and the target's forward under
`torch.compile(dynamic=False)`, one graph per tree-size bucket; on CUDA each bucket's call then captured
as a CUDA graph of our own (cuda_graphs.py). The prefill stays eager (its length varies).

Batch: the API carries B; this version runs B = 1 (ValueError otherwise). prefill, verify and commit run
in inference mode (`heads.grad.inference_mode`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from transformers import DynamicCache

from spechead.heads.base import resolve_layers
from spechead.heads.capture import final_norm
from spechead.heads.grad import inference_mode, version
from spechead.heads.hybrid import check_attention_only
from spechead.inference.compiling import compile_function
from spechead.inference.devices import host_ids, host_to_device
from spechead.inference.kv_cache import SlotCache, commit_path, croppable_cache
from spechead.inference.positions import PositionIds
from spechead.inference.sliding import layer_masks, sliding_layout, slot_positions
from spechead.inference.tree import ancestors_on_device, causal_inputs_static, tree_inputs_after, tree_mask

if TYPE_CHECKING:
    from transformers import PreTrainedModel

CACHES = ("dynamic", "static")
CUDA_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class _Capture:
    """Forward hooks on a model's decoder, installed once; record {canonical index: [B, T, H]} when active."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.decoder = model.get_decoder()
        self.num_layers = len(self.decoder.layers)
        self.wanted: set[int] = set()
        self.store: dict[int, Tensor] = {}
        self.active = False

    def want(self, canonical: Sequence[int]) -> None:
        """Install hooks for canonical indices not hooked yet (0 = embeddings, L = after the final norm)."""
        layers = self.decoder.layers
        for c in sorted(set(canonical) - self.wanted):
            if c == 0:
                layers[0].register_forward_pre_hook(self._save_input, with_kwargs=True)
            elif c == self.num_layers:
                final_norm(self.decoder).register_forward_hook(self._saver(c))
            else:
                layers[c - 1].register_forward_hook(self._saver(c))
            self.wanted.add(c)

    def _saver(self, c: int):
        def hook(_module, _args, output):
            if self.active:
                self.store[c] = output[0] if isinstance(output, (tuple, list)) else output

        return hook

    def _save_input(self, _module, args, kwargs):
        if self.active:
            self.store[0] = args[0] if args else kwargs["hidden_states"]

    @classmethod
    def of(cls, model: PreTrainedModel) -> _Capture:
        """The model's capture (created on first use and kept on the model)."""
        capture = model.__dict__.get("_spechead_capture")
        if capture is None:
            capture = cls(model)
            model.__dict__["_spechead_capture"] = capture
        return capture


def check_tree_attention(model: PreTrainedModel) -> None:
    """ValueError when the target cannot take tree passes: attention that takes no arbitrary 4D (tree)
    masks, or layers with recurrent state (Mamba, linear attention: heads/hybrid.py)."""
    impl = getattr(model.config, "_attn_implementation", None) or ""
    if "flash" in impl:
        raise ValueError(
            f"tree verification needs arbitrary 4D masks; attn_implementation {impl!r} cannot take them "
            "(load the target with attn_implementation='spechead_sdpa', 'sdpa' or 'eager')"
        )
    check_attention_only(model.config, "speculative decoding")


class TargetRunner:
    """Prefill, verify token trees and commit accepted paths on one target (see the module doc)."""

    def __init__(
        self,
        model: PreTrainedModel,
        hidden_layers: Sequence[int] = (),
        *,
        cache: str = "dynamic",
        max_length: int | None = None,
        buckets: Sequence[int] | None = None,
        compile: bool | str = False,
    ) -> None:
        if cache not in CACHES:
            raise ValueError(f"cache must be one of {CACHES}, got {cache!r}")
        if compile and cache != "static":
            raise ValueError(f"compile=True needs cache='static' (fixed shapes), got cache={cache!r}")
        check_tree_attention(model)
        self.model = model
        self.sliding = sliding_layout(model)  # sliding-window layers: windowed masks (sliding.py)
        self.kind = cache
        self.fixed_length = max_length  # None: sized by `reserve` for each sequence
        self.static_shapes = bool(compile)
        cuda = next(model.parameters()).device.type == "cuda"
        # (CUDA graphs read the cache's buffers and the captured layers: their graph state)
        self._compiled = (
            compile_function(self._graph_forward, compile, cuda, state=self._graph_state) if compile else None
        )
        # compiled: the accepted path's K/V copies in every layer as one graph (paths padded to a power of 2)
        self._compiled_commit = (
            compile_function(self._commit_graph, compile, cuda, state=self._graph_state) if compile else None
        )
        # compiled: every tree is padded to a bucket, so a handful of graphs serve every size
        self.buckets = tuple(sorted(buckets or (CUDA_BUCKETS if compile else ())))
        param = next(model.parameters())
        self.device = param.device
        self.dtype = param.dtype if param.dtype.is_floating_point else torch.float32
        self.num_layers = model.config.get_text_config().num_hidden_layers
        self._capture = _Capture.of(model)
        self.layers: dict[int, int] = {}  # requested HF index -> canonical index
        self.use_layers(hidden_layers)
        self.cache: DynamicCache | SlotCache | None = None
        self.length = 0  # committed positions (past_len)
        self.last_ancestors: Tensor | None = None  # [B, N, N] of the last verify
        self.last_parents: Tensor | None = None  # [B, N] of the last verify, on the device (eager step: None)
        self._zeros: Tensor | None = None  # [1, 1, 1, S] additive zeros: the plain step's mask
        self._positions = PositionIds()  # the plain step's position [1, 1]: a view, not a new tensor
        self._single: Tensor | None = None  # the plain step's ancestors [1, 1, 1] (all True)
        self._graph_ancestors: Tensor | None = None  # compiled: the last pass's ancestors [1, N, N]
        self._trees: dict[bytes, tuple[Tensor, Tensor, Tensor]] = {}  # tree shape -> ancestors, depths, block
        self._wide: dict[bytes, Tensor] = {}  # tree shape seen again -> its mask over W + N columns
        # the last known tree's host parents (kept: its id stays its own), their version, `_structure`'s answer
        self._last_tree: tuple[Tensor, int, tuple[Tensor, Tensor, Tensor, bytes]] | None = None

    def use_layers(self, hidden_layers: Sequence[int]) -> None:
        """Capture these HF hidden-state indices from now on (hooks added only for new ones)."""
        wanted = tuple(int(x) for x in hidden_layers)
        if tuple(self.layers) != wanted:
            canon = resolve_layers(list(wanted), self._capture.num_layers)
            self._capture.want(canon)
            self.layers = dict(zip(wanted, canon))

    @property
    def slots(self) -> SlotCache:
        """The static back-end's cache (`reserve` makes it; static_shapes implies the static back-end)."""
        assert isinstance(self.cache, SlotCache), "the static back-end's cache is made by reserve()"
        return self.cache

    # ---- sizing --------------------------------------------------------------------------------

    @property
    def capacity(self) -> int | None:
        """Positions the preallocated cache can hold (None: the dynamic cache grows)."""
        return self.cache.max_length if isinstance(self.cache, SlotCache) else self.fixed_length

    def reserve(self, prompt_len: int, max_new_tokens: int, tree_room: int = 64) -> None:
        """Make room for prompt + max_new_tokens (+ tree scratch); ValueError when a fixed cache is too small."""
        need = prompt_len + max_new_tokens
        if self.fixed_length is not None and need > self.fixed_length:
            raise ValueError(
                f"KV cache of {self.fixed_length} positions is too small for the prompt ({prompt_len} tokens) + "
                f"max_new_tokens ({max_new_tokens}): raise max_cache_len or lower max_new_tokens"
            )
        if self.kind == "static":
            step = 1024 if self.static_shapes else 256  # rounded: reused across calls (no recompile)
            size = self.fixed_length or -(-(need + tree_room) // step) * step
            if not isinstance(self.cache, SlotCache) or self.cache.max_length < size:
                self.cache = SlotCache(self.num_layers, size, static_shapes=self.static_shapes)

    def room(self) -> int | None:
        """Tree nodes that still fit after the committed positions (None: unbounded)."""
        cap = self.capacity
        return None if cap is None else cap - self.length

    # ---- passes --------------------------------------------------------------------------------

    def _graph_forward(self, input_ids: Tensor, parents: Tensor) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
        """The compiled pass over a tree input_ids / parents [1, N] after the cache's device length (its
        mask, positions and ancestors made in the graph: no op outside it): logits [1, N, V], ancestors
        [1, N, N] and the captured layers' states (graph outputs, not hooks: hooks added after a graph
        was traced would not run in it), in `self.layers` order."""
        slots = self.slots
        lengths = slots.device_length().view(1)  # [1]
        mask, positions, anc = tree_inputs_after(parents, lengths, slots.max_length, self.dtype)
        keys = slot_positions(lengths, positions, slots.max_length) if self.sliding else positions  # [1, S]
        out = self.model(
            input_ids=input_ids,
            attention_mask=layer_masks(self.sliding, mask, positions, keys),
            position_ids=positions,
            cache=self.cache,
            use_cache=True,
            output_hidden_states=bool(self.layers),
        )
        return out.logits, anc, tuple(out.hidden_states[c] for c in self.layers.values())

    def _graph_state(self) -> tuple:
        """What the compiled passes read besides their arguments: the cache's allocation, the layers."""
        generation = self.cache.generation if isinstance(self.cache, SlotCache) else None
        return generation, tuple(self.layers.values())

    def _forward(self, compiled: bool = False, **kwargs) -> tuple[Tensor, dict[int, Tensor]]:
        if compiled:  # (input_ids, parents: see `_graph_forward`; its ancestors kept for `verify`)
            assert self._compiled is not None  # compiled passes run only when compile= made it
            logits, self._graph_ancestors, states = self._compiled(**kwargs)
            return logits, dict(zip(self.layers, states))  # [B, T, H] each
        store = self._capture.store
        store.clear()
        self._capture.active = True
        try:
            out = self.model(cache=self.cache, use_cache=True, **kwargs)
        finally:
            self._capture.active = False
        hidden = {req: store[c] for req, c in self.layers.items()}  # [B, T, H] each
        store.clear()
        return out.logits, hidden

    @inference_mode
    def prefill(self, input_ids: Tensor) -> tuple[Tensor, dict[int, Tensor]]:
        """Run the prompt input_ids [B, T] from an empty cache: logits [B, V] (fp32, last position), {l: [B, T, H]}."""
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"prefill takes input_ids [B, T] with T >= 1, got {tuple(input_ids.shape)}")
        if input_ids.shape[0] != 1:
            raise ValueError(f"this runner decodes batch size 1, got B = {input_ids.shape[0]}")
        if self.kind == "static":
            if self.cache is None:
                self.reserve(input_ids.shape[1], 1)
            if input_ids.shape[1] > self.slots.max_length:
                raise ValueError(
                    f"prompt of {input_ids.shape[1]} tokens > KV cache of {self.slots.max_length}"
                )
            self.slots.set_length(0)
        else:
            self.cache = croppable_cache(self.model)
        if self.static_shapes:  # eager, but over the whole buffer like the compiled passes
            size = self.slots.max_length
            mask, positions = causal_inputs_static(input_ids.shape[1], 0, size, self.dtype, self.device)
            keys = torch.arange(size, device=self.device)  # [S] slot = position
            logits, hidden = self._forward(
                input_ids=input_ids.to(self.device),
                attention_mask=layer_masks(self.sliding, mask, positions, keys),
                position_ids=positions,
                logits_to_keep=1,
            )
            self.slots.set_length(input_ids.shape[1])
        else:
            logits, hidden = self._forward(input_ids=input_ids.to(self.device), logits_to_keep=1)
        self.length = input_ids.shape[1]
        return logits[:, -1].float(), hidden

    @inference_mode
    def verify(self, tokens: Tensor, parents: Tensor) -> tuple[Tensor, dict[int, Tensor]]:
        """ONE target forward over trees tokens [B, N] / parents [B, N] on top of the committed cache.

        Returns logits [B, N, V] (fp32; row i = the target's output at node i, as if its root-to-node path
        ran as a plain sequence) and {l: [B, N, H]}. Writes N entries after the committed ones; follow with
        `commit`. N = 1 (plain decoding) passes an all-visible mask; a tree's ancestors and depths are
        remembered per shape (static trees repeat every pass).
        """
        if self.cache is None:
            raise RuntimeError("verify before prefill")
        if tokens.shape != parents.shape or tokens.dim() != 2 or tokens.shape[0] != 1:
            raise ValueError(
                f"tokens and parents must both be [1, N], got {tuple(tokens.shape)}, {tuple(parents.shape)}"
            )
        n = tokens.shape[1]
        room = self.room()
        if room is not None and n > room:
            raise ValueError(
                f"a tree of {n} nodes does not fit: {room} KV slots left (cache {self.capacity})"
            )
        self._rewind()
        if n == 1 and not self.static_shapes:
            if tokens.device != self.device:  # (`to` costs even as a no-op)
                tokens = host_to_device(tokens, self.device)
            if self._single is None:  # one node is its own ancestor: the same [1, 1, 1] every step
                self._single = torch.ones(1, 1, 1, dtype=torch.bool, device=self.device)
            self.last_ancestors, self.last_parents = self._single, None
            positions = self._positions(self.length, 1, self.device)  # [1, 1]
            # an explicit all-visible mask: transformers then skips building its own causal mask,
            # which costs more than the rest of the pass outside the layers (measured on the CPU)
            visible = self._visible(self.length + 1)
            mask: Tensor | dict[str, Tensor] = visible
            if self.sliding:  # keys at positions 0..length, the query at `length`
                keys = torch.arange(self.length + 1, device=self.device)
                mask = layer_masks(self.sliding, visible, positions, keys)
            logits, hidden = self._forward(input_ids=tokens, attention_mask=mask, position_ids=positions)
            return _fp32(logits), hidden
        size = self._bucket(n, room)
        if size > n:  # pad where the tree is (the host, usually): children of the root nobody attends to
            pad = size - n
            tokens = torch.cat([tokens, tokens[:, :1].expand(1, pad)], dim=1)
            parents = torch.cat([parents, parents.new_zeros(1, pad)], dim=1)
        host_parents = parents if parents.is_cpu else None  # a cache key without a sync
        if tokens.device != self.device:  # (a drafter's tree on the GPU already: no copy, no wait)
            tokens = host_to_device(tokens, self.device)
        if parents.device != self.device:
            parents = host_to_device(parents, self.device)
        if self.static_shapes:  # the mask, positions and ancestors made inside the graph
            logits, hidden = self._forward(True, input_ids=tokens, parents=parents)
            anc = self._graph_ancestors
            assert anc is not None  # the graph's output
        else:
            anc, depth, block, key = self._structure(parents, host_parents)
            full = self._tree_mask(block, key)  # [1, 1, N, past + N]
            positions = depth + self.length  # [1, N]
            masks: Tensor | dict[str, Tensor] = full
            if self.sliding:  # keys: the prefix at positions 0..past-1, then the nodes at their own
                prefix = torch.arange(self.length, device=self.device)
                masks = layer_masks(self.sliding, full, positions, torch.cat([prefix, positions[0]]))
            logits, hidden = self._forward(input_ids=tokens, attention_mask=masks, position_ids=positions)
        self.last_ancestors = anc if size == n else anc[:, :n, :n]  # unpadded: no slicing (ops cost on a CPU)
        self.last_parents = parents if size == n else parents[:, :n]  # [1, N] on the device
        if size > n:  # padded: cut the padding off again
            logits, hidden = logits[:, :n], {k: v[:, :n] for k, v in hidden.items()}
        return _fp32(logits), hidden

    def _structure(self, parents: Tensor, host: Tensor | None) -> tuple[Tensor, Tensor, Tensor, bytes | None]:
        """Ancestors [1, N, N], depths [1, N] and the additive mask block [1, 1, N, N] (0 = attend) of
        parents [1, N] (on the device), remembered per tree shape when the shape is known on the host
        (static trees repeat every pass); and the shape's key when it was remembered from an earlier
        pass (None the first time: dynamic trees rarely repeat)."""
        last = self._last_tree
        if host is not None and last is not None and host is last[0] and version(host) == last[1] >= 0:
            return last[2]  # the very tensor of the last pass, unchanged (a static tree's): no key to make
        key = host.numpy().tobytes() if host is not None else None
        found = self._trees.get(key) if key is not None else None
        if found is not None:
            assert host is not None and key is not None  # (found: looked up by the host's key)
            self._last_tree = (host, version(host), (*found, key))
            return (*found, key)
        anc = ancestors_on_device(parents)
        found = (anc, anc.sum(-1) - 1, tree_mask(anc, 0, self.dtype))
        if key is not None:
            if len(self._trees) >= 64:  # keep the memory bounded
                self._trees.clear()
            self._trees[key] = found
        return (*found, None)

    def _tree_mask(self, block: Tensor, key: bytes | None) -> Tensor:
        """The verify mask [1, 1, N, past + N]: every node sees the committed prefix, then `block`.

        A shape seen before (key) keeps [1, 1, N, W + N] (W >= past columns of zeros, then the block), so
        its mask is ONE view (each op costs on a CPU); at most 4 shapes are kept (W x N each). On the CPU
        only: CUDA's memory-efficient attention reads the mask assuming a 16-element-aligned start
        (PyTorch pads a mask whose strides are not aligned, not one whose start is not), and a view at
        column W - past crashed there with 'misaligned address'."""
        size, past = block.shape[-1], self.length
        key = key if block.is_cpu else None
        wide = self._wide.get(key) if key is not None else None
        if key is not None and (wide is None or wide.shape[-1] - size < past):
            if wide is None and len(self._wide) >= 4:
                self._wide.clear()
            columns = max(self.capacity or 0, 2 * past, 1024)
            wide = self._wide[key] = torch.cat([block.new_zeros(1, 1, size, columns), block], dim=-1)
        if wide is None:  # a new shape: the prefix's zeros and the block, one concatenation
            return torch.cat([self._visible(past).expand(1, 1, size, past), block], dim=-1)
        return wide[..., wide.shape[-1] - size - past :]

    def _visible(self, columns: int) -> Tensor:
        """An additive mask [1, 1, 1, columns] of zeros (one query that sees every cached position)."""
        if self._zeros is None or self._zeros.shape[-1] < columns:
            self._zeros = torch.zeros(1, 1, 1, max(columns, 1024), dtype=self.dtype, device=self.device)
        return self._zeros[..., :columns]

    def _bucket(self, n: int, room: int | None) -> int:
        for size in self.buckets:
            if size >= n and (room is None or size <= room):
                return size
        return n

    def _rewind(self) -> None:
        """Drop scratch entries of an uncommitted verify (dynamic: crop; static: just the length)."""
        if isinstance(self.cache, SlotCache):
            self.cache.crop_to(self.length)  # (after a commit: nothing to drop)
            return
        assert self.cache is not None  # verify checked it
        if self.cache.get_seq_length() > self.length:
            self.cache.crop(self.length - self.cache.get_seq_length())

    @inference_mode
    def commit(self, path: Tensor | Sequence[int]) -> None:
        """Keep the accepted nodes `path` [K] (ascending, path[0] = 0) of the last verify after the prefix."""
        if isinstance(path, list):  # the generator's plain list: no tensor when the path is in place
            k, contiguous = len(path), bool(path) and path[-1] == len(path) - 1
            if contiguous and isinstance(self.cache, SlotCache):  # already in place: just the length
                self.cache.set_length(self.length + k)
                self.length += k
                return
            path = torch.arange(k) if contiguous else host_ids(path, torch.device("cpu"))
        else:
            path = torch.as_tensor(path, dtype=torch.long)
            if path.dim() == 2:
                path = path[0]
            k = int(path.numel())
            contiguous = bool(k and int(path[-1]) == k - 1)  # ascending, ends at k-1: path == arange(k)
        assert self.cache is not None, "commit before prefill"
        padded = 1 << max(k - 1, 0).bit_length()  # P >= K: a few graph shapes
        if (
            self._compiled_commit is not None
            and not contiguous
            and self.length + padded <= self.slots.max_length
        ):
            # pad with the last node: the copies past K land in scratch slots, beyond the new length
            path = host_to_device(torch.cat([path, path[-1:].expand(padded - k)]), self.device)
            self._compiled_commit(path)
            self.slots.set_length(self.length + k)
        else:
            commit_path(self.cache, self.length, path, contiguous=contiguous)
        self.length += k

    @property
    def queues_commits(self) -> bool:
        """Whether `commit_queued` runs here (compiled: the commit is a fixed-shape graph)."""
        return self._compiled_commit is not None

    @inference_mode
    def commit_queued(self, path: Tensor) -> None:
        """`commit` of a path still on the device, in two halves: the copy of its nodes into place queued
        now (path [N]: the accepted nodes ascending, then the last one repeated; compiled runners only),
        `advance(K)` once K is read (engine/loop.py)."""
        assert self._compiled_commit is not None, "commit_queued needs compile= (a fixed-shape commit)"
        self._compiled_commit(path)

    def advance(self, k: int) -> None:
        """The second half of `commit_queued`: the K entries it moved are committed (the cache's lengths
        follow at the next verify's rewind)."""
        self.length += k

    def _commit_graph(self, path: Tensor) -> None:
        """Copy the entries of tree nodes `path` [P] to the P slots after the committed length, in every
        layer (static shapes: both ends come from the device length, so one graph serves every length)."""
        cache = self.slots
        start = cache.device_length()
        src = start + path  # [P] slots the verify wrote these nodes at
        dst = start + torch.arange(path.shape[0], device=path.device)  # [P]
        for layer in cache.slot_layers:
            layer.keys.index_copy_(2, dst, layer.keys.index_select(2, src))
            layer.values.index_copy_(2, dst, layer.values.index_select(2, src))


def _fp32(logits: Tensor) -> Tensor:
    """logits as fp32 (`float()` costs a call into torch even when they are fp32 already)."""
    return logits if logits.dtype == torch.float32 else logits.float()
