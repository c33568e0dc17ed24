"""The target architecture's own decoder layer, rotary embedding and attention masks, for draft heads.

EAGLE heads run decoder layers of their target's architecture. They are built from transformers'
PUBLIC classes (found through `MODEL_MAPPING` and the model's `_no_split_modules`), from a small
JSON-safe `layer_config` saved inside the head config, so a head rebuilds without its target.

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


def layer_config_from(pretrained_config: PretrainedConfig) -> dict[str, Any]:
    """The JSON-safe subset of a target's (text) config that rebuilds one decoder layer of it."""
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
    except ValueError as err:
        raise HeadError(f"cannot build a {model_type!r} layer config: {err}") from err
    if getattr(config, "sliding_window", None) is not None:
        config.sliding_window = None
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = ["full_attention"] * num_layers
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
            "_no_split_modules: it is not supported by EAGLE heads"
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
                "full layers, as Gemma-3 does): EAGLE heads do not support it; train head=medusa or "
                "head=medusa2 for this target"
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
