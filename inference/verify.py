"""One target forward over a whole draft tree (and the prefill that precedes it).

Works with any Hugging Face causal LM (batch 1) whose decoder accepts a custom 4D ADDITIVE float mask:
eager and sdpa attention; flash_attention_2 cannot take arbitrary masks and is refused, as are hybrid
targets (heads/hybrid.py).

Hidden states are captured with `spechead.heads.capture.capture_hidden` (the same hooks training uses),
by HF `output_hidden_states` indices.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache

from spechead.heads.capture import capture_hidden
from spechead.inference.kv_cache import cache_length, croppable_cache
from spechead.inference.runner import check_tree_attention
from spechead.inference.sliding import layer_masks, sliding_layout
from spechead.inference.tree import TokenTree, tree_attention_mask, tree_position_ids

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@torch.inference_mode()
def verify_tree(
    model: PreTrainedModel,
    cache: DynamicCache,
    tree: TokenTree,
    past_len: int,
    hidden_layers: Sequence[int] = (),
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """ONE target forward over all N tree nodes on top of `cache` (which must hold exactly past_len).

    Uses the additive tree mask [1, 1, N, past_len + N] (windowed for sliding layers: sliding.py) and
    position ids [1, N] = past_len + depth.
    Returns logits [N, V] in fp32 (row i = target output at node i, as if its root-to-node path were
    run as a plain sequence) and {index: hidden [N, H]} in the model dtype. Appends N entries to the
    cache; follow with `keep_positions` to keep the accepted path.
    """
    check_tree_attention(model)
    if cache_length(cache) != past_len:
        raise ValueError(f"cache holds {cache_length(cache)} positions, expected past_len={past_len}")
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    if not dtype.is_floating_point:
        dtype = torch.float32
    parents = tree.parents.cpu()
    mask = tree_attention_mask(parents, past_len, dtype, device=device)  # [1, 1, N, past_len + N]
    position_ids = tree_position_ids(parents, past_len).to(device)  # [1, N]
    input_ids = tree.tokens.to(device)[None]  # [1, N]
    keys = torch.cat([torch.arange(past_len, device=device), position_ids[0]])  # [past_len + N] positions
    with capture_hidden(model, hidden_layers) as store:
        out = model(
            input_ids=input_ids,
            attention_mask=layer_masks(sliding_layout(model), mask, position_ids, keys),
            position_ids=position_ids,
            cache=cache,
            use_cache=True,
        )
    hidden = {k: v[0] for k, v in store.items()}  # [N, H] each
    return out.logits[0].float(), hidden


@torch.inference_mode()
def prefill(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    hidden_layers: Sequence[int] = (),
    logits_to_keep: int = 0,
) -> tuple[DynamicCache, torch.Tensor, dict[int, torch.Tensor]]:
    """Run the prompt input_ids [1, T] (or [T]) through a fresh croppable cache (kv_cache.croppable_cache).

    Returns (cache holding T positions, logits [T, V] fp32, {index: hidden [T, H]}). With
    logits_to_keep = k > 0 only the last k rows of logits are computed ([k, V], HF semantics).
    """
    check_tree_attention(model)
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"prefill takes input_ids [1, T] (batch 1), got {tuple(input_ids.shape)}")
    if input_ids.shape[1] == 0:
        raise ValueError("prefill needs at least one token")
    device = next(model.parameters()).device
    cache = croppable_cache(model)
    with capture_hidden(model, hidden_layers) as store:
        out = model(
            input_ids=input_ids.to(device),
            cache=cache,
            use_cache=True,
            logits_to_keep=logits_to_keep,
        )
    hidden = {k: v[0] for k, v in store.items()}  # [T, H] each
    return cache, out.logits[0].float(), hidden
