"""Import EAGLE-1/2 heads as published by the EAGLE authors (SafeAILab layout).

Layout: a Llama-style config.json (num_hidden_layers = draft layers, optional `bias` for fc,
default true, optional `qkv_bias`) and `pytorch_model.bin` / `model.safetensors` holding
fc.weight [+ fc.bias], layers.{i}.* and usually a frozen copy of the target's embed_tokens.weight.
Tensor names already match EagleHead. Structural differences from spechead's own heads:
- layer 0 has no input_layernorm (fc's output enters attention un-normed): first_layer_input_norm=False;
- fc without bias or q/k/v biases without an o_proj bias: the missing biases become zeros (exact);
- embed_tokens.weight is dropped: spechead reads the attached target embedding, which is what the
  reference head holds (a frozen copy) when paired with its own target.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor
from transformers import PretrainedConfig

from spechead.heads.eagle import EagleConfig, EagleHead
from spechead.heads.errors import HeadError
from spechead.heads.formats.build import fill_head
from spechead.heads.formats.llama import layer_config_of, target_fields

WEIGHT_NAMES = ("model.safetensors", "pytorch_model.bin", "*.safetensors")


def is_eagle_tensors(names: set[str]) -> bool:
    """True when tensor names look like a published EAGLE-1/2 head (fc + layers.0, no model. prefix)."""
    return (
        "fc.weight" in names
        and any(n.startswith("layers.0.") for n in names)
        and not any(n.startswith(("model.", "midlayer.")) for n in names)
    )


def import_eagle(
    directory: Path,
    config: dict[str, Any],
    tensors: dict[str, Tensor],
    target_config: PretrainedConfig | None = None,
    **load: Any,
) -> EagleHead:
    """An EagleHead computing exactly what the published EAGLE-1/2 head in `directory` computes."""
    where = f"EAGLE head {directory}"
    tensors = {k: v for k, v in tensors.items() if k != "embed_tokens.weight"}
    num_layers = int(config.get("num_hidden_layers") or 1)
    layer_fields = dict(config)
    if layer_fields.get("model_type", "llama") == "llama":
        # The reference Llama layer reads only `qkv_bias` (q/k/v biases; the missing o_proj bias is
        # filled with zeros below) and never gives its MLP a bias, whatever else the config says.
        layer_fields.update(attention_bias=bool(config.get("qkv_bias")), mlp_bias=False)
    layer_config = layer_config_of(layer_fields, where)
    if "fc.weight" not in tensors:
        raise HeadError(f"{where} has no fc.weight: it is not an EAGLE-1/2 head")
    hidden, vocab = int(tensors["fc.weight"].shape[0]), config.get("vocab_size")
    if not isinstance(vocab, int):
        raise HeadError(f"{where}: config.json has no vocab_size (the target's vocabulary size)")
    head = EagleHead(
        EagleConfig(
            hidden_size=hidden,
            vocab_size=vocab,
            layer_config=layer_config,
            num_layers=num_layers,
            first_layer_input_norm="layers.0.input_layernorm.weight" in tensors,
            **target_fields(target_config, hidden, vocab, where),
        )
    )
    zero = ("fc.bias", *(f"layers.{i}.self_attn.o_proj.bias" for i in range(num_layers)))
    return fill_head(head, tensors, where, zero_biases=zero, **load)
