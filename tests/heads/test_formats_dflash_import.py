"""DFlash drafters imported through the public loader: the z-lab / SGLang layout (our own export round trips
to the same block logits; a checkpoint written by hand the way z-lab publishes them, modelled on
z-lab/Qwen3-8B-DFlash-b16's config.json, builds the head a native config for that target builds) and
speculators' "dflash" layout as the REAL speculators 0.9.0 DFlashConverter writes it. Drafters spechead's
head cannot run (windowed / causal layers, no mask token, the last layer's pre-norm state, variants,
sample_from_anchor, a reduced vocabulary) are refused in one line."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import save_file

from spechead.heads import DFlashConfig, DFlashHead, HeadError, load_head
from spechead.heads.formats import export_head
from spechead.heads.formats.detect import detect_layout, layout_of_config
from spechead.heads.formats.dflash_import import default_target_layer_ids

from .test_formats_dflash import LAYER_TENSORS, LAYERS, MASK, H, L, V, dflash_head, qwen3_target

T = 24
ANCHORS = torch.tensor([[0, 5, 11, 17, 20]])  # last context position of each block, < T - 1


def block_logits(head: DFlashHead, target) -> torch.Tensor:
    """(1, A, block_size - 1, V): each anchor's drafts through the target's lm_head."""
    head.attach_target_modules(target.lm_head, target.get_input_embeddings())
    g = torch.Generator().manual_seed(2)
    states = [2 * torch.randn(1, T, H, generator=g) for _ in head.config.target_layers]
    ids = torch.randint(0, MASK, (1, T), generator=g)
    with torch.no_grad():
        blocks = head.predict_blocks(head.fuse(states), ids, ANCHORS)  # (1, A, bs, H)
        return head.logits(blocks[:, :, 1:].flatten(1, 2)).view(1, ANCHORS.shape[1], -1, V)


def same_head(back, head, target) -> None:
    assert isinstance(back, DFlashHead)
    fields = ("block_size", "num_layers", "mask_token_id", "target_layers", "target_num_layers", "vocab_size")
    assert all(getattr(back.config, f) == getattr(head.config, f) for f in fields)
    mine, theirs = back.state_dict(), head.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    torch.testing.assert_close(block_logits(back, target), block_logits(head, target), atol=1e-6, rtol=1e-6)


def test_export_then_import_gives_the_same_drafter(tmp_path) -> None:
    target = qwen3_target()
    head = dflash_head(target)
    out = export_head(head, "sglang", tmp_path / "d")
    assert detect_layout(out, json.loads((out / "config.json").read_text())) == "dflash"  # was "eagle"
    same_head(load_head(out, target_config=target.config), head, target)
    alone = load_head(out)  # num_target_layers and target_layer_ids are in its config: no target needed
    assert alone.config.target_layers == LAYERS and alone.config.target_num_layers == L


def zlab_config(**changes) -> dict:
    """A tiny config.json shaped like z-lab/Qwen3-8B-DFlash-b16's (its keys; sizes of the test target)."""
    config = {
        "architectures": ["DFlashDraftModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "block_size": 4,
        "bos_token_id": 0,
        "dflash_config": {"mask_token_id": MASK, "target_layer_ids": [1, 3, 5]},
        "dtype": "bfloat16",
        "eos_token_id": 1,
        "head_dim": 8,
        "hidden_act": "silu",
        "hidden_size": H,
        "initializer_range": 0.02,
        "intermediate_size": 2 * H,
        "layer_types": ["full_attention", "full_attention"],
        "max_position_embeddings": 40960,
        "max_window_layers": 2,
        "model_type": "qwen3",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "num_target_layers": L,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "transformers_version": "4.57.1",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": V,
    }
    return {**config, **changes}


def zlab_tensors() -> dict[str, torch.Tensor]:
    """bf16 draft tensors under SGLang's names, shaped from zlab_config (4 heads, 2 kv heads, head_dim 8)."""
    shapes = {
        "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
        "self_attn.q_proj.weight": (32, H), "self_attn.k_proj.weight": (16, H), "self_attn.v_proj.weight": (16, H),
        "self_attn.o_proj.weight": (H, 32), "self_attn.q_norm.weight": (8,), "self_attn.k_norm.weight": (8,),
        "mlp.gate_proj.weight": (2 * H, H), "mlp.up_proj.weight": (2 * H, H), "mlp.down_proj.weight": (H, 2 * H),
    }  # fmt: skip
    assert set(shapes) == set(LAYER_TENSORS)
    g = torch.Generator().manual_seed(7)
    named = {f"layers.{i}.{n}": s for i in range(2) for n, s in shapes.items()}
    named |= {"fc.weight": (H, 3 * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    return {
        n: (0.2 * torch.randn(s, generator=g) + (1 if len(s) == 1 else 0)).bfloat16()
        for n, s in named.items()
    }


def write_zlab(directory, config: dict, tensors: dict[str, torch.Tensor]):
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, directory / "model.safetensors")
    return directory


def test_a_checkpoint_written_as_zlab_publishes_them_imports(tmp_path) -> None:
    """Not our exporter: the head built from the file equals a head configured natively for the target with
    the file's fields (layers = target_layer_ids + 1, the drafter's rope theta 1e6, not the target's 1e4;
    Qwen3 q/k norms), holding its tensors."""
    target = qwen3_target()
    tensors = zlab_tensors()
    back = load_head(write_zlab(tmp_path / "z", zlab_config(), tensors), target_config=target.config)
    assert isinstance(back, DFlashHead)
    cfg = back.config
    assert (cfg.block_size, cfg.num_layers, cfg.mask_token_id, cfg.target_layers) == (4, 2, MASK, [2, 4, 6])
    assert (
        cfg.layer_config["model_type"] == "qwen3" and cfg.layer_config["rope_parameters"]["rope_theta"] == 1e6
    )
    for name, tensor in back.state_dict().items():
        assert torch.equal(tensor, tensors[name].float()), name
    fields = DFlashConfig.from_target(target.config, "qwen3").layer_config  # the target's theta: 1e4
    rope = {"rope_type": "default", "rope_theta": 1e6}  # the drafter's own, as its config says
    native = DFlashHead(
        DFlashConfig.from_target(
            target.config, "qwen3", layer_config={**fields, "rope_parameters": rope}, block_size=4, num_layers=2,
            mask_token_id=MASK, target_layers=[2, 4, 6],
        )
    )  # fmt: skip
    native.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=True)
    torch.testing.assert_close(
        block_logits(back, target), block_logits(native.eval(), target), atol=1e-6, rtol=0
    )


def test_without_layer_ids_sglangs_default_applies() -> None:
    """SGLang's default for a config naming no target_layer_ids, checked against z-lab's published
    Qwen3-8B drafter (36 target layers, 5 draft layers: target_layer_ids [1, 9, 17, 25, 33])."""
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(36, 1) == [18]
    assert default_target_layer_ids(8, 3) == [1, 3, 5]


def test_without_layer_ids_the_targets_depth_decides(tmp_path) -> None:
    target = qwen3_target()
    tensors = zlab_tensors()
    config = zlab_config(num_hidden_layers=3, layer_types=["full_attention"] * 3, max_window_layers=3)
    config["dflash_config"] = {"mask_token_id": MASK}
    third = {
        k.replace("layers.1.", "layers.2."): v.clone()
        for k, v in tensors.items()
        if k.startswith("layers.1.")
    }
    path = write_zlab(
        tmp_path / "z", {k: v for k, v in config.items() if k != "num_target_layers"}, tensors | third
    )
    with pytest.raises(HeadError, match="does not name its target layers"):
        load_head(path)
    assert load_head(path, target_config=target.config).config.target_layers == [2, 4, 6]  # outputs 1, 3, 5


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 8, "use_sliding_window": True},
         r"\['sliding_attention'\] draft layers"),
        ({"dflash_config": {"target_layer_ids": [1, 3, 5]}}, "names no mask_token_id"),
        ({"dflash_config": {"mask_token_id": MASK, "target_layer_ids": [1, 3, L - 1]}}, "BEFORE the final norm"),
        ({"num_target_layers": 12}, "made for a 12-layer target, the target has 8 layers"),
        ({"dflash_config": {"mask_token_id": MASK, "target_layer_ids": [1, 3, 5], "conv_kernel_size": 3}},
         r"DFlash variant \(conv_kernel_size\)"),
        ({"dflash_config": {"mask_token_id": MASK, "target_layer_ids": [1, 5]}}, "fc reads 96 features"),
    ],
    ids=["sliding-layer", "no-mask-token", "last-layer", "other-target", "conv-variant", "fc-width"],
)  # fmt: skip
def test_what_the_head_cannot_run_is_refused(tmp_path, changes, message) -> None:
    path = write_zlab(tmp_path / "z", zlab_config(**changes), zlab_tensors())
    with pytest.raises(HeadError, match=message):
        load_head(path, target_config=qwen3_target().config)


def test_dflash_markers_are_recognised() -> None:
    assert layout_of_config({"architectures": ["DFlashDraftModel"], "model_type": "qwen3"}) == "dflash"
    assert layout_of_config({"model_type": "qwen3", "dflash_config": {"mask_token_id": 5}}) == "dflash"
    assert layout_of_config({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}) is None
    assert layout_of_config({"speculators_model_type": "dflash"}) == "speculators-dflash"


# ---- speculators' layout, written by the real speculators converter ------------------------------------


def test_speculators_dflash_written_by_its_converter_imports(tmp_path) -> None:
    converter = pytest.importorskip("speculators.convert.dflash", reason="speculators is not installed")
    from loguru import logger

    logger.disable("speculators")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    target = qwen3_target()
    target.save_pretrained(tmp_path / "target")
    head = dflash_head(target)
    out = export_head(head, "sglang", tmp_path / "d")
    converter.DFlashConverter().convert(out, tmp_path / "conv", str(tmp_path / "target"), validate=False)
    file = tmp_path / "conv" / "config.json"
    config = json.loads(file.read_text())
    assert config["speculators_model_type"] == "dflash" and config["aux_hidden_state_layer_ids"] == LAYERS
    back = load_head(tmp_path / "conv", target_config=target.config)
    assert back.config.target_name_or_path == str(tmp_path / "target")  # its verifier
    same_head(back, head, target)
    for changes, message in (
        ({"sample_from_anchor": True}, r"DFlash variant \(sample_from_anchor\)"),
        ({"draft_vocab_size": V // 2}, f"reduced vocabulary \\({V // 2} of {V} tokens"),
        ({"mask_token_id": None}, "names no mask_token_id"),
        ({"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 8}, "sliding_attention"),
    ):
        file.write_text(json.dumps({**config, **changes}))
        with pytest.raises(HeadError, match=message):
            load_head(tmp_path / "conv", target_config=target.config)


def word_tokenizer(tokens: list[str]):
    """A tokenizer whose vocabulary is `tokens`, in order (ids 0..len - 1)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    model = WordLevel({t: i for i, t in enumerate(tokens)}, unk_token=tokens[0])
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(model))


@pytest.mark.parametrize(
    ("section", "tokens", "expected"),
    [
        ({}, [f"t{i}" for i in range(40)] + ["<|MASK|>"], 40),  # SGLang's <|MASK|>, in the vocabulary
        ({}, [f"t{i}" for i in range(50)], 50),  # not there: SGLang adds it, at len(tokenizer) (a spare row)
        (
            {"mask_token": "<|fim_pad|>"},
            [f"t{i}" for i in range(30)] + ["<|fim_pad|>"],
            30,
        ),  # the named token
        ({"mask_token_id": MASK}, [f"t{i}" for i in range(40)] + ["<|MASK|>"], MASK),  # a named id wins
    ],
    ids=["in-vocabulary", "added", "named-token", "named-id"],
)
def test_a_zlab_config_without_a_mask_id_takes_sglangs_from_the_tokenizer(
    tmp_path, section, tokens, expected
):
    """z-lab / SGLang DFLASH configs may name no mask_token_id: SGLang then embeds the masks as its mask token
    (dflash_config.mask_token, default <|MASK|>) of the target's tokenizer, adding it when missing."""
    config = zlab_config()
    config["dflash_config"] = {"target_layer_ids": [1, 3, 5], **section}
    path = write_zlab(tmp_path / "z", config, zlab_tensors())
    target = qwen3_target()
    head = load_head(path, target_config=target.config, target_tokenizer=word_tokenizer(tokens))
    assert head.config.mask_token_id == expected


def test_a_mask_token_with_no_embedding_row_is_refused(tmp_path) -> None:
    """<|MASK|> not in a tokenizer of V tokens: SGLang would add it at id V, past the embedding: one line."""
    config = zlab_config()
    config["dflash_config"] = {"target_layer_ids": [1, 3, 5]}
    path = write_zlab(tmp_path / "z", config, zlab_tensors())
    with pytest.raises(HeadError, match=f"no mask_token_id below the vocabulary size {V} \\(got {V}\\)"):
        load_head(
            path,
            target_config=qwen3_target().config,
            target_tokenizer=word_tokenizer([f"t{i}" for i in range(V)]),
        )
    with pytest.raises(HeadError, match="load it with the target's tokenizer"):  # no tokenizer: the hint
        load_head(path, target_config=qwen3_target().config)
