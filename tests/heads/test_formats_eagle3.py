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
    assert config["speculators_model_type"] == "eagle3" and config["dtype"] == "float32"
    flags = ("norm_before_fc", "norm_before_residual", "norm_output")
    assert {f: config[f] for f in flags} == dict.fromkeys(flags, False)  # all written: vLLM's default differs
    assert config["eagle_aux_hidden_state_layer_ids"] == LAYERS  # vLLM: layer INPUT ids = HF indices
    assert config["draft_vocab_size"] == VD and config["transformer_layer_config"]["vocab_size"] == V
    assert config["transformer_layer_config"]["num_hidden_layers"] == 1
    spec = config["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["proposal_methods"][0]["speculative_tokens"] == 4
    assert spec["verifier"] == {"name_or_path": "org/tiny-llama", "architectures": ["LlamaForCausalLM"]}
    names = set(load_file(out / "model.safetensors"))
    assert "layers.0.hidden_norm.weight" in names and not any(n.startswith("midlayer.") for n in names)
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= names
    embedding = load_file(out / "model.safetensors")["embed_tokens.weight"]  # the target's, shipped
    assert torch.equal(embedding, target.get_input_embeddings().weight)
    back = attach(load_head(out), target)
    assert back.config.target_name_or_path == "org/tiny-llama"
    assert_same_head(head, back)


def test_a_head_with_its_own_embedding_round_trips_with_it(target, tmp_path) -> None:
    """own_embedding: the speculators export ships the head's table (not the target's) with
    embed_requires_grad true and reloads as the same head; layouts that would serve the target's refuse."""
    head = make_head(target, own_embedding=True)
    out = export_head(head, "speculators", tmp_path / "spec")
    assert json.loads((out / "config.json").read_text())["embed_requires_grad"] is True
    shipped = load_file(out / "model.safetensors")["embed_tokens.weight"]
    assert torch.equal(shipped, head.embed_tokens.weight)
    assert not torch.allclose(shipped, target.get_input_embeddings().weight, atol=0.1)
    back = attach(load_head(out), target)
    mine, theirs = head.state_dict(), back.state_dict()
    assert back.config.own_embedding and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert mine.keys() == theirs.keys()
    assert_same_head(head, back)
    with pytest.raises(HeadError, match="drop --no-embedding"):
        export_head(head, "speculators", tmp_path / "a", with_embedding=False)
    with pytest.raises(HeadError, match="SGLang replaces with the target's"):
        export_head(head, "sglang", tmp_path / "b")


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
    ("fmt", "change", "message"),
    [
        ("speculators", {"fc_norm": True}, "fc_norm=true"),
        ("speculators", {"speculators_model_type": "eagle"}, "'eagle' model"),
        ("speculators", {"target_hidden_size": 2 * H}, "another width"),
        ("sglang", {"eagle_config": {"use_aux_hidden_state": False}}, "use_aux_hidden_state=false"),
        ("sglang", {"num_hidden_layers": 2}, "several decoder layers"),
        ("speculators", {"transformer_layer_config": {"num_hidden_layers": 2}}, "num_hidden_layers 2 but"),
    ],
)
def test_variants_spechead_cannot_run_are_refused(target, tmp_path, fmt, change, message) -> None:
    """A speculators or official-layout head whose config asks for what spechead's head does not compute
    (another norm placement, no fused target layers, several decoder layers) is refused,
    not imported as a one-layer head reading three layers."""
    out = export_head(make_head(target), fmt, tmp_path / fmt)
    config = json.loads((out / "config.json").read_text())
    layer = {**config.get("transformer_layer_config", {}), **change.pop("transformer_layer_config", {})}
    if fmt == "speculators":  # (a layer config that says 2 layers where the tensors hold one)
        change["transformer_layer_config"] = layer
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
    with pytest.raises(HeadError, match="2 decoder layers and SGLang's EAGLE-3 layout holds one"):
        export_head(make_head(target, num_layers=2), "sglang", tmp_path / "c")


def test_layout_of_config_reads_each_marker_alone() -> None:
    """Each marker identifies its layout by itself: an Eagle3 architecture without draft_vocab_size (the
    draft vocab is then the lm_head's rows), draft_vocab_size under a plain Llama architecture (SpecForge
    heads), speculators_model_type, and Medusa by model_type alone (vLLM); a target's or a spechead
    head's config is none of them."""
    from spechead.heads.formats.detect import layout_of_config

    assert layout_of_config({"architectures": ["LlamaForCausalLMEagle3"]}) == "eagle3"
    assert layout_of_config({"architectures": ["LlamaForCausalLM"], "draft_vocab_size": VD}) == "eagle3"
    assert layout_of_config({"speculators_model_type": "eagle3", "draft_vocab_size": VD}) == "speculators"
    assert layout_of_config({"model_type": "medusa", "num_heads": 2}) == "medusa"
    assert layout_of_config({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}) is None
    assert layout_of_config({"family": "eagle3", "draft_vocab_size": VD}) is None


def test_exports_refuse_the_embeddings_layer_and_sglang_refuses_biases(target, tmp_path) -> None:
    """Engines feed EAGLE-3 the inputs of decoder layers 1..L-1: a head fusing hidden state 0 (the
    embeddings) cannot be served. SGLang's EAGLE-3 layer has no biases: a biased head is refused there,
    not written with tensors SGLang would drop (vLLM's speculators layer takes them)."""
    with pytest.raises(HeadError, match=r"include the embeddings \(0\)"):
        export_head(make_head(target, target_layers=[0, 4, 6]), "speculators", tmp_path / "a")
    biased = make_head(target, layer_config={**layer_config_from(target.config), "attention_bias": True})
    with pytest.raises(HeadError, match="attention or MLP biases"):
        export_head(biased, "sglang", tmp_path / "b")
    export_head(biased, "speculators", tmp_path / "c")


def test_draft_vocab_that_does_not_add_up_is_refused(target, tmp_path) -> None:
    """The draft vocab comes from the lm_head rows and d2t / t2d: a config naming another draft_vocab_size,
    no mapping for a draft vocab smaller than the target's (it would map draft id i to target id i), or
    d2t offsets past vocab_size are errors, never a silently wrong token mapping."""
    out = export_head(make_head(target), "sglang", tmp_path / "sgl")
    config = json.loads((out / "config.json").read_text())
    state = load_file(out / "model.safetensors")
    (out / "config.json").write_text(json.dumps({**config, "draft_vocab_size": VD + 1}))
    with pytest.raises(HeadError, match=f"draft_vocab_size {VD + 1} != lm_head rows {VD}"):
        load_head(out)
    (out / "config.json").write_text(json.dumps(config))
    save_file({k: v for k, v in state.items() if k not in ("d2t", "t2d")}, out / "model.safetensors")
    with pytest.raises(HeadError, match=f"no d2t/t2d but its draft vocab \\({VD}\\) != vocab_size"):
        load_head(out)
    d2t = state["d2t"].clone()
    d2t[-1] = V  # draft id VD-1 -> target id V + VD - 1: past the vocabulary
    save_file({**{k: v for k, v in state.items() if k != "t2d"}, "d2t": d2t}, out / "model.safetensors")
    with pytest.raises(HeadError, match="no vocab_size covering its target ids"):
        load_head(out)


def test_speculators_import_keeps_the_verifier_it_names(target, tmp_path) -> None:
    """speculators_config.verifier names the target: its path and architecture land in the head config."""
    out = export_head(
        make_head(target, target_name_or_path="org/tiny-llama"), "speculators", tmp_path / "spec"
    )
    back = load_head(out)
    assert back.config.target_name_or_path == "org/tiny-llama"
    assert back.config.target_architecture == "LlamaForCausalLM"


def test_an_explicit_head_dim_survives_export(target, tmp_path) -> None:
    """A layer whose head_dim is not hidden_size / num_attention_heads (16, not 8: as Qwen3 or Gemma
    targets have) is exported with that head_dim and computes the same after the round trip."""
    layer_config = {**layer_config_from(target.config), "head_dim": 16}
    head = make_head(target, layer_config=layer_config)
    assert head.midlayer.self_attn.q_proj.out_features == 4 * 16
    for fmt in ("sglang", "speculators"):
        out = export_head(head, fmt, tmp_path / fmt)
        config = json.loads((out / "config.json").read_text())
        assert config.get("head_dim", config.get("transformer_layer_config", {}).get("head_dim")) == 16
        assert_same_head(head, attach(load_head(out), target))


def test_a_16_bit_export_keeps_the_vocab_maps_integer(target, tmp_path) -> None:
    """`dtype=bfloat16` casts the weights only: d2t stays int64 and t2d bool (a bf16 d2t would round
    target ids above 256), and the head loads back with the same maps."""
    head = make_head(target)
    out = export_head(head, "speculators", tmp_path / "spec", dtype=torch.bfloat16)
    state = load_file(out / "model.safetensors")
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    assert state["fc.weight"].dtype == torch.bfloat16
    back = load_head(out)
    assert torch.equal(back.d2t, head.d2t) and torch.equal(back.t2d, head.t2d)


def test_exported_layer_config_keeps_the_targets_norm_eps_and_positions(tiny_llama, tmp_path) -> None:
    """rms_norm_eps and max_position_embeddings are the target's (1e-5 and 512 here, not library
    defaults): engines build the draft layer's norms and rotary tables from them."""
    other = tiny_llama(V, layers=L, hidden=H, rms_norm_eps=1e-5)
    head = make_head(other)
    out = export_head(head, "sglang", tmp_path / "sgl")
    config = json.loads((out / "config.json").read_text())
    assert config["rms_norm_eps"] == 1e-5 and config["max_position_embeddings"] == 512
    assert_same_head(head, attach(load_head(out), other))


@pytest.mark.parametrize(("fmt", "key"), [("speculators", None), ("sglang", "eagle_config")])
def test_the_last_layer_id_is_refused_when_the_depth_is_known(target, tmp_path, fmt, key) -> None:
    """vLLM's layer id L and SGLang's output id L-1 are the last layer's state BEFORE the final norm;
    spechead's index L is after it: a head fusing it is refused once the target's depth is known."""
    out = export_head(make_head(target), fmt, tmp_path / fmt)
    config = json.loads((out / "config.json").read_text())
    if key:
        config[key]["eagle_aux_hidden_state_layer_ids"] = [0, 3, L - 1]  # output ids: L - 1 is the last
    else:
        config["eagle_aux_hidden_state_layer_ids"] = [1, 4, L]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(HeadError, match=f"fuses target layer {L} \\(of {L}\\).*BEFORE the final norm"):
        load_head(out, target_config=target.config)
    config[key or "eagle_aux_hidden_state_layer_ids"] = (
        {**config[key], "eagle_aux_hidden_state_layer_ids": [0, 3, L - 2]} if key else [1, 4, L - 1]
    )
    (out / "config.json").write_text(json.dumps(config))
    assert load_head(out, target_config=target.config).config.target_layers == [1, 4, L - 1]


def test_eagle31_options_in_each_layout(target, tmp_path) -> None:
    """speculators: the options round-trip and a missing norm_before_residual reads true (vLLM's
    default); the official layout reads a missing one as false and takes EAGLE-3.1 flags at its top
    level (as speculators' converter does); SGLang's layout refuses a head using them."""
    options = {"norm_before_fc": True, "norm_before_residual": False, "norm_output": True}
    head = make_head(target, **options)
    out = export_head(head, "speculators", tmp_path / "spec")
    back = attach(load_head(out), target)
    assert {k: getattr(back.config, k) for k in options} == options
    assert_same_head(head, back)
    config = json.loads((out / "config.json").read_text())
    del config["norm_before_residual"]
    (out / "config.json").write_text(json.dumps(config))
    assert load_head(out).config.norm_before_residual is True
    with pytest.raises(HeadError, match="EAGLE-3.1 options.*--format speculators"):
        export_head(head, "sglang", tmp_path / "sgl")
    plain = export_head(make_head(target), "sglang", tmp_path / "plain")
    assert load_head(plain).config.norm_before_residual is False
    config = json.loads((plain / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps({**config, "norm_output": True}))
    assert load_head(plain).config.norm_output is True


def test_a_windowed_layer_is_refused_in_the_official_layout(target, tmp_path) -> None:
    out = export_head(make_head(target), "sglang", tmp_path / "sgl")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "sliding_window": 8}))  # no layer_types: applies
    with pytest.raises(HeadError, match="sliding window of 8 tokens"):
        load_head(out)
    windowless = {**config, "sliding_window": 8, "layer_types": ["full_attention"]}  # switched off
    (out / "config.json").write_text(json.dumps(windowless))
    assert load_head(out).config.target_layers == LAYERS
