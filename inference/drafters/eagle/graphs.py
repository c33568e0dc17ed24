"""EAGLE / EAGLE-3 rows with fixed shapes: every row's whole draft as ONE captured graph.

`GraphRows` runs `EagleRows`' growth code in a few shapes, so that on CUDA a pass drafts every row's tree
with one graph replay and commits with another, not tens of host-launched kernels a depth (as SGLang
captures EAGLE's draft).
- rows: `capacity` physical rows (the batch's next power of 2), kept per capacity; `keep` only remaps
  active -> physical rows. An idle row drafts at length 0 from token 0 into its own row; its tree is dropped.
- the head cache: a `RowCache(static_shapes=True)` per capacity, S_max a multiple of 1024 (grown rarely:
  every graph is captured again); C_b is its device `lengths_t`, moved inside the accept graph.
- accepts: K tokens padded to a power of 2 (<= GRAPH_COMMIT; longer blocks, such as the prompt, run the
  same function eagerly).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from spechead.heads.grad import inference_mode
from spechead.inference import compiling
from spechead.inference.devices import host_to_device
from spechead.inference.drafters.base import BatchDraft, next_ids_of, padded_prompts, paths_states
from spechead.inference.drafters.eagle.rows import EagleRows
from spechead.inference.target.cache import RowCache
from spechead.inference.target.runner import batch_capacity

if TYPE_CHECKING:
    from spechead.inference.drafters.eagle.drafter import EagleDrafter


GRAPH_COMMIT = 16  # accepts of at most this many tokens run as a graph (the prompt runs eagerly)
PROMPT_BLOCK = 512  # a prompt's pairs are committed this many positions at a time (bounded masks)


class _Capacity:
    """The fixed-shape state of one capacity P: the head cache, committed lengths C_b [P] on the host
    (its device copy is the cache's `lengths_t`) and each row's last committed output feature [P, H]."""

    def __init__(self, layers: int, capacity: int, max_length: int, feature: Tensor) -> None:
        self.cache = RowCache(layers, capacity, max_length, static_shapes=True)
        self.lengths_t = self.cache.lengths_t = torch.zeros(capacity, dtype=torch.long, device=feature.device)
        self.lengths = torch.zeros(capacity, dtype=torch.long)  # [P] host copy
        self.feature = feature  # [P, H]

    @inference_mode
    def sync(self) -> None:
        """The device lengths follow the host's (one small copy, no sync)."""
        self.lengths_t.copy_(host_to_device(self.lengths, self.lengths_t.device))  # (device to device)


class GraphRows(EagleRows):
    """B rows of an `EagleDrafter` as fixed-shape graphs (the module doc); compile: as `use_compile`'s."""

    _capacity: _Capacity  # the current rows' fixed-shape state (made by `start`)

    def __init__(self, drafter: EagleDrafter, compile: bool | str) -> None:
        super().__init__(drafter)
        cuda = self.device.type == "cuda"
        self._kept: dict[int, _Capacity] = {}  # capacity -> its fixed-shape state
        self.rows: list[int] = []  # the physical row of each active row, in the caller's order
        # _draft: every physical row's tree from its feature [P, H] and root [P]: tokens, parents [P, N]
        self._draft, self._accept = (
            compiling.compile_function(f, compile, cuda, fullgraph=True, state=self._graph_state)
            for f in (self._grow, self._graph_accept)
        )

    def _graph_state(self) -> tuple:
        """What the graphs read besides their arguments (CUDA graphs bake it in): every kept head cache's
        allocation, the drafter's id map, static plan and tree settings (top-k chunks, the fused step's
        attention), and that step's rotary table, remade larger when a longer cache asks."""
        d, step = self.drafter, self.drafter.head_step
        caches = tuple((p, rows.cache.generation) for p, rows in self._kept.items())
        table = getattr(step, "table", None)
        angles = None if table is None else (table[0].data_ptr(), table[0].shape[0])
        settings = (d.top_k, d.depth, d.total_tokens, d.topk_chunk, getattr(step, "attention", None))
        return caches, id(d._d2t), id(d._plan), *settings, angles

    # ---- the drafter's calls ------------------------------------------------------------------------------

    @inference_mode
    def start(
        self, prompts: Sequence[Tensor], hidden: Sequence[dict[int, Tensor]], roots: Sequence[int]
    ) -> None:
        """New rows 0..B-1 of a kept capacity; their prompts' pairs committed eagerly (any length)."""
        batch, longest = len(prompts), max(p.numel() for p in prompts)
        capacity = batch_capacity(batch)
        need = -(-(longest + 128 + self.drafter._spec_room + GRAPH_COMMIT) // 1024) * 1024
        rows = self._kept.get(capacity)
        if rows is None or rows.cache.max_length < need:
            size = max(need, rows.cache.max_length if rows is not None else 0)
            width = self.head.config.hidden_size
            feature = torch.zeros(capacity, width, device=self.device, dtype=self.dtype)
            rows = self._kept[capacity] = _Capacity(self.head.config.num_layers, capacity, size, feature)
        self._capacity, self.cache, self.rows = rows, rows.cache, list(range(batch))
        rows.lengths.zero_()
        rows.sync()
        tokens, states = padded_prompts(prompts, hidden, self.drafter.hidden_layers)  # [B, T], {l: [B, T, H]}
        lengths = torch.tensor([p.numel() for p in prompts])  # [B]
        # in blocks of PROMPT_BLOCK positions: a block's mask is [P, 1, block, S_max], not the prompt's
        for start in range(0, longest, PROMPT_BLOCK):
            block = tokens[:, start : start + PROMPT_BLOCK]  # [B, K]
            n = (lengths - start).clamp(0, block.shape[1])  # [B] pairs of each row in this block
            ends = lengths > start + n  # the row goes on: its block's last pair's next token is in the prompt
            after = tokens[torch.arange(batch), (start + n).clamp(max=longest - 1)]
            nexts = torch.where(ends, after, torch.tensor(list(roots)))  # [B]
            before = rows.feature
            part = {layer: x[:, start : start + PROMPT_BLOCK] for layer, x in states.items()}
            self.accept(block, n.tolist(), part, nexts.tolist(), eager=True)
            going = torch.zeros(capacity, dtype=torch.bool)  # rows with pairs here: the others keep theirs
            going[:batch] = n > 0
            rows.feature = torch.where(host_to_device(going, self.device)[:, None], rows.feature, before)

    @inference_mode
    def propose(self, roots: Sequence[int], sampling, generators) -> BatchDraft:
        """Every row's tree of the head's top-k children in one graph call (greedy / lossless rule A)."""
        self._ensure_room(0)
        return self.propose_queued(host_to_device(torch.tensor(list(roots), dtype=torch.long), self.device))

    @inference_mode
    def keep(self, rows: Sequence[int]) -> None:
        """Keep only these active rows (in this order); the others' physical rows go idle (length 0)."""
        kept = [self.rows[i] for i in rows]
        self._capacity.lengths[list(set(self.rows) - set(kept))] = 0
        self.rows = kept
        self._capacity.sync()

    def rewind(self, length: int) -> None:
        """`EagleRows.rewind` of the active rows, on the host and the device."""
        self._capacity.lengths[self.rows] = length
        self._capacity.sync()

    # ---- one draft ahead (engine/loop.py): the accepted paths still on the device ----------------------

    @inference_mode
    def accept_queued(
        self, hidden: dict[int, Tensor], tokens: Tensor, paths: Tensor, ks: Tensor, nexts: Tensor
    ) -> None:
        """`accept` of each row's path from device tensors (`Drafter.accept_queued`; the pairs past K_b land
        in scratch): the device lengths move by K_b in the graph, the host's copy waits for `settle`."""
        rows, width, dev = self._capacity, self.drafter.commit_width, self.device
        self._ensure_room(2 * width)  # (this commit, and the next draft before `settle` counts it)
        paths = paths[:, :width]  # [B, P]
        read = paths_states(hidden, paths)  # {l: [B, P, H]}
        # the pairs' own tokens [B, P], K and next token [B]: packed on the device
        packed, states = self._pack(tokens.to(dev).gather(1, paths), ks.to(dev), nexts.to(dev), read, width)
        rows.feature = self._accept(packed, *states)  # [P_rows, H]

    @inference_mode
    def propose_queued(self, nexts: Tensor) -> BatchDraft:
        """`propose` from the next tokens [B] on the device (after `accept_queued`), the trees left there."""
        rows, drafter = self._capacity, self.drafter
        drafter._map_ids(self.device)
        if drafter._static is not None:
            drafter._static_plan()  # built eagerly (host loops), read by the graph
        all_roots = torch.zeros(rows.cache.batch, dtype=torch.long, device=self.device)  # [P] idle: token 0
        all_roots[host_to_device(torch.tensor(self.rows), self.device)] = nexts.to(self.device)
        tokens, parents = self._draft(rows.feature, all_roots)  # [P_rows, N] each
        if self.rows == list(range(len(self.rows))):  # the active rows come first: views
            tokens, parents = tokens[: len(self.rows)], parents[: len(self.rows)]
        else:
            picked = host_to_device(torch.tensor(self.rows), self.device)  # [B] physical rows
            tokens, parents = tokens[picked], parents[picked]
        return BatchDraft(tokens, parents, [tokens.shape[1]] * tokens.shape[0])

    @inference_mode
    def settle(self, ks: Sequence[int]) -> None:
        """The host's committed lengths follow the queued accept (active row b: ks[b] pairs)."""
        self._capacity.lengths.index_add_(0, torch.tensor(self.rows), torch.tensor(list(ks)))

    # ---- the graphs --------------------------------------------------------------------------------

    def _graph_accept(self, packed: Tensor, *states: Tensor) -> Tensor:
        """Commit row b's first n_b of K pairs, packed [P, K + 2] = (tokens [P, K], n_b, next root) with
        target states [P, K, H] per captured layer, after the device lengths (which move by n_b):
        the new last output feature [P, H]. Pairs past n_b write scratch that no real pair sees."""
        batch, k = packed.shape[0], packed.shape[1] - 2
        tokens, lengths, roots = packed[:, :k], packed[:, k], packed[:, k + 1]  # [P, K], [P], [P]
        last = (lengths - 1).clamp(min=0)[:, None]  # [P, 1] each row's last real pair (idle: any)
        next_ids = next_ids_of(tokens, lengths, roots)  # [P, K]
        own = torch.ones(k, k, dtype=torch.bool, device=packed.device).tril()  # [K, K] causal
        offsets = torch.arange(k, device=packed.device)
        features = self.head.features(list(states))  # [P, K, H] (EAGLE-3: fused)
        out = self._run(features, next_ids, self._inputs(own.expand(batch, k, k), offsets))  # [P, K, H]
        self._capacity.lengths_t.add_(lengths)
        return out.gather(1, last[:, :, None].expand(batch, 1, out.shape[-1]))[:, 0]  # [P, H]

    # ---- committed cache ---------------------------------------------------------------------------

    @inference_mode
    def accept(
        self,
        tokens: Tensor,
        lengths: Sequence[int],
        hidden: dict[int, Tensor],
        next_roots: Sequence[int],
        eager: bool = False,
    ) -> None:
        """`EagleRows.accept` into the active rows' physical rows: as the accept graph when K <= GRAPH_COMMIT
        (padded to a power of 2), otherwise (or `eager`) the same function run eagerly."""
        rows, k = self._capacity, tokens.shape[1]
        graph = not eager and k <= GRAPH_COMMIT
        width = 1 << max(k - 1, 0).bit_length() if graph else k  # K' >= K: a few graph shapes
        self._ensure_room(width)
        n, roots = torch.tensor(list(lengths)), torch.tensor(list(next_roots))  # [B] each
        # packed on the host: its n_b column moves the host's lengths too
        packed, states = self._pack(tokens.cpu(), n, roots, hidden, width)
        accept = self._accept if graph else self._graph_accept
        rows.feature = accept(host_to_device(packed, self.device), *states)  # [P, H]
        rows.lengths += packed[:, width]

    def _pack(
        self, tokens: Tensor, ks: Tensor, nexts: Tensor, hidden: dict[int, Tensor], width: int
    ) -> tuple[Tensor, list[Tensor]]:
        """The accept graph's inputs from the active rows' tokens [B, K], pair counts n_b [B] and next
        roots [B] (all on one device) and states {l: [B, K, H]}, K <= W: packed [P, W + 2] on that
        device and each captured layer's states [P, W, H] on the head's, zero in the idle rows (n = 0)."""
        capacity, k, dev = self._capacity.cache.batch, tokens.shape[1], self.device
        active = host_to_device(torch.tensor(self.rows), tokens.device)  # [B] physical rows
        packed = torch.zeros(capacity, width + 2, dtype=torch.long, device=tokens.device)
        packed[active, :k], packed[active, width], packed[active, width + 1] = tokens, ks, nexts
        on_device = host_to_device(active, dev)
        states = []
        for state in self._states(hidden):  # [B, K, H] each
            full = torch.zeros(capacity, width, state.shape[-1], device=dev, dtype=self.dtype)
            full[on_device, :k] = state
            states.append(full)
        return packed, states

    def _ensure_room(self, extra: int) -> None:
        """`EagleRows._ensure_room` over the physical rows' host lengths, in steps of 1024 (module doc)."""
        self.cache.grow(int(self._capacity.lengths.max()) + extra + self.drafter._spec_room, 1024)
