"""A DFlash head's block forward as the fused functional chain of heads/fused.py, for drafting: the same
layer code as EAGLE's fused step, each layer attending over its context keys / values placed before the
block's. `DFlashHead.forward` stays the reference (training, export); tests check this path against it."""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor, nn

from spechead.heads.dflash import DFlashHead
from spechead.heads.fused import _FusedLayers, _is_norm, _linears, _norm, _sub, _supported, rotated
from spechead.heads.grad import no_grad


def fused_block(head: nn.Module) -> _FusedBlock | None:
    """A drop-in for a DFlash head's `forward(block_ids, positions, context_kv, attention_mask4d)` -> normed
    block states (B, Q, H) (no autograd: drafting only), or None when its layers or final norm are not of a
    supported kind."""
    if not isinstance(head, DFlashHead) or not _is_norm(head.norm):
        return None
    layers = list(head.layers)
    return _FusedBlock(head, layers) if all(_supported(layer) for layer in layers) else None


class _FusedBlock(_FusedLayers):
    """A DFlash head's block forward through the fused layers (`fused_block`): each layer attends over its
    context keys / values placed before the block's; `inject` makes those keys / values (a commit)."""

    @no_grad
    def __call__(
        self,
        block_ids: Tensor,
        positions: Tensor,
        context_kv: list[tuple[Tensor, Tensor]],
        attention_mask4d: Tensor,
    ) -> Tensor:
        """Blocks (B, Q) at positions (B, Q), context_kv per layer (B, kv, S, D) each, additive mask
        (B, 1, Q, S + Q) -> normed block states (B, Q, H), as `DFlashHead.forward`."""
        head = cast(DFlashHead, self.head)
        hidden = head.embed_block(block_ids)  # (B, Q, H)
        mask = attention_mask4d
        if mask.dtype != hidden.dtype:  # (`to` costs even as a no-op)
            mask = mask.to(hidden.dtype)
        cos, sin = self._angles(hidden, positions, None)  # (B, Q, 1, D) each; sin signed
        hidden = self._layers(hidden, None, cos, sin, mask, _Prefixes(context_kv))
        return _norm(head.norm, hidden)

    @no_grad
    def inject(self, context: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """As `DFlashHead.inject`: context features (B, T, H) at positions (B, T) -> every layer's (keys,
        values), each (B, kv, T, D), the keys normed and rotated as the layer's attention does them."""
        context = context.to(cast(DFlashHead, self.head).fc.weight.dtype)
        cos, sin = self._angles(context, positions, None)  # (B, T, 1, D) each; sin signed
        out = []
        for layer in self.layers:
            attn = _sub(layer, "self_attn")
            keys, values = _linears([_sub(attn, "k_proj"), _sub(attn, "v_proj")], context)
            values = values.view(*context.shape[:2], -1, cast(int, attn.head_dim)).transpose(1, 2)
            out.append((rotated(attn, "k_norm", keys, cos, sin), values))  # (B, kv, T, D) each
        return out


class _Prefixes:
    """Every layer's context keys / values (B, kv, S, D), placed before the block's by `update`."""

    def __init__(self, context_kv: list[tuple[Tensor, Tensor]]) -> None:
        self.context_kv = context_kv

    def update(self, keys: Tensor, values: Tensor, layer: int) -> tuple[Tensor, Tensor]:
        """Layer `layer`'s block K/V (B, kv, Q, D) -> context + block (B, kv, S + Q, D)."""
        prefix_k, prefix_v = self.context_kv[layer]
        return torch.cat([prefix_k, keys], dim=2), torch.cat([prefix_v, values], dim=2)
