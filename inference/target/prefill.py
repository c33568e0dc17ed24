"""Prompts of several rows into a `RowCache`: rows of similar lengths run together (right-padded), each
group through a croppable DynamicCache whose entries are then copied into the rows' first slots (a
group of every row in order straight into them)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence
from transformers.cache_utils import Cache

from spechead.inference.devices import host_to_device
from spechead.inference.kv_cache import croppable_cache

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from spechead.inference.target.cache import RowCache

# a forward over a cache with the model's arguments -> logits, {HF layer index: [B, T, H]}
Forward = Callable[..., tuple[Tensor, dict[int, Tensor]]]


def length_groups(lengths: Sequence[int], waste: float = 0.25, most: int = 8) -> list[list[int]]:
    """Rows 0..B-1 of these prompt lengths in groups to prefill together: by length, longest first, a
    row joining the current group while its padded size (rows x the group's longest) stays within
    1 + waste of its real tokens (mixed lengths do not pay for the longest prompt B times) and the
    group has fewer than `most` rows (a group's logits are kept at every row's last position: rows x
    distinct lengths x V)."""
    groups: list[list[int]] = []
    real = 0  # the current group's real tokens
    for b in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if groups and len(groups[-1]) < most:
            padded = (len(groups[-1]) + 1) * lengths[groups[-1][0]]  # its rows x its longest, with b
            if padded <= (1 + waste) * (real + lengths[b]):
                groups[-1].append(b)
                real += lengths[b]
                continue
        groups.append([b])
        real = lengths[b]
    return groups


def prefill_groups(
    model: PreTrainedModel, forward: Forward, prompts: Sequence[Tensor], rows: Sequence[int], cache: RowCache
) -> tuple[Tensor, list[dict[int, Tensor]]]:
    """Run the prompts ids_b [T_b] in `length_groups`, each group ONE `forward` right-padded to its longest
    prompt, and copy prompt b's K/V into the first slots of `cache` row rows[b]: logits [B, V] (fp32,
    last positions) and [{l: [T_b, H]}]. No mask: the padding sits after every real token, so causality
    alone hides it; its entries land in slots past T_b (scratch)."""
    device = next(model.parameters()).device
    all_logits: list[Tensor] = [torch.empty(0)] * len(prompts)
    hiddens: list[dict[int, Tensor]] = [{} for _ in prompts]
    for group in length_groups([p.numel() for p in prompts]):
        sizes = [prompts[b].numel() for b in group]
        ids = pad_sequence([prompts[b].long() for b in group], batch_first=True)  # [G, T] right-padded
        # the logits at the rows' last positions only (a 1-D `logits_to_keep`: every model reads it
        # as positions kept for every row), [G, P, V] for the P distinct ones
        last = sorted({n - 1 for n in sizes})
        # every row of an eager cache, in order (a batch of one): written in a row from slot 0, no copy
        direct = not cache.static_shapes and [rows[b] for b in group] == list(range(cache.batch))
        group_cache: Cache = cache if direct else croppable_cache(model)
        logits, hidden = forward(
            group_cache,
            input_ids=ids.to(device),
            logits_to_keep=host_to_device(torch.tensor(last), device),
        )
        for row, b in enumerate(group):
            all_logits[b] = logits[row, last.index(sizes[row] - 1)].float()  # [V]
            hiddens[b] = {k: v[row, : sizes[row]] for k, v in hidden.items()}  # {l: [T_b, H]}
        if not direct:
            targets = host_to_device(torch.tensor([rows[b] for b in group]), device)  # [G] rows in `cache`
            layers = cast(list, group_cache.layers)  # a dense decoder's DynamicLayers, filled by the forward
            cache.write_rows(targets, [(x.keys, x.values) for x in layers])  # (past a row's T_b: scratch)
    return torch.stack(all_logits), hiddens
