"""P-EAGLE: every position is the anchor of a K-token block, all depths trained in one parallel forward.

Depth 0 is the real position a (EAGLE-3's step 0: it predicts x_{a+2}); depth j >= 1 is future position
j of anchor a (it predicts x_{a+2+j}). Depth j's loss is the KL to the target distribution at a + 1 + j
restricted to the draft vocabulary (EAGLE-3's step loss), weighted decay**j, averaged over every valid
(anchor, depth) of the batch.

Memory (sequence partitioning): the real pass runs once; the anchors' blocks run in `partitions` groups
over its keys/values, each inside activation checkpointing, so backward recomputes one group at a time
and the gradients of all groups accumulate into the same step. The head's peak is then about
1 + ceil((K - 1) / partitions) logit sets and layer passes per position instead of K (see `work`);
e.g. K = 8 at max_length 2048 with partitions = 7 stays below EAGLE-3's 7-step TTT.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from spechead.heads.families import Work
from spechead.heads.peagle import PEagleConfig, PEagleHead
from spechead.heads.unroll import ttt_valid
from spechead.training.eagle_losses import eagle3_step_loss, step_weights
from spechead.training.errors import TrainError
from spechead.training.metrics import answer_roots, chain_counts, walked_counts
from spechead.training.objectives.base import Recipe
from spechead.training.objectives.eagle import next_token_valid, shift_left
from spechead.training.objectives.eagle3 import Eagle3LossConfig, Eagle3Objective, install_draft_vocab


@dataclass
class PEagleLossConfig(Eagle3LossConfig):
    """`head.loss.*` for P-EAGLE: EAGLE-3's decay (depth j's loss weight is decay**j) and the partitions."""

    partitions: int = 1  # anchor groups recomputed one at a time in backward (1 = one forward for all)
    # COD sampling (speculators' P-EAGLE recipe): while training, depth j >= 1 keeps about
    # max(cod_ratio**j, cod_min) of the anchors, nested (an anchor kept at depth j is kept at j - 1: its
    # block's earlier positions are what depth j attends to); 1.0 keeps every anchor at every depth.
    cod_ratio: float = 1.0
    cod_min: float = 0.2

    def __post_init__(self) -> None:
        if isinstance(self.partitions, bool) or self.partitions < 1:
            raise TrainError(f"head.loss.partitions must be an int >= 1, got {self.partitions!r}")
        for name in ("cod_ratio", "cod_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise TrainError(f"head.loss.{name} must be a number in (0, 1], got {value!r}")


def cod_depths(count: int, depth: int, ratio: float, floor: float, device: torch.device) -> Tensor:
    """COD sampling: how many future positions each of `count` anchors trains, (count,) long in 0..depth;
    P(>= j) = max(ratio**j, floor), so the anchors kept at depth j are a subset of those kept at j - 1."""
    keep = torch.tensor([max(ratio**j, floor) for j in range(1, depth + 1)], device=device)  # (depth,)
    draws = torch.rand(count, 1, device=device)  # (count, 1): one draw an anchor, compared at every depth
    return (draws < keep).sum(-1)  # keep is non-increasing: the kept depths are a prefix 1..d


def shifted(x: Tensor, j: int) -> Tensor:
    """x[:, t + j] at t, False/0 past the end: (B, T, ...) -> (B, T, ...)."""
    out = torch.zeros_like(x)
    out[:, : x.shape[1] - j] = x[:, j:]
    return out


class ParallelModel(nn.Module):
    """The head's parallel forward with its per-depth losses inside one forward, so DDP sees every gradient."""

    def __init__(
        self, head: PEagleHead, weights: list[float], partitions: int, cod: tuple[float, float] = (1, 1)
    ):
        super().__init__()
        self.head = head
        self.weights = weights
        self.partitions = partitions
        self.cod = cod  # (cod_ratio, cod_min): anchors dropped per depth while training (1: none)

    def forward(self, states: list[Tensor], target_logits: Tensor, batch: dict):
        """states: 3 x (B, T, H); target_logits (B, T, V). Returns loss, per-depth correct (K,) and count
        (K,), and hits (K, B, T) bool: depth j's draft at anchor t equals the target's greedy token."""
        head, weights = self.head, self.weights
        ids, mask = batch["input_ids"], batch["attention_mask"]
        target_next = shift_left(target_logits)  # (B, T, V): at t the target's distribution for x_{t+2}
        target_top = target_next.argmax(-1)  # (B, T)
        predicted = next_token_valid(batch) & mask.bool()  # (B, T): x_{t+2} is a loss token
        in_draft = head.t2d.bool()[target_top] & predicted  # (B, T): positions whose CE is counted
        # Depth j at anchor a uses row a + j of the depth-0 tables; every mean is over the whole batch.
        valid = [shifted(predicted, j) for j in range(len(weights))]
        useful = torch.stack(valid).any(0).any(0)  # (T,): anchors with some counted depth
        anchors = useful.nonzero().squeeze(-1)  # (A,)
        depths = torch.full_like(anchors, len(weights) - 1)  # (A,) future positions each anchor trains
        if torch.is_grad_enabled() and self.cod[0] < 1:  # COD sampling: training only, evaluation sees all
            depths = cod_depths(anchors.numel(), len(weights) - 1, *self.cod, device=anchors.device)
            reach = torch.zeros_like(useful, dtype=torch.long).index_put_((anchors,), depths)  # (T,)
            valid = [v & (reach >= j)[None] if j else v for j, v in enumerate(valid)]
        denom = [max(int((shifted(in_draft, j) & v).sum()), 1) for j, v in enumerate(valid)]
        real, kv = head.real_forward(head.fuse(states), ids, mask)
        logits0 = head.logits(real)  # (B, T, Vd)
        loss0, right0, n0 = eagle3_step_loss(logits0, target_next, head.t2d, valid[0])
        total = weights[0] * loss0  # (its mean is over denom[0] entries already)
        hits = torch.zeros(len(weights), *ids.shape, dtype=torch.bool, device=ids.device)  # (K, B, T)
        hits[0] = (head.draft_to_target(logits0.argmax(-1)) == target_top) & valid[0]
        correct, count = [right0.float()], [n0.float()]
        part_correct = torch.zeros(len(weights) - 1, device=ids.device)
        part_count = torch.zeros_like(part_correct)
        for depth in depths.unique().tolist():  # one block length per group (all K - 1 without COD)
            if depth == 0:
                continue
            for group in anchors[depths == depth].chunk(self.partitions):
                args = (kv, group, depth, mask, target_next, target_top, valid, denom)
                if torch.is_grad_enabled() and self.partitions > 1:
                    out = checkpoint(self._blocks, *args, use_reentrant=False)
                else:
                    out = self._blocks(*args)
                part_loss, part_right, part_n, part_hits = out
                total = total + part_loss
                part_correct[:depth] += part_right
                part_count[:depth] += part_n
                hits[1 : depth + 1, :, group] = part_hits
        correct.extend(part_correct.unbind())
        count.extend(part_count.unbind())
        return total, torch.stack(correct), torch.stack(count), hits

    def _blocks(self, kv, anchors, depth, mask, target_next, target_top, valid, denom):
        """One anchor group's blocks of `depth` future positions over the real pass's per-layer keys/values
        `kv`: (weighted loss sum, correct (depth,), count (depth,), hits (depth, B, A))."""
        head = self.head
        future = head.block_forward(kv, mask.bool(), anchors, depth)  # (B, A, depth, H)
        total = torch.zeros((), device=mask.device)
        right, count, hits = [], [], []
        for j in range(1, depth + 1):
            rows = (anchors + j).clamp(max=target_next.shape[1] - 1)  # (A,) depth j reads row a + j
            ok = valid[j][:, anchors]  # (B, A)
            logits = head.logits(future[:, :, j - 1])  # (B, A, Vd)
            loss, n_right, n = eagle3_step_loss(logits, target_next[:, rows], head.t2d, ok)
            counted = int((head.t2d.bool()[target_top[:, rows]] & ok).sum())
            total = total + self.weights[j] * loss * (counted / denom[j])
            right.append(n_right.float())
            count.append(n.float())
            hits.append((head.draft_to_target(logits.argmax(-1)) == target_top[:, rows]) & ok)
        return total, torch.stack(right), torch.stack(count), torch.stack(hits)


class PEagleObjective(Eagle3Objective):
    """P-EAGLE on a frozen target (EAGLE-3's logging and summary; its own model and chain alignment)."""

    def __init__(self, head: PEagleHead, cfg: PEagleLossConfig):
        self.head = head
        self.cfg = cfg
        self.partitions = cfg.partitions
        weights = step_weights(head.block_size, cfg.decay)
        self.model = ParallelModel(head, weights, cfg.partitions, (cfg.cod_ratio, cfg.cod_min))

    def work(self) -> Work:
        """Per trained position: the real pass (one logit set, num_layers layer passes, its causal mask) plus
        one partition's share c of the K - 1 future positions (backward recomputes one partition at a time):
        its mask has T * c queries over T + T * c keys."""
        cfg = cast(PEagleConfig, self.head.config)
        share = math.ceil((cfg.block_size - 1) / self.partitions)
        layers = int(cfg.num_layers)
        return Work(1 + share, int(cfg.draft_vocab_size), (1 + share) * layers, 1.0 + share * (1 + share))

    def eval_counts(self, model, target, batch):
        loss, correct, count, hits = self._run(model, target, batch)
        anchors = next_token_valid(batch) & ttt_valid(batch["attention_mask"], 0)  # as EAGLE-3's chains
        return {
            "loss_sum": loss.detach().cpu() * count[0].cpu(),
            "correct": correct,  # (K,)
            "count": count,  # (K,)
            **chain_counts(hits[:, anchors]),  # a chain reads its anchor's K depths: no alignment
            **walked_counts(hits, anchors & answer_roots(batch)),
        }


def longest(rows) -> int:
    """The longest `input_ids` among training rows (a collection of row sets is walked in turn)."""
    best = 0
    for row in rows:
        best = max(best, len(row["input_ids"]) if isinstance(row, dict) else longest(row))
    return best


def _make(head: PEagleHead, target, loss: PEagleLossConfig, sections, train_data) -> PEagleObjective:
    if train_data is not None:
        length = longest(train_data)
        if length and head.block_size + 2 > length:
            raise TrainError(
                f"head.block_size={head.block_size} needs sequences of at least block_size + 2 = "
                f"{head.block_size + 2} tokens, but the longest training sequence has {length}: lower "
                "head.block_size or raise trainer.max_length"
            )
    objective = PEagleObjective(head, loss)
    coverage = install_draft_vocab(head, train_data, target.lm_head.weight)
    objective.notes.append(
        f"draft vocabulary: {head.config.draft_vocab_size} tokens cover {coverage:.2%} of training targets"
    )
    return objective


RECIPE = Recipe(PEagleConfig, PEagleLossConfig, _make)
# P-EAGLE: EAGLE-3's head and draft vocabulary, K drafts per forward (heads/peagle.py).
