"""Medusa training loss and the target alignment it shares with the metrics.

Alignment: Medusa head k's logits at position t predict token t+2+k (the target predicts t+1), and a
position counts only where `loss_mask` marks that predicted token as a target.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


def medusa_offset(k: int) -> int:
    """How many tokens ahead head k predicts: 2 + k (the target itself predicts 1 ahead)."""
    return 2 + k


def shifted_targets(input_ids: Tensor, loss_mask: Tensor, offset: int, seq_len: int) -> tuple[Tensor, Tensor]:
    """Token `offset` ahead of each of `seq_len` positions and whether it counts.

    input_ids, loss_mask: (B, S) with seq_len <= S. Returns (targets (B, seq_len) long, valid (B, seq_len)
    bool); positions whose target falls past the end are invalid and hold target 0.
    """
    if input_ids.shape != loss_mask.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and loss_mask {tuple(loss_mask.shape)} differ")
    batch, total = input_ids.shape
    if seq_len > total:
        raise ValueError(f"logits cover {seq_len} positions but input_ids only {total}")
    targets = input_ids.new_zeros(batch, seq_len, dtype=torch.long)
    valid = torch.zeros(batch, seq_len, dtype=torch.bool, device=input_ids.device)
    span = max(0, min(seq_len, total - offset))  # positions t whose target t+offset exists
    targets[:, :span] = input_ids[:, offset : offset + span]
    valid[:, :span] = loss_mask[:, offset : offset + span] != 0
    return targets, valid


def medusa_head_targets(
    logits_k: Tensor, k: int, input_ids: Tensor, loss_mask: Tensor
) -> tuple[Tensor, Tensor]:
    """For head k's logits (B, T, V): the valid rows (N, V) and their target ids (N,)."""
    if logits_k.shape[0] != input_ids.shape[0]:
        raise ValueError(f"logits batch {logits_k.shape[0]} != input_ids batch {input_ids.shape[0]}")
    targets, valid = shifted_targets(input_ids, loss_mask, medusa_offset(k), logits_k.shape[1])
    return logits_k[valid], targets[valid]


def medusa_weights(num_heads: int, decay: float = 0.8) -> list[float]:
    """Per-head loss weights decay**k: later heads are less accurate and matter less for acceptance."""
    return [decay**k for k in range(num_heads)]


def medusa_loss(
    logits: list[Tensor], input_ids: Tensor, loss_mask: Tensor, weights: Sequence[float]
) -> tuple[Tensor, Tensor]:
    """Weighted sum over heads of the mean cross-entropy of head k against input_ids[:, t+2+k].

    logits: K tensors (B, T, V); input_ids, loss_mask: (B, S), S >= T. Returns (scalar loss,
    per-head CE (K,) detached). A head with no valid position contributes 0, not NaN.
    """
    if not logits:
        raise ValueError("medusa_loss needs at least one head's logits")
    if len(weights) != len(logits):
        raise ValueError(f"got {len(weights)} loss weights for {len(logits)} heads")
    per_head = []
    for k, logits_k in enumerate(logits):
        rows, targets = medusa_head_targets(logits_k, k, input_ids, loss_mask)  # (N, V), (N,)
        # Summing then dividing keeps an empty head at 0 and still in the graph (zero grads, so DDP
        # does not see unused parameters). CE in fp32: bf16 log-softmax over big vocabularies is coarse.
        rows = rows.to(torch.promote_types(rows.dtype, torch.float32))
        ce_sum = F.cross_entropy(rows, targets, reduction="sum")
        per_head.append(ce_sum / max(targets.numel(), 1))
    stacked = torch.stack(per_head)  # (K,)
    loss = (stacked * torch.tensor(list(weights), dtype=stacked.dtype, device=stacked.device)).sum()
    return loss, stacked.detach()
