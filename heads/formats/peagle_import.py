"""Import P-EAGLE heads in speculators' "peagle" layout (vLLM's parallel drafting): the inverse of
`peagle_export`.

The layout is EAGLE-3's speculators layout (`eagle3_import.speculators_eagle3` reads it) plus:
- mask_token_id (required; vLLM's `pard_token`): masked slots read embed_tokens[mask_token_id], which
  becomes the head's mask_embedding, so the checkpoint must ship embed_tokens.weight;
- embed_requires_grad (speculators' P-EAGLE trainer defaults it to TRUE, so an omitted one is true): the
  head trained its embedding, which it keeps as its own (`own_embedding`; the mask row, trained too, is
  the mask_embedding as above). False: every other row is the target's, which spechead reads instead;
- mask_hidden [1, 1, 3H]: the masked slots' target features before input_norm and fc. spechead keeps
  them after fc: mask_hidden = fc(input_norm(m)) (input_norm only with norm_before_fc);
- speculators_config's proposal speculative_tokens = K, the block drafted per forward (block_size);
- a missing norm_before_residual is false (vLLM's P-EAGLE reader; EAGLE-3's reads true).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor
from transformers import PretrainedConfig

from spechead.heads.errors import HeadError
from spechead.heads.formats.build import placed
from spechead.heads.formats.eagle3_import import speculators_eagle3
from spechead.heads.peagle import PEagleHead

WEIGHT_NAMES = ("model.safetensors", "pytorch_model.bin", "*.safetensors")


def import_peagle_speculators(
    directory: Path,
    config: dict[str, Any],
    tensors: dict[str, Tensor],
    target_config: PretrainedConfig | None = None,
    **load: Any,
) -> PEagleHead:
    """A PEagleHead from speculators' P-EAGLE layout (speculators_model_type "peagle")."""
    where = f"speculators P-EAGLE head {directory}"
    mask_id = config.get("mask_token_id")
    if isinstance(mask_id, bool) or not isinstance(mask_id, int) or mask_id < 0:
        raise HeadError(f"{where}: config.json needs mask_token_id (a token id >= 0), got {mask_id!r}")
    table, masked = tensors.get("embed_tokens.weight"), tensors.get("mask_hidden")
    if table is None or not mask_id < table.shape[0]:
        raise HeadError(
            f"{where} ships no embed_tokens.weight row {mask_id} (its mask embedding): export it with the "
            "target's embedding included"
        )
    if masked is None:
        raise HeadError(f"{where} has no mask_hidden tensor: it is not a P-EAGLE head")
    hidden = int(table.shape[1])
    if masked.numel() != 3 * hidden:
        raise HeadError(
            f"{where}: mask_hidden has {masked.numel()} values, spechead's P-EAGLE fuses 3 target states "
            f"({3 * hidden}): not supported"
        )
    extra = {"block_size": _speculative_tokens(where, config)}
    placeholders = {"mask_hidden": torch.zeros(hidden), "mask_embedding": table[mask_id]}
    head = cast(
        PEagleHead,
        speculators_eagle3(
            where,
            config,
            {**{k: v for k, v in tensors.items() if k != "mask_hidden"}, **placeholders},
            target_config,
            {},  # placed below, once mask_hidden is computed in the checkpoint's fp32 copy
            head_class=PEagleHead,
            residual_default=False,
            embed_trained_default=True,
            extra=extra,
        ),
    )
    with torch.no_grad():
        states = masked.reshape(1, 1, 3 * hidden).to(head.fc.weight.dtype).chunk(3, dim=-1)
        head.mask_hidden.copy_(head.fuse(list(states))[0, 0])  # fc(input_norm(m)): spechead's (H,)
    return placed(head, load.get("device"), load.get("dtype"))


def _speculative_tokens(where: str, config: dict[str, Any]) -> int:
    """K: speculative_tokens of the default proposal method of speculators_config (HeadError if absent)."""
    spec = config.get("speculators_config") or {}
    methods = [m for m in spec.get("proposal_methods") or [] if isinstance(m, dict)]
    chosen = [m for m in methods if m.get("proposal_type") == spec.get("default_proposal_method")]
    tokens = (chosen or methods or [{}])[0].get("speculative_tokens")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 2:
        raise HeadError(
            f"{where}: speculators_config names no proposal with speculative_tokens >= 2 (the block P-EAGLE "
            f"drafts per forward), got {tokens!r}"
        )
    return tokens
