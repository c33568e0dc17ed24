"""EAGLE-3 heads: export to vLLM `speculators` and SGLang, and import of the official / SGLang /
SpecForge / speculators layouts, each checked by identical draft logits after the round trip."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from spechead.heads import HeadError, load_head
from spechead.heads.decoder_layer import layer_config_from
from spechead.heads.eagle3 import Eagle3Config, Eagle3Head
from spechead.heads.formats import export_head

H, V, L, VD = 32, 48, 8, 20
LAYERS = [1, 4, 6]  # not the default [2, 4, 5]: the engines must be told


@pytest.fixture(scope="module")
def target(tiny_llama):
    return tiny_llama(V, layers=L, hidden=H).requires_grad_(False)


def make_head(target, **overrides) -> Eagle3Head:
    """An Eagle3Head with random weights everywhere (norms included) and a scattered draft vocab."""
    torch.manual_seed(0)
    fields = {"draft_vocab_size": VD, "target_layers": LAYERS, **overrides}
    head = Eagle3Head(Eagle3Config.from_target(target.config, **fields))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.2)
    ids = torch.randperm(V)[:VD].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    head.set_draft_vocab(ids - torch.arange(VD), t2d)
    return attach(head.eval(), target)


def attach(head, target):
    head.attach_target_modules(lm_head=target.lm_head, embed_tokens=target.get_input_embeddings())
    return head


def draft_logits(head: Eagle3Head) -> torch.Tensor:
    """Two chained draft steps on fixed random inputs: (2, 5, Vd) logits."""
    g = torch.Generator().manual_seed(1)
    states = [torch.randn(2, 5, H, generator=g) for _ in range(3)]
    ids = torch.randint(0, V, (2, 5), generator=g)
    with torch.no_grad():
        hidden = head.step(head.fuse(states), ids)
        return head.logits(head.step(hidden, ids.flip(1)))


def assert_same_head(a: Eagle3Head, b: Eagle3Head) -> None:
    assert b.config.target_layers == a.config.target_layers
    assert torch.equal(a.d2t, b.d2t) and torch.equal(a.t2d, b.t2d)
    assert torch.equal(draft_logits(a), draft_logits(b))


def test_speculators_export_round_trip(target, tmp_path) -> None:
    head = make_head(target, target_name_or_path="org/tiny-llama")
    out = export_head(head, "speculators", tmp_path / "spec", speculative_tokens=4)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["norm_before_residual"] is False
    assert config["eagle_aux_hidden_state_layer_ids"] == LAYERS  # vLLM: layer INPUT ids = HF indices
    assert config["draft_vocab_size"] == VD and config["transformer_layer_config"]["vocab_size"] == V
    assert config["transformer_layer_config"]["num_hidden_layers"] == 1
    spec = config["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["proposal_methods"][0]["speculative_tokens"] == 4
    assert spec["verifier"] == {"name_or_path": "org/tiny-llama", "architectures": ["LlamaForCausalLM"]}
    names = set(load_file(out / "model.safetensors"))
    assert "layers.0.hidden_norm.weight" in names and not any(n.startswith("midlayer.") for n in names)
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= names
    assert "embed_tokens.weight" not in names
    back = attach(load_head(out), target)
    assert back.config.target_name_or_path == "org/tiny-llama"
    assert_same_head(head, back)


def test_sglang_export_round_trip(target, tmp_path) -> None:
    rope = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
    head = make_head(target, layer_config={**layer_config_from(target.config), "rope_parameters": rope})
    out = export_head(head, "sglang", tmp_path / "sgl", dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in LAYERS]
    assert config["tie_word_embeddings"] is False and config["num_hidden_layers"] == 1
    assert config["head_dim"] == H // 4 and config["num_key_value_heads"] == 2
    assert config["rope_theta"] == 5e5 and config["rope_scaling"]["rope_type"] == "llama3"
    assert set(load_file(out / "model.safetensors")) == set(head.state_dict())  # midlayer.* names
    assert_same_head(head, attach(load_head(out), target))


def test_official_layout_import_needs_the_targets_depth(target, tmp_path) -> None:
    """An official / SpecForge head: Llama config without layer ids, a pickled state dict with an
    embed_tokens copy; its default layers [2, L//2, L-3] come from the target's config."""
    head = make_head(target, target_layers=[2, L // 2, L - 3])
    directory = tmp_path / "official"
    directory.mkdir()
    config = {  # as the EAGLE-3 authors / SpecForge write it (transformers v4 names)
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": 2 * H,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "pad_token_id": 0,
        "tie_word_embeddings": False,
        "vocab_size": V,
        "draft_vocab_size": VD,
        "torch_dtype": "float16",
        "transformers_version": "4.28.1",
    }
    (directory / "config.json").write_text(json.dumps(config))
    state = {**head.state_dict(), "embed_tokens.weight": target.get_input_embeddings().weight.clone()}
    torch.save(state, directory / "pytorch_model.bin")
    with pytest.raises(HeadError, match="target_config=target.config"):
        load_head(directory)
    back = attach(load_head(directory, target_config=target.config), target)
    assert back.config.target_num_layers == L and back.config.target_architecture == "LlamaForCausalLM"
    assert_same_head(head, back)


def test_sglang_layout_with_d2t_only_and_explicit_layers(target, tmp_path) -> None:
    head = make_head(target)
    out = export_head(head, "sglang", tmp_path / "sgl")
    state = load_file(out / "model.safetensors")
    del state["t2d"]  # SGLang reads d2t only; t2d is rebuilt from it
    save_file(state, out / "model.safetensors")
    assert_same_head(head, attach(load_head(out), target))


def test_a_layout_with_t2d_only_gets_its_offsets(target, tmp_path) -> None:
    """A head that stores t2d without d2t: d2t is rebuilt as offsets (target id - draft id), so every
    draft id maps to the target id t2d marks in its place."""
    head = make_head(target)
    out = export_head(head, "sglang", tmp_path / "sgl")
    state = load_file(out / "model.safetensors")
    del state["d2t"]
    save_file(state, out / "model.safetensors")
    assert_same_head(head, attach(load_head(out), target))


def test_speculators_layout_with_embeddings_and_bf16(target, tmp_path) -> None:
    head = make_head(target)
    out = export_head(head, "speculators", tmp_path / "spec")
    state = load_file(out / "model.safetensors")
    state["embed_tokens.weight"] = target.get_input_embeddings().weight.clone()  # speculators keeps a copy
    save_file(state, out / "model.safetensors")
    back = load_head(out, dtype=torch.bfloat16)
    assert back.fc.weight.dtype == torch.bfloat16 and back.d2t.dtype == torch.long
    assert torch.equal(back.fc.weight, head.fc.weight.to(torch.bfloat16))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"norm_before_residual": True}, "norm_before_residual=true"),
        ({"norm_output": True}, "norm_output=true"),
        ({"embed_requires_grad": True}, "trained its own embedding"),
        ({"speculators_model_type": "eagle"}, "'eagle' model"),
        ({"target_hidden_size": 2 * H}, "another width"),
    ],
)
def test_speculators_variants_spechead_cannot_run_are_refused(target, tmp_path, change, message) -> None:
    out = export_head(make_head(target), "speculators", tmp_path / "spec")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(HeadError, match=message):
        load_head(out)


def test_exports_refuse_what_engines_cannot_feed(target, tmp_path) -> None:
    with pytest.raises(HeadError, match="final normed state"):
        export_head(make_head(target, target_layers=[2, 4, L]), "speculators", tmp_path / "a")
    with pytest.raises(HeadError, match="not strictly ascending"):
        export_head(make_head(target, target_layers=[4, 1, 6]), "sglang", tmp_path / "a")
    with pytest.raises(HeadError, match="formats for eagle3 heads: sglang, speculators"):
        export_head(make_head(target), "medusa", tmp_path / "b")
