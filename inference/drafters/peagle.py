"""P-EAGLE drafting: ONE head forward per pass drafts every row's block of K tokens (default tree: the
chain of the K best, the paper's draft).

A pass writes into the head's cache, per row, the positions committed since the last pass (fused target
states and next tokens; the last, whose next token is the root, is the anchor) and K - 1 future positions
after them, attending causally by slot (slot s = target position s = the rotary position). Row b's new
positions are padded to the longest row's P and its padding written AFTER its block, where no real query
sees it: real j at L_b + j (j < k_b), future i at L_b + k_b + i, padding j at L_b + K - 1 + j. The
futures' and padding's K/V are scratch: the committed length moves past the real entries only.

Compiled, a pass pads its pending positions to P = `commit_width` and attends over the whole buffer
behind a device mask; a pass of more (the prompt's, an accept longer than the tree) or the first one runs
eagerly, over the slots up to the longest row's last write (the fewest a CPU computes).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.nn.functional import pad

from spechead.heads.decoder_layer import additive_mask
from spechead.heads.fused import fused_logits, fused_step
from spechead.heads.grad import inference_mode
from spechead.heads.peagle import PEagleHead
from spechead.inference.devices import host_to_device
from spechead.inference.drafters.base import next_ids_of, padded_prompts, paths_states
from spechead.inference.drafters.block_tree import BlockTree
from spechead.inference.drafters.parallel import ParallelDrafter


class PEagleDrafter(ParallelDrafter):
    """B rows' static trees from ONE P-EAGLE head forward per pass (children deterministic: rule A when
    sampling); row b's tree is the one a batch of one of that row proposes."""

    head: PEagleHead
    # not yet in the head cache (made by `start`): fused states [B, P, H], next ids [B, P], counts k [B]
    pending: tuple[Tensor, Tensor, Tensor]

    def __init__(self, head: PEagleHead, choices: list[list[int]] | None = None):
        super().__init__(head, BlockTree(choices, head.block_size))
        # short chains of ops on the head's weights where its layer kind allows (heads/fused.py): on a CPU
        # the modules' overhead is as large as the arithmetic
        self.head_step = fused_step(head) or head.step
        self.head_logits = fused_logits(head) or head.logits
        self.host_counts: list[int] | None = None  # read first: k per row on the host (queued: `settle`)
        # the state before the last pass (pending, device lengths): a propose again without an accept
        # (rows may have left between) drafts that pass again
        self._redo: tuple[tuple[Tensor, Tensor, Tensor], Tensor] | None = None

    @inference_mode
    def start(
        self, prompts: Sequence[Tensor], hidden: Sequence[dict[int, Tensor]], roots: Sequence[int]
    ) -> None:
        """New rows: every prompt position is pending, accepted as a path is."""
        tokens, states = padded_prompts(prompts, hidden, self.hidden_layers)  # [B, T], {l: [B, T, H]}
        self.accept(tokens, [p.numel() for p in prompts], states, roots)
        self._new_rows(len(prompts), 2 * (tokens.shape[1] + self.head.block_size))

    def _draft(self, roots: Tensor) -> Tensor:
        """The pending positions into the head cache and every row's tree tokens [B, N] from its roots [B]."""
        cache, k = self.cache, self.head.block_size
        if self.pending[1].shape[1] == 0 and self._redo is not None:  # a propose again, no accept between
            # (calibration times repeated drafts): the same pass from the state before the last one (the
            # host's lengths count that pass already, or `settle` will)
            self.pending, self.lengths_t = self._redo
            self.host_counts = None
        self._redo = (self.pending, self.lengths_t)
        fused, next_ids, counts = self.pending
        batch, width = next_ids.shape  # P: pending positions per row (padded)
        fixed = bool(self._compile) and width <= self.commit_width and cache.row_layers[0].is_initialized
        if fixed:  # padded to P = commit_width (after each row's block: scratch)
            fused = pad(fused, (0, 0, 0, self.commit_width - width))  # [B, P, H]
            next_ids = pad(next_ids, (0, self.commit_width - width))  # [B, P]
            width = self.commit_width
        view = max(cache.lengths) + width + k - 1  # (host lengths >= device ones before this pass)
        cache.grow(view)
        # [B, N]; compiled, over every row of the cache (idle ones: nothing they write is read)
        run, view = (self._draft_fn, cache.max_length) if fixed else (self._tokens, view)
        tokens = self._over_rows(
            run, cache.batch, batch, fused, next_ids, counts, roots, self.lengths_t, view
        )
        self.lengths_t = self.lengths_t + counts
        if self.host_counts is not None:  # read first: the host's lengths follow now (queued: `settle`)
            self.settle(self.host_counts)
            self.host_counts = [0] * batch
        self.pending = (fused[:, :0], next_ids[:, :0], counts)
        return tokens

    def _tokens(
        self, fused: Tensor, next_ids: Tensor, counts: Tensor, roots: Tensor, lengths: Tensor, view: int
    ) -> Tensor:
        """The fixed-shape pass: pending fused states [B, P, H], next ids [B, P] and real counts [B], roots
        [B] and committed lengths [B] (device) -> every row's tree tokens [B, N]; writes the P pending
        positions and the block at each row's slots, attending over the cache's first `view` slots."""
        head, cache, k = self.head, self.cache, self.head.block_size
        batch, width = next_ids.shape
        device = fused.device
        j = torch.arange(width, device=device)  # [P]
        real = torch.where(j < counts[:, None], j, k - 1 + j)  # [B, P] padding after the block
        future = counts[:, None] + torch.arange(k - 1, device=device)  # [B, K - 1]
        slots = lengths[:, None] + torch.cat([real, future], dim=1)  # [B, P + K - 1]
        future_hidden, future_ids = head.future_inputs(batch, k - 1)
        keys = torch.arange(view, device=device)
        allowed = keys[None, None, :] <= slots[:, :, None]  # [B, Q, S]: causal by slot
        cache.write_slots, cache.view_length = slots, view
        try:
            out = self.head_step(
                torch.cat([fused, future_hidden], dim=1),
                torch.cat([next_ids, future_ids], dim=1),
                additive_mask(allowed, fused.dtype),
                slots,
                cache,
            )  # [B, P + K - 1, H]
        finally:
            cache.write_slots = None
        anchor = (counts - 1).clamp(min=0)[:, None, None].expand(-1, 1, out.shape[-1])  # [B, 1, H] (idle: 0)
        block = torch.cat([out.gather(1, anchor), out[:, width:]], dim=1)  # [B, K, H]
        top = self.head_logits(block).topk(self.tree.width, dim=-1).indices  # [B, K, width] draft ids
        return self.tree.tokens(roots, head.draft_to_target(top))  # [B, N] target ids

    def _graph_state(self) -> tuple:
        """What the compiled pass reads besides its arguments: the head cache's buffers, the tree and the
        fused step's rotary table (made again when a grown cache asks)."""
        table = getattr(self.head_step, "table", None)
        return (*super()._graph_state(), None if table is None else table[0].data_ptr())

    @inference_mode
    def accept(
        self,
        tokens: Tensor,
        lengths: Sequence[int],
        hidden: dict[int, Tensor],
        next_roots: Sequence[int],
    ) -> None:
        """Row b's lengths[b] accepted tokens [B, K'] (root first) with their states {layer: [B, K', H]}:
        pending positions whose next tokens are the following accepted token, then the next root."""
        device = self._device()
        counts = torch.tensor(list(lengths))  # [B]
        ids = next_ids_of(tokens.cpu(), counts, torch.tensor(list(next_roots)))  # [B, K']
        self.pending = (self._fused(hidden), ids.to(device), host_to_device(counts, device))
        self.host_counts, self._redo = counts.tolist(), None

    def _keep_rows(self, rows: Sequence[int]) -> Tensor:
        """The pending positions and the redo state of these rows too."""
        pick = super()._keep_rows(rows)
        fused, ids, counts = self.pending
        self.pending = (fused[pick], ids[pick], counts[pick])
        if self.host_counts is not None:
            self.host_counts = [self.host_counts[r] for r in rows]
        if self._redo is not None:  # (a propose again drafts the kept rows' last pass)
            (fused, ids, counts), lengths = self._redo
            self._redo = (fused[pick], ids[pick], counts[pick]), lengths[pick]
        return pick

    # ---- one draft ahead (engine/loop.py): the accepted paths still on the device -----------------------

    @inference_mode
    def accept_queued(self, hidden, tokens, paths, ks, nexts) -> None:
        """`accept` from device tensors: the trees' states {l: [B, N, H]} and tokens [B, N], paths [B, >= P]
        (ascending, the last node repeated), K [B] and next tokens [B]: P pending positions, K_b real."""
        device, width = self._device(), self.commit_width
        paths = paths[:, :width].to(device)  # [B, P]
        counts = ks.to(device)
        ids = next_ids_of(tokens.to(device).gather(1, paths), counts, nexts.to(device))  # [B, P]
        self.pending = (self._fused(paths_states(hidden, paths)), ids, counts)
        self.host_counts, self._redo = None, None
