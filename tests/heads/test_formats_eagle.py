"""EAGLE-1/2 heads in the EAGLE authors' layout: import (config, pickled weights, layer 0 without
input_layernorm, optional fc / q,k,v biases, the embed_tokens copy they ship) and export."""

from __future__ import annotations

import json

import pytest
import torch

from spechead.heads import HeadError, load_head
from spechead.heads.decoder_layer import causal_mask4d, layer_config_from
from spechead.heads.eagle import EagleConfig, EagleHead
from spechead.heads.formats import export_head, is_head_dir
from spechead.heads.formats.weights import target_embedding

H, V, L = 32, 48, 4


@pytest.fixture(scope="module")
def target(tiny_llama):
    return tiny_llama(V, layers=L, hidden=H).requires_grad_(False)


def random_head(target, **overrides) -> EagleHead:
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.from_target(target.config, first_layer_input_norm=False, **overrides))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.2)
    return attach(head.eval(), target)


def attach(head, target):
    head.attach_target_modules(lm_head=target.lm_head, embed_tokens=target.get_input_embeddings())
    return head


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, 6, H, generator=g), torch.randint(0, V, (2, 6), generator=g)


def eagle_config(num_layers: int = 1, **extra) -> dict:
    """config.json as the EAGLE authors publish it (a transformers v4 Llama config)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": 2 * H,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": num_layers,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "vocab_size": V,
        "torch_dtype": "float16",
        "transformers_version": "4.28.1",
        **extra,
    }


def write_reference(directory, config: dict, state: dict, target) -> None:
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    torch.save({**state, "embed_tokens.weight": target.get_input_embeddings().weight.clone()},
               directory / "pytorch_model.bin")  # fmt: skip


def test_layer_zero_without_input_norm_is_the_reference_computation(target) -> None:
    """fc -> attention on the UN-normed fc output (residual too) -> post-attention norm + MLP."""
    head = random_head(target)
    assert "layers.0.input_layernorm.weight" not in head.state_dict()
    features, ids = inputs()
    layer = head.layers[0]
    with torch.no_grad():
        x = head.fc(torch.cat([target.get_input_embeddings()(ids), features], dim=-1))
        positions = torch.arange(6).expand(2, 6)
        attn, _ = layer.self_attn(
            hidden_states=x,
            position_embeddings=head.rotary(x, positions),
            attention_mask=causal_mask4d(x, None),
        )
        x = x + attn
        expected = x + layer.mlp(layer.post_attention_layernorm(x))
        assert torch.allclose(head(features, ids), expected, atol=1e-6)


def test_import_published_eagle_head(target, tmp_path) -> None:
    head = random_head(target)
    write_reference(tmp_path / "eagle", eagle_config(), head.state_dict(), target)
    assert is_head_dir(json.loads((tmp_path / "eagle" / "config.json").read_text()), tmp_path / "eagle")
    back = attach(load_head(tmp_path / "eagle"), target)
    assert isinstance(back, EagleHead) and back.config.first_layer_input_norm is False
    assert back.config.target_layers == [-1]  # the final normed state, as the reference reads
    features, ids = inputs()
    with torch.no_grad():
        assert torch.equal(back.logits(back(features, ids)), head.logits(head(features, ids)))


def test_import_two_layers_without_fc_bias_with_qkv_bias(target, tmp_path) -> None:
    """Reference options: `bias: false` (no fc bias) and `qkv_bias` (q/k/v biases, none on o_proj)."""
    layer_config = {**layer_config_from(target.config), "attention_bias": True}
    head = random_head(target, num_layers=2, layer_config=layer_config)
    with torch.no_grad():
        head.fc.bias.zero_()
        for layer in head.layers:
            layer.self_attn.o_proj.bias.zero_()
    state = {k: v for k, v in head.state_dict().items() if k != "fc.bias" and not k.endswith("o_proj.bias")}
    assert "layers.1.input_layernorm.weight" in state  # only layer 0 drops its input norm
    write_reference(tmp_path / "eagle", eagle_config(2, bias=False, qkv_bias=True), state, target)
    back = attach(load_head(tmp_path / "eagle", target_config=target.config), target)
    assert back.config.num_layers == 2 and back.config.target_layers == [L]
    features, ids = inputs()
    with torch.no_grad():
        assert torch.equal(back(features, ids), head(features, ids))


def test_a_target_model_directory_is_not_taken_for_a_head(tiny_target_dir) -> None:
    config = json.loads((tiny_target_dir / "config.json").read_text())
    assert not is_head_dir(config, tiny_target_dir)
    with pytest.raises(HeadError, match="not a spechead head config"):
        load_head(tiny_target_dir)


def test_a_mismatching_checkpoint_is_refused(target, tmp_path) -> None:
    head = random_head(target)
    state = {k: v for k, v in head.state_dict().items() if "mlp.up_proj" not in k}
    write_reference(tmp_path / "eagle", eagle_config(), state, target)
    with pytest.raises(HeadError, match=r"missing tensors \['layers.0.mlp.up_proj.weight'\]"):
        load_head(tmp_path / "eagle")
    with pytest.raises(HeadError, match="vocab_size 48 but the target has 56"):
        other = type(target.config)(**{**target.config.to_dict(), "vocab_size": V + 8})
        load_head(tmp_path / "eagle", target_config=other)


def test_export_in_the_authors_layout_reads_back_as_the_same_head(target, tmp_path) -> None:
    """`--format eagle`: config.json + pytorch_model.bin (fc, layers, the target's embedding), which the
    authors' engine loads strictly; importing it again computes exactly what the head computes."""
    head = random_head(target, num_layers=2)
    out = export_head(head, "eagle", tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["bias"] is True and config["vocab_size"] == V
    state = torch.load(out / "pytorch_model.bin", weights_only=True)
    assert torch.equal(state["embed_tokens.weight"], target.get_input_embeddings().weight)
    assert "layers.0.input_layernorm.weight" not in state and "layers.1.input_layernorm.weight" in state
    back = attach(load_head(out, target_config=target.config), target)
    features, ids = inputs()
    with torch.no_grad():
        assert torch.equal(back(features, ids), head(features, ids))


def test_export_takes_the_embedding_given_and_checks_its_shape(target, tmp_path) -> None:
    head = random_head(target)
    given = torch.randn(V, H)
    out = export_head(head, "eagle", tmp_path / "a", embedding=given)
    state = torch.load(out / "pytorch_model.bin", weights_only=True)
    assert torch.equal(state["embed_tokens.weight"], given)
    with pytest.raises(HeadError, match=r"embedding has shape \(48, 16\), the head needs \(48, 32\)"):
        export_head(head, "eagle", tmp_path / "b", embedding=torch.randn(V, H // 2))


def test_export_refuses_what_the_authors_layout_cannot_hold(target, tmp_path) -> None:
    own = attach(EagleHead(EagleConfig.from_target(target.config)), target)  # layer 0 normalises its input
    with pytest.raises(HeadError, match="first_layer_input_norm=false"):
        export_head(own, "eagle", tmp_path / "a")
    biased = random_head(target, layer_config={**layer_config_from(target.config), "attention_bias": True})
    with pytest.raises(HeadError, match="attention or MLP biases"):
        export_head(biased, "eagle", tmp_path / "b")
    bare = EagleHead(EagleConfig.from_target(target.config, first_layer_input_norm=False))
    with pytest.raises(HeadError, match="no target embed_tokens attached"):
        export_head(bare, "eagle", tmp_path / "c")


def test_target_embedding_reads_one_tensor_of_a_saved_target(tiny_target_dir, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    want = AutoModelForCausalLM.from_pretrained(tiny_target_dir).get_input_embeddings().weight
    assert torch.equal(target_embedding(str(tiny_target_dir)), want)
    with pytest.raises(HeadError, match="no safetensors checkpoint with exactly one embed_tokens.weight"):
        target_embedding(str(tmp_path))


def test_import_ignores_bias_flags_the_reference_layer_never_reads(target, tmp_path) -> None:
    """The reference Llama layer builds q/k/v biases from `qkv_bias` only and never an MLP bias: a config
    that also says attention_bias / mlp_bias true still imports as the bias-free layer it ran."""
    head = random_head(target)
    write_reference(
        tmp_path / "eagle", eagle_config(attention_bias=True, mlp_bias=True), head.state_dict(), target
    )
    back = attach(load_head(tmp_path / "eagle"), target)
    assert not any(k.endswith("proj.bias") for k in back.state_dict())
    features, ids = inputs()
    with torch.no_grad():
        assert torch.equal(back(features, ids), head(features, ids))


def test_import_keeps_a_layer_zero_input_norm_when_the_checkpoint_has_one(target, tmp_path) -> None:
    """A published head whose layer 0 keeps its input_layernorm imports with first_layer_input_norm=True
    (the norm is applied, not dropped as unexpected)."""
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.from_target(target.config))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.2)
    head = attach(head.eval(), target)
    assert "layers.0.input_layernorm.weight" in head.state_dict()
    write_reference(tmp_path / "eagle", eagle_config(), head.state_dict(), target)
    back = attach(load_head(tmp_path / "eagle"), target)
    assert back.config.first_layer_input_norm is True
    features, ids = inputs()
    with torch.no_grad():
        assert torch.equal(back(features, ids), head(features, ids))


def test_export_writes_the_dtype_it_names(target, tmp_path) -> None:
    """`dtype=bfloat16`: every tensor of pytorch_model.bin (the embedding too) is bf16, as torch_dtype says."""
    out = export_head(random_head(target), "eagle", tmp_path / "out", dtype=torch.bfloat16)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    state = torch.load(out / "pytorch_model.bin", weights_only=True)
    assert {t.dtype for t in state.values()} == {torch.bfloat16}


def test_tensor_names_of_other_layouts_are_not_an_eagle_head() -> None:
    """fc + layers.0.* alone mark an EAGLE-1/2 head; with model.* or midlayer.* tensors beside them the
    file is another layout (a whole model, an EAGLE-3 head) and must not be imported as EAGLE-1/2."""
    from spechead.heads.formats.eagle import is_eagle_tensors

    names = {"fc.weight", "layers.0.mlp.up_proj.weight"}
    assert is_eagle_tensors(names)
    assert not is_eagle_tensors(names | {"model.norm.weight"})
    assert not is_eagle_tensors(names | {"midlayer.hidden_norm.weight"})


def test_a_pickle_holding_more_than_tensors_is_refused(target, tmp_path) -> None:
    """pytorch_model.bin must be a plain state dict of tensors (a training checkpoint with a step count or
    optimizer state beside them is not a head)."""
    state = {**random_head(target).state_dict(), "step": 3}
    write_reference(tmp_path / "eagle", eagle_config(), state, target)
    with pytest.raises(HeadError, match="is not a state dict of tensors"):
        load_head(tmp_path / "eagle")


def test_a_misshapen_tensor_is_a_head_error_naming_it(target, tmp_path) -> None:
    """A tensor whose shape is not what the config implies (an MLP of another width) is a HeadError naming
    the tensor and both shapes, not a bare load_state_dict RuntimeError."""
    state = random_head(target).state_dict()
    state["layers.0.mlp.up_proj.weight"] = state["layers.0.mlp.up_proj.weight"][:8].clone()
    write_reference(tmp_path / "eagle", eagle_config(), state, target)
    with pytest.raises(HeadError, match=r"tensor layers.0.mlp.up_proj.weight has shape \(8, 32\)"):
        load_head(tmp_path / "eagle")
