"""P-EAGLE drafting: ONE head forward per pass drafts every row's block of K tokens.

The head keeps its own KV cache of committed positions (a `RowCache`, row b holding lengths[b]
entries). A pass writes, per row, the positions committed since the last pass (their fused target states
and next tokens; the last one, whose next token is the root, is the anchor) and K - 1 future positions
right after them, and attends causally by slot: each row's block sees its own prefix only. The futures'
K/V are scratch (the committed length moves past the real entries only), overwritten next pass.

Slot s of row b is target position s, so rotary positions are the slots. Rows with fewer new positions
than the longest are padded AFTER their block (scratch slots no real query sees).

The tree: a static tree of rank paths (`choices`, as Medusa's): a node at depth d with rank r carries the
r-th best token of block slot d - 1. The default is the chain of the K best tokens (the paper's draft).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from spechead.heads.decoder_layer import additive_mask
from spechead.heads.grad import inference_mode
from spechead.heads.peagle import PEagleHead
from spechead.inference.drafters.base import BatchDraft, BatchDrafter
from spechead.inference.sampling import SamplingParams
from spechead.inference.target.cache import RowCache
from spechead.inference.target.runner import TargetRunner
from spechead.inference.tree import depth_first, tree_from_choices


class PEagleDrafter(BatchDrafter):
    """B rows' static trees (default: a chain of K) from ONE P-EAGLE head forward per pass (children
    deterministic: rule A when sampling). Row b's tree is the tree a batch of one of that row proposes."""

    tunes_tree = True

    def __init__(self, head: PEagleHead, choices: list[list[int]] | None = None):
        self.head = head.eval()
        k = head.block_size
        choices = [c for c in (choices or [[0] * (d + 1) for d in range(k)]) if len(c) <= k]
        self.choices: list[list[int]] = choices
        self.static = depth_first(tree_from_choices(choices))  # parents, depth, rank [N]
        depth, rank = self.static.depth, self.static.rank
        self._width = int(rank.max()) + 1 if len(rank) > 1 else 1
        self._pick = (depth[1:] - 1) * self._width + rank[1:]  # [N - 1] into the block's [K * width]
        self.max_nodes = len(choices) + 1
        self.hidden_layers = tuple(head.config.target_layers)
        self.cache: RowCache | None = None
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # per row: fused [n, H], next ids [n]

    def check_target(self, hidden_size: int, vocab_size: int, num_layers: int) -> None:
        self.head.check_target(hidden_size, vocab_size, num_layers)

    def with_tree(self, choices: list[list[int]]) -> PEagleDrafter:
        """The same head with another static tree (rank paths)."""
        return PEagleDrafter(self.head, choices)

    def _fused(self, states: dict[int, torch.Tensor]) -> torch.Tensor:
        """Target states {layer: [..., n, H]} -> fused [..., n, H] in the head's dtype and device."""
        weight = self.head.fc.weight
        return self.head.fuse([states[layer].to(weight.device, weight.dtype) for layer in self.hidden_layers])

    @inference_mode
    def start(
        self, prompts: Sequence[torch.Tensor], hidden: Sequence[dict[int, torch.Tensor]], roots: Sequence[int]
    ) -> None:
        """New rows: every prompt position is pending (its next token: the prompt's, the root after the last)."""
        device = self.head.fc.weight.device
        self.pending = []
        for prompt, states, root in zip(prompts, hidden, roots):
            ids = torch.cat([prompt.reshape(-1)[1:].to(device), torch.tensor([root], device=device)])
            self.pending.append((self._fused(states), ids))
        longest = max(ids.numel() for _, ids in self.pending)
        self.cache = RowCache(1, batch=len(prompts), max_length=2 * (longest + self.head.block_size))

    @inference_mode
    def propose(
        self,
        roots: Sequence[int],
        sampling: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> BatchDraft:
        """Every row's tree: ONE head forward over all rows' pending positions and blocks (sampling and
        generators are not read: the children are each slot's top ids)."""
        assert self.cache is not None  # start made it
        head, cache, k = self.head, self.cache, self.head.block_size
        device = head.fc.weight.device
        batch, new = len(self.pending), max(ids.numel() for _, ids in self.pending)
        lengths = list(cache.lengths)
        width = new + k - 1  # queries per row: the new positions (padded), then the block
        view = max(lengths) + width
        if view > cache.max_length:
            cache.grow(2 * view)
        hidden = torch.zeros(batch, new, head.config.hidden_size, dtype=head.fc.weight.dtype, device=device)
        next_ids = torch.zeros(batch, new, dtype=torch.long, device=device)
        slots = torch.zeros(batch, width, dtype=torch.long)
        anchors = []
        for b, (fused, ids) in enumerate(self.pending):
            n = ids.numel()
            hidden[b, :n], next_ids[b, :n] = fused, ids
            # real entries at length.., the block right after the anchor, padding after the block
            order = list(range(n)) + list(range(n + k - 1, new + k - 1)) + list(range(n, n + k - 1))
            slots[b] = lengths[b] + torch.tensor(order)
            anchors.append(n - 1)
        slots = slots.to(device)
        future_hidden, future_ids = head.future_inputs(batch, k - 1)
        keys = torch.arange(view, device=device)
        allowed = keys[None, None, :] <= slots[:, :, None]  # (B, Q, S): causal by slot
        cache.write_slots, cache.view_length = slots, view
        try:
            out = head.step(
                torch.cat([hidden, future_hidden], dim=1),
                torch.cat([next_ids, future_ids], dim=1),
                additive_mask(allowed, hidden.dtype),
                slots,
                cache,
            )  # (B, new + K - 1, H)
        finally:
            cache.write_slots = None
        rows = torch.arange(batch, device=device)
        anchor_out = out[rows, torch.tensor(anchors, device=device)]  # (B, H)
        block = torch.cat([anchor_out[:, None], out[:, new:]], dim=1)  # (B, K, H)
        top = head.logits(block).topk(self._width, dim=-1).indices  # (B, K, width) draft ids
        candidates = head.draft_to_target(top).flatten(1)  # (B, K * width) target ids
        root_ids = torch.tensor(list(roots), device=device)[:, None]  # (B, 1)
        tokens = torch.cat([root_ids, candidates.index_select(1, self._pick.to(device))], dim=1)  # (B, N)
        cache.set_lengths([length + ids.numel() for length, (_, ids) in zip(lengths, self.pending)])
        self.pending = [(fused[:0], ids[:0]) for fused, ids in self.pending]
        parents = self.static.parents.to(device)[None].expand(batch, -1)
        return BatchDraft(tokens, parents, [tokens.shape[1]] * batch)

    @inference_mode
    def accept(
        self,
        tokens: torch.Tensor,
        lengths: Sequence[int],
        hidden: dict[int, torch.Tensor],
        next_roots: Sequence[int],
    ) -> None:
        """Row b's lengths[b] accepted tokens [B, K'] (root first) with their states {layer: [B, K', H]}:
        pending positions whose next tokens are the following accepted token, then the next root."""
        fused = self._fused(hidden)  # (B, K', H)
        device = fused.device
        for b, (n, root) in enumerate(zip(lengths, next_roots)):
            ids = torch.cat([tokens[b, 1:n].to(device), torch.tensor([root], device=device)])
            self.pending[b] = (fused[b, :n], ids)

    @inference_mode
    def keep(self, rows: Sequence[int]) -> None:
        """Only these rows, in this order."""
        assert self.cache is not None
        self.cache.keep_rows(list(rows))
        self.pending = [self.pending[r] for r in rows]


def assumed_peagle_accuracy(head: PEagleHead) -> torch.Tensor:
    """A typical trained P-EAGLE head's accuracy [K, 4] (block slot 0 top-1 0.7, each later slot x0.85:
    parallel slots lose more per depth than EAGLE's steps), to size batch trees without a measured table."""
    ranks = torch.tensor([0.70, 0.08, 0.03, 0.02], dtype=torch.float64)
    return torch.stack([ranks * 0.85**d for d in range(head.block_size)])


@inference_mode
def measure_peagle_accuracy(
    model,
    head: PEagleHead,
    sequences: list[torch.Tensor],
    depth: int,
    topk: int,
    starts: Sequence[int] | None = None,
) -> torch.Tensor:
    """accuracy [K, topk] of a P-EAGLE head: accuracy[d, r] = share of anchors whose block slot d's r-th
    candidate is the sequence's token at anchor + 2 + d (one parallel forward per sequence, every anchor;
    `depth` is ignored: a block has K slots). An anchor counts when it is >= starts[i] - 1 (references
    generated, not prompt) and the token exists; tokens outside the draft vocab are misses."""
    starts = [0] * len(sequences) if starts is None else list(starts)
    k, weight = head.block_size, head.fc.weight
    hits = torch.zeros(k, topk, dtype=torch.long)
    counts = torch.zeros(k, dtype=torch.long)
    runner = TargetRunner(model, tuple(head.config.target_layers))
    for seq, start in zip(sequences, starts):
        seq = seq.reshape(-1).long().cpu()  # [T]
        hidden = runner.prefill([seq])[1][0]  # {l: [T, H]}
        fused = head.fuse(
            [hidden[layer].to(weight.device, weight.dtype)[None] for layer in head.config.target_layers]
        )
        anchors = torch.arange(max(start - 1, 0), max(len(seq) - 2, 0))  # (A,): anchor a drafts a + 2 ..
        if not anchors.numel():
            continue
        cand = (
            head.parallel_logits(fused, seq[None].to(weight.device), anchors)[0].topk(topk, -1).indices.cpu()
        )
        for d in range(k):
            ok = anchors + 2 + d < len(seq)  # (A,)
            ref = head.target_to_draft(seq[(anchors + 2 + d)[ok]].to(weight.device)).cpu()  # -1: outside
            hits[d] += (cand[ok, d] == ref[:, None]).sum(0)
            counts[d] += int(ok.sum())
    return hits.double().div(counts.clamp(min=1)[:, None]).float()
