"""Export an Eagle3Head for serving: vLLM's `speculators` layout and the SGLang / official layout.

Both engines run ONE Llama decoder layer whose q/k/v read concat(input_layernorm(embed),
hidden_norm(hidden)) with the un-normed hidden as residual (speculators: norm_before_residual false),
then norm + lm_head over the draft vocab (d2t offsets). The embedding is the target's (not written).
The fused target layers are written in each engine's convention:
- speculators / vLLM: eagle_aux_hidden_state_layer_ids = layer INPUT ids (= spechead's HF indices);
- SGLang: eagle_config.eagle_aux_hidden_state_layer_ids = layer OUTPUT ids (= HF index - 1).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from spechead.heads.eagle3 import Eagle3Head
from spechead.heads.errors import HeadError
from spechead.heads.formats.build import export_dtype, renamed
from spechead.heads.formats.llama import llama_layer_fields
from spechead.heads.formats.weights import write_tensors

_PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_NORMS = ("input_layernorm", "hidden_norm", "post_attention_layernorm")


def export_speculators(
    head: Eagle3Head,
    out: Path,
    *,
    dtype: torch.dtype | None = None,
    speculative_tokens: int = 3,
    verifier: str | None = None,
) -> Path:
    """Write `out`/config.json + model.safetensors for vLLM (`vllm serve T --speculative-config` model=out)."""
    layer = _llama_layer(head, allow_bias=True)
    cfg = head.config
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": {**layer, "vocab_size": cfg.vocab_size},
        "draft_vocab_size": cfg.draft_vocab_size,
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": _layer_inputs(head),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": verifier or cfg.target_name_or_path or None,
                "architectures": [cfg.target_architecture] if cfg.target_architecture else [],
            },
        },
        "torch_dtype": export_dtype(head, dtype),
    }
    tensors = renamed(head.state_dict(), "midlayer.", "layers.0.")
    return _write(out, config, tensors, dtype)


def export_sglang(head: Eagle3Head, out: Path, *, dtype: torch.dtype | None = None, **_: Any) -> Path:
    """Write `out` in the official EAGLE-3 layout SGLang loads (`--speculative-draft-model-path out`)."""
    layer = _llama_layer(head, allow_bias=False)  # SGLang's EAGLE-3 layer has no q/k/v or MLP biases
    cfg = head.config
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        **layer,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in _layer_inputs(head)],
            "use_aux_hidden_state": True,
        },
        "torch_dtype": export_dtype(head, dtype),
    }
    return _write(out, config, head.state_dict(), dtype)


def _layer_inputs(head: Eagle3Head) -> list[int]:
    """The fused target layers as decoder-layer input ids 1..L-1 (HF hidden-state indices)."""
    cfg = head.config
    depth = cfg.target_num_layers
    if any(i < 0 for i in cfg.target_layers):
        raise HeadError(
            f"target_layers {cfg.target_layers} are relative to a target depth the head does not record: "
            "set target_num_layers in its config.json"
        )
    if any(i < 1 or (depth and i >= depth) for i in cfg.target_layers):
        raise HeadError(
            f"target_layers {cfg.target_layers} include the embeddings (0) or the final normed state (L): serving "
            "engines feed EAGLE-3 heads the inputs of decoder layers 1..L-1 only"
        )
    if sorted(set(cfg.target_layers)) != list(cfg.target_layers):
        raise HeadError(
            f"target_layers {cfg.target_layers} are not strictly ascending: serving engines capture each layer "
            "once, in layer order, so fc would read its inputs in another order"
        )
    return list(cfg.target_layers)


def _llama_layer(head: Eagle3Head, allow_bias: bool) -> dict[str, Any]:
    """Llama fields of the midlayer; HeadError unless its tensors are exactly a Llama EAGLE-3 layer's."""
    layer = llama_layer_fields(head.config.layer_config)
    if not allow_bias and (layer["attention_bias"] or layer["mlp_bias"]):
        raise HeadError("the head's layer has attention or MLP biases, which this format's Llama layer lacks")
    expected = {f"{p}.weight" for p in (*_PROJ, *_MLP, *_NORMS)}
    expected |= {f"{p}.bias" for p in _PROJ if layer["attention_bias"]}
    expected |= {f"{p}.bias" for p in _MLP if layer["mlp_bias"]}
    actual = {name for name, _ in head.midlayer.named_parameters()}
    if actual != expected:
        raise HeadError(
            f"the head's decoder layer ({head.config.layer_config.get('model_type')}) is not a Llama layer: "
            f"extra {sorted(actual - expected)[:4]}, missing {sorted(expected - actual)[:4]}"
        )
    return layer


def _write(out: Path, config: dict[str, Any], tensors: dict, dtype: torch.dtype | None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    write_tensors(tensors, out / "model.safetensors", dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
