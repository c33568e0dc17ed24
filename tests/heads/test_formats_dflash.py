"""DFlash exported in the layout SGLang's DFLASH loads. SGLang cannot run here (GPU build, not installed):
the layout is tested against its published loader's schema (heads/formats/dflash_export.py names the
source: sgl-project/sglang models/dflash.py and speculative/dflash_utils.py), and the REAL speculators
0.9.0 DFlashConverter (which reads this z-lab / SGLang layout) loads it strictly into its
DFlashDraftModel with our tensors (test_formats_dflash_client.py runs it: the same logits). Heads SGLang
cannot hold are refused."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from spechead.heads import DFlashConfig, DFlashHead, HeadError, load_head
from spechead.heads.dflash import MASK as MASK_ID
from spechead.heads.formats import export_head

V, H, L, MASK = 64, 32, 8, 63
LAYERS = [2, 4, 6]  # HF hidden-state indices = outputs of target layers 1, 3, 5


def qwen3_target() -> Qwen3ForCausalLM:
    config = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=L,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)  # fmt: skip
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).eval()


def dflash_head(target, draft_layer: str = "target", **overrides) -> DFlashHead:
    fields = {"block_size": 4, "num_layers": 2, "mask_token_id": MASK, "target_layers": LAYERS, **overrides}
    torch.manual_seed(1)
    head = DFlashHead(DFlashConfig.from_target(target.config, draft_layer, **fields))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.2)
    return head.eval()


# SGLang's DFlashDraftModel parameters per layer (its q/k/v and gate/up are stacked from these names)
LAYER_TENSORS = [
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
]  # fmt: skip


def test_layout_matches_sglangs_dflash_schema(tmp_path) -> None:
    target = qwen3_target()
    head = dflash_head(target)
    out = export_head(head, "sglang", tmp_path / "d")
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["model_type"] == "qwen3"
    assert raw["num_hidden_layers"] == 2 and raw["num_target_layers"] == L and raw["block_size"] == 4
    assert raw["dflash_config"] == {"mask_token_id": MASK, "target_layer_ids": [1, 3, 5], "block_size": 4}
    assert raw["layer_types"] == ["full_attention"] * 2 and raw["hidden_act"] == "silu"
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                "intermediate_size", "rope_theta", "max_position_embeddings", "vocab_size"):  # fmt: skip
        assert key in raw, key
    tensors = load_file(out / "model.safetensors")
    expected = {f"layers.{i}.{name}" for i in range(2) for name in LAYER_TENSORS}
    expected |= {"fc.weight", "hidden_norm.weight", "norm.weight"}
    assert set(tensors) == expected  # no embedding, no lm_head: SGLang uses the target's
    assert tensors["fc.weight"].shape == (H, len(LAYERS) * H)  # (H, K * H): K = len(target_layer_ids)
    assert tensors["layers.0.self_attn.k_norm.weight"].shape == (8,)  # per head (head_dim)
    for name, tensor in head.state_dict().items():
        assert torch.equal(tensors[name], tensor), name


def test_the_default_draft_layer_exports_for_any_target(tmp_path) -> None:
    """head.draft_layer=qwen3 (the default) on a Llama target: a Qwen3 layer sized from it, with the q/k
    norms SGLang's DFLASH layer always applies, exports; a Llama layer (no q/k norms) is refused."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=L,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    llama = LlamaForCausalLM(config).eval()
    assert DFlashConfig.from_target(llama.config).layer_config["model_type"] == "qwen3"  # the default
    out = export_head(dflash_head(llama, "qwen3"), "sglang", tmp_path / "q")
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3"
    assert "layers.1.self_attn.k_norm.weight" in load_file(out / "model.safetensors")
    with pytest.raises(HeadError, match="head.draft_layer=qwen3"):
        export_head(dflash_head(llama, "llama"), "sglang", tmp_path / "l")


def test_speculators_converter_loads_the_layout_strictly(tmp_path) -> None:
    """speculators' DFlashConverter reads the z-lab / SGLang layout into its DFlashDraftModel (unexpected
    or missing draft tensors raise); the converted model holds our weights and our layer ids."""
    converter = pytest.importorskip("speculators.convert.dflash", reason="speculators is not installed")
    from loguru import logger

    logger.disable("speculators")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    target = qwen3_target()
    target.save_pretrained(tmp_path / "target")
    head = dflash_head(target)
    out = export_head(head, "sglang", tmp_path / "d")
    converter.DFlashConverter().convert(out, tmp_path / "conv", str(tmp_path / "target"), validate=False)
    from speculators.models.dflash import DFlashDraftModel

    model = DFlashDraftModel.from_pretrained(str(tmp_path / "conv"))
    cfg = model.config
    assert cfg.block_size == 4 and cfg.mask_token_id == MASK
    assert cfg.aux_hidden_state_layer_ids == LAYERS  # theirs: target_layer_ids + 1 = our HF indices
    theirs = model.state_dict()
    for name, tensor in head.state_dict().items():
        assert torch.equal(theirs[name], tensor), name


def test_heads_sglang_cannot_hold_are_refused(tmp_path) -> None:
    target = qwen3_target()
    with pytest.raises(
        HeadError, match=r"--format vllm --mask-token-id ID .* train with head.mask_token_id=<id>"
    ):
        export_head(dflash_head(target, mask_token_id=-1), "sglang", tmp_path / "a")
    with pytest.raises(HeadError, match=r"embeds its masks as token 63: drop --mask-token-id 5"):
        export_head(dflash_head(target), "sglang", tmp_path / "e", mask_token_id=5)
    with pytest.raises(HeadError, match="per-head q/k norms"):
        export_head(dflash_head(target, "llama"), "sglang", tmp_path / "b")
    with pytest.raises(HeadError, match="final normed state"):
        export_head(dflash_head(target, target_layers=[2, 4, L]), "sglang", tmp_path / "c")
    with pytest.raises(HeadError, match="cannot be exported as 'speculators'"):
        export_head(dflash_head(target), "speculators", tmp_path / "d")


# ---- through scripts/export.py -----------------------------------------------------------------------


def run_script(argv: list[str]) -> int:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "export.py"
    spec = importlib.util.spec_from_file_location("export_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main([str(a) for a in argv])


def test_the_script_exports_a_dflash_head(tmp_path, capsys) -> None:
    head = dflash_head(qwen3_target()).save_pretrained(tmp_path / "head")
    assert run_script([head, "--format", "sglang", "--out", tmp_path / "o"]) == 0
    count = len(load_head(head).state_dict())  # reloaded through spechead's DFlash importer, bit for bit
    assert f"round-trip check: reloaded with spechead, {count} tensors identical\n" in capsys.readouterr().out
    assert json.loads((tmp_path / "o" / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]


@pytest.mark.parametrize(
    ("overrides", "fmt", "message"),
    [
        ({"mask_token_id": -1}, "sglang", "train with head.mask_token_id=<id>"),
        ({"mask_token_id": -1}, "vllm", "pass --mask-token-id ID"),
        ({}, "speculators", "is a dflash head; formats for dflash heads: sglang, vllm"),
        ({}, "eagle", "is a dflash head; formats for dflash heads: sglang, vllm"),
        ({}, "medusa", "is a dflash head; formats for dflash heads: sglang, vllm"),
    ],
    ids=[
        "learned-mask-to-sglang",
        "learned-mask-to-vllm-without-an-id",
        "to-speculators",
        "to-eagle",
        "to-medusa",
    ],
)
def test_the_script_refuses_in_one_error_line(tmp_path, capsys, overrides, fmt, message) -> None:
    head = dflash_head(qwen3_target(), **overrides).save_pretrained(tmp_path / "head")
    assert run_script([head, "--format", fmt, "--out", tmp_path / "o"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and message in err


# ---- vLLM: a learned mask embedding in mask_embedding.pt ---------------------------------------------


def vllm_block_embeddings(out, target, ids: torch.Tensor) -> torch.Tensor:
    """What vLLM's DFlash drafter embeds for block ids [T] (its documented loader: the target's embedding,
    and where mask_embedding.pt exists, its embedding in place of every position holding config.json's
    dflash_config.mask_token_id)."""
    mask_id = json.loads((out / "config.json").read_text())["dflash_config"]["mask_token_id"]
    embeds = target.get_input_embeddings()(ids)  # (T, H)
    file = out / "mask_embedding.pt"
    if file.is_file():
        state = torch.load(file, weights_only=True)
        assert state["mask_token_id"] == mask_id  # vLLM raises otherwise
        embeds = torch.where((ids == mask_id)[:, None], state["embedding"].reshape(-1), embeds)
    return embeds


def test_a_learned_mask_exports_for_vllm_in_mask_embedding_pt(tmp_path) -> None:
    """The z-lab files plus mask_embedding.pt: vLLM feeds the masked positions as the chosen id and embeds
    them with the head's learned embedding, so its block input equals ours; spechead reloads the export as
    the same head (learned mask, mask_token_id -1)."""
    target = qwen3_target()
    head = dflash_head(target, mask_token_id=-1)
    head.attach_target_modules(lm_head=target.lm_head, embed_tokens=target.get_input_embeddings())
    out = export_head(head, "vllm", tmp_path / "v", mask_token_id=5)
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["dflash_config"]["mask_token_id"] == 5
    assert "mask_embedding" not in load_file(out / "model.safetensors")  # (vLLM takes it from the .pt)
    ids = torch.tensor([7, 5, 5, 5])  # [root, masks...]: vLLM's block input ids
    with torch.no_grad():
        ours = head.embed_block(torch.tensor([[7, MASK_ID, MASK_ID, MASK_ID]]))[0]  # (block size, H)
        torch.testing.assert_close(vllm_block_embeddings(out, target, ids), ours, rtol=0, atol=0)
    back = load_head(out)
    assert back.config.mask_token_id == -1
    mine, theirs = head.state_dict(), back.state_dict()
    assert set(mine) - {"embed_tokens.weight", "lm_head.weight"} == set(theirs)
    assert all(torch.equal(theirs[k], mine[k]) for k in theirs)
    (out / "config.json").write_text(
        json.dumps({**raw, "dflash_config": {**raw["dflash_config"], "mask_token_id": 6}})
    )
    with pytest.raises(HeadError, match="mask_embedding.pt is for mask_token_id 5, config.json names 6"):
        load_head(out)


def test_a_token_mask_exports_for_vllm_as_for_sglang(tmp_path) -> None:
    target = qwen3_target()
    head = dflash_head(target)
    vllm, sglang = export_head(head, "vllm", tmp_path / "v"), export_head(head, "sglang", tmp_path / "s")
    assert sorted(p.name for p in vllm.iterdir()) == sorted(p.name for p in sglang.iterdir())
    assert (vllm / "config.json").read_text() == (sglang / "config.json").read_text()
    with pytest.raises(HeadError, match="drop --mask-token-id 5"):
        export_head(head, "vllm", tmp_path / "x", mask_token_id=5)


def test_the_script_exports_a_learned_mask_for_vllm(tmp_path, capsys) -> None:
    head = dflash_head(qwen3_target(), mask_token_id=-1).save_pretrained(tmp_path / "head")
    argv = [head, "--format", "vllm", "--mask-token-id", "5", "--out", tmp_path / "o"]
    assert run_script(argv) == 0
    count = len(load_head(head).state_dict())
    assert f"round-trip check: reloaded with spechead, {count} tensors identical\n" in capsys.readouterr().out
    assert (tmp_path / "o" / "mask_embedding.pt").is_file()
