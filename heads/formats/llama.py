"""Llama-style config dicts of published heads <-> spechead's `layer_config` and target fields.

Reference heads describe their decoder layer with a plain (transformers v4 style) Llama config:
`rope_theta` + `rope_scaling`, `head_dim`, `attention_bias`, ... spechead keeps the v5 fields of
the target's architecture (`layer_config_from`). Exports write the v4 names, which v4 and v5 read.
"""

from __future__ import annotations

from typing import Any

from transformers import AutoConfig, PretrainedConfig

from spechead.heads.decoder_layer import build_config, layer_config_from
from spechead.heads.eagle import target_fields as described_target
from spechead.heads.errors import HeadError

# Keys of a published head's config that describe the head or the file, never its decoder layer.
_NOT_LAYER = {"architectures", "auto_map", "model_type", "torch_dtype", "dtype", "transformers_version"}


def layer_config_of(config: dict[str, Any], where: str, layers: int = 1) -> dict[str, Any]:
    """spechead `layer_config` for the decoder layers (the first `layers`) a published head's config
    describes; HeadError if one of them attends through a sliding window."""
    model_type = config.get("model_type") or "llama"
    fields = {k: v for k, v in config.items() if k not in _NOT_LAYER}
    try:
        parsed = AutoConfig.for_model(model_type, **fields)
    except (ValueError, TypeError, KeyError) as err:
        raise HeadError(f"{where}: cannot read its {model_type!r} layer config: {err}") from None
    window = sliding_window(parsed, layers)
    if window:
        raise HeadError(
            f"{where}: its draft layer attends through a sliding window of {window} tokens, which spechead's "
            "draft layers do not implement (they would attend to the whole context): not supported"
        )
    return layer_config_from(parsed)


def sliding_window(config: PretrainedConfig, layers: int = 1) -> int | None:
    """The window (tokens) any of the first `layers` layers of `config` attends through, None for full
    attention: where the config lists layer_types (speculators, vLLM and transformers read those), those
    layers' types decide; without them a sliding_window the config does not switch off
    (use_sliding_window) applies."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not window:
        return None
    if types:
        return int(window) if "sliding_attention" in types[:layers] else None
    return int(window) if getattr(config, "use_sliding_window", True) else None


def llama_layer_fields(layer_config: dict[str, Any]) -> dict[str, Any]:
    """The Llama config fields (v4 names, one layer) that rebuild the layer `layer_config` describes."""
    cfg = build_config(layer_config)
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    if "partial_rotary_factor" in rope or getattr(cfg, "partial_rotary_factor", 1.0) != 1.0:
        raise HeadError("the head's layer uses partial rotary embeddings, which a Llama layer cannot express")
    theta = rope.pop("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    return {
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": theta,
        "rope_scaling": None if rope_type == "default" else rope,
        "attention_bias": bool(getattr(cfg, "attention_bias", False)),
        "mlp_bias": bool(getattr(cfg, "mlp_bias", False)),
        "num_hidden_layers": 1,
        "tie_word_embeddings": False,
    }


def target_fields(
    target_config: PretrainedConfig | None, hidden_size: int, vocab_size: int, where: str
) -> dict[str, Any]:
    """HeadConfig target fields from the target's config (empty if None; a name it leaves empty, as an unsaved
    target does, is left out, so a verifier the head names stays); sizes must match the head's."""
    if target_config is None:
        return {}
    found = described_target(target_config)
    for name, mine in (("hidden_size", hidden_size), ("vocab_size", vocab_size)):
        if mine != found[name]:
            raise HeadError(
                f"{where} has {name} {mine} but the target has {found[name]}: it was made for another target"
            )
    return {
        k: found[k] for k in ("target_num_layers", "target_architecture", "target_name_or_path") if found[k]
    }


def check_fused_layers(where: str, layers: list[int], depth: int) -> None:
    """HeadError if `layers` (HF hidden-state indices a published head fuses) include the target's last
    layer `depth` (0 = depth unknown): engines capture that layer's output BEFORE the final norm, while
    spechead's hidden-state index `depth` is after it."""
    if depth and depth in layers:
        raise HeadError(
            f"{where} fuses target layer {depth} (of {depth}): in vLLM and SGLang that is the last decoder "
            f"layer's output BEFORE the final norm, while spechead's hidden-state index {depth} is after it; "
            "the head would read another state: not supported"
        )
