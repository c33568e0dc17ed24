"""DFlash drafting: ONE head forward over every row's block proposes a chain of block_size - 1 tokens.

Each row keeps its context keys / values per drafter layer for the positions in the target cache (the
fused target states injected, `DFlashHead.inject`), in one padded buffer per layer [B, kv, S, D] with each
row's committed length. A proposal runs the block [root, MASK, ...] of every row at positions
length_b .. length_b + block_size - 1 against its own committed context (a mask hides the other rows'
padding); block position j's argmax is the depth-j node of the row's chain. Children are deterministic
(lossless rule A when sampling too). Read-first only: the loop reads each acceptance before the next draft.

Why its own buffer, not a RowCache: the head's forward takes the context K/V as a prefix, never writes
the block's, so a commit is one scatter of the accepted positions' K/V and nothing is cropped.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from spechead.heads.decoder_layer import additive_mask
from spechead.heads.dflash import MASK, DFlashHead
from spechead.heads.grad import inference_mode
from spechead.inference.drafters.base import BatchDraft, BatchDrafter
from spechead.inference.sampling import SamplingParams


class DFlashDrafter(BatchDrafter):
    """A chain of block_size - 1 drafts per row from one head forward, for any number of rows."""

    def __init__(self, head: DFlashHead, tree: str = "chain"):
        if tree != "chain":
            raise ValueError(f"a DFlash drafter proposes a chain (tree='chain'), got tree={tree!r}")
        self.head = head.eval()
        self.block_size = head.config.block_size
        self.hidden_layers = tuple(head.config.target_layers)
        self.max_nodes = self.block_size
        self.kv: list[tuple[Tensor, Tensor]] = []  # per layer, keys / values [B, kv, S, D]
        self.lengths: list[int] = []  # row b's committed context positions

    def check_target(self, hidden_size: int, vocab_size: int, num_layers: int) -> None:
        self.head.check_target(hidden_size, vocab_size, num_layers)

    def _device(self) -> torch.device:
        return self.head.fc.weight.device

    def _context(self, hidden: dict[int, Tensor]) -> Tensor:
        """Target states {layer: [B, K, H]} -> fused context features [B, K, H] on the head's device."""
        return self.head.fuse([hidden[layer].to(self._device()) for layer in self.hidden_layers])

    def _write(self, context: Tensor, counts: Sequence[int]) -> None:
        """Append row b's first counts[b] context positions (context [B, K, H]) to its committed K/V."""
        batch, width = context.shape[:2]
        device = context.device
        starts = torch.tensor(self.lengths, device=device)  # [B]
        positions = starts[:, None] + torch.arange(width, device=device)  # [B, K]
        new = self.head.inject(context, positions)  # per layer [B, kv, K, D]
        need = max(s + c for s, c in zip(self.lengths, counts))
        rows = torch.arange(batch, device=device)[:, None]  # [B, 1]
        slots = positions.clamp(max=need - 1)  # [B, K] (slots past a row's count are overwritten later)
        keep = torch.arange(width, device=device)[None] < torch.tensor(list(counts), device=device)[:, None]
        grown = []
        for index, (keys, values) in enumerate(new):
            if len(self.kv) <= index:
                old_k = keys.new_zeros(batch, keys.shape[1], 0, keys.shape[3])
                old_v = values.new_zeros(batch, values.shape[1], 0, values.shape[3])
            else:
                old_k, old_v = self.kv[index]
            if old_k.shape[2] < need:  # grow (doubling: rare); padded slots are masked by each row's length
                pad = max(need, 2 * old_k.shape[2]) - old_k.shape[2]
                old_k = torch.cat([old_k, old_k.new_zeros(*old_k.shape[:2], pad, old_k.shape[3])], dim=2)
                old_v = torch.cat([old_v, old_v.new_zeros(*old_v.shape[:2], pad, old_v.shape[3])], dim=2)
            for buffer, fresh in ((old_k, keys), (old_v, values)):
                current = buffer.permute(0, 2, 1, 3)  # [B, S, kv, D] view
                fresh = fresh.permute(0, 2, 1, 3)  # [B, K, kv, D]
                current[rows.expand_as(slots)[keep], slots[keep]] = fresh[keep]
            grown.append((old_k, old_v))
        self.kv = grown
        self.lengths = [s + c for s, c in zip(self.lengths, counts)]

    @inference_mode
    def start(
        self, prompts: Sequence[Tensor], hidden: Sequence[dict[int, Tensor]], roots: Sequence[int]
    ) -> None:
        """New rows: each prompt's states {layer: [T_b, H]} become its committed context."""
        width = max(len(p) for p in prompts)
        padded = {}
        for layer in self.hidden_layers:
            rows = [h[layer] for h in hidden]  # [T_b, H] each
            padded[layer] = torch.stack(
                [torch.cat([r, r.new_zeros(width - r.shape[0], r.shape[1])]) for r in rows]
            )  # [B, T, H]
        self.kv, self.lengths = [], [0] * len(prompts)
        self._write(self._context(padded), [len(p) for p in prompts])

    @inference_mode
    def propose(
        self,
        roots: Sequence[int],
        sampling: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> BatchDraft:
        """Every row's chain [root, d_1 .. d_{bs-1}] from ONE head forward over all rows' blocks."""
        device, size, batch = self._device(), self.block_size, len(roots)
        block = torch.full((batch, size), MASK, dtype=torch.long, device=device)
        block[:, 0] = torch.tensor(list(roots), device=device)
        lengths = torch.tensor(self.lengths, device=device)  # [B]
        positions = lengths[:, None] + torch.arange(size, device=device)  # [B, bs]
        span = self.kv[0][0].shape[2]
        seen = torch.arange(span, device=device)[None] < lengths[:, None]  # [B, S] committed slots
        allowed = torch.cat([seen, seen.new_ones(batch, size)], dim=1)[:, None].expand(-1, size, -1)
        hidden = self.head(block, positions, self.kv, additive_mask(allowed, self.head.fc.weight.dtype))
        drafts = self.head.logits(hidden[:, 1:]).argmax(-1)  # [B, bs-1]
        tokens = torch.cat([block[:, :1], drafts], dim=1)  # [B, bs]
        parents = torch.arange(-1, size - 1, device=device).expand(batch, -1)  # a chain
        return BatchDraft(tokens, parents, [size] * batch)

    @inference_mode
    def accept(
        self, tokens: Tensor, lengths: Sequence[int], hidden: dict[int, Tensor], next_roots: Sequence[int]
    ) -> None:
        """Row b's first lengths[b] states {layer: [B, K, H]} (root + accepted drafts) join its context."""
        self._write(self._context(hidden), lengths)

    @inference_mode
    def keep(self, rows: Sequence[int]) -> None:
        """Only these rows, in this order."""
        pick = torch.tensor(list(rows), device=self._device())
        self.kv = [(k[pick], v[pick]) for k, v in self.kv]
        self.lengths = [self.lengths[r] for r in rows]


def assumed_dflash_accuracy(head: DFlashHead) -> Tensor:
    """A typical trained DFlash head's accuracy [block_size - 1, 4] (top-1 0.8 at the first draft, x0.93
    a position): sizes nothing yet (a DFlash drafter proposes its chain), there for the registry's call."""
    ranks = torch.tensor([0.80, 0.06, 0.02, 0.01], dtype=torch.float64)
    return torch.stack([ranks * 0.93**d for d in range(head.config.block_size - 1)])


def measure_dflash_accuracy(
    model, head: DFlashHead, sequences, *, depth=None, topk: int = 4, starts=None
) -> Tensor:
    """Not built yet: a DFlash drafter proposes a chain, so no tree is tuned from a measured table."""
    raise NotImplementedError("measuring a DFlash head's accuracy table is not built yet (it drafts a chain)")
