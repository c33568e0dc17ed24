"""Medusa drafting: every head's top-k at the last committed position fills a static tree.

Head k at position t predicts token t+2+k; the root (token t+1) is the target's, so a node at depth d
with rank r carries head (d-1)'s r-th best token (all branches at one depth share that head's candidates).
Only each row's last target state is kept, so the queued form (engine/loop.py) is the same draft from a
path and a next token still on the device: no shape depends on the path, nothing to settle.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from spechead.heads.fused import fused_medusa_logits
from spechead.heads.grad import inference_mode
from spechead.heads.medusa import MedusaHead
from spechead.inference.devices import host_ids, host_to_device
from spechead.inference.drafters.base import BatchDraft, Drafter, paths_states
from spechead.inference.drafters.block_tree import BlockTree
from spechead.inference.drafters.topk import Chunk, resolve_chunk, topk_rows
from spechead.inference.sampling import SamplingParams

# A 24-node default (plus the root): wide near the root, a long greedy spine for easy text.
DEFAULT_MEDUSA_CHOICES: list[list[int]] = [
    [0], [1], [2], [3],
    [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0],
    [0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0], [0, 0, 2],
    [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0], [0, 1, 0, 0],
    [0, 0, 0, 0, 0], [0, 0, 0, 0, 1],
    [0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 0],
]  # fmt: skip


class MedusaDrafter(Drafter):
    """Static-tree drafting with Medusa heads for B rows (children deterministic: lossless rule A when
    sampling). Row b's tree is the tree a batch of one of that row proposes."""

    tunes_tree = True  # `with_tree` swaps its static tree
    last_hidden: torch.Tensor  # [B, H] target state of each row's last cached token (made by `start`)

    def __init__(self, head: MedusaHead, choices: list[list[int]] | None = None):
        self.head = head.eval()
        # head k's logits [B, T, H] -> [B, T, V], without module calls where the blocks allow
        self.head_logits = fused_medusa_logits(head) or head.head_logits
        # head k is block slot k; depth-first, the greedy path is nodes 0..d
        self.tree = BlockTree(choices or DEFAULT_MEDUSA_CHOICES, head.config.num_heads)
        self.choices: list[list[int]] = self.tree.choices
        self.hidden_layers = (head.config.target_layers[0],)
        # the heads' device and dtype from a kept Parameter (no module walk each pass); int8 heads
        # without ResBlocks (heads/int8.py) have no parameter left: their first floating buffer
        floating = (b for b in head.buffers() if b.is_floating_point())
        self._weight = next(itertools.chain(head.parameters(), floating))
        # a batch of one's parents: ONE kept [1, N] on the host (the target runner knows the very tensor
        # again without reading it: target/tree_inputs.py); B rows' are expanded on the tokens' device
        self._parents_one = self.tree.static.parents[None]  # [1, N]
        # `_draft`'s kept buffers: ids [B, 1 + K * width] (root, then the heads' top ids), top values
        # [B, K, width], the ids' views [B, 1] and [B, K, width], and pick [N] into a row of ids
        self._row: tuple[torch.Tensor, ...] | None = None
        # each head's best ids: over the chunks with the largest maxima for long rows (topk.py; None:
        # one torch.topk); Medusa heads score the target's whole vocabulary
        self.topk_chunk: Chunk = "auto"

    def with_tree(self, choices: list[list[int]]) -> MedusaDrafter:
        """The same heads with another static tree (rank paths, see `tree_from_choices`)."""
        other = MedusaDrafter(self.head, choices)
        other.topk_chunk = self.topk_chunk
        return other

    # ---- read first: host roots and paths ---------------------------------------------------------------

    @inference_mode
    def start(
        self, prompts: Sequence[torch.Tensor], hidden: Sequence[dict[int, torch.Tensor]], roots: Sequence[int]
    ) -> None:
        """New rows (whatever came before): each row's last prompt state {layer: [T_b, H]} -> [B, H]."""
        self.last_hidden = torch.stack([h[self.hidden_layers[0]][-1] for h in hidden])  # [B, H]

    @inference_mode
    def propose(
        self,
        roots: Sequence[int],
        sampling: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> BatchDraft:
        """Every row's static tree from its last state and roots [B] (host ints); sampling and generators
        are not read (the children are each head's top ids)."""
        return self._draft(self.last_hidden, roots)

    @inference_mode
    def accept(
        self,
        tokens: torch.Tensor,
        lengths: Sequence[int],
        hidden: dict[int, torch.Tensor],
        next_roots: Sequence[int],
    ) -> None:
        """Each row's state at its last accepted token: states {layer: [B, K, H]}, row b's lengths[b]."""
        self.last_hidden = _take(hidden[self.hidden_layers[0]], [k - 1 for k in lengths])  # [B, H]

    @inference_mode
    def accept_paths(
        self,
        tokens: Sequence[list[int]],
        hidden: dict[int, torch.Tensor],
        paths: Sequence[list[int]],
        next_roots: Sequence[int],
    ) -> None:
        """`accept` from the trees' states {layer: [B, N, H]}: each path's last node's state."""
        if type(self).accept is not MedusaDrafter.accept:  # a subclass's own `accept` hears every path
            super().accept_paths(tokens, hidden, paths, next_roots)
            return
        self.last_hidden = _take(hidden[self.hidden_layers[0]], [p[-1] for p in paths])  # [B, H]

    @inference_mode
    def keep(self, rows: Sequence[int]) -> None:
        """Only these rows, in this order: their last states [B', H]."""
        self.last_hidden = self.last_hidden[host_ids(list(rows), self.last_hidden.device)]  # [B', H]

    # ---- one draft ahead (engine/loop.py): the accepted paths still on the device -----------------------

    @inference_mode
    def accept_queued(self, hidden, tokens, paths, ks, nexts) -> None:
        """Each row's next state: the verified trees' states {l: [B, N, H]} at its path's last node (paths
        [B, >= 1], ascending, the last node repeated: the last entry, a device index)."""
        layer = self.hidden_layers[0]
        self.last_hidden = paths_states({layer: hidden[layer]}, paths[:, -1:])[layer][:, 0]  # [B, H]

    @inference_mode
    def propose_queued(self, nexts: torch.Tensor) -> BatchDraft:
        """`propose` from the next tokens [B] on the device (written there: no wait)."""
        return self._draft(self.last_hidden, nexts)

    def _draft(self, states: torch.Tensor, roots: Sequence[int] | torch.Tensor) -> BatchDraft:
        """The rows' static trees (tokens [B, N] on the heads' device) from last target states [B, H] and
        roots [B] (ints or a device tensor): each head runs ONCE over all rows into a kept buffer, then ONE
        gather (on a CPU every op costs about as much as the heads' small GEMMs)."""
        weight, batch, depth, width = self._weight, states.shape[0], self.tree.depth, self.tree.width
        if states.dtype != weight.dtype or states.device != weight.device:  # (`to` costs even as a no-op)
            states = states.to(weight.device, weight.dtype)  # (the target may run elsewhere)
        logits = None  # [B, K, V] (a root-only tree runs no head)
        if depth:
            x = states[:, None]  # [B, 1, H]
            logits = torch.cat([self.head_logits(k, x) for k in range(depth)], 1)
        dtype, row = weight.dtype if logits is None else logits.dtype, self._row
        if row is None or row[1].dtype != dtype or row[0].shape[0] != batch or row[0].device != states.device:
            ids = torch.zeros(batch, 1 + depth * width, dtype=torch.long, device=states.device)
            values = torch.empty(batch, depth, width, dtype=dtype, device=states.device)
            pick = torch.cat([self.tree.pick.new_zeros(1), self.tree.pick + 1]).to(states.device)  # [N]
            row = self._row = (ids, values, ids[:, :1], ids[:, 1:].view(batch, depth, width), pick)
        ids, values, root_slot, top, pick = row
        if logits is not None:
            chunk = resolve_chunk(self.topk_chunk, logits.device.type, logits.shape[-1])
            if chunk is None:
                torch.topk(logits, width, dim=-1, out=(values, top))
            else:  # long rows: the chunked search's ids, copied in
                top.copy_(topk_rows(logits, width, chunk)[1])
        if isinstance(roots, torch.Tensor):  # still on the device: copied there, no wait
            root_slot.copy_(roots.view(batch, 1))
        elif batch == 1:
            root_slot.fill_(roots[0])  # (an item assignment makes a tensor of the int first)
        else:
            root_slot.copy_(host_to_device(torch.tensor(list(roots))[:, None], weight.device))  # (no wait)
        tokens = ids.index_select(1, pick)  # [B, N]
        parents = self._parents_one if batch == 1 else self.tree.batch_parents(batch, tokens.device)
        return BatchDraft(tokens, parents, [tokens.shape[1]] * batch)


def _take(states: torch.Tensor, last: list[int]) -> torch.Tensor:
    """Row b's state at node last[b]: states [B, N, H] -> [B, H] (a batch of one: a view, no copy)."""
    if len(last) == 1:
        return states[:, last[0]]
    rows = torch.arange(len(last), device=states.device)  # [B]
    return states[rows, host_ids(last, states.device)]
