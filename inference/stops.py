"""When a sequence stops: the target's EOS ids and cutting emitted tokens at EOS or a token budget."""

from __future__ import annotations

from torch import nn


def eos_ids(model: nn.Module, tokenizer=None) -> set[int]:
    """EOS ids of `model`'s generation config, plus the tokenizer's EOS when one is given."""
    ids = set()
    config = getattr(model, "generation_config", None)
    for value in (getattr(config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)
    return ids


def until_stop(tokens: list[int], eos: set[int], room: int | None = None) -> list[int]:
    """`tokens` up to and including the first EOS, and at most `room` of them (None: no budget)."""
    out = []
    for t in tokens if room is None else tokens[: max(room, 0)]:
        out.append(t)
        if t in eos:
            break
    return out
