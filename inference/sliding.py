"""Sliding-window attention in tree passes: the window lives in the MASKS, not in the cache.

Every cache keeps every position in every layer (a tree's entries and the accepted path's copies need
fixed slots), so a target pass hands a sliding layer the full mask with keys too far behind each query
blocked (`layer_masks`). As in transformers (masking_utils.sliding_window_overlay), a key at POSITION p
is visible to a query at position q iff it is causally visible and q - p < window; tree nodes sit at
position past_len + depth but at slot past_len + node index (`slot_positions`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

SLIDING = "sliding_attention"


@dataclass(frozen=True)
class SlidingLayout:
    """A target with sliding-window layers: its `window` and, when it reads one mask per layer type, the
    layer types its mask dict needs (None: every layer slides and takes one windowed mask)."""

    window: int
    layer_types: tuple[str, ...] | None


def sliding_layout(model) -> SlidingLayout | None:
    """The target's sliding-window layout (None when no layer slides): layers listed in `layer_types` as
    "sliding_attention" (Gemma-2/3, GPT-OSS, Qwen2 with use_sliding_window), or a `sliding_window`
    without per-layer types (every layer slides: Mistral v0.1, Mixtral, Phi-3). ValueError for chunked
    attention (Llama-4), whose masks tree passes do not build."""
    cfg = model.config.get_text_config()
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if isinstance(types, (list, tuple)) and "chunked_attention" in types:
        raise ValueError(
            f"{type(model).__name__} has chunked-attention layers, which tree verification does not mask "
            "yet: decode it with transformers' generate"
        )
    if not window:
        return None
    if not isinstance(types, (list, tuple)):
        return SlidingLayout(int(window), None)
    if SLIDING not in types:
        return None  # a window set but no layer uses it
    return SlidingLayout(int(window), tuple(sorted(set(types))))


def layer_masks(
    layout: SlidingLayout | None, mask: Tensor, query_pos: Tensor, key_pos: Tensor
) -> Tensor | dict[str, Tensor]:
    """What a target pass hands the model as `attention_mask` for the full mask `mask` [B, 1, Q, K] with
    queries at query_pos [B, Q] / [Q] and keys at key_pos [B, K] / [K] (rotary POSITIONS, not cache slots):
    `mask` itself without a sliding layer; when every layer slides, the windowed mask (a copy with key k
    also blocked for query i when query_pos[i] - key_pos[k] >= window); else {layer type: its mask}."""
    if layout is None:
        return mask
    # [B, 1, Q, K] or [1, Q, K]: broadcast over the mask's [B, 1, Q, K]
    far = (query_pos[..., :, None] - key_pos[..., None, :] >= layout.window).unsqueeze(-3)
    windowed = mask.masked_fill(far, torch.finfo(mask.dtype).min)
    if layout.layer_types is None:
        return windowed
    return {kind: windowed if kind == SLIDING else mask for kind in layout.layer_types}


def slot_positions(lengths: Tensor, positions: Tensor, size: int) -> Tensor:
    """Key positions [B, S] of a slot layout of `size` slots: slot j < lengths[b] holds committed position
    j; slot lengths[b] + i holds tree node i at positions[b, i] (positions [B, N]); later slots are
    scratch (position = slot: the mask blocks them anyway). On the lengths' device, fixed shapes."""
    batch, n = positions.shape
    pos = torch.arange(size, device=lengths.device).expand(batch, size).clone()  # [B, S]
    slots = (lengths[:, None] + torch.arange(n, device=lengths.device)).clamp(max=size - 1)  # [B, N]
    return pos.scatter_(1, slots, positions)
