"""Capture a causal LM's hidden states with forward hooks (training and inference use this one helper).

Indices follow HF `output_hidden_states` over L decoder layers: 0 = the input of layer 0 (the
embeddings as the decoder sees them, scaling included), i in 1..L-1 = output of layer i-1 (pre-norm),
L (or -1) = after the final norm. Negative indices count from L + 1 like HF's tuple. Only the
requested states are kept, which matters for 70B targets.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn

from spechead.heads.base import resolve_layers
from spechead.heads.errors import HeadError

if TYPE_CHECKING:
    from transformers import PreTrainedModel


# Names transformers gives a decoder's final norm (Llama/Qwen/Gemma: norm; Falcon-H1: final_layernorm;
# NemotronH, Mamba: norm_f; GPT-2 style: ln_f).
FINAL_NORMS = ("norm", "final_layernorm", "norm_f", "ln_f", "final_norm")


def final_norm(decoder: nn.Module) -> nn.Module:
    """The decoder's final norm module, whatever its name (HeadError if it has none we know)."""
    for name in FINAL_NORMS:
        module = getattr(decoder, name, None)
        if isinstance(module, nn.Module):
            return module
    raise HeadError(
        f"{type(decoder).__name__} has no final norm named any of {list(FINAL_NORMS)}: "
        "pick target layers before the last (head.layers)"
    )


@contextmanager
def capture_hidden(model: PreTrainedModel, hidden_layers: Sequence[int]) -> Iterator[dict[int, torch.Tensor]]:
    """Context manager: while active, forwards of `model` fill the yielded dict {requested index: [B, T, H]}."""
    decoder = model.get_decoder()
    layers = decoder.layers
    wanted = {int(i): c for i, c in zip(hidden_layers, resolve_layers(list(hidden_layers), len(layers)))}
    store: dict[int, torch.Tensor] = {}
    handles = []

    def first(t: torch.Tensor | tuple[torch.Tensor, ...] | list[torch.Tensor]) -> torch.Tensor:
        return t[0] if isinstance(t, (tuple, list)) else t

    def save(canon: int):
        def hook(_module, _args, output):
            for req, c in wanted.items():
                if c == canon:
                    store[req] = first(output)

        return hook

    def save_input(_module, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        for req, c in wanted.items():
            if c == 0:
                store[req] = x

    try:
        canon_set = set(wanted.values())
        if 0 in canon_set:
            handles.append(layers[0].register_forward_pre_hook(save_input, with_kwargs=True))
        for c in canon_set - {0, len(layers)}:
            handles.append(layers[c - 1].register_forward_hook(save(c)))
        if len(layers) in canon_set:
            handles.append(final_norm(decoder).register_forward_hook(save(len(layers))))
        yield store
    finally:
        for h in handles:
            h.remove()
