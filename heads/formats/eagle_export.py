"""Export an EagleHead (EAGLE-1/2) in the EAGLE authors' layout, which their engine (`EaModel` of the
`eagle-llm` package and the SafeAILab/EAGLE repository) and vLLM's EAGLE-1 loader read.

Layout: a Llama config.json (num_hidden_layers = the head's decoder layers, `bias` = fc has a bias)
and `pytorch_model.bin` with fc.weight, fc.bias, layers.{i}.* and embed_tokens.weight: a copy of the
target's embedding, which the reference head holds as a frozen module and loads strictly. The
reference layer 0 has no input_layernorm, so only heads trained with `first_layer_input_norm=False`
(`python train.py head=eagle +head.first_layer_input_norm=false`) export exactly; others are refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import torch

from spechead.heads.eagle import EagleHead
from spechead.heads.errors import HeadError
from spechead.heads.formats.build import export_dtype
from spechead.heads.formats.llama import llama_layer_fields
from spechead.heads.formats.weights import write_pickle

_WEIGHTS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "post_attention_layernorm.weight",
)


def export_eagle(
    head: EagleHead,
    out: Path,
    *,
    dtype: torch.dtype | None = None,
    embedding: torch.Tensor | None = None,
    **_: Any,
) -> Path:
    """Write `out`/config.json + pytorch_model.bin in the EAGLE authors' EAGLE-1/2 layout.

    embedding: the target's input embedding [V, H] (`weights.target_embedding`); default: the one
    attached to the head (`attach_target_modules`)."""
    cfg = head.config
    if cfg.first_layer_input_norm:
        raise HeadError(
            "the head's first layer normalises its input (spechead's default) and the EAGLE authors' layer 0 "
            "has no input norm: export a head trained with head.first_layer_input_norm=false"
        )
    layer = llama_layer_fields(cfg.layer_config)
    if layer["attention_bias"] or layer["mlp_bias"]:
        raise HeadError(
            "the head's layers have attention or MLP biases, which the EAGLE authors' Llama layer lacks"
        )
    tensors = {name: t for name, t in head.state_dict().items() if name.startswith(("fc.", "layers."))}
    expected = {"fc.weight", "fc.bias"} | {
        f"layers.{i}.{name}" for i in range(cfg.num_layers) for name in _WEIGHTS
    }
    expected |= {f"layers.{i}.input_layernorm.weight" for i in range(1, cfg.num_layers)}
    if set(tensors) != expected:
        extra, missing = sorted(set(tensors) - expected), sorted(expected - set(tensors))
        raise HeadError(
            f"the head's layers ({cfg.layer_config.get('model_type')}) are not Llama layers: "
            f"extra {extra[:4]}, missing {missing[:4]}"
        )
    if embedding is None:  # HeadError when no target is attached either
        embedding = cast(torch.Tensor, head.target_embed_tokens.weight)
    if tuple(embedding.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise HeadError(
            f"the target embedding has shape {tuple(embedding.shape)}, the head needs "
            f"{(cfg.vocab_size, cfg.hidden_size)}: pass the target the head was trained for"
        )
    tensors["embed_tokens.weight"] = embedding
    config = {
        "architectures": ["LlamaForCausalLM"],
        **layer,
        "num_hidden_layers": cfg.num_layers,
        "vocab_size": cfg.vocab_size,
        "bias": True,
        "torch_dtype": export_dtype(head, dtype),
    }
    out.mkdir(parents=True, exist_ok=True)
    write_pickle(tensors, out / "pytorch_model.bin", dtype)  # what the reference engine torch.loads
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
