"""DFlash: several blocks per sequence per step, each predicted in one forward of the head.

Anchors c are drawn among the positions whose block has something to learn (x_{c+2} is a loss token);
each anchor's block holds x_{c+1} then masks, and block position j >= 1 predicts x_{c+1+j}: the target's
distribution at position c + j (`block_targets`). Position j's loss is the soft cross-entropy to that
distribution over the target vocabulary, weighted decay**(j-1) (a later position only counts once every
earlier one was accepted); accuracy per position and the simulated chain tau go through training.metrics
as EAGLE-3's do (the drafts of one block form the chain).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from spechead.heads.dflash import DFlashConfig, DFlashHead
from spechead.training.eagle_losses import soft_cross_entropy, step_weights
from spechead.training.errors import TrainError
from spechead.training.metrics import answer_roots, chain_counts, chain_summary, walked_counts
from spechead.training.objectives.base import Objective, Recipe

EVAL_SEED = 0  # evaluation draws the same anchors every time, so its metrics compare across steps
WALK_QUERIES = 4096  # block queries per forward when evaluation drafts from every anchor


@dataclass
class DFlashLossConfig:
    """`head.loss.*` for DFlash."""

    decay: float = 0.8  # block position j's loss weight is decay**(j-1)
    anchors: int = 0  # blocks per sequence per step; 0 = T // block_size (about T block queries)


def pick_anchors(batch: dict, count: int, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Up to `count` distinct random anchors per row -> anchors (B, A) long and ok (B, A) bool.

    A candidate anchor c has a real x_{c+1} and a loss token x_{c+2} (its first draft has a target). A row
    with fewer candidates fills its remaining slots with anchors that are not ok (their loss is masked)."""
    candidate = candidates(batch)
    batch_size, length = candidate.shape
    scores = torch.rand(batch_size, length, generator=generator).to(candidate.device)  # (B, T)
    scores = scores.masked_fill(~candidate, -1.0)
    top = scores.topk(min(count, length), dim=1)
    return top.indices, top.values >= 0


def candidates(batch: dict) -> Tensor:
    """(B, T) bool: anchors c with a real x_{c+1} and a loss token x_{c+2} (a first draft to learn)."""
    loss_mask, attention = batch["loss_mask"].bool(), batch["attention_mask"].bool()
    candidate = torch.zeros_like(loss_mask)
    candidate[:, : loss_mask.shape[1] - 2] = attention[:, 1:-1] & loss_mask[:, 2:]
    return candidate


def block_targets(values: Tensor, anchors: Tensor, block_size: int) -> Tensor:
    """values (B, T, ...) at the positions block position j >= 1 learns from: values[c + j] ->
    (B, A, block_size - 1, ...) (clamped at the sequence's end; `block_valid` masks those)."""
    length = values.shape[1]
    offsets = torch.arange(1, block_size, device=anchors.device)  # (bs-1,)
    index = (anchors[..., None] + offsets).clamp(max=length - 1).flatten(1)  # (B, A*(bs-1))
    rows = torch.arange(values.shape[0], device=values.device)[:, None]
    return values[rows, index].view(*anchors.shape, block_size - 1, *values.shape[2:])


def block_valid(loss_mask: Tensor, anchors: Tensor, ok: Tensor, block_size: int) -> Tensor:
    """(B, A, block_size - 1) bool: block position j >= 1 of an ok anchor c predicts x_{c+1+j}, a loss
    token inside the sequence."""
    length = loss_mask.shape[1]
    predicted = anchors[..., None] + 1 + torch.arange(1, block_size, device=anchors.device)  # (B, A, bs-1)
    inside = predicted < length
    token = loss_mask.bool().gather(1, predicted.clamp(max=length - 1).flatten(1)).view_as(predicted)
    return inside & token & ok[..., None]


class BlockModel(nn.Module):
    """The head over every anchor's block with its per-position losses inside one forward (DDP sees
    every gradient)."""

    def __init__(self, head: DFlashHead, weights: list[float]):
        super().__init__()
        self.head = head
        self.weights = weights

    def forward(self, states: list[Tensor], target_logits: Tensor, batch: dict, anchors: Tensor, ok: Tensor):
        """states: the target layers' (B, T, H); target_logits (B, T, V); anchors, ok (B, A).
        Returns loss, per position (correct, count) each (bs-1,), and hits (bs-1, B, A) bool."""
        head, size = self.head, self.head.config.block_size
        hidden = head.predict_blocks(head.fuse(states), batch["input_ids"], anchors, batch["attention_mask"])
        targets = block_targets(target_logits, anchors, size)  # (B, A, bs-1, V)
        valid = block_valid(batch["loss_mask"], anchors, ok, size)  # (B, A, bs-1)
        total = torch.zeros((), device=target_logits.device)
        correct, count, hits = [], [], []
        for j, weight in enumerate(self.weights):  # one position's (N, V) rows alive at a time
            logits = head.logits(hidden[:, :, j + 1])  # (B, A, V)
            keep = valid[:, :, j]
            rows, target_rows = logits[keep], targets[:, :, j][keep].detach()  # (N, V)
            probs = torch.softmax(target_rows.float(), dim=-1)
            total = total + weight * soft_cross_entropy(rows, probs).sum() / keep.sum().clamp(min=1)
            hit = (logits.argmax(-1) == targets[:, :, j].argmax(-1)) & keep  # (B, A)
            hits.append(hit)
            correct.append(hit.sum())
            count.append(keep.sum())
        return total, torch.stack(correct).float(), torch.stack(count).float(), torch.stack(hits)


class DFlashObjective(Objective):
    """DFlash on a frozen target."""

    needs_logits = True

    def __init__(self, head: DFlashHead, cfg: DFlashLossConfig):
        self.head = head
        self.cfg = cfg
        self.model = BlockModel(head, step_weights(head.config.block_size - 1, cfg.decay))

    def module(self) -> nn.Module:
        return self.model

    def _count(self, batch: dict) -> int:
        return self.cfg.anchors or max(1, batch["input_ids"].shape[1] // self.head.config.block_size)

    def _run(self, model, target, batch, generator=None):
        anchors, ok = pick_anchors(batch, self._count(batch), generator)
        cap = self.capture(target, batch)
        return (*model(cap.hidden, cap.logits, batch, anchors, ok), ok)

    def loss(self, model, target, batch, step):
        loss, correct, count, _, _ = self._run(model, target, batch)
        acc = (correct / count.clamp(min=1)).tolist()
        return loss, {f"acc/step{j}": a for j, a in enumerate(acc)}

    def eval_counts(self, model, target, batch):
        generator = torch.Generator().manual_seed(EVAL_SEED)
        anchors, ok = pick_anchors(batch, self._count(batch), generator)
        cap = self.capture(target, batch)
        loss, correct, count, hits = model(cap.hidden, cap.logits, batch, anchors, ok)
        return {
            "loss_sum": loss.detach().cpu() * count[0].cpu(),
            "correct": correct.cpu(),  # (bs-1,)
            "count": count.cpu(),  # (bs-1,)
            **chain_counts(hits[:, ok]),  # the chain of one block: its positions in order
            **self._walk(cap, batch),
        }

    @torch.no_grad()
    def _walk(self, cap, batch: dict) -> dict[str, Tensor]:
        """`walked_counts` over blocks at EVERY anchor (decoding's walk needs each one it may land on): the
        context fused and injected once, then WALK_QUERIES block queries per forward, each block position's
        top-1 against the target's greedy token (as `BlockModel` scores `hits`)."""
        head, size = self.head, self.head.config.block_size
        anchor_ok = candidates(batch)  # (B, T)
        batch_size, length = anchor_ok.shape
        context = head.fuse(cap.hidden)  # (B, T, H)
        kv = head.inject(context, torch.arange(length, device=context.device).expand(batch_size, length))
        target_top = cap.logits.argmax(-1)  # (B, T)
        correct = torch.zeros(size - 1, batch_size, length, dtype=torch.bool, device=anchor_ok.device)
        per = max(WALK_QUERIES // (batch_size * size), 1)  # anchors per forward
        for first in range(0, length, per):
            span = torch.arange(first, min(first + per, length), device=anchor_ok.device)  # (A,)
            ok = anchor_ok[:, span]  # (B, A)
            if not ok.any():
                continue
            anchors = span.expand(batch_size, -1)  # (B, A)
            blocks = head.predict_blocks(context, batch["input_ids"], anchors, batch["attention_mask"], kv)
            valid = block_valid(batch["loss_mask"], anchors, ok, size)  # (B, A, bs-1)
            targets = block_targets(target_top, anchors, size)  # (B, A, bs-1)
            for j in range(size - 1):  # one position's (B, A, V) logits at a time
                right = head.logits(blocks[:, :, j + 1]).argmax(-1) == targets[:, :, j]  # (B, A)
                correct[j][:, span] = right & valid[:, :, j]
        return walked_counts(correct, anchor_ok & answer_roots(batch))

    def summarize(self, counts):
        acc = counts["correct"] / counts["count"].clamp(min=1)
        out = {"loss": float(counts["loss_sum"] / counts["count"][0].clamp(min=1))}
        out.update({f"acc/step{j}_top1": float(a) for j, a in enumerate(acc)})
        out.update(chain_summary(counts))
        return out


def longest_row(rows: Iterable[Any]) -> int:
    """The most tokens of one training row (rows of input_ids, or collections of such rows)."""
    most = 0
    for item in rows:
        if isinstance(item, Mapping):
            most = max(most, len(item["input_ids"]))
        elif not isinstance(item, (str, bytes)):
            most = max(most, longest_row(item))
    return most


def _make(head: DFlashHead, target, loss: DFlashLossConfig, sections, train_data) -> DFlashObjective:
    if loss.anchors < 0:
        raise TrainError(
            f"head.loss.anchors must be >= 0 (0 = sequence length // block_size), got {loss.anchors}"
        )
    size = head.config.block_size
    longest = longest_row(train_data) if train_data is not None else 0
    if train_data is not None and size + 1 > longest:
        raise TrainError(
            f"head.block_size={size} needs sequences of at least {size + 1} tokens (an anchor and its "
            f"block) but the longest training sequence has {longest}: lower head.block_size"
        )
    return DFlashObjective(head, loss)


RECIPE = Recipe(DFlashConfig, DFlashLossConfig, _make)
