"""DFlash draft head: a multi-layer block-diffusion drafter (arXiv 2602.06036).

Several target hidden states (shallow to deep) are concatenated and fused by `fc` + `hidden_norm` into one
context feature per position. That feature is INJECTED into every drafter layer: each layer's keys and
values over the context positions are its own k_proj / v_proj (and k_norm, rotary) of the context feature,
so at inference they sit in the drafter's KV cache like a prefix. A block of `block_size` positions after
the context is then predicted in ONE forward: the first holds the last accepted token, the others a mask
(a learnable `mask_embedding`, or the target's embedding of `mask_token_id`); attention inside the block
is bidirectional and sees every context position, so block position j predicts the token j steps after
the first. The draft cost does not grow with the drafter's depth, so `num_layers` can be several.

Layout as SGLang's DFLASH loads it: fc, hidden_norm, layers.{i}.*, norm; the token embedding and lm_head
are the target's (attached, never saved). A learnable mask embedding has no place there: exporting needs
`mask_token_id` (the target's embedding of that token is the mask).

Anchor convention (training and drafting): an anchor c is the last context position; its block sits at
positions c+1 .. c+block_size, block token 0 is x_{c+1}, and block position j >= 1 predicts x_{c+1+j}.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig

from spechead.heads.base import DraftHead, HeadConfig, register_head
from spechead.heads.decoder_layer import Rotary, additive_mask, build_config, decoder_layer_class
from spechead.heads.eagle import check_layer_config, target_fields
from spechead.heads.eagle3 import default_eagle3_layers
from spechead.heads.errors import HeadError
from spechead.heads.families import Family, Work, register_family

MASK = -1  # block token id of a mask position (`embed_block` turns it into the mask embedding)
# A layer whose context K/V `inject` can compute: Llama-like parts, attention of projections and per-head
# q/k norms (Qwen3). Anything else (Gemma's extra norms, MLA) would be injected wrong, so it is refused.
_LAYER_PARTS = {"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"}
_ATTENTION_PARTS = {"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"}


def default_dflash_layers(num_layers: int) -> list[int]:
    """Target layers as EAGLE-3 picks them: HF hidden-state indices [2, L//2, L-3] (shallow to deep)."""
    return default_eagle3_layers(num_layers)


@dataclass(kw_only=True)
class DFlashConfig(HeadConfig):
    """DFlash head. target_layers default to default_dflash_layers(target_num_layers)."""

    family = "dflash"

    target_layers: list[int] = field(default_factory=list)
    layer_config: dict[str, Any]
    block_size: int = 16  # block positions per forward: the last accepted token + block_size - 1 masks
    num_layers: int = 1  # drafter decoder layers, each reading the injected context
    mask_token_id: int = -1  # -1: a learnable mask embedding; else the target's embedding of this id
    attn_implementation: str = "sdpa"

    def __post_init__(self) -> None:
        if not self.target_layers:
            if not self.target_num_layers:
                raise HeadError("DFlashConfig needs target_layers or target_num_layers (to pick them)")
            self.target_layers = default_dflash_layers(self.target_num_layers)
        super().__post_init__()
        if self.block_size < 2:
            raise HeadError(
                f"head.block_size must be >= 2 (the last accepted token + at least one draft), got {self.block_size}"
            )
        if self.num_layers < 1:
            raise HeadError(f"head.num_layers (drafter decoder layers) must be >= 1, got {self.num_layers}")
        if not -1 <= self.mask_token_id < self.vocab_size:
            raise HeadError(
                f"head.mask_token_id must be -1 (learned) or a token id below {self.vocab_size}, got {self.mask_token_id}"
            )
        check_layer_config(self.layer_config, self.hidden_size)

    @classmethod
    def from_target(
        cls, target_config: PretrainedConfig, draft_layer: str = "qwen3", **overrides: Any
    ) -> DFlashConfig:
        """A config for the target described by `target_config` (fields in `overrides` win)."""
        return cls(**{**target_fields(target_config, draft_layer), **overrides})


class _Prefix:
    """One layer's context keys / values, placed before the block's by the attention's `cache.update`.

    Why not a DynamicCache: the block's K/V must not stay (the next forward has another block), and one
    object per layer keeps the layers' prefixes apart without a layer index bookkeeping."""

    def __init__(self, keys: Tensor, values: Tensor) -> None:
        self.keys, self.values = keys, values  # (B, kv, S, D)

    def update(
        self, keys: Tensor, values: Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        """Block K/V (B, kv, Q, D) -> prefix + block (B, kv, S + Q, D)."""
        return torch.cat([self.keys, keys], dim=2), torch.cat([self.values, values], dim=2)


@register_head
class DFlashHead(DraftHead):
    """fc (nH -> H) + hidden_norm, `num_layers` decoder layers with the context injected, norm."""

    config_class = DFlashConfig
    family = "dflash"
    config: DFlashConfig

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__(config)
        hidden = config.hidden_size
        layer_cfg = build_config(config.layer_config, config.attn_implementation, config.num_layers)
        layer_class = decoder_layer_class(layer_cfg)
        self.fc = nn.Linear(len(config.target_layers) * hidden, hidden, bias=False)
        self.layers = nn.ModuleList(
            _checked(layer_class(layer_cfg, layer_idx=i)) for i in range(config.num_layers)
        )
        norm_class = type(cast(nn.Module, self.layers[0].input_layernorm))
        self.hidden_norm = norm_class(hidden, eps=layer_cfg.rms_norm_eps)
        self.norm = norm_class(hidden, eps=layer_cfg.rms_norm_eps)
        if config.mask_token_id < 0:  # only then: a head with a mask token keeps SGLang's tensor names
            self.mask_embedding = nn.Parameter(torch.randn(hidden) * 0.02)
        self.rotary = Rotary(layer_cfg)
        self._rotate = _rotary_function(self.layers[0])

    # ---- forward pieces ------------------------------------------------------------------------

    def fuse(self, hidden_states: list[Tensor]) -> Tensor:
        """The target states of `target_layers` (shallow to deep), each (B, T, H) -> context (B, T, H)."""
        if len(hidden_states) != len(self.config.target_layers):
            raise HeadError(
                f"fuse takes {len(self.config.target_layers)} hidden states (target_layers order), "
                f"got {len(hidden_states)}"
            )
        dtype = self.fc.weight.dtype
        stacked = torch.cat([h.to(dtype) for h in hidden_states], dim=-1)  # (B, T, nH)
        return self.hidden_norm(self.fc(stacked))

    features = fuse  # the input-features name shared with the EAGLE heads

    def inject(self, context: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Context features (B, T, H) at positions (B, T) -> every layer's (keys, values), each (B, kv, T, D).

        The keys are rotated at the context's own positions, as the layer rotates its block's keys."""
        context = context.to(self.fc.weight.dtype)
        cos, sin = self.rotary(context, positions)  # (B, T, D) each
        out = []
        for layer in self.layers:
            attn = cast(Any, layer).self_attn
            shape = (*context.shape[:2], -1, attn.head_dim)
            keys = attn.k_proj(context).view(shape)  # (B, T, kv, D)
            if hasattr(attn, "k_norm"):  # per-head key norm (Qwen3), before the rotation as the layer does
                keys = attn.k_norm(keys)
            keys = keys.transpose(1, 2)  # (B, kv, T, D)
            _, keys = self._rotate(keys, keys, cos, sin)
            out.append((keys, attn.v_proj(context).view(shape).transpose(1, 2)))
        return out

    def embed_block(self, block_ids: Tensor) -> Tensor:
        """Block tokens (B, Q), MASK at mask positions -> inputs (B, Q, H): frozen target embeddings,
        the mask embedding at MASK."""
        masked = block_ids == MASK  # (B, Q)
        if self.config.mask_token_id >= 0:
            return self.embed(torch.where(masked, self.config.mask_token_id, block_ids))
        tokens = self.embed(block_ids.clamp(min=0))  # (B, Q, H)
        return torch.where(masked[..., None], self.mask_embedding.to(tokens.dtype), tokens)

    def forward(
        self,
        block_ids: Tensor,
        positions: Tensor,
        context_kv: list[tuple[Tensor, Tensor]],
        attention_mask4d: Tensor,
    ) -> Tensor:
        """Blocks -> normed block states (B, Q, H), in one pass through every layer.

        block_ids (B, Q) (MASK at mask positions), positions (B, Q); context_kv from `inject` (S context
        positions); attention_mask4d additive (B, 1, Q, S + Q), 0 = attend, keys context first.
        """
        hidden = self.embed_block(block_ids)  # (B, Q, H)
        position_embeddings = self.rotary(hidden, positions)
        mask = attention_mask4d.to(hidden.dtype)
        for layer, (keys, values) in zip(self.layers, context_kv):
            hidden = layer(
                hidden,
                attention_mask=mask,
                position_ids=positions,
                cache=_Prefix(keys, values),
                position_embeddings=position_embeddings,
            )
        return self.norm(hidden)

    def logits(self, hidden: Tensor) -> Tensor:
        """Normed block states (B, Q, H) -> fp32 logits (B, Q, V) through the attached target lm_head."""
        lm_head = self.target_lm_head  # frozen, possibly bf16 while the head trains in fp32
        return lm_head(hidden.to(cast(Tensor, lm_head.weight).dtype)).float()

    def draft_to_target(self, ids: Tensor) -> Tensor:
        """Head-vocab ids -> target ids: the same ids (DFlash drafts over the target's vocabulary)."""
        return ids

    def predict_blocks(
        self,
        context: Tensor,
        input_ids: Tensor,
        anchors: Tensor,
        attention_mask: Tensor | None = None,
        context_kv: list[tuple[Tensor, Tensor]] | None = None,
    ) -> Tensor:
        """Every anchor's block in one forward (training, evaluation): context (B, T, H) from `fuse`,
        input_ids (B, T), anchors (B, A) (last context position of each block, < T - 1), attention_mask
        (B, T) of 1 = real token -> normed block states (B, A, block_size, H). context_kv: `inject` of the
        context at positions 0..T-1, when the caller keeps it for several calls."""
        batch, length = context.shape[:2]  # the context may stop before input_ids (at the last anchor)
        size = self.config.block_size
        if context_kv is None:
            context_kv = self.inject(
                context, torch.arange(length, device=input_ids.device).expand(batch, length)
            )
        block_ids, block_positions = block_layout(input_ids, anchors, size)
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        valid = mask[:, :length].bool()  # (B, T)
        allowed = block_mask(anchors, valid, size)  # (B, A*bs, T + A*bs)
        hidden = self(block_ids, block_positions, context_kv, additive_mask(allowed, context.dtype))
        return hidden.view(batch, anchors.shape[1], size, -1)


def block_layout(input_ids: Tensor, anchors: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """input_ids (B, T), anchors (B, A) -> block tokens and positions, each (B, A * block_size).

    Block a: [x_{c+1}, MASK, ...] at positions c+1 .. c+block_size (c = anchors[:, a]); an anchor at the
    sequence's end reads its last token (its predictions have no target and must be masked out)."""
    length = input_ids.shape[1]
    offsets = torch.arange(block_size, device=anchors.device)  # (bs,)
    positions = anchors[..., None] + 1 + offsets  # (B, A, bs)
    first = input_ids.gather(1, (anchors + 1).clamp(max=length - 1))  # (B, A)
    ids = torch.full_like(positions, MASK)
    ids[..., 0] = first
    return ids.flatten(1), positions.flatten(1)


def block_mask(anchors: Tensor, context_valid: Tensor, block_size: int) -> Tensor:
    """Who sees what: anchors (B, A), context_valid (B, T) bool (real tokens) -> allowed (B, Q, T + Q)
    bool with Q = A * block_size, keys ordered [context positions, blocks].

    A query of anchor c's block sees context position t iff t <= c and t is real, and every position of
    its own block (bidirectional); never another anchor's block nor the context after its anchor."""
    batch, count = anchors.shape
    length = context_valid.shape[1]
    t = torch.arange(length, device=anchors.device)  # (T,)
    context = (t <= anchors[..., None]) & context_valid[:, None, :]  # (B, A, T)
    context = context.repeat_interleave(block_size, dim=1)  # (B, Q, T)
    block_of = torch.arange(count, device=anchors.device).repeat_interleave(block_size)  # (Q,)
    own = (block_of[:, None] == block_of[None, :]).expand(batch, -1, -1)  # (B, Q, Q)
    return torch.cat([context, own], dim=2)


def _checked(layer: nn.Module) -> nn.Module:
    """The layer if `inject` can compute its context keys / values, HeadError otherwise."""
    parts = {name for name, _ in layer.named_children()}
    attn = getattr(layer, "self_attn", None)
    attn_parts = {name for name, _ in attn.named_children()} if isinstance(attn, nn.Module) else set()
    norm = getattr(attn, "k_norm", None)
    head_dim = getattr(attn, "head_dim", None)
    per_head = norm is None or getattr(norm, "weight", torch.empty(0)).numel() == head_dim
    if parts != _LAYER_PARTS or not {"k_proj", "v_proj"} <= attn_parts <= _ATTENTION_PARTS or not per_head:
        raise HeadError(
            f"{type(layer).__name__} has submodules {sorted(parts)} / attention {sorted(attn_parts)}; DFlash "
            "injects its context into Llama-like layers (optionally with per-head q/k norms): train with "
            "head.draft_layer=llama"
        )
    return layer


def _rotary_function(layer: nn.Module) -> Callable[..., tuple[Tensor, Tensor]]:
    """The layer architecture's `apply_rotary_pos_emb` (how its attention rotates queries and keys)."""
    found = getattr(sys.modules[type(layer).__module__], "apply_rotary_pos_emb", None)
    if not callable(found):
        raise HeadError(
            f"{type(layer).__name__}'s module has no apply_rotary_pos_emb: train with head.draft_layer=llama"
        )
    return found


def _dflash_work(config: HeadConfig) -> Work:
    """Memory plan per sequence position, with the objective's default anchors (blocks of about as many
    queries as the sequence has tokens): one logit set over the target vocabulary; one layer pass per layer
    (its block queries; projecting the context's keys / values adds about 2H a position, measured on the
    CPU); one mask of T block queries over the T context keys and the T block keys."""
    return Work(1, config.vocab_size, int(cast(DFlashConfig, config).num_layers), 2.0)


register_family(
    Family(
        name="dflash",
        head="dflash",
        summary="DFlash block-diffusion drafter (fused target layers injected into every layer's K/V)",
        tags=("dflash",),
        recipe="spechead.training.objectives.dflash:RECIPE",
        drafter="spechead.inference.drafters.dflash:DFlashDrafter",
        tree_option="tree",  # "chain" or a static tree of rank paths over the block's positions
        default_tree={"tree": "chain"},
        accuracy="spechead.inference.tuning.accuracy:measure_dflash_accuracy",
        assumed_accuracy="spechead.inference.tuning.accuracy:assumed_dflash_accuracy",
        calibrate_assumed=False,
        drafts_per_depth=False,
        work=_dflash_work,
        exports={
            "sglang": "spechead.heads.formats.dflash_export:export_dflash_sglang",
            "vllm": "spechead.heads.formats.dflash_export:export_dflash_vllm",
        },
        default_layers=default_dflash_layers,
    )
)
