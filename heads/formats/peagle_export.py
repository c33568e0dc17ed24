"""Export a PEagleHead in vLLM's parallel-drafting layout: the speculators "peagle" format.

Follows speculators 0.9.0 (`speculators/models/peagle/`: PEagleSpeculatorConfig, PEagleDraftModel) and
vLLM's speculators reader (`update_peagle`: mask_token_id -> the proposer's `pard_token`, parallel
drafting on, `num_speculative_tokens` = the proposal's speculative_tokens). The layout is EAGLE-3's
speculators layout plus:
- speculators_model_type / algorithm "peagle", architectures ["PEagleSpeculator"];
- speculative_tokens = K (block_size): slot 0 is the real position, K - 1 masked slots follow;
- `mask_token_id`: masked slots read embed_tokens[mask_token_id]. spechead learns a mask embedding
  vector instead, so the export writes it into that row of the shipped embedding (the target's
  otherwise, or the head's own with `own_embedding`, then embed_requires_grad true): pick a token the
  target never reads (a reserved special token);
- `mask_hidden` [1, 1, 3H]: the masked slots' target features BEFORE input_norm and fc, while
  spechead's mask_hidden (H,) is after fc. The export solves fc(input_norm(m)) = mask_hidden for m
  (`mask_hidden_input`; min-norm least squares in float64), which is exact while fc has full row rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor

from spechead.heads.errors import HeadError
from spechead.heads.formats.build import target_embedding_of
from spechead.heads.formats.eagle3_export import speculators_config, speculators_tensors, write_export
from spechead.heads.peagle import PEagleHead

ARCHITECTURE = "PEagleSpeculator"


def export_peagle_speculators(
    head: PEagleHead,
    out: Path,
    *,
    dtype: torch.dtype | None = None,
    mask_token_id: int | None = None,
    verifier: str | None = None,
    embedding: Tensor | None = None,
    with_embedding: bool = True,
    **_: Any,
) -> Path:
    """Write `out`/config.json + model.safetensors for vLLM's P-EAGLE parallel drafting.

    mask_token_id: the target token whose embedding row becomes the head's mask embedding (required).
    embedding: the target's input embedding [V, H] (default: the one attached to the head; not read for a
    head with its own embedding, which ships instead)."""
    cfg = head.config
    if mask_token_id is None:
        raise HeadError(
            "a P-EAGLE export needs a mask token: pass --mask-token-id ID (a token the target never reads, "
            "e.g. a reserved special token) or auto; its embedding row is replaced by the head's mask embedding"
        )
    if not 0 <= mask_token_id < cfg.vocab_size:
        raise HeadError(f"--mask-token-id must be a token id in 0..{cfg.vocab_size - 1}, got {mask_token_id}")
    if not with_embedding:
        raise HeadError(
            "a P-EAGLE export ships the embedding (its mask row holds the learned mask embedding): "
            "drop --no-embedding"
        )
    config = speculators_config(head, dtype, cfg.block_size, verifier)
    config["architectures"] = [ARCHITECTURE]
    config["speculators_model_type"] = "peagle"
    config["speculators_config"]["algorithm"] = "peagle"
    config["mask_token_id"] = int(mask_token_id)
    own = bool(cfg.own_embedding)
    config["embed_requires_grad"] = own  # false: every row but the mask token's is the target's
    tensors = speculators_tensors(head)
    tensors.pop("mask_embedding")
    tensors["mask_hidden"] = mask_hidden_input(head).to(head.fc.weight.dtype).view(1, 1, -1)  # (1, 1, 3H)
    shipped = tensors.pop("embed_tokens.weight") if own else target_embedding_of(head, embedding)
    tensors["embed_tokens.weight"] = with_mask_row(shipped, head.mask_embedding, mask_token_id)
    return write_export(out, config, tensors, dtype)


def with_mask_row(table: Tensor, mask_embedding: Tensor, mask_token_id: int) -> Tensor:
    """A copy of the embedding `table` [V, H] whose mask_token_id row is the mask embedding (H,): the
    table the layout ships, where masked slots read embed_tokens[mask_token_id]. The copy takes the wider
    of the two dtypes: a bf16 target's table would round an fp32 mask embedding (an export's --dtype still
    casts the whole file)."""
    wide = torch.promote_types(table.dtype, mask_embedding.dtype)
    out = table.detach().to(wide, copy=True)  # (V, H)
    out[mask_token_id] = mask_embedding.detach().to(wide)
    return out


@torch.no_grad()
def mask_hidden_input(head: PEagleHead) -> Tensor:
    """The fc input m (3H,) with fc(input_norm(m)) == head.mask_hidden (H,); HeadError if none exists.

    Without norm_before_fc: m = pinv(W) h. With it (RMSNorm weight w, eps): z = pinv(W diag(w)) h is the
    norm's output over w; an RMSNorm output has mean((out / w)^2) < 1, so z needs a = mean(z^2) < 1,
    and m = z * sqrt(eps / (1 - a)) normalizes to exactly w * z."""
    weight = head.fc.weight.double()  # (H, 3H)
    target = head.mask_hidden.double()  # (H,)
    scale = None
    if head.config.norm_before_fc:
        norm = head.input_norm
        scale = cast(Tensor, norm.weight).double()  # (3H,)
        if bool(torch.any(scale == 0)):
            raise HeadError("input_norm has zero weights: the P-EAGLE mask hidden state cannot be exported")
        weight = weight * scale
    solution = torch.linalg.pinv(weight) @ target  # (3H,)
    error = float((weight @ solution - target).norm()) / max(float(target.norm()), 1e-30)
    if error > 1e-6:
        raise HeadError(
            f"fc cannot reproduce the head's mask_hidden (relative error {error:.1e}): its fc weight is "
            "rank deficient, so the speculators layout (mask_hidden before fc) cannot hold this head"
        )
    if scale is None:
        return solution.float()
    mean_square = float(solution.pow(2).mean())
    if mean_square >= 1:
        raise HeadError(
            "the head's mask_hidden lies outside what input_norm can output (norm_before_fc): the speculators "
            "layout (mask_hidden before the norm) cannot hold this head"
        )
    eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
    return (solution * (eps / (1 - mean_square)) ** 0.5).float()
