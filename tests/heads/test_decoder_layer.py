"""decoder_layer: a layer rebuilt from layer_config reproduces the target's own layer; masks; errors."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config

from spechead.heads import HeadError
from spechead.heads.decoder_layer import (
    Rotary,
    additive_mask,
    build_config,
    causal_allowed,
    causal_mask4d,
    decoder_layer_class,
    layer_config_from,
    rotary_class,
)

TINY = dict(
    vocab_size=40,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_parameters={"rope_type": "default", "rope_theta": 500.0},  # not the default: must survive
)
ARCHS = {"llama": "LlamaDecoderLayer", "qwen2": "Qwen2DecoderLayer", "mistral": "MistralDecoderLayer"}


def tiny_target(model_type: str):
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **TINY)
    config._attn_implementation = "eager"
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("model_type", sorted(ARCHS))
def test_layer_config_is_json_safe_and_layer_only(model_type) -> None:
    layer_config = layer_config_from(tiny_target(model_type).config)
    assert json.loads(json.dumps(layer_config)) == layer_config
    assert layer_config["model_type"] == model_type
    assert layer_config["rope_parameters"]["rope_theta"] == 500.0
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "rms_norm_eps",
    ):
        assert key in layer_config
    for key in ("vocab_size", "num_hidden_layers", "sliding_window", "layer_types", "architectures"):
        assert key not in layer_config


@pytest.mark.parametrize("model_type", sorted(ARCHS))
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_rebuilt_layer_reproduces_the_targets_first_layer(model_type, impl) -> None:
    target = tiny_target(model_type)
    config = build_config(layer_config_from(target.config), attn_implementation=impl)
    assert config.num_hidden_layers == 1 and config._attn_implementation == impl
    assert getattr(config, "sliding_window", None) is None
    layer_class = decoder_layer_class(config)
    assert layer_class.__name__ == ARCHS[model_type]
    assert rotary_class(config).__name__ == ARCHS[model_type].replace("DecoderLayer", "RotaryEmbedding")
    layer = layer_class(config, layer_idx=0).eval()
    layer.load_state_dict(target.model.layers[0].state_dict())

    ids = torch.tensor([[3, 7, 1, 9, 2, 5], [4, 4, 8, 0, 6, 1]])
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states  # hs[1] = layer 0 output (pre-norm)
        x = hs[0]  # (B, T, H)
        positions = torch.arange(6).expand(2, 6)
        out = layer(
            x,
            attention_mask=causal_mask4d(x, None),
            position_ids=positions,
            position_embeddings=Rotary(config)(x, positions),
        )
    torch.testing.assert_close(out, hs[1], atol=1e-5, rtol=1e-5)


def test_unsupported_architectures_raise_head_errors() -> None:
    with pytest.raises(HeadError, match="DecoderLayer"):
        decoder_layer_class(GPT2Config(n_embd=32, n_layer=1, n_head=4))
    with pytest.raises(HeadError, match="no hidden_size"):
        layer_config_from(GPT2Config(n_embd=32, n_layer=1, n_head=4))
    with pytest.raises(HeadError, match="no model_type"):
        build_config({"hidden_size": 32})
    with pytest.raises(HeadError, match="not-a-model"):
        build_config({"model_type": "not-a-model", "hidden_size": 32})


def test_additive_mask_blocks_with_finfo_min() -> None:
    allowed = torch.tensor([[[True, False], [True, True]]])
    mask = additive_mask(allowed, torch.bfloat16)
    assert mask.shape == (1, 1, 2, 2) and mask.dtype == torch.bfloat16
    assert mask[0, 0, 0, 0] == 0 and mask[0, 0, 1, 1] == 0
    assert mask[0, 0, 0, 1] == torch.finfo(torch.bfloat16).min


def test_causal_allowed_with_padding_and_a_cached_prefix() -> None:
    pad = torch.tensor([[0, 1, 1, 1]])  # left padded
    allowed = causal_allowed(pad)
    expected = torch.tensor([[1, 0, 0, 0], [0, 1, 0, 0], [0, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(allowed[0], expected)  # the padded query sees only itself: no empty row
    last_two = causal_allowed(torch.ones(1, 4), query_len=2)  # queries are positions 2 and 3
    assert torch.equal(last_two[0], torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool))
    mask = causal_mask4d(torch.zeros(1, 2, 8), torch.ones(1, 2), past_len=3)  # (B, T) mask + prefix
    assert mask.shape == (1, 1, 2, 5)
    with pytest.raises(HeadError, match="attention_mask has shape"):
        causal_mask4d(torch.zeros(1, 2, 8), torch.ones(1, 4), past_len=3)


def test_gemma3_own_layer_is_refused_in_one_line_naming_the_llama_draft_layer() -> None:
    """Gemma-3 keeps one rotary table per attention type and sandwich-normed layers: with
    draft_layer="target" EAGLE and EAGLE-3 heads refuse it at construction, in one line that names the
    Llama-style draft layer (the default, which builds)."""
    from transformers import Gemma3TextConfig

    from spechead.heads import Eagle3Config, Eagle3Head, EagleConfig, EagleHead

    target = Gemma3TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8,
    )  # fmt: skip
    for make in (
        lambda: EagleHead(EagleConfig.from_target(target, draft_layer="target")),
        lambda: Eagle3Head(Eagle3Config.from_target(target, draft_layer="target", target_layers=[0, 1, 1])),
    ):
        with pytest.raises(HeadError, match=r"train with head.draft_layer=llama$") as err:
            make()
        assert "\n" not in str(err.value)
    assert EagleHead(EagleConfig.from_target(target)).config.layer_config["model_type"] == "llama"
    head3 = Eagle3Head(Eagle3Config.from_target(target, target_layers=[0, 1, 1]))
    assert head3.config.layer_config["model_type"] == "llama"


def test_the_llama_draft_layer_is_sized_from_any_target() -> None:
    """llama_layer_config reads each target's own field names: MLA's plain head split, Gemma-3's
    full-attention rotary, Gemma's activation name, NemotronH's activation and epsilon names, no partial
    rotary (the draft layer's attention is its own), and OLMo's missing epsilon as Llama's default."""
    from transformers import AutoConfig

    from spechead.heads.decoder_layer import llama_layer_config

    def layer(model_type: str, **fields):
        return llama_layer_config(AutoConfig.for_model(model_type, **fields))

    mla = layer("deepseek_v3", hidden_size=64, num_attention_heads=4, qk_rope_head_dim=8, kv_lora_rank=16)
    assert (mla["head_dim"], mla["num_key_value_heads"]) == (16, 4)
    gemma3 = layer("gemma3_text", hidden_size=64, num_attention_heads=4, head_dim=8)
    full = AutoConfig.for_model("gemma3_text").rope_parameters["full_attention"]["rope_theta"]
    assert gemma3["rope_parameters"]["rope_theta"] == full != 10000.0
    assert (gemma3["head_dim"], gemma3["hidden_act"]) == (8, "gelu_pytorch_tanh")
    nemotron = layer("nemotron_h", hidden_size=64, num_attention_heads=4, layer_norm_epsilon=1e-4)
    assert (nemotron["hidden_act"], nemotron["rms_norm_eps"]) == ("relu2", 1e-4)
    qwen3_next = layer("qwen3_next", hidden_size=64, num_attention_heads=4, head_dim=16)
    assert "partial_rotary_factor" not in qwen3_next["rope_parameters"]
    assert layer("olmo", hidden_size=64, num_attention_heads=4)["rms_norm_eps"] == 1e-6
    gpt_oss = layer("gpt_oss", hidden_size=64, num_attention_heads=4, head_dim=8)
    assert gpt_oss["rope_parameters"]["rope_type"] == "yarn" and gpt_oss["head_dim"] == 8
