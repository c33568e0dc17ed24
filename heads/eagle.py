"""EAGLE-1 draft head (EAGLE-2 is the same head, drafting a dynamic tree at inference).

At position t the head reads the target's final normed feature f_t and the embedding of the next
token x_{t+1}, and predicts f_{t+1}: fc(concat(embed(x_{t+1}), f_t)) -> decoder layer(s), Llama-style
by default (see heads/decoder_layer.py). Its logits go through the target's frozen lm_head (they predict x_{t+2}).
Saved weights are fc and the layers only: the embedding and lm_head are the attached target modules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import Tensor, nn
from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, Cache, PretrainedConfig

from spechead.heads.base import DraftHead, HeadConfig, register_head
from spechead.heads.decoder_layer import (
    Rotary,
    build_config,
    causal_mask4d,
    decoder_layer_class,
    default_positions,
    layer_config_from,
)
from spechead.heads.errors import HeadError
from spechead.heads.families import Family, Work, register_family


def target_fields(target_config: PretrainedConfig, draft_layer: str = "llama") -> dict[str, Any]:
    """Head-config fields describing a target: sizes, depth, architecture and the draft layer_config
    (`draft_layer`: "llama" for every target, or "target" for the target's own layer class)."""
    text = target_config.get_text_config(decoder=True)
    architectures = getattr(target_config, "architectures", None) or [_causal_lm_name(target_config)]
    return {
        "hidden_size": text.hidden_size,
        "vocab_size": text.vocab_size,
        "target_num_layers": text.num_hidden_layers,
        "target_architecture": architectures[0],
        "target_name_or_path": getattr(target_config, "_name_or_path", "") or "",
        "layer_config": layer_config_from(target_config, draft_layer),
    }


def _causal_lm_name(config: PretrainedConfig) -> str:
    """The causal-LM class name of a config that was never saved (so has no `architectures`)."""
    try:
        # transformers annotates the values as (class, class) pairs; this mapping holds classes
        return cast(type, MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]).__name__
    except KeyError:
        return config.model_type


def check_layer_config(layer_config: dict[str, Any], hidden_size: int) -> None:
    """HeadError unless layer_config describes a layer of this hidden size."""
    if not isinstance(layer_config, dict) or "model_type" not in layer_config:
        raise HeadError(
            "layer_config must be a dict with a model_type: build it with layer_config_from(target.config)"
        )
    if layer_config.get("hidden_size") != hidden_size:
        raise HeadError(
            f"layer_config hidden_size {layer_config.get('hidden_size')} != head hidden_size {hidden_size}: "
            "both must come from the same target"
        )


@dataclass(kw_only=True)
class EagleConfig(HeadConfig):
    """EAGLE-1/2 head. Default reads the final normed state (HF index -1, resolved to L)."""

    family = "eagle"

    target_layers: list[int] = field(default_factory=lambda: [-1])
    layer_config: dict[str, Any]
    num_layers: int = 1
    attn_implementation: str = "sdpa"
    # False: layer 0 skips its input_layernorm (fc's output enters attention un-normed), as in the
    # heads published by the EAGLE authors; spechead's own heads keep the architecture's layer as is.
    first_layer_input_norm: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.target_layers) != 1:
            raise HeadError(
                f"EAGLE heads read exactly one target layer, got target_layers={self.target_layers}"
            )
        if self.num_layers < 1:
            raise HeadError(f"num_layers (decoder layers) must be >= 1, got {self.num_layers}")
        check_layer_config(self.layer_config, self.hidden_size)

    @classmethod
    def from_target(
        cls, target_config: PretrainedConfig, draft_layer: str = "llama", **overrides: Any
    ) -> EagleConfig:
        """A config for the target described by `target_config` (fields in `overrides` win)."""
        return cls(**{**target_fields(target_config, draft_layer), **overrides})


@register_head
class EagleHead(DraftHead):
    """fc (Linear(2H, H, bias)) then `num_layers` decoder layers (Llama-style, or the target's own)."""

    config_class = EagleConfig
    family = "eagle"
    config: EagleConfig

    def __init__(self, config: EagleConfig) -> None:
        super().__init__(config)
        hidden = config.hidden_size
        layer_cfg = build_config(config.layer_config, config.attn_implementation, config.num_layers)
        layer_class = decoder_layer_class(layer_cfg)
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)
        self.layers = nn.ModuleList(layer_class(layer_cfg, layer_idx=i) for i in range(config.num_layers))
        if not config.first_layer_input_norm:
            self.layers[0].input_layernorm = nn.Identity()
        self.rotary = Rotary(layer_cfg)

    def forward(
        self,
        features: Tensor,
        next_ids: Tensor,
        attention_mask4d: Tensor | None = None,
        position_ids: Tensor | None = None,
        past_key_values: Cache | None = None,
        attention_mask: Tensor | None = None,
    ) -> Tensor:
        """Predicted next features (B, T, H) from features f_t (B, T, H) and tokens x_{t+1} (B, T).

        attention_mask4d: additive float mask (B, 1, T, past + T), 0 = attend (tree drafting). Without
        it the pass is causal after whatever `past_key_values` holds, honouring the optional padding
        mask `attention_mask` ((B, T) or (B, past + T), 1 = real token). position_ids (B, T) default
        to past + arange(T). The cache gets each layer's K/V appended.
        """
        dtype = self.fc.weight.dtype
        hidden = self.fc(torch.cat([self.embed(next_ids), features.to(dtype)], dim=-1))  # (B, T, H)
        past_len = past_key_values.get_seq_length() if past_key_values is not None else 0
        if attention_mask4d is None:
            attention_mask4d = causal_mask4d(hidden, attention_mask, past_len)
        if position_ids is None:
            position_ids = default_positions(hidden, past_len)
        position_embeddings = self.rotary(hidden, position_ids)  # 2 x (B, T, head_dim)
        for layer in self.layers:
            hidden = layer(
                hidden,
                attention_mask=attention_mask4d.to(dtype),
                position_ids=position_ids,
                cache=past_key_values,
                use_cache=past_key_values is not None,
                position_embeddings=position_embeddings,
            )
        return hidden

    step = forward  # the drafting-step name shared with Eagle3Head (see heads/unroll.py)

    def features(self, states: list[Tensor]) -> Tensor:
        """The head's input features (B, T, H) from its one target layer's states [(B, T, H)]."""
        return states[0]

    def draft_to_target(self, ids: Tensor) -> Tensor:
        """Head-vocab ids -> target ids: the same ids (EAGLE-1/2 drafts over the target's vocabulary)."""
        return ids

    def target_to_draft(self, ids: Tensor) -> Tensor:
        """Target ids -> head-vocab ids: the same ids."""
        return ids

    def logits(self, features: Tensor) -> Tensor:
        """(B, T, H) -> fp32 logits (B, T, V) through the attached frozen target lm_head."""
        lm_head = self.target_lm_head  # frozen, possibly bf16 while the head trains in fp32
        return lm_head(features.to(cast(Tensor, lm_head.weight).dtype)).float()


def _eagle_work(config: HeadConfig) -> Work:
    """Memory plan: one logit set over the whole vocabulary, num_layers decoder-layer passes, one causal
    mask."""
    return Work(1, config.vocab_size, int(cast(EagleConfig, config).num_layers), 1.0)


EAGLE_DRAFTING: dict[str, Any] = dict(  # how EAGLE-1/2 and EAGLE-3 heads draft and are measured (inference/)
    drafter="spechead.inference.drafters.eagle:EagleDrafter",
    tree_option="tree",
    default_tree={"tree": "dynamic"},
    accuracy="spechead.inference.tuning.accuracy:measure_eagle_accuracy",
    assumed_accuracy="spechead.inference.tuning.accuracy:assumed_eagle_accuracy",
    calibrate_assumed=True,
    drafts_per_depth=True,
)
register_family(
    Family(
        name="eagle",
        head="eagle",
        summary="EAGLE-1/2 feature head (drafts EAGLE-2 dynamic trees)",
        tags=("eagle",),
        recipe="spechead.training.objectives.eagle:RECIPE",
        work=_eagle_work,
        exports={"eagle": "spechead.heads.formats.eagle_export:export_eagle"},
        **EAGLE_DRAFTING,
    )
)
