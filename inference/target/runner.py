"""The target runner: the one place that owns the target's KV cache (a `RowCache` of B rows) and its
hidden-state capture.

    runner = TargetRunner(model, hidden_layers=(2, 4, 6))
    runner.reserve([T_0, T_1], [new_0, new_1])             # size the cache for these rows
    logits, hiddens = runner.prefill([ids_0, ids_1])        # ids_b [T_b] -> [B, V], [{l: [T_b, H]}]
    logits, hidden = runner.verify(tokens, parents)         # [B, N] each -> [B, N, V], {l: [B, N, H]}
    runner.commit([path_0, path_1])                         # accepted nodes [K_b] per row (ascending, [0] = 0)
    runner.keep([1])                                        # only these rows go on

Row b's tree entries are written after its own committed length, seen through an additive mask that
opens its prefix plus each node's ancestors, at positions length_b + depth; a commit copies the accepted
entries into place after the prefix (no concatenation, no reallocation).

Eager: the cache holds the active rows; a batch of one takes the CPU's fast paths (writes in a row, the
plain step's all-visible mask view, per-shape tree inputs, an in-place path committed by its length).
Compiled (compile=...): `capacity` physical rows for the runner's life (`keep` only remaps them), trees
padded to a bucket, verify and commit as fixed-shape graphs (graphs.py); the prefill stays eager.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from spechead.heads.base import resolve_layers
from spechead.heads.grad import inference_mode
from spechead.inference.devices import host_to_device
from spechead.inference.positions import PositionIds
from spechead.inference.sliding import layer_masks, sliding_layout
from spechead.inference.target.cache import RowCache
from spechead.inference.target.capture import Capture, check_tree_attention
from spechead.inference.target.commit import Path, commit_row, commit_rows
from spechead.inference.target.graphs import RowGraphs
from spechead.inference.target.prefill import prefill_groups
from spechead.inference.target.tree_inputs import TreeInputs, pad_trees, rows_inputs

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from transformers.cache_utils import Cache

CUDA_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def batch_capacity(batch: int) -> int:
    """Physical rows for a batch of `batch`: the next power of 2 (a few graph shapes serve every B)."""
    return 1 << max(batch - 1, 0).bit_length()


class TargetRunner:
    """Prefill, verify token trees and commit accepted paths for B rows of one target (see the module doc)."""

    last_ancestors: Tensor  # [B, N, N] of the last verify (on the device; set by `verify`)

    def __init__(
        self,
        model: PreTrainedModel,
        hidden_layers: Sequence[int] = (),
        *,
        max_length: int | None = None,
        buckets: Sequence[int] | None = None,
        compile: bool | str = False,
        capacity: int | None = None,
    ) -> None:
        check_tree_attention(model)
        if capacity is not None and not compile:
            raise ValueError("capacity (fixed physical rows) needs compile=: an eager runner holds its rows")
        self.model = model
        self.sliding = sliding_layout(model)  # sliding-window layers: windowed masks (sliding.py)
        param = next(model.parameters())
        self.device = param.device
        self.dtype = param.dtype if param.dtype.is_floating_point else torch.float32
        self.fixed_length = max_length  # None: sized by `reserve`
        self.static_shapes = bool(compile)
        cuda = self.device.type == "cuda"
        # compiled: every tree padded to a bucket, so a handful of graphs serve every size (on a CPU no
        # padding unless asked: it is pure waste there)
        self.buckets = tuple(
            sorted(buckets if buckets is not None else CUDA_BUCKETS if compile and cuda else ())
        )
        self.capacity = capacity  # compiled: physical rows (None: `batch_capacity` of the first batch)
        self._capture = Capture.of(model)
        self.layers: dict[int, int] = {}  # requested HF index -> canonical index
        self.use_layers(hidden_layers)
        self.cache: RowCache | None = None
        self.rows: list[int] = []  # the physical row of each active row, in the caller's order
        self._graphs = RowGraphs(self, compile) if compile else None  # compiled: verify and commit
        self._inputs = TreeInputs(self.dtype, self.device)  # a batch of one's per-shape masks
        self._positions = PositionIds()  # the plain step's position [1, 1]: a view, not a new tensor
        # a one-node tree's ancestors [1, 1, 1]: the same every plain step
        self._single = torch.ones(1, 1, 1, dtype=torch.bool, device=self.device)

    def use_layers(self, hidden_layers: Sequence[int]) -> None:
        """Capture these HF hidden-state indices from now on (hooks added only for new ones)."""
        wanted = tuple(int(x) for x in hidden_layers)
        if tuple(self.layers) != wanted:
            self.layers = dict(zip(wanted, resolve_layers(list(wanted), self._capture.num_layers)))
            self._capture.want(self.layers.values())

    # ---- sizing and rows ---------------------------------------------------------------------------

    @property
    def lengths(self) -> list[int]:
        """Committed positions [B] of the active rows (host); set it to drop later commits."""
        cache = self.cache
        return [] if cache is None else [cache.lengths[r] for r in self.rows]

    @lengths.setter
    @inference_mode
    def lengths(self, lengths: Sequence[int]) -> None:
        assert self.cache is not None and len(lengths) == len(self.rows), "one length per active row"
        every = list(self.cache.lengths)
        for row, n in zip(self.rows, lengths):
            every[row] = int(n)
        self.cache.set_lengths(every)

    def reserve(self, lengths: Sequence[int], max_new: Sequence[int], tree_room: int = 64) -> None:
        """Make room for each row's prompt lengths[b] + max_new[b] (+ a tree's scratch), rounded up so later
        calls reuse the cache; ValueError when a fixed max_length is too small."""
        if len(lengths) != len(max_new) or not lengths:
            raise ValueError(f"reserve takes one prompt length and max_new per row, got {lengths}, {max_new}")
        need = [t + m for t, m in zip(lengths, max_new)]
        worst = max(range(len(need)), key=need.__getitem__)
        fixed = self.fixed_length
        if fixed is not None and need[worst] > fixed:
            whose = "the prompt" if len(need) == 1 else f"row {worst}: prompt"
            raise ValueError(
                f"KV cache of {fixed} positions is too small for {whose} ({lengths[worst]} tokens) + "
                f"max_new_tokens ({max_new[worst]}): raise max_cache_len or lower max_new_tokens"
            )
        rows = len(need)
        if self.static_shapes:
            self.capacity = self.capacity or batch_capacity(rows)
            if rows > self.capacity:
                raise ValueError(f"{rows} prompts > this runner's {self.capacity} rows")
            rows = self.capacity
        step = 1024 if self.static_shapes else 256  # rounded: reused across calls (no recompile)
        size = fixed or -(-(need[worst] + tree_room) // step) * step
        cache = self.cache
        if cache is None or cache.max_length < size or cache.batch != rows:
            self.cache, self.rows = RowCache(self._capture.num_layers, rows, size, self.static_shapes), []

    def room(self) -> int:
        """Tree nodes every active row can still take (a padded tree must fit after the longest row)."""
        cache, rows = self.cache, self.rows
        if cache is None:
            raise RuntimeError("room before prefill")
        if len(rows) == 1:  # (a batch of one: every pass asks)
            return cache.max_length - cache.lengths[rows[0]]
        return cache.max_length - max((cache.lengths[r] for r in rows), default=0)

    @inference_mode
    def keep(self, rows: Sequence[int]) -> None:
        """Keep only these active rows, in this order (e.g. drop the finished ones)."""
        rows, cache = list(rows), self.cache
        if rows == list(range(len(self.rows))) or cache is None:
            return
        if self.static_shapes:  # the others go idle (length 0): no data moves
            self.rows = [self.rows[i] for i in rows]
            cache.set_lengths([n if r in self.rows else 0 for r, n in enumerate(cache.lengths)])
            return
        cache.keep_rows(rows, max((cache.lengths[i] for i in rows), default=0))  # (committed: what counts)
        self.rows = list(range(len(rows)))

    # ---- prefill -----------------------------------------------------------------------------------

    def _forward(self, cache: Cache, **kwargs) -> tuple[Tensor, dict[int, Tensor]]:
        """One eager model call over `cache` with the capture on: logits, {requested layer: [B, T, H]}."""
        store = self._capture.store  # (emptied after every forward; every hooked layer writes again)
        self._capture.active = True
        try:
            out = self.model(cache=cache, use_cache=True, **kwargs)
        finally:
            self._capture.active = False
        hidden = {req: store[c] for req, c in self.layers.items()}  # [B, T, H] each
        store.clear()
        return out.logits, hidden

    @inference_mode
    def prefill(self, prompts: Sequence[Tensor]) -> tuple[Tensor, list[dict[int, Tensor]]]:
        """Run prompts ids_b [T_b] from empty rows (without `reserve`: a cache sized for them): logits
        [B, V] (fp32, last positions) and [{l: [T_b, H]}], in groups of similar lengths (prefill.py)."""
        lengths = [p.numel() for p in prompts]
        for b, ids in enumerate(prompts):
            if ids.dim() != 1 or ids.numel() == 0:
                raise ValueError(f"row {b}: prompt must be a non-empty 1-D id tensor, got {tuple(ids.shape)}")
        cache, batch = self.cache, len(lengths)
        rows = self.capacity if self.static_shapes and self.capacity else batch
        if cache is None or cache.batch != rows or batch > rows or cache.max_length < max(lengths):
            self.reserve(lengths, [0] * batch)  # (no prompt, or one past a fixed size: its ValueError)
        cache = self.cache
        assert cache is not None  # reserve made it
        self.rows = list(range(batch))
        cache.set_lengths([0] * cache.batch)
        out = prefill_groups(self.model, self._forward, prompts, self.rows, cache)
        cache.set_lengths(lengths + [0] * (cache.batch - batch))
        return out

    # ---- verify ------------------------------------------------------------------------------------

    @inference_mode
    def verify(self, tokens: Tensor, parents: Tensor) -> tuple[Tensor, dict[int, Tensor]]:
        """ONE target forward over every active row's tree tokens [B, N] / parents [B, N] (host or device;
        a row of fewer real nodes padded with children nobody descends from), row b after its committed
        entries: logits [B, N, V] (fp32; node i's as if its root-to-node path ran as a plain sequence) and
        {l: [B, N, H]}; sets `last_ancestors` [B, N, N]. The next verify drops an uncommitted one's entries."""
        cache = self.cache
        if cache is None:
            raise RuntimeError("verify before prefill")
        if tokens.dim() != 2 or parents.shape != tokens.shape or tokens.shape[0] != len(self.rows):
            raise ValueError(
                f"tokens and parents must be [B={len(self.rows)}, N], got {tuple(tokens.shape)}, "
                f"{tuple(parents.shape)}"
            )
        room, n = self.room(), tokens.shape[1]
        if n > room:
            raise ValueError(
                f"a tree of {n} nodes does not fit: {room} KV slots left (cache {cache.max_length})"
            )
        if self._graphs is not None:
            return self._graphs.verify(cache, tokens, parents, self._bucket(n, room))
        if tokens.shape[0] == 1:
            return self._verify_one(cache, tokens, parents, room)
        return self._verify_rows(cache, tokens, parents, room)

    def _verify_one(self, cache: RowCache, tokens: Tensor, parents: Tensor, room: int) -> tuple[Tensor, dict]:
        """`verify` of a batch of one, eager: written in a row after the committed length."""
        past, n, dev = cache.lengths[0], tokens.shape[1], self.device
        if cache.row_layers[0].length != past:  # an uncommitted verify's entries: dropped in every layer
            cache.set_length(past)
        if n == 1:
            anc, size = self._single, 1
            positions = self._positions(past, 1, dev)  # [1, 1]
            # an explicit all-visible mask: transformers then skips building its own causal mask,
            # which costs more than the rest of the pass outside the layers (measured on the CPU)
            mask = self._inputs.visible(past + 1)
        else:
            size = self._bucket(n, room)
            tokens, parents = pad_trees(tokens, parents, size)  # (where the tree is: the host, usually)
            host_parents = parents if parents.is_cpu else None  # a cache key without a sync
            block, depth, anc, key = self._inputs.structure(host_to_device(parents, dev), host_parents)
            mask = self._inputs.mask(block, key, past, cache.max_length)  # [1, 1, N, past + N]
            positions = depth + past  # [1, N]
        masks: Tensor | dict[str, Tensor] = mask
        if self.sliding:  # keys: the prefix at positions 0..past-1, then the nodes at their own
            prefix = torch.arange(past + 1 if n == 1 else past, device=dev)  # (a plain step: the query too)
            keys = prefix if n == 1 else torch.cat([prefix, positions[0]])
            masks = layer_masks(self.sliding, mask, positions, keys)
        tokens = host_to_device(tokens, dev)  # (no wait)
        logits, hidden = self._forward(cache, input_ids=tokens, attention_mask=masks, position_ids=positions)
        if size == n:  # unpadded: no slicing (ops cost on a CPU)
            self.last_ancestors = anc
            return _fp32(logits), hidden
        self.last_ancestors = anc[:, :n, :n]
        return _fp32(logits[:, :n]), {k: v[:, :n] for k, v in hidden.items()}

    def _verify_rows(
        self, cache: RowCache, tokens: Tensor, parents: Tensor, room: int
    ) -> tuple[Tensor, dict]:
        """`verify` of B > 1 rows, eager: each row's entries scattered after its own length, the mask over
        the S = longest + N slots every row needs."""
        n, dev = tokens.shape[1], self.device
        size = 1 if n == 1 else self._bucket(n, room)  # (a plain step is never padded)
        tokens, parents = pad_trees(tokens, parents, size)
        tokens, parents = host_to_device(tokens, dev), host_to_device(parents, dev)  # (no wait for the GPU)
        lengths = host_to_device(torch.tensor(cache.lengths), dev)  # [B]
        view = max(cache.lengths) + size  # S
        masks, positions, anc = rows_inputs(self.sliding, parents, lengths, view, self.dtype)
        cache.write_slots = lengths[:, None] + torch.arange(size, device=dev)  # [B, N]
        cache.view_length = view
        try:
            logits, hidden = self._forward(
                cache, input_ids=tokens, attention_mask=masks, position_ids=positions
            )
        finally:
            cache.write_slots = None  # (a batch of one writes in a row)
        self.last_ancestors = anc[:, :n, :n]
        return logits[:, :n].float(), {k: v[:, :n] for k, v in hidden.items()}  # [B, N, V]

    def _bucket(self, n: int, room: int) -> int:
        """The tree size to pad N nodes to: the first bucket that holds them and fits, else N itself."""
        for size in self.buckets:
            if n <= size <= room:
                return size
        return n

    # ---- commit ------------------------------------------------------------------------------------

    @inference_mode
    def commit(self, paths: Sequence[Path]) -> None:
        """Active row b keeps the accepted nodes paths[b] [K_b] (ascending, paths[b][0] = 0) of the last
        verify after its prefix; a path already in place (0..K-1) moves the length only."""
        cache = self.cache
        if len(paths) != len(self.rows) or cache is None:
            raise ValueError(f"need one path per row ({len(self.rows)}), got {len(paths)}")
        nodes = [p.reshape(-1).tolist() if isinstance(p, Tensor) else list(p) for p in paths]
        if self._graphs is not None:
            self._graphs.commit(cache, nodes)
            self.advance([len(p) for p in nodes])
        elif len(nodes) == 1:
            commit_row(cache, nodes[0], self.device)
        else:
            commit_rows(cache, nodes, self.device)

    @inference_mode
    def commit_queued(self, paths: Tensor) -> None:
        """`commit` of device paths [B, P] (accepted nodes ascending, the last one repeated; compiled only):
        the copies queued now, `advance(K_b)` once the K_b are read."""
        assert self._graphs is not None and self.cache is not None, "commit_queued needs compile="
        self._graphs.commit_queued(self.cache, paths)

    @inference_mode
    def advance(self, ks: Sequence[int]) -> None:
        """The second half of `commit_queued`: active row b committed ks[b] entries (host and device)."""
        self.lengths = [n + int(k) for n, k in zip(self.lengths, ks)]


def _fp32(logits: Tensor) -> Tensor:
    """logits as fp32 (`float()` costs a call into torch even when they are fp32 already)."""
    return logits if logits.dtype == torch.float32 else logits.float()
