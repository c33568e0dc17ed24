"""heads/hybrid.py: the one detector of layers with recurrent state, read from configs alone (every
field a hybrid architecture uses to say so), and its one-line refusal."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers import AutoConfig

from spechead.heads.hybrid import check_attention_only, recurrent_layers

HYBRIDS = {
    "qwen3_next": ["linear_attention"],  # layer_types
    "falcon_h1": ["hybrid"],  # attention and Mamba in every layer (a layer_types property)
    "jamba": ["linear_attention", "mamba"],  # layers_block_type ("mamba") and layer_types
    "nemotron_h": ["linear_attention", "mamba"],  # layers_block_type and hybrid_override_pattern
    "bamba": ["linear_attention"],
    "zamba2": ["hybrid", "linear_attention"],
    "granitemoehybrid": ["linear_attention"],
    "minimax": ["linear_attention"],
    "mamba": ["linear_attention"],
}
ATTENTION_ONLY = ["llama", "mistral", "gemma2", "gemma3_text", "gpt_oss", "qwen2", "qwen3_moe", "llama4_text"]


@pytest.mark.parametrize("model_type", list(HYBRIDS))
def test_hybrid_configs_name_their_recurrent_layers(model_type):
    assert recurrent_layers(AutoConfig.for_model(model_type)) == HYBRIDS[model_type]


@pytest.mark.parametrize("model_type", ATTENTION_ONLY)
def test_attention_only_configs_have_none(model_type):
    """Sliding, chunked, MoE and full attention layers are all attention."""
    config = AutoConfig.for_model(model_type)
    assert recurrent_layers(config) == []
    check_attention_only(config, "speculative decoding")  # no error


def test_each_field_is_read_on_its_own():
    """A config that says it only through one field: per-layer types, block types, NemotronH's pattern
    (M = Mamba-2, * = attention, - = MLP, E = MoE), or an all-recurrent model type; LFM2's "conv"."""
    assert recurrent_layers(SimpleNamespace(layer_types=["full_attention", "conv"])) == ["conv"]
    assert recurrent_layers(SimpleNamespace(layers_block_type=["attention", "mamba"])) == ["mamba"]
    assert recurrent_layers(SimpleNamespace(hybrid_override_pattern="*-E*")) == []
    assert recurrent_layers(SimpleNamespace(hybrid_override_pattern="M-M*")) == ["mamba"]
    assert recurrent_layers(SimpleNamespace(model_type="rwkv")) == ["rwkv"]
    assert recurrent_layers(SimpleNamespace(model_type="llama", layer_types=["full_attention"])) == []


def test_the_refusal_is_one_line_naming_the_architecture_and_what_to_do():
    config = AutoConfig.for_model("jamba")
    config.architectures = ["JambaForCausalLM"]
    with pytest.raises(ValueError) as err:
        check_attention_only(config, "speculative decoding")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("JambaForCausalLM is a hybrid model (linear_attention, mamba layers")
    assert "speculative decoding is not supported" in message and "transformers' generate" in message
    with pytest.raises(ValueError, match=r"^qwen3_next is a hybrid model .*: training it is .*; use a GPU"):
        check_attention_only(AutoConfig.for_model("qwen3_next"), "training it", "use a GPU")
