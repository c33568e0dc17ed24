"""EAGLE-3 draft head and its training-time test (TTT).

The head fuses three target hidden states (low, mid, high; pre-norm) with `fc`, then runs a decoder
layer (Llama-style for every target by default, as vLLM and SGLang load it) whose attention reads
concat(input_layernorm(embed(x_{t+1})), hidden_norm(hidden)) (2H wide), then `num_layers - 1` plain
decoder layers (`extra_layers`; default none: one layer, as published EAGLE-3 heads; speculators builds
several, layers.1.. in its layout); its own `norm` + `lm_head` predict over a draft vocabulary of Vd
target tokens (target_id = draft_id + d2t[draft_id]). Parameter names match published EAGLE-3 heads
(midlayer.*, fc, norm, lm_head, d2t, t2d); the embedding is the attached frozen target embed_tokens, or
with `own_embedding` the head's own `embed_tokens` (V x H, trained with the head, as speculators'
embed_requires_grad heads ship it).

EAGLE-3.1 options (off by default; speculators' trainer turns the first and last on): norm_before_fc
(an RMSNorm over the concatenated 3H states before fc, `input_norm`), norm_before_residual (the
residual is hidden_norm(hidden), not hidden), norm_output (a step returns norm(output), which the next
step reads and lm_head takes without another norm).

TTT (see `spechead.heads.unroll.ttt_forward`): the head is unrolled `steps` times on its own outputs, with attention arranged
so that every position of step j sees exactly what a depth-j tree node sees at inference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
from torch import Tensor, nn
from transformers import Cache, PretrainedConfig

from spechead.heads.base import DraftHead, HeadConfig, register_head
from spechead.heads.decoder_layer import (
    Rotary,
    build_config,
    causal_mask4d,
    decoder_layer_class,
    default_positions,
)
from spechead.heads.eagle import EAGLE_DRAFTING, check_layer_config, target_fields
from spechead.heads.errors import HeadError
from spechead.heads.families import Family, Work, register_family

# Submodules the midlayer composition uses; a layer with any other (e.g. Gemma's extra feed-forward
# norms) would be silently run wrong, so it is refused.
_LAYER_PARTS = {"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"}


class _MidLayer(Protocol):
    """The midlayer as `step` runs it: _LAYER_PARTS plus the hidden_norm `_build_midlayer` adds."""

    input_layernorm: nn.Module
    hidden_norm: nn.Module
    self_attn: nn.Module
    post_attention_layernorm: nn.Module
    mlp: nn.Module


def default_eagle3_layers(num_layers: int) -> list[int]:
    """HF hidden-state indices [2, L//2, L-3] (pre-norm inputs of those layers) for an L-layer target."""
    if num_layers < 4:
        raise HeadError(
            f"EAGLE-3 default layers need a target with >= 4 layers, got {num_layers}: set target_layers"
        )
    return [2, num_layers // 2, num_layers - 3]


def draft_to_target(ids: Tensor, d2t: Tensor) -> Tensor:
    """Draft ids (any shape) -> target ids: id + d2t[id]."""
    return ids + d2t[ids]


def target_to_draft(ids: Tensor, t2d: Tensor) -> Tensor:
    """Target ids (any shape) -> draft ids, -1 where the token is not in the draft vocab.

    Relies on draft ids following target-id order (true for build_draft_vocab and published heads).
    """
    rank = torch.cumsum(t2d.long(), dim=0) - 1  # (V,) draft id of each in-vocab target id
    return torch.where(t2d[ids], rank[ids], torch.full_like(ids, -1))


@dataclass(kw_only=True)
class Eagle3Config(HeadConfig):
    """EAGLE-3 head. target_layers default to default_eagle3_layers(target_num_layers)."""

    family = "eagle3"

    target_layers: list[int] = field(default_factory=list)
    layer_config: dict[str, Any]
    draft_vocab_size: int
    attn_implementation: str = "sdpa"
    ttt_steps: int = 7  # recorded for reference: the training objective decides how many to unroll
    norm_before_fc: bool = False  # EAGLE-3.1: RMSNorm over cat(low, mid, high) (3H) before fc
    norm_before_residual: bool = False  # the residual around attention is hidden_norm(hidden)
    norm_output: bool = False  # EAGLE-3.1: a step's output is norm(.); logits = lm_head(output)
    own_embedding: bool = False  # the head's own token embedding (V x H, saved with it), not the target's
    num_layers: int = 1  # decoder layers: the fused first one, then num_layers - 1 plain ones

    def __post_init__(self) -> None:
        if not self.target_layers:
            if not self.target_num_layers:
                raise HeadError(
                    "Eagle3Config needs target_layers or target_num_layers (to pick [2, L//2, L-3])"
                )
            self.target_layers = default_eagle3_layers(self.target_num_layers)
        super().__post_init__()
        if len(self.target_layers) != 3:
            raise HeadError(f"EAGLE-3 fuses exactly 3 target layers, got target_layers={self.target_layers}")
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise HeadError(
                f"head.draft_vocab_size must be in 1..vocab_size ({self.vocab_size}), got {self.draft_vocab_size}"
            )
        if self.ttt_steps < 1:
            raise HeadError(f"ttt_steps must be >= 1, got {self.ttt_steps}")
        if isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise HeadError(f"head.num_layers must be an int >= 1 (decoder layers), got {self.num_layers!r}")
        check_layer_config(self.layer_config, self.hidden_size)

    @classmethod
    def from_target(
        cls, target_config: PretrainedConfig, draft_layer: str = "llama", **overrides: Any
    ) -> Eagle3Config:
        """A config for the target described by `target_config` (fields in `overrides` win)."""
        fields = {**target_fields(target_config, draft_layer), **overrides}
        fields.setdefault("draft_vocab_size", fields["vocab_size"])
        return cls(**fields)


@register_head
class Eagle3Head(DraftHead):
    """fc (3H -> H), midlayer (2H-input decoder layer + hidden_norm), extra_layers (num_layers - 1 decoder
    layers, only when there are any), norm, lm_head (H -> Vd)."""

    config_class = Eagle3Config
    family = "eagle3"
    config: Eagle3Config
    d2t: Tensor  # buffers (register_buffer)
    t2d: Tensor

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__(config)
        hidden, vocab, draft_vocab = config.hidden_size, config.vocab_size, config.draft_vocab_size
        layer_cfg = build_config(config.layer_config, config.attn_implementation, config.num_layers)
        self.fc = nn.Linear(3 * hidden, hidden, bias=False)
        self.midlayer = _build_midlayer(layer_cfg)
        if config.num_layers > 1:  # only then: one-layer heads keep their published tensor names
            self.extra_layers = nn.ModuleList(_plain_layer(layer_cfg, i) for i in range(1, config.num_layers))
        norm_class = type(cast(_MidLayer, self.midlayer).input_layernorm)
        self.norm = norm_class(hidden, eps=layer_cfg.rms_norm_eps)
        if config.norm_before_fc:  # only then: heads without it keep their published tensor names
            self.input_norm = norm_class(3 * hidden, eps=layer_cfg.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)
        if config.own_embedding:  # only then: other heads keep their published tensor names
            self.embed_tokens = nn.Embedding(vocab, hidden)  # (V, H): `embed` reads it, not the target's
        self.rotary = Rotary(layer_cfg)
        # Default draft vocab: the first Vd target ids (the identity when Vd == V).
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        self.register_buffer("t2d", torch.arange(vocab) < draft_vocab)

    # ---- draft vocabulary ----------------------------------------------------------------------

    @torch.no_grad()
    def set_draft_vocab(self, d2t: Tensor, t2d: Tensor) -> Eagle3Head:
        """Install d2t (Vd,) long offsets and t2d (V,) bool; they must describe the same token set."""
        cfg = self.config
        if tuple(d2t.shape) != (cfg.draft_vocab_size,) or tuple(t2d.shape) != (cfg.vocab_size,):
            raise HeadError(
                f"d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)} must be ({cfg.draft_vocab_size},) / "
                f"({cfg.vocab_size},): build them with head.draft_vocab_size = {cfg.draft_vocab_size}"
            )
        targets = torch.arange(cfg.draft_vocab_size, device=d2t.device) + d2t.long()  # (Vd,)
        expected = t2d.bool().nonzero().squeeze(-1).to(targets.device)
        if expected.numel() != targets.numel() or not torch.equal(targets, expected):
            raise HeadError("d2t and t2d disagree: draft ids must map, in order, onto the tokens t2d marks")
        self.d2t.copy_(d2t.long())
        self.t2d.copy_(t2d.bool())
        return self

    def draft_to_target(self, ids: Tensor) -> Tensor:
        """Draft ids -> target ids (same shape)."""
        return draft_to_target(ids, self.d2t)

    def target_to_draft(self, ids: Tensor) -> Tensor:
        """Target ids -> draft ids (same shape), -1 for tokens outside the draft vocab."""
        return target_to_draft(ids, self.t2d)

    @torch.no_grad()
    def init_lm_head_from_target_(self, lm_head_weight: Tensor) -> Eagle3Head:
        """Copy the target lm_head rows (V, H) of the draft tokens into lm_head (Vd, H)."""
        rows = self.draft_to_target(torch.arange(self.config.draft_vocab_size, device=self.d2t.device))
        self.lm_head.weight.copy_(lm_head_weight[rows.to(lm_head_weight.device)])
        return self

    @torch.no_grad()
    def init_embedding_from_target_(self, embedding_weight: Tensor) -> Eagle3Head:
        """Copy the target's input embedding (V, H) into the head's own (HeadError without own_embedding)."""
        if not self.config.own_embedding:
            raise HeadError(
                "the head reads the target's embedding (own_embedding false): nothing to initialise"
            )
        self.embed_tokens.weight.copy_(embedding_weight)
        return self

    @property
    def decoder_layers(self) -> list[nn.Module]:
        """Every decoder layer in order (cache layer i is layer i's): the midlayer, then `extra_layers`."""
        return [self.midlayer, *getattr(self, "extra_layers", ())]

    # ---- forward pieces ------------------------------------------------------------------------

    def fuse(self, hidden_states: list[Tensor]) -> Tensor:
        """Three target states (low, mid, high), each (B, T, H) -> fused (B, T, H)."""
        if len(hidden_states) != 3:
            raise HeadError(f"fuse takes 3 hidden states (target_layers order), got {len(hidden_states)}")
        dtype = self.fc.weight.dtype
        stacked = torch.cat([h.to(dtype) for h in hidden_states], dim=-1)  # (B, T, 3H)
        if self.config.norm_before_fc:
            stacked = self.input_norm(stacked)
        return self.fc(stacked)

    features = fuse  # the input-features name shared with EagleHead

    def step(
        self,
        hidden: Tensor,
        next_ids: Tensor,
        attention_mask4d: Tensor | None = None,
        position_ids: Tensor | None = None,
        past_key_values: Cache | None = None,
    ) -> Tensor:
        """One draft step: hidden (B, T, H) at t and tokens x_{t+1} (B, T) -> next hidden (B, T, H).

        attention_mask4d: additive float (B, 1, T, past + T), 0 = attend; None = causal after the cache.
        position_ids (B, T) default to past + arange(T). K/V are appended to `past_key_values`.
        """
        layer = cast(_MidLayer, self.midlayer)
        dtype = self.fc.weight.dtype
        hidden = hidden.to(dtype)
        past_len = past_key_values.get_seq_length() if past_key_values is not None else 0
        if attention_mask4d is None:
            attention_mask4d = causal_mask4d(hidden, None, past_len)
        if position_ids is None:
            position_ids = default_positions(hidden, past_len)
        # Attention reads both streams; the residual is the un-normed hidden (as published EAGLE-3)
        # unless norm_before_residual.
        normed = layer.hidden_norm(hidden)  # (B, T, H)
        attn_in = torch.cat([layer.input_layernorm(self.embed(next_ids)), normed], dim=-1)  # (B, T, 2H)
        angles = self.rotary(hidden, position_ids)  # 2 x (B, T, head_dim)
        mask = attention_mask4d.to(dtype)
        attn_out, _ = layer.self_attn(
            hidden_states=attn_in,  # (B, T, 2H)
            position_embeddings=angles,
            attention_mask=mask,
            position_ids=position_ids,
            cache=past_key_values,
        )
        hidden = (normed if self.config.norm_before_residual else hidden) + attn_out
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        for extra in getattr(self, "extra_layers", ()):  # plain layers: same mask, positions, cache
            hidden = extra(
                hidden,
                attention_mask=mask,
                position_ids=position_ids,
                cache=past_key_values,
                use_cache=past_key_values is not None,
                position_embeddings=angles,
            )
        return self.norm(hidden) if self.config.norm_output else hidden

    forward = step

    def logits(self, hidden: Tensor) -> Tensor:
        """(B, T, H) -> draft-vocab logits (B, T, Vd) (a norm_output head's steps are normed already)."""
        return self.lm_head(hidden if self.config.norm_output else self.norm(hidden))


def _plain_layer(layer_cfg: PretrainedConfig, index: int) -> nn.Module:
    """The architecture's decoder layer `index` (its cache layer), checked to be made of _LAYER_PARTS."""
    layer = decoder_layer_class(layer_cfg)(layer_cfg, layer_idx=index)
    children = {name for name, _ in layer.named_children()}
    if children != _LAYER_PARTS:
        raise HeadError(
            f"{type(layer).__name__} has submodules {sorted(children)}; EAGLE-3 supports layers made of "
            f"exactly {sorted(_LAYER_PARTS)} (Llama-like): train with head.draft_layer=llama"
        )
    return layer


def _build_midlayer(layer_cfg: PretrainedConfig) -> nn.Module:
    """The architecture's decoder layer 0 with q/k/v reading 2H features and an extra hidden_norm."""
    layer = _plain_layer(layer_cfg, 0)
    attn, hidden = layer.self_attn, layer_cfg.hidden_size
    for name in ("q_proj", "k_proj", "v_proj"):
        old = getattr(attn, name, None)
        if not isinstance(old, nn.Linear):
            raise HeadError(f"{type(attn).__name__} has no Linear {name}: train with head.draft_layer=llama")
        setattr(attn, name, nn.Linear(2 * hidden, old.out_features, bias=old.bias is not None))
    layer.hidden_norm = type(cast(nn.Module, layer.input_layernorm))(hidden, eps=layer_cfg.rms_norm_eps)
    return layer


def _eagle3_work(config: HeadConfig) -> Work:
    """Memory plan: one logit set over the draft vocabulary and num_layers layer passes per training-time-test
    step; step j's mask covers T queries x T * (j + 1) keys, all kept for backward."""
    cfg = cast(Eagle3Config, config)
    steps = int(cfg.ttt_steps)
    return Work(steps, int(cfg.draft_vocab_size), steps * int(cfg.num_layers), steps * (steps + 1) / 2)


register_family(
    Family(
        name="eagle3",
        head="eagle3",
        summary="EAGLE-3 head (fused low/mid/high target layers, training-time test)",
        tags=("eagle3",),
        recipe="spechead.training.objectives.eagle3:RECIPE",
        work=_eagle3_work,
        exports={
            "speculators": "spechead.heads.formats.eagle3_export:export_speculators",
            "sglang": "spechead.heads.formats.eagle3_export:export_sglang",
        },
        default_layers=default_eagle3_layers,
        **EAGLE_DRAFTING,
    )
)
