"""DFlash drafting: ONE head forward over every row's block proposes its tree (default: a chain of
block_size - 1 tokens).

Each row's context keys / values (the fused target states injected, `DFlashHead.inject`) live in the
head's `RowCache` [B, kv, S, D] a layer, row b committed to L_b. A proposal runs the block [root, MASK, ...]
at positions L_b .. L_b + block_size - 1 against its row's context (a mask hides the slots from L_b on);
block position j scores the token j steps after the root. A commit writes W positions at slots L_b ..
L_b + W - 1 (one fixed-shape scatter a layer) and moves L_b by k_b <= W: the slots past k_b are scratch,
masked and overwritten by the next commit. The forward never writes the block's K/V: nothing is cropped.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from spechead.heads.decoder_layer import additive_mask
from spechead.heads.dflash import MASK, DFlashHead
from spechead.heads.fused_block import fused_block
from spechead.heads.grad import inference_mode
from spechead.inference.devices import host_to_device
from spechead.inference.drafters.base import padded_prompts, paths_states
from spechead.inference.drafters.block_tree import BlockTree
from spechead.inference.drafters.parallel import ParallelDrafter


class DFlashDrafter(ParallelDrafter):
    """Every row's static tree (default: a chain of block_size - 1 drafts) from one head forward, for any
    number of rows. tree: "chain", or rank paths over the block's positions (see `block_tree`)."""

    head: DFlashHead
    eager_reads_whole_cache = True  # (`_tokens`: the cache's every slot, masked by the lengths)

    def __init__(self, head: DFlashHead, tree: str | list[list[int]] = "chain"):
        if isinstance(tree, str) and tree != "chain":
            raise ValueError(f"a DFlash drafter's tree is 'chain' or a list of rank paths, got tree={tree!r}")
        self.block_size = head.config.block_size
        super().__init__(head, BlockTree(None if isinstance(tree, str) else tree, self.block_size - 1))
        # short chains of ops on the head's weights where its layer kind allows (heads/fused_block.py): on a
        # CPU the layer modules' overhead is as large as their arithmetic
        fused = fused_block(head)
        self.head_forward = fused or head
        self.head_inject = fused.inject if fused is not None else head.inject  # (a commit's keys / values)

    def _commit(self, context: Tensor, counts: Tensor) -> None:
        """Write every row's W context positions (context [B, W, H]) at slots L_b .. L_b + W - 1 and move
        L_b by counts [B] (device); the cache doubles when a row's slots would pass its end."""
        cache, lengths, width = self.cache, self.lengths_t, context.shape[1]
        cache.grow(max(cache.lengths) + width)  # (host lengths >= device ones before this commit)
        slots = lengths[:, None] + torch.arange(width, device=context.device)  # [B, W]
        for layer, (keys, values) in zip(cache.row_layers, self.head_inject(context, slots)):  # [B, kv, W, D]
            if not layer.is_initialized:  # (its buffers hold the cache's rows, compiled more than B)
                layer.lazy_initialization(keys, values)
            layer.keys.scatter_(2, slots[:, None, :, None].expand_as(keys), keys)
            layer.values.scatter_(2, slots[:, None, :, None].expand_as(values), values)
        self.lengths_t = lengths + counts

    @inference_mode
    def start(
        self, prompts: Sequence[Tensor], hidden: Sequence[dict[int, Tensor]], roots: Sequence[int]
    ) -> None:
        """New rows: each prompt's states {layer: [T_b, H]} become its committed context."""
        tokens, states = padded_prompts(prompts, hidden, self.hidden_layers)  # [B, T], {l: [B, T, H]}
        self._new_rows(len(prompts), 2 * (tokens.shape[1] + self.tree.depth + 1))  # (room to grow into)
        self.accept(tokens, [len(p) for p in prompts], states, roots)

    def _draft(self, roots: Tensor) -> Tensor:
        """Every row's tree tokens [B, N] from its root [B] (device) and its committed context."""
        return self._over_rows(self._draft_fn, self.cache.batch, roots.shape[0], roots, self.lengths_t)

    def _tokens(self, roots: Tensor, lengths: Tensor) -> Tensor:
        """The fixed-shape draft: roots [B] and committed lengths [B] over the cache's context buffers ->
        every row's tree tokens [B, N]."""
        device, size, batch = roots.device, self.block_size, roots.shape[0]
        kv = [(layer.keys, layer.values) for layer in self.cache.row_layers]  # [B, kv, S, D] each, in place
        block = torch.cat([roots[:, None], torch.full((batch, size - 1), MASK, device=device)], dim=1)
        positions = lengths[:, None] + torch.arange(size, device=device)  # [B, bs]
        span = kv[0][0].shape[2]
        seen = torch.arange(span, device=device)[None] < lengths[:, None]  # [B, S] committed slots
        allowed = torch.cat([seen, seen.new_ones(batch, size)], dim=1)[:, None].expand(-1, size, -1)
        hidden = self.head_forward(block, positions, kv, additive_mask(allowed, self.head.fc.weight.dtype))
        top = self.head.logits(hidden[:, 1:]).topk(self.tree.width, dim=-1).indices  # [B, bs-1, width]
        return self.tree.tokens(roots, top)  # [B, N]

    @inference_mode
    def accept(
        self, tokens: Tensor, lengths: Sequence[int], hidden: dict[int, Tensor], next_roots: Sequence[int]
    ) -> None:
        """Row b's first lengths[b] states {layer: [B, K, H]} (root + accepted drafts) join its context."""
        context = self._fused(hidden)  # [B, K, H]
        self._commit(context, host_to_device(torch.tensor(list(lengths)), context.device))
        self.settle(lengths)

    # ---- one draft ahead (engine/loop.py): the accepted paths still on the device -----------------------

    @inference_mode
    def accept_queued(self, hidden, tokens, paths, ks, nexts) -> None:
        """`accept` from device tensors: the verified trees' states {l: [B, N, H]}, each row's path
        [B, >= P] (ascending, the last node repeated) and its K [B]: P positions written, L_b moves by K_b."""
        context = self._fused(paths_states(hidden, paths[:, : self.commit_width]))  # [B, P, H]
        self._commit(context, ks.to(context.device))
