"""Draft heads' decoder layers (Llama-style, or the target architecture's own), rotary and masks.

EAGLE heads run decoder layers built from transformers' PUBLIC classes (found through `MODEL_MAPPING`
and the model's `_no_split_modules`), from a small JSON-safe `layer_config` saved inside the head
config, so a head rebuilds without its target. By default (`draft_layer="llama"`) the layer is a Llama
decoder layer sized from the target whatever the target's own layers are (MLA, MoE, sliding windows,
soft-capping, hybrid Mamba/linear attention): the head reads only the target's hidden states,
embedding and lm_head, and vLLM and SGLang load EAGLE-3 drafts as Llama layers for every target.
`draft_layer="target"` keeps the target's own layer where its shape allows it.

transformers v5 decoder layers return a plain tensor, take `position_embeddings=(cos, sin)` from the
rotary module, an ADDITIVE float mask `[B, 1, q_len, kv_len]` (0 = attend, finfo.min = blocked: a bool
mask is silently wrong under eager attention) and a `DynamicCache` that appends K/V on the sequence.
Draft layers always use full attention: tree and training-time-test masks are explicit, and a
sliding-window cache would silently drop the keys those masks index.
"""

from __future__ import annotations

import json
import sys
from typing import Any, cast

import torch
from torch import Tensor, nn
from transformers import MODEL_MAPPING, AutoConfig, PretrainedConfig

from spechead.heads.errors import HeadError

# Fields one decoder layer of a Llama-like architecture reads from its config.
_LAYER_FIELDS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "rope_parameters",
    "max_position_embeddings",
    "attention_bias",
    "mlp_bias",
)
# Architecture-specific extras (partial rotary, qk-norm, biases, ...) are kept by name pattern.
_EXTRA_PATTERNS = ("rope", "rotary", "_bias", "norm", "head_dim", "_act")
# Never kept: they describe the whole model, tokens or sliding windows, not one full-attention layer.
_DROPPED = {"num_hidden_layers", "layer_types", "sliding_window", "use_sliding_window", "max_window_layers"}


DRAFT_LAYERS = ("llama", "qwen3", "target")
# Rotary types a Llama layer computes (the default type is spelled "default" and not registered).
_LLAMA_ROPE = {"default", "linear", "dynamic", "yarn", "longrope", "llama3"}


def layer_config_from(pretrained_config: PretrainedConfig, draft_layer: str = "target") -> dict[str, Any]:
    """The JSON-safe config of a draft head's decoder layer for this target.

    draft_layer="llama": a Llama layer sized from the target (`llama_layer_config`); "qwen3": the same sizes
    in a Qwen3 layer (Llama's plus per-head q/k RMSNorms: the layer SGLang's DFLASH drafter runs); "target":
    the subset of the target's (text) config that rebuilds one decoder layer of the target's own class.
    """
    if draft_layer == "llama":
        return llama_layer_config(pretrained_config)
    if draft_layer == "qwen3":
        return {**llama_layer_config(pretrained_config), "model_type": "qwen3"}
    if draft_layer != "target":
        raise HeadError(f"head.draft_layer must be one of {list(DRAFT_LAYERS)}, got {draft_layer!r}")
    text = pretrained_config.get_text_config(decoder=True)
    full = text.to_dict()
    full["model_type"] = text.model_type
    keep = {}
    for key, value in full.items():
        wanted = key in _LAYER_FIELDS or any(p in key for p in _EXTRA_PATTERNS)
        if not wanted or key in _DROPPED or key.startswith("_") or value is None:
            continue
        try:
            json.dumps(value)
        except TypeError:
            continue  # not JSON-safe: the layer class falls back to its default for it
        keep[key] = value
    for key in ("model_type", "hidden_size", "num_attention_heads"):
        if key not in keep:
            raise HeadError(
                f"target config {type(text).__name__} has no {key}: cannot build its decoder layer"
            )
    return keep


def _first(config: PretrainedConfig, names: tuple[str, ...], default: Any) -> Any:
    """The first of `names` the config sets (not None), else `default`."""
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def _llama_rope(text: PretrainedConfig) -> dict[str, Any]:
    """Rotary parameters a Llama layer computes: the target's full-attention rotary when a Llama layer can
    (partial rotary dropped: the draft layer's attention is its own), else the default type at its theta."""
    rope = getattr(text, "rope_parameters", None) or {}
    if rope and all(isinstance(v, dict) for v in rope.values()):  # one table per layer type (Gemma-3)
        rope = rope.get("full_attention") or next(iter(rope.values()))
    rope = {k: v for k, v in dict(rope).items() if k != "partial_rotary_factor"}
    theta = float(rope.get("rope_theta", _first(text, ("rope_theta",), 10000.0)))
    partial = float(_first(text, ("partial_rotary_factor",), 1.0)) != 1.0
    if rope.get("rope_type", "default") not in _LLAMA_ROPE or (
        partial and rope.get("rope_type") == "longrope"
    ):
        return {"rope_type": "default", "rope_theta": theta}
    return {**rope, "rope_type": rope.get("rope_type", "default"), "rope_theta": theta}


def llama_layer_config(pretrained_config: PretrainedConfig) -> dict[str, Any]:
    """A Llama decoder layer's config (JSON-safe) sized from the target: its width, MLP width, heads, KV
    heads, head size, activation, norm epsilon and rotary. Fields the target lacks take Llama's defaults."""
    text = pretrained_config.get_text_config(decoder=True)
    hidden = getattr(text, "hidden_size", None)
    heads = getattr(text, "num_attention_heads", None)
    if not hidden or not heads:
        raise HeadError(
            f"target config {type(text).__name__} has no hidden_size / num_attention_heads: "
            "cannot size a Llama draft layer for it"
        )
    # MLA targets (DeepSeek-V3: kv_lora_rank) name their rotary part head_dim and have one key/value
    # head per query head (no grouping): the plain split, as many KV heads as heads.
    mla = bool(getattr(text, "kv_lora_rank", None))
    head_dim = hidden // heads if mla else _first(text, ("head_dim",), hidden // heads)
    kv_heads = heads if mla else _first(text, ("num_key_value_heads",), heads)
    return {
        "model_type": "llama",
        "hidden_size": int(hidden),
        "intermediate_size": int(_first(text, ("intermediate_size",), 4 * hidden)),
        "num_attention_heads": int(heads),
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(head_dim),
        "hidden_act": str(_first(text, ("hidden_act", "hidden_activation", "mlp_hidden_act"), "silu")),
        "rms_norm_eps": float(
            _first(text, ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps"), 1e-6)
        ),
        "rope_parameters": _llama_rope(text),
        "max_position_embeddings": int(_first(text, ("max_position_embeddings",), 4096)),
        "attention_bias": False,
        "mlp_bias": False,
    }


def build_config(
    layer_config: dict[str, Any], attn_implementation: str = "sdpa", num_layers: int = 1
) -> PretrainedConfig:
    """A transformers config of the layer's architecture with `num_layers` full-attention layers."""
    fields = dict(layer_config)
    model_type = fields.pop("model_type", None)
    if not model_type:
        raise HeadError(
            f"layer_config has no model_type: {sorted(layer_config)}; rebuild it with layer_config_from"
        )
    try:
        config = AutoConfig.for_model(model_type, **fields, num_hidden_layers=num_layers)
        if getattr(config, "sliding_window", None) is not None:
            config.sliding_window = None
        if getattr(config, "layer_types", None) is not None:
            config.layer_types = ["full_attention"] * num_layers
    except (ValueError, TypeError, AttributeError, KeyError) as err:  # e.g. hybrids' read-only layer types
        raise HeadError(
            f"cannot build a {model_type!r} draft layer config ({err}): train with head.draft_layer=llama"
        ) from None
    config._attn_implementation = attn_implementation
    return config


def _model_module(config: PretrainedConfig) -> tuple[Any, type[nn.Module]]:
    try:  # transformers annotates the values as (class, class) pairs; this mapping holds classes
        model_class = cast(type[nn.Module], MODEL_MAPPING[type(config)])
    except KeyError:
        raise HeadError(
            f"architecture {config.model_type!r} has no base model in transformers' MODEL_MAPPING: "
            "EAGLE heads need a decoder-only target with a standard decoder layer"
        ) from None
    return sys.modules[model_class.__module__], model_class


def decoder_layer_class(config: PretrainedConfig) -> type[nn.Module]:
    """The architecture's decoder layer class (e.g. LlamaDecoderLayer), found through public API."""
    module, model_class = _model_module(config)
    names = [n for n in (getattr(model_class, "_no_split_modules", None) or []) if n.endswith("DecoderLayer")]
    layer = getattr(module, names[0], None) if names else None
    if not isinstance(layer, type) or not issubclass(layer, nn.Module):
        raise HeadError(
            f"architecture {config.model_type!r} ({model_class.__name__}) names no *DecoderLayer in "
            "_no_split_modules: its own layer cannot be a draft layer; train with head.draft_layer=llama"
        )
    return layer


def rotary_class(config: PretrainedConfig) -> type[nn.Module]:
    """The architecture's rotary embedding class (e.g. LlamaRotaryEmbedding) from the same module."""
    module, _ = _model_module(config)
    prefix = decoder_layer_class(config).__name__.removesuffix("DecoderLayer")
    found = getattr(module, f"{prefix}RotaryEmbedding", None)
    if found is None:
        candidates = [
            v for k, v in vars(module).items() if k.endswith("RotaryEmbedding") and isinstance(v, type)
        ]
        found = candidates[0] if len(candidates) == 1 else None
    if found is None:
        raise HeadError(
            f"architecture {config.model_type!r} has no single *RotaryEmbedding class: not supported"
        )
    return found


class Rotary:
    """The architecture's rotary embedding, kept OUT of the head's module tree.

    As a registered submodule, `head.to(torch.bfloat16)` would round its fp32 `inv_freq` (positions
    then drift from the target's); here it only follows the input's device, lazily.
    """

    def __init__(self, config: PretrainedConfig) -> None:
        self.module = rotary_class(config)(config=config)
        if not isinstance(getattr(self.module, "inv_freq", None), Tensor):  # one table per layer type
            raise HeadError(
                f"architecture {config.model_type!r} keeps a rotary table per attention type (sliding and "
                "full layers, as Gemma-3 does): its own layer cannot be a draft layer; train with "
                "head.draft_layer=llama"
            )

    def __call__(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        """x (B, T, *) for dtype/device, position_ids (B, T) -> (cos, sin), each (B, T, head_dim)."""
        if self.module.inv_freq.device != x.device:
            self.module.to(x.device)
        return self.module(x, position_ids)


def additive_mask(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """Bool allowed (B, Q, K) -> additive float mask (B, 1, Q, K): 0 where allowed, finfo.min elsewhere."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min).unsqueeze(1)


def causal_allowed(attention_mask: Tensor, query_len: int | None = None) -> Tensor:
    """Causal + padding pattern: attention_mask (B, K) of 1 = real token -> allowed (B, Q, K) bool.

    The queries are the LAST `query_len` (default K) of the K positions, so a cached prefix of
    K - Q tokens is covered. A query always sees itself, so a padded query never gets an empty row
    (an all-blocked row turns into NaN under sdpa); its output is garbage and must be masked later.
    """
    batch, kv_len = attention_mask.shape
    q_len = kv_len if query_len is None else query_len
    device = attention_mask.device
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)  # (Q,)
    k_pos = torch.arange(kv_len, device=device)  # (K,)
    causal = k_pos[None, :] <= q_pos[:, None]  # (Q, K)
    allowed = causal[None] & attention_mask.bool()[:, None, :]  # (B, Q, K)
    return allowed | (k_pos[None, :] == q_pos[:, None])[None]


def causal_mask4d(x: Tensor, attention_mask: Tensor | None, past_len: int = 0) -> Tensor:
    """Additive causal mask (B, 1, T, past_len + T) in x's dtype for x (B, T, H) after a cache.

    attention_mask: optional padding mask (B, past_len + T) or (B, T) (1 = real token; a (B, T) mask
    treats the cached prefix as real).
    """
    batch, q_len = x.shape[:2]
    if attention_mask is None:
        attention_mask = torch.ones(batch, past_len + q_len, dtype=torch.bool, device=x.device)
    elif attention_mask.shape[1] == q_len and past_len:
        prefix = torch.ones(batch, past_len, dtype=attention_mask.dtype, device=attention_mask.device)
        attention_mask = torch.cat([prefix, attention_mask], dim=1)
    if tuple(attention_mask.shape) != (batch, past_len + q_len):
        raise HeadError(
            f"attention_mask has shape {tuple(attention_mask.shape)}; expected (B, T) or (B, past + T) = "
            f"({batch}, {q_len}) or ({batch}, {past_len + q_len})"
        )
    return additive_mask(causal_allowed(attention_mask.to(x.device), q_len), x.dtype)


def default_positions(x: Tensor, past_len: int = 0) -> Tensor:
    """Position ids (B, T) = past_len + arange(T) for x (B, T, ...)."""
    batch, q_len = x.shape[:2]
    return torch.arange(past_len, past_len + q_len, device=x.device).expand(batch, q_len)
