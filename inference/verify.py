"""One target forward over a whole draft tree (and the prefill that precedes it).

Works with any Hugging Face causal LM (batch 1) whose decoder accepts a custom 4D ADDITIVE float mask:
eager and sdpa attention; flash_attention_2 cannot take arbitrary masks and is refused.

Hidden states are captured with hooks on `model.get_decoder()` modules, using HF `output_hidden_states`
indices over L decoder layers: 0 = input of layer 0 (the embeddings), i in 1..L-1 = output of layer
i-1 (pre-norm), L (or -1) = after the final norm. Negative indices count from L + 1 like HF's tuple.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from transformers import DynamicCache

from spechead.inference.kv_cache import cache_length
from spechead.inference.tree import TokenTree, tree_attention_mask, tree_position_ids


def _normalise_layers(hidden_layers: Sequence[int], num_layers: int) -> dict[int, int]:
    """Requested index -> canonical index in [0, L]; raises ValueError when out of range."""
    out = {}
    for idx in hidden_layers:
        canon = idx + num_layers + 1 if idx < 0 else idx
        if not 0 <= canon <= num_layers:
            raise ValueError(
                f"hidden layer index {idx} out of range for {num_layers} layers ([-{num_layers + 1}, {num_layers}])"
            )
        out[int(idx)] = canon
    return out


@contextmanager
def capture_hidden(model: torch.nn.Module, hidden_layers: Sequence[int]) -> Iterator[dict[int, torch.Tensor]]:
    """Context manager: while active, forwards of `model` fill the yielded dict {requested index: [B, T, H]}."""
    decoder = model.get_decoder()
    layers = decoder.layers
    wanted = _normalise_layers(hidden_layers, len(layers))
    store: dict[int, torch.Tensor] = {}
    handles = []

    def first(t: object) -> torch.Tensor:
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
            handles.append(decoder.norm.register_forward_hook(save(len(layers))))
        yield store
    finally:
        for h in handles:
            h.remove()


def _check_model(model: torch.nn.Module) -> None:
    impl = getattr(model.config, "_attn_implementation", None) or ""
    if "flash" in impl:
        raise ValueError(
            f"tree verification needs arbitrary 4D masks; attn_implementation {impl!r} cannot take them"
        )


@torch.no_grad()
def verify_tree(
    model: torch.nn.Module,
    cache: DynamicCache,
    tree: TokenTree,
    past_len: int,
    hidden_layers: Sequence[int] = (),
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """ONE target forward over all N tree nodes on top of `cache` (which must hold exactly past_len).

    Uses the additive tree mask [1, 1, N, past_len + N] and position ids [1, N] = past_len + depth.
    Returns logits [N, V] in fp32 (row i = target output at node i, as if its root-to-node path were
    run as a plain sequence) and {index: hidden [N, H]} in the model dtype. Appends N entries to the
    cache; follow with `keep_positions` to keep the accepted path.
    """
    _check_model(model)
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
    with capture_hidden(model, hidden_layers) as store:
        out = model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
        )
    hidden = {k: v[0] for k, v in store.items()}  # [N, H] each
    return out.logits[0].float(), hidden


@torch.no_grad()
def prefill(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    hidden_layers: Sequence[int] = (),
    logits_to_keep: int = 0,
) -> tuple[DynamicCache, torch.Tensor, dict[int, torch.Tensor]]:
    """Run the prompt input_ids [1, T] (or [T]) through a fresh `DynamicCache(config=model.config)`.

    Returns (cache holding T positions, logits [T, V] fp32, {index: hidden [T, H]}). With
    logits_to_keep = k > 0 only the last k rows of logits are computed ([k, V], HF semantics).
    """
    _check_model(model)
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"prefill takes input_ids [1, T] (batch 1), got {tuple(input_ids.shape)}")
    if input_ids.shape[1] == 0:
        raise ValueError("prefill needs at least one token")
    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    with capture_hidden(model, hidden_layers) as store:
        out = model(
            input_ids=input_ids.to(device),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=logits_to_keep,
        )
    hidden = {k: v[0] for k, v in store.items()}  # [T, H] each
    return cache, out.logits[0].float(), hidden
