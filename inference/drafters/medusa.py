"""Medusa drafting: every head's top-k at the last committed position fills a static tree.

Head k at position t predicts token t+2+k; the root (token t+1) comes from the target itself, so a
node at depth d (root = 0) with child rank r carries head (d-1)'s r-th best token. All branches at one
depth share that head's candidates, as in the reference design.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from spechead.heads.fused import fused_medusa_logits
from spechead.heads.grad import inference_mode
from spechead.heads.medusa import MedusaHead
from spechead.inference.devices import host_to_device
from spechead.inference.drafters.base import BatchDraft, BatchDrafter, Draft, Drafter
from spechead.inference.drafters.topk import Chunk, resolve_chunk, topk_rows
from spechead.inference.sampling import SamplingParams
from spechead.inference.tree import TokenTree, depth_first, tree_from_choices

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
    """Static-tree drafting with Medusa heads (children deterministic: lossless rule A when sampling)."""

    def __init__(self, head: MedusaHead, choices: list[list[int]] | None = None):
        self.head = head.eval()
        # head k's logits (B, T, H) -> (B, T, V), without module calls where the blocks allow
        self.head_logits = fused_medusa_logits(head) or head.head_logits
        depth_limit = head.config.num_heads
        choices = [c for c in (choices or DEFAULT_MEDUSA_CHOICES) if len(c) <= depth_limit]
        # parents [N], depth [N], rank [N]; depth-first: the greedy main path is nodes 0..d (contiguous)
        self.static = depth_first(tree_from_choices(choices))
        self.choices: list[list[int]] = choices
        # Precomputed once: which heads run, how many candidates each gives, where they go.
        depth, rank = self.static.depth, self.static.rank  # [N], [N]
        self._width = int(rank.max()) + 1 if len(rank) > 1 else 1
        # node i >= 1's candidate among the heads' [K * width] (head depth - 1, its rank-th best), on
        # the heads' device (moved by `fill` when they move)
        self._pick = (depth[1:] - 1) * self._width + rank[1:]  # [N - 1]
        self._used_heads = int(depth.max())  # heads deeper than the tree never run
        self.hidden_layers = (head.config.target_layers[0],)
        # the heads' device and dtype: a kept Parameter follows head.to() and load_state_dict, and
        # `next(head.parameters())` walks every submodule (each pass); heads without ResBlocks whose
        # projections are int8 (heads/int8.py) have no parameter left: their first floating buffer
        floating = (b for b in head.buffers() if b.is_floating_point())
        self._weight = next(itertools.chain(head.parameters(), floating))
        self.last_hidden: torch.Tensor | None = None  # [H] target state of the last cached token
        # one row's kept buffers (`_one_row`): ids [1 + K * width] (the root's slot, then the heads' top
        # ids), top values [1, K, width], the ids' views [1] (root) and [1, K, width] (top ids), and pick
        # [N] into ids
        self._row: tuple[torch.Tensor, ...] | None = None
        # each head's best ids: over the chunks with the largest maxima for long rows (topk.py; None:
        # one torch.topk); Medusa heads score the target's whole vocabulary
        self.topk_chunk: Chunk = "auto"

    def check_target(self, hidden_size: int, vocab_size: int, num_layers: int) -> None:
        self.head.check_target(hidden_size, vocab_size, num_layers)

    @inference_mode
    def start(self, prompt: torch.Tensor, hidden: dict[int, torch.Tensor], root: int) -> None:
        self.last_hidden = hidden[self.hidden_layers[0]][-1]

    @inference_mode
    def propose(self, root: int, sampling: SamplingParams, generator: torch.Generator | None) -> Draft:
        assert self.last_hidden is not None  # start made it
        if self._used_heads:
            tokens = self._one_row(self.last_hidden, root)  # [N]
        else:  # a root-only tree
            tokens = self.fill(self.last_hidden[None], [root])[0]
        return Draft(TokenTree.trusted(tokens, self.static.parents))  # validated once, when built

    @inference_mode
    def accept(self, tokens: torch.Tensor, hidden: dict[int, torch.Tensor], next_root: int) -> None:
        self.last_hidden = hidden[self.hidden_layers[0]][-1]

    @inference_mode
    def accept_path(
        self, tokens: list[int], hidden: dict[int, torch.Tensor], path: list[int], next_root: int
    ) -> None:
        """`accept` from the tree's states {layer: [1, N, H]}: the path's last node's state, read directly."""
        if type(self).accept is not MedusaDrafter.accept:  # a subclass's own `accept` hears every path
            super().accept_path(tokens, hidden, path, next_root)
            return
        self.last_hidden = hidden[self.hidden_layers[0]][0, path[-1]]  # [H]

    def with_tree(self, choices: list[list[int]]) -> MedusaDrafter:
        """The same heads with another static tree (rank paths, see `tree_from_choices`)."""
        other = MedusaDrafter(self.head, choices)
        other.topk_chunk = self.topk_chunk
        return other

    def batched(self) -> MedusaBatchDrafter:
        return MedusaBatchDrafter(self)

    @inference_mode
    def fill(self, states: torch.Tensor, roots: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """The static tree's tokens [B, N] for rows with last target states [B, H] and roots [B] (ints, or
        a device tensor: engine/loop.py): each head runs ONCE over all rows. The tokens stay on the
        heads' device: on a GPU the verify is queued behind the heads, no wait (the acceptance reads the
        accepted tokens with its transfer)."""
        weight = self._weight
        state = states.to(weight.device, weight.dtype)[:, None]  # [B, 1, H] (the target may run elsewhere)
        if isinstance(roots, torch.Tensor):
            root_ids = roots.to(weight.device)[:, None]  # [B, 1]
        else:
            root_ids = host_to_device(torch.tensor(list(roots))[:, None], weight.device)  # [B, 1] (no wait)
        if not self._used_heads:  # a root-only tree
            return root_ids.clone()
        logits = [self.head_logits(k, state)[:, 0] for k in range(self._used_heads)]  # K x [B, V]
        candidates = topk_rows(torch.stack(logits, 1), self._width, self.topk_chunk)[1]  # [B, K, width]
        if self._pick.device != weight.device:
            self._pick = self._pick.to(weight.device)
        # node i >= 1 (depth-first: the root is the only node at depth 0) carries candidate pick[i - 1]
        return torch.cat([root_ids, candidates.flatten(1).index_select(1, self._pick)], dim=1)  # [B, N]

    def _one_row(self, state: torch.Tensor, root: int | torch.Tensor) -> torch.Tensor:
        """`fill` for one row, the last target state [H] (at least one head runs) and the root (an int, or
        a one-element device tensor: medusa_ahead.py): the heads' top ids written after the root's slot
        of a kept buffer, the tree's tokens [N] taken by ONE gather (a new tensor). On a CPU every op costs after the heads' forwards: no tensor from a host list, no
        concatenation with the root, no per-head views."""
        weight = self._weight
        if state.dtype != weight.dtype or state.device != weight.device:  # (`to` costs even as a no-op)
            state = state.to(weight.device, weight.dtype)
        x = state.view(1, 1, -1)  # [1, 1, H]
        logits = torch.cat([self.head_logits(k, x) for k in range(self._used_heads)], 1)  # [1, K, V]
        row = self._row
        if row is None or row[1].dtype != logits.dtype or row[0].device != logits.device:
            k, width, device = self._used_heads, self._width, logits.device
            ids = torch.zeros(1 + k * width, dtype=torch.long, device=device)
            values = torch.empty(1, k, width, dtype=logits.dtype, device=device)
            pick = torch.cat([self._pick.new_zeros(1), self._pick + 1]).to(device)  # [N], root first
            row = self._row = (ids, values, ids[:1], ids[1:].view(1, k, width), pick)
        ids, values, root_slot, top, pick = row
        chunk = resolve_chunk(self.topk_chunk, logits.device.type, logits.shape[-1])
        if chunk is None:
            torch.topk(logits, self._width, dim=-1, out=(values, top))
        else:  # long rows: the chunked search's ids, copied in
            top.copy_(topk_rows(logits, self._width, chunk)[1])
        if isinstance(root, torch.Tensor):  # still on the device: copied there, no wait
            root_slot.copy_(root.view(1))
        else:
            root_slot.fill_(root)  # (an item assignment makes a tensor of the int first)
        return ids.index_select(0, pick)  # [N]


class MedusaBatchDrafter(BatchDrafter):
    """Medusa for B rows: one call per head over every row's last target state, the static tree for all."""

    def __init__(self, drafter: MedusaDrafter) -> None:
        self.drafter = drafter
        self.layer = drafter.hidden_layers[0]
        self.last_hidden: torch.Tensor | None = None  # [B, H] target state of each row's last cached token
        self._parents = drafter.static.parents  # [N] the static tree's, kept on the tokens' device

    @inference_mode
    def start(self, prompts, hidden, roots) -> None:
        self.last_hidden = torch.stack([h[self.layer][-1] for h in hidden])  # [B, H]

    def propose(self, roots, sampling, generators) -> BatchDraft:
        assert self.last_hidden is not None  # start made it
        return self._draft(self.drafter.fill(self.last_hidden, roots))

    def _draft(self, tokens: torch.Tensor) -> BatchDraft:
        """The rows' trees of tokens [B, N] (every row the static tree)."""
        if self._parents.device != tokens.device:  # (on a GPU, the verify packs both on the device)
            self._parents = self._parents.to(tokens.device)
        return BatchDraft(tokens, self._parents.expand_as(tokens), [tokens.shape[1]] * tokens.shape[0])

    @inference_mode
    def accept(self, tokens, lengths, hidden, next_roots) -> None:
        states = hidden[self.layer]  # [B, K, H]
        last = torch.tensor(lengths, device=states.device) - 1  # [B]
        self.last_hidden = states[torch.arange(states.shape[0], device=states.device), last]

    @inference_mode
    def keep(self, rows) -> None:
        assert self.last_hidden is not None  # start made it
        self.last_hidden = self.last_hidden[torch.tensor(rows, device=self.last_hidden.device)]

    # one draft ahead (engine/loop.py): the accepted paths still on the device
    commit_width = 1  # `accept_queued` reads each path's last entry only

    def queues(self) -> bool:
        return True

    @inference_mode
    def accept_queued(self, hidden, tokens, paths, ks, nexts) -> None:
        """Each row's next state: the verified trees' states {l: [B, N, H]} at its path's last node (paths
        [B, >= 1], ascending, the last node repeated: the last entry)."""
        states = hidden[self.layer]  # [B, N, H]
        last = paths[:, -1:].to(states.device)  # [B, 1]
        self.last_hidden = states.gather(1, last[:, :, None].expand(-1, -1, states.shape[-1]))[:, 0]

    def propose_queued(self, nexts: torch.Tensor) -> BatchDraft:
        """`propose` from the next tokens [B] on the device."""
        assert self.last_hidden is not None  # accept_queued set it
        return self._draft(self.drafter.fill(self.last_hidden, nexts))

    def settle(self, ks, nexts) -> None:
        """Nothing: the heads keep no count of their own."""
