"""Fill a freshly built spechead head from a converted state dict, all or nothing."""

from __future__ import annotations

from typing import TypeVar

import torch
from torch import Tensor

from spechead.heads.base import DraftHead
from spechead.heads.errors import HeadError

H = TypeVar("H", bound=DraftHead)


def fill_head(
    head: H,
    tensors: dict[str, Tensor],
    where: str,
    *,
    zero_biases: tuple[str, ...] = (),
    device: torch.device | str | int | None = None,
    dtype: torch.dtype | None = None,
) -> H:
    """Load `tensors` (spechead names) into `head` strictly; returns it in eval mode.

    zero_biases: bias names the reference layout has no tensor for. A zero bias computes exactly
    what no bias does, so those are filled with zeros; any other missing, unexpected or misshapen
    tensor is a HeadError (the checkpoint is not what its config says).
    """
    expected = head.state_dict()
    tensors = dict(tensors)
    for name in zero_biases:
        if name in expected and name not in tensors:
            tensors[name] = torch.zeros_like(expected[name])
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise HeadError(
            f"{where} does not match the layout its config describes: missing tensors {missing[:6]}, "
            f"unexpected tensors {unexpected[:6]}"
        )
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise HeadError(
                f"{where}: tensor {name} has shape {tuple(tensor.shape)} but its config implies "
                f"{tuple(expected[name].shape)}"
            )
    head.load_state_dict(tensors, strict=True)
    if device is not None:
        head.to(device)
    if dtype is not None:
        head.to(dtype=dtype)  # floating tensors only: d2t / t2d keep their integer dtypes
    return head.eval()


def renamed(tensors: dict[str, Tensor], old: str, new: str) -> dict[str, Tensor]:
    """`tensors` with the name prefix `old` replaced by `new`."""
    return {(new + k[len(old) :] if k.startswith(old) else k): v for k, v in tensors.items()}


def export_dtype(head: DraftHead, dtype: torch.dtype | None) -> str:
    """The dtype name ("float32", "bfloat16", ...) an export of `head` is written in."""
    chosen = dtype or next(head.parameters()).dtype
    return str(chosen).removeprefix("torch.")
