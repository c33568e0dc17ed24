"""EAGLE-3: fused low/mid/high target states, training-time test over `steps` unrolled drafts.

Step j's output at t predicts x_{t+2} like step 0, but from a context whose last j features are the
head's own (see spechead.heads.unroll). Each step's loss is the KL to the target distribution at
t + 1 restricted to the draft vocabulary, weighted decay**j; it is computed step by step so only one
step's draft logits and one restricted copy of the target distribution are alive at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from spechead.heads.eagle3 import Eagle3Config, Eagle3Head
from spechead.heads.unroll import ttt_forward, ttt_valid
from spechead.training.draft_vocab import build_draft_vocab, token_frequencies
from spechead.training.eagle_losses import eagle3_step_loss, step_weights
from spechead.training.metrics import align_chain, answer_roots, chain_counts, chain_summary, walked_counts
from spechead.training.objectives.base import Objective, Recipe
from spechead.training.objectives.eagle import next_token_valid, shift_left

DEFAULT_DRAFT_VOCAB = 32000


@dataclass
class Eagle3LossConfig:
    """`head.loss.*` for EAGLE-3."""

    decay: float = 0.8  # step j's loss weight is decay**j


class TTTModel(nn.Module):
    """The head unrolled with its per-step losses inside one forward, so DDP sees every gradient."""

    def __init__(self, head: Eagle3Head, weights: list[float]):
        super().__init__()
        self.head = head
        self.weights = weights

    def forward(self, states: list[torch.Tensor], target_logits: torch.Tensor, batch: dict):
        """states: 3 x (B, T, H); target_logits (B, T, V). Returns loss, per-step (correct, count, hits)."""
        head = self.head
        outputs = ttt_forward(
            head, head.fuse(states), batch["input_ids"], batch["attention_mask"], len(self.weights)
        )
        target_next = shift_left(target_logits)  # (B, T, V): the target's distribution for x_{t+2}
        target_top = target_next.argmax(-1)  # (B, T)
        predicted = next_token_valid(batch)
        total = torch.zeros((), device=target_logits.device)
        correct, count, hits = [], [], []
        for j, (out, weight) in enumerate(zip(outputs, self.weights)):
            valid = predicted & ttt_valid(batch["attention_mask"], j)
            logits = head.logits(out)  # (B, T, Vd)
            loss, right, n = eagle3_step_loss(logits, target_next, head.t2d, valid)
            total = total + weight * loss
            correct.append(right)
            count.append(n)
            hits.append((head.draft_to_target(logits.argmax(-1)) == target_top) & valid)
        return total, torch.stack(correct).float(), torch.stack(count).float(), hits


class Eagle3Objective(Objective):
    """EAGLE-3 on a frozen target."""

    needs_logits = True

    def __init__(self, head: Eagle3Head, cfg: Eagle3LossConfig, steps: int):
        self.head = head
        self.cfg = cfg
        self.model: nn.Module = TTTModel(head, step_weights(steps, cfg.decay))

    def module(self) -> nn.Module:
        return self.model

    def _run(self, model, target, batch):
        cap = self.capture(target, batch)
        return model(cap.hidden, cap.logits, batch)

    def loss(self, model, target, batch, step):
        loss, correct, count, _ = self._run(model, target, batch)
        acc = (correct / count.clamp(min=1)).tolist()
        return loss, {f"acc/step{j}": a for j, a in enumerate(acc)}

    def eval_counts(self, model, target, batch):
        loss, correct, count, hits = self._run(model, target, batch)
        anchors = next_token_valid(batch) & ttt_valid(batch["attention_mask"], 0)
        chains = align_chain(hits)  # (D, B, T)
        return {
            "loss_sum": loss.detach().cpu() * count[0].cpu(),
            "correct": correct,  # (steps,)
            "count": count,  # (steps,)
            **chain_counts(chains[:, anchors]),
            **walked_counts(chains, anchors & answer_roots(batch)),
        }

    def summarize(self, counts):
        acc = counts["correct"] / counts["count"].clamp(min=1)
        out = {"loss": float(counts["loss_sum"] / counts["count"][0].clamp(min=1))}
        out.update({f"acc/step{j}_top1": float(a) for j, a in enumerate(acc)})
        out.update(chain_summary(counts))
        return out


def install_draft_vocab(head: Eagle3Head, train_data, lm_head_weight: torch.Tensor) -> float:
    """Pick the draft vocabulary from loss-masked token counts of the training data; returns coverage."""
    freqs = token_frequencies(train_data, head.config.vocab_size)
    d2t, t2d, coverage = build_draft_vocab(freqs, head.config.draft_vocab_size)
    head.set_draft_vocab(d2t, t2d)
    head.init_lm_head_from_target_(lm_head_weight)
    return coverage


def _make(head: Eagle3Head, target, loss: Eagle3LossConfig, sections, train_data) -> Eagle3Objective:
    objective = Eagle3Objective(head, loss, head.config.ttt_steps)
    coverage = install_draft_vocab(head, train_data, target.lm_head.weight)
    objective.notes.append(
        f"draft vocabulary: {head.config.draft_vocab_size} tokens cover {coverage:.2%} of training targets"
    )
    return objective


RECIPE = Recipe(Eagle3Config, Eagle3LossConfig, _make)
