"""Fill a freshly built spechead head from a converted state dict, all or nothing."""

from __future__ import annotations

from typing import TypeVar, cast

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
    return placed(head, device, dtype)


def placed(head: H, device: torch.device | str | int | None = None, dtype: torch.dtype | None = None) -> H:
    """`head` moved to `device` and cast to `dtype` (where given), in eval mode."""
    if device is not None:
        head.to(device)
    if dtype is not None:
        head.to(dtype=dtype)  # floating tensors only: d2t / t2d keep their integer dtypes
    return head.eval()


def renamed(tensors: dict[str, Tensor], old: str, new: str) -> dict[str, Tensor]:
    """`tensors` with the name prefix `old` replaced by `new`."""
    return {(new + k[len(old) :] if k.startswith(old) else k): v for k, v in tensors.items()}


def speculators_layer_names(
    tensors: dict[str, Tensor], layers: int, to_speculators: bool
) -> dict[str, Tensor]:
    """An EAGLE-3 head's decoder-layer tensor names between spechead's (midlayer.*, extra_layers.{i - 1}.*)
    and speculators' (layers.{i}.*), for `layers` decoder layers."""
    pairs = [
        ("midlayer.", "layers.0."),
        *((f"extra_layers.{i - 1}.", f"layers.{i}.") for i in range(1, layers)),
    ]
    for ours, theirs in pairs:
        tensors = renamed(tensors, ours, theirs) if to_speculators else renamed(tensors, theirs, ours)
    return tensors


def export_dtype(head: DraftHead, dtype: torch.dtype | None) -> str:
    """The dtype name ("float32", "bfloat16", ...) an export of `head` is written in."""
    chosen = dtype or next(head.parameters()).dtype
    return str(chosen).removeprefix("torch.")


def target_embedding_of(head: DraftHead, embedding: Tensor | None = None) -> Tensor:
    """The target input embedding [V, H] an export ships: `embedding` if given, else the one attached to
    the head; HeadError if neither or its shape is not the head's (vocab_size, hidden_size)."""
    if embedding is None:
        try:
            embedding = cast(Tensor, head.target_embed_tokens.weight)
        except HeadError:
            raise HeadError(
                "the export ships the target's embedding and none is given or attached: pass the target "
                "(scripts/export.py --target TARGET), or leave it out (--no-embedding)"
            ) from None
    cfg = head.config
    if tuple(embedding.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise HeadError(
            f"the target embedding has shape {tuple(embedding.shape)}, the head needs "
            f"{(cfg.vocab_size, cfg.hidden_size)}: pass the target the head was trained for"
        )
    return embedding
