"""Medusa head accuracy (as summable counts) and the teacher-forced chain acceptance it implies."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from spechead.training.losses import medusa_head_targets, medusa_offset, shifted_targets


@torch.no_grad()
def medusa_topk_counts(
    logits: list[Tensor], input_ids: Tensor, loss_mask: Tensor, topk: Sequence[int] = (1, 5)
) -> tuple[Tensor, Tensor]:
    """Top-k hits of each head against input_ids[:, t+2+k] on loss-masked targets.

    logits: K tensors (B, T, V). Returns (correct (K, len(topk)) float, total (K,) float): counts, not
    ratios, so they can be summed over batches and processes before `counts_to_accuracy`. A k larger
    than the vocabulary counts as the whole vocabulary.
    """
    # On the logits' device, so a distributed all-reduce (NCCL needs GPU tensors) can sum them as is.
    device = logits[0].device if logits else None
    correct = torch.zeros(len(logits), len(topk), device=device)
    total = torch.zeros(len(logits), device=device)
    for k, logits_k in enumerate(logits):
        rows, targets = medusa_head_targets(logits_k, k, input_ids, loss_mask)  # (N, V), (N,)
        kmax = min(max(topk), rows.shape[-1])
        hits = rows.topk(kmax, dim=-1).indices == targets[:, None]  # (N, kmax)
        for j, kk in enumerate(topk):
            correct[k, j] = hits[:, :kk].any(dim=-1).sum()
        total[k] = targets.numel()
    return correct, total


def counts_to_accuracy(correct: Tensor, total: Tensor) -> Tensor:
    """Accuracy (K, len(topk)) from counts; a head with no valid position reads 0."""
    return correct / total.clamp(min=1).unsqueeze(-1)


@torch.no_grad()
def medusa_chains(logits: list[Tensor], input_ids: Tensor, loss_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Whether each head's top-1 is right at every position: (right (K, B, T) bool, anchor (B, T) bool, the
    positions whose next token (t+1, the chain's root) is a target). A head whose target t+2+k is masked
    or past the end counts as wrong there, since a chain cannot be accepted beyond it."""
    if not logits:
        return torch.zeros(0, *input_ids.shape, dtype=torch.bool), torch.zeros_like(
            input_ids, dtype=torch.bool
        )
    seq_len = logits[0].shape[1]
    _, anchor = shifted_targets(input_ids, loss_mask, 1, seq_len)  # (B, T): target's own token counts
    rows = []
    for k, logits_k in enumerate(logits):
        targets, valid = shifted_targets(input_ids, loss_mask, medusa_offset(k), seq_len)  # (B, T)
        rows.append((logits_k.argmax(dim=-1) == targets) & valid)
    return torch.stack(rows), anchor


def simulated_chain_tau(correct_top1: Tensor) -> float:
    """Teacher-forced tokens per target pass for a greedy Medusa chain.

    correct_top1: (K, N) bool, head k right at position n. Mean over positions of 1 (the target's
    own token) + the number of leading heads that are all right. 0.0 when N == 0.
    """
    if correct_top1.ndim != 2:
        raise ValueError(f"correct_top1 must be (K, N), got shape {tuple(correct_top1.shape)}")
    if correct_top1.shape[1] == 0:
        return 0.0
    leading = correct_top1.bool().long().cumprod(dim=0).sum(dim=0)  # (N,)
    return float(1.0 + leading.float().mean())


def align_chain(step_correct: list[Tensor]) -> Tensor:
    """Stack per-step correctness so a chain reads down one column.

    step_correct[j] (B, T) bool: the depth-(j+1) draft at position t was right. A chain anchored at s
    uses step j at position s + j, so the result (D, B, T) holds step_correct[j][:, s + j] at [j, :, s]
    (False past the end).
    """
    rows = []
    for j, correct in enumerate(step_correct):
        shifted = torch.zeros_like(correct, dtype=torch.bool)
        shifted[:, : correct.shape[1] - j] = correct[:, j:].bool()
        rows.append(shifted)
    return torch.stack(rows)


def chain_counts(correct: Tensor) -> dict[str, Tensor]:
    """Summable chain statistics of correct (D, N) bool (depth d+1 draft right, for chain n).

    tau_sum / positions is the simulated acceptance length; depth_correct[d] / positions the
    fraction of chains whose depth-(d+1) draft is right (regardless of the ones before it).
    """
    n = correct.shape[1]
    return {
        "tau_sum": torch.tensor(simulated_chain_tau(correct) * n),
        "positions": torch.tensor(float(n)),
        "depth_correct": correct.float().sum(dim=1).cpu(),  # (D,)
    }


def walked_counts(correct: Tensor, stand: Tensor) -> dict[str, Tensor]:
    """Summable counts of the chains decoding would draft: correct (D, B, T) bool (the depth-(d+1) draft of
    the chain anchored at t is right), stand (B, T) bool (anchors a pass can start from: their root is an
    answer token and their first draft has a target).

    Each row is walked as greedy decoding walks it: from the first anchor of each answer, a pass accepts
    a = the anchor's leading right drafts and the next pass starts at anchor + 1 + a. walk_tokens /
    walk_passes is then the tau decoding would see on these tokens. Why beside `chain_counts`: that one
    averages over every anchor, but decoding drafts once a pass, after a miss, so a run the head gets right
    counts once there and at each of its positions in chain_counts (which overstates decoding)."""
    leading = correct.long().cumprod(dim=0).sum(dim=0).tolist()  # (B, T) host lists
    tokens = passes = 0
    for row_leading, row_stand in zip(leading, stand.tolist()):
        t = 0
        while t < len(row_stand):
            if not row_stand[t]:  # outside an answer: on to the next answer's first anchor
                t += 1
                continue
            tokens, passes = tokens + 1 + row_leading[t], passes + 1
            t += 1 + row_leading[t]
    return {"walk_tokens": torch.tensor(float(tokens)), "walk_passes": torch.tensor(float(passes))}


def answer_roots(batch: dict) -> Tensor:
    """(B, T) bool: the token after t (an anchor's root, the first token of its pass) is a loss token."""
    mask = batch["loss_mask"].bool()
    return torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], dim=1)


def chain_summary(counts: dict[str, Tensor]) -> dict[str, float]:
    """tau, per-depth greedy accuracy and, from `walked_counts` when present, tau_walked from summed
    counts."""
    n = counts["positions"].clamp(min=1)
    out = {"tau": float(counts["tau_sum"] / n)}
    if "walk_passes" in counts:
        out["tau_walked"] = float(counts["walk_tokens"] / counts["walk_passes"].clamp(min=1))
    out.update({f"acc/depth{d + 1}": float(c / n) for d, c in enumerate(counts["depth_correct"])})
    return out


def best_score(metrics: dict[str, float]) -> tuple[str, float] | None:
    """Which validation metric picks OUT/best and its value: `tau_walked` when reported (the tau decoding
    would see), else `tau`; None when neither is (no validation split)."""
    for name in ("tau_walked", "tau"):
        if name in metrics:
            return name, metrics[name]
    return None
