"""Pad tokenized conversations into training batches."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Collator:
    """Right-pads features {input_ids (T_i,), loss_mask (T_i,)} into a batch of (B, T) long tensors."""

    pad_token_id: int
    pad_to_multiple_of: int | None = None  # e.g. 8 or 64 for tensor-core friendly shapes

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """Return input_ids, attention_mask and loss_mask, each (B, T) long, T = longest (rounded up)."""
        if not features:
            raise ValueError("Collator got an empty batch")
        rows = [_as_long(f["input_ids"]) for f in features]  # B x (T_i,)
        masks = [_as_long(f["loss_mask"]) for f in features]  # B x (T_i,)
        for r, m in zip(rows, masks):
            if r.shape != m.shape:
                raise ValueError(f"input_ids and loss_mask lengths differ: {r.numel()} vs {m.numel()}")
        length = self._padded_length(max(r.numel() for r in rows))
        input_ids = torch.full((len(rows), length), self.pad_token_id, dtype=torch.long)  # (B, T)
        attention_mask = torch.zeros((len(rows), length), dtype=torch.long)  # (B, T)
        loss_mask = torch.zeros((len(rows), length), dtype=torch.long)  # (B, T), 0 on padding
        for b, (r, m) in enumerate(zip(rows, masks)):
            n = r.numel()
            input_ids[b, :n] = r
            attention_mask[b, :n] = 1
            loss_mask[b, :n] = m
        return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}

    def _padded_length(self, longest: int) -> int:
        k = self.pad_to_multiple_of
        return longest if not k else -(-longest // k) * k


def _as_long(values: Sequence[int] | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.long).reshape(-1)
