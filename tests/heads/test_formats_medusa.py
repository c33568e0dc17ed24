"""Medusa heads: export to the layouts vLLM's Medusa loader and FasterDecoding's `MedusaModel` read,
import of both, checked by identical head logits."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from spechead.heads import HeadError, load_head
from spechead.heads.eagle import EagleHead
from spechead.heads.formats import export_head
from spechead.heads.medusa import MedusaConfig, MedusaHead

H, V, L = 16, 40, 4


def random_head(num_heads: int = 3, num_layers: int = 2, **overrides) -> MedusaHead:
    torch.manual_seed(0)
    config = MedusaConfig(
        hidden_size=H,
        vocab_size=V,
        num_heads=num_heads,
        num_layers=num_layers,
        target_num_layers=L,
        **overrides,
    )
    head = MedusaHead(config)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3)
    return head.eval()


def same_logits(a: MedusaHead, b: MedusaHead) -> bool:
    hidden = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return all(torch.equal(x, y) for x, y in zip(a(hidden), b(hidden), strict=True))


def test_vllm_export_round_trip(tmp_path) -> None:
    head = random_head(target_name_or_path="org/tiny")
    out = export_head(head, "medusa", tmp_path / "vllm")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "medusa" and config["architectures"] == ["MedusaModel"]
    assert (config["num_heads"], config["num_hidden_layers"]) == (3, 2)
    assert config["medusa_fc_bias"] is True and config["truncated_vocab_size"] == V == config["vocab_size"]
    # vLLM renames every key holding "num" and "heads"/"layers"; only num_heads/num_hidden_layers may.
    assert [k for k in config if "num" in k] == ["num_heads", "num_hidden_layers"]
    names = set(load_file(out / "model.safetensors"))
    assert names == {
        f"blocks.{k}.layers.{j}.{p}" for k in range(3) for j in range(2) for p in ("weight", "bias")
    } | {f"lm_heads.{k}.weight" for k in range(3)}
    back = load_head(out)
    assert back.config.num_heads == 3 and back.config.num_layers == 2 and back.config.target_layers == [-1]
    assert same_logits(head, back) and same_logits(head, MedusaHead.from_pretrained(out))
    with pytest.raises(HeadError, match="holds a 'medusa' head .* not a 'eagle' head"):
        EagleHead.from_pretrained(out)


def test_fasterdecoding_import(tmp_path) -> None:
    head = random_head(num_heads=4, num_layers=1)
    directory = tmp_path / "medusa"
    directory.mkdir()
    config = {
        "medusa_num_heads": 4,
        "medusa_num_layers": 1,
        "base_model_name_or_path": "lmsys/vicuna-7b-v1.3",
    }
    (directory / "config.json").write_text(json.dumps({**config, "transformers_version": "4.34.0"}))
    # medusa_lm_head.pt is the state dict of the bare ModuleList: "{k}.{j}.linear.weight", "{k}.{n}.weight".
    torch.save(
        {k.removeprefix("heads."): v for k, v in head.state_dict().items()}, directory / "medusa_lm_head.pt"
    )
    back = load_head(directory)
    assert isinstance(back, MedusaHead) and back.config.num_heads == 4
    assert same_logits(head, back)


def test_vllm_layout_with_shared_lm_head_and_no_block_bias(tmp_path) -> None:
    head = random_head(num_heads=2, num_layers=1)
    with torch.no_grad():
        head.heads[1][1].weight.copy_(head.heads[0][1].weight)
        for seq in head.heads:
            seq[0].linear.bias.zero_()
    out = export_head(head, "medusa", tmp_path / "vllm")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(
        json.dumps({**config, "medusa_fc_bias": False, "original_lm_head": True})
    )
    state = load_file(out / "model.safetensors")
    save_file({k: v for k, v in state.items() if not k.endswith("bias") and k != "lm_heads.1.weight"},
              out / "model.safetensors")  # fmt: skip
    assert same_logits(head, load_head(out))


def test_what_vllm_cannot_run_is_refused(tmp_path) -> None:
    with pytest.raises(HeadError, match="share_lm_head=true"):
        export_head(random_head(share_lm_head=True), "medusa", tmp_path / "a")
    with pytest.raises(HeadError, match="final normed state"):
        export_head(random_head(target_layers=[2]), "medusa", tmp_path / "b")
    with pytest.raises(HeadError, match="formats for medusa heads: fasterdecoding, medusa"):
        export_head(random_head(), "sglang", tmp_path / "c")
    out = export_head(random_head(), "medusa", tmp_path / "d")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "truncated_vocab_size": V // 2}))
    with pytest.raises(HeadError, match="truncated vocabulary"):
        load_head(out)


def test_fasterdecoding_export_round_trip(tmp_path) -> None:
    """config.json (medusa_num_heads, medusa_num_layers, base_model_name_or_path) + medusa_lm_head.pt, the
    state dict of their bare ModuleList of heads."""
    head = random_head(num_heads=4, num_layers=1, target_name_or_path="org/tiny")
    out = export_head(head, "fasterdecoding", tmp_path / "fd")
    config = json.loads((out / "config.json").read_text())
    assert (config["medusa_num_heads"], config["medusa_num_layers"]) == (4, 1)
    assert config["base_model_name_or_path"] == "org/tiny"
    state = torch.load(out / "medusa_lm_head.pt", weights_only=True)
    assert set(state) == {f"{k}.0.linear.{p}" for k in range(4) for p in ("weight", "bias")} | {
        f"{k}.1.weight" for k in range(4)
    }
    assert same_logits(head, load_head(out))


def test_what_fasterdecoding_cannot_run_is_refused(tmp_path) -> None:
    with pytest.raises(HeadError, match="FasterDecoding's Medusa needs its own"):
        export_head(
            random_head(share_lm_head=True, target_name_or_path="t"), "fasterdecoding", tmp_path / "a"
        )
    with pytest.raises(HeadError, match="names the target"):
        export_head(random_head(), "fasterdecoding", tmp_path / "b")


def test_prefixed_and_default_variants_of_both_layouts_import(tmp_path) -> None:
    """Names and defaults the two layouts also come with: vLLM tensors under `medusa_heads.`, a vLLM config
    without num_hidden_layers (one ResBlock), its shared projection stored as `lm_head.weight`, and a
    FasterDecoding state dict under `medusa_head.`; each imports as the same heads."""
    head = random_head(num_heads=2, num_layers=1)
    out = export_head(head, "medusa", tmp_path / "vllm")
    config = json.loads((out / "config.json").read_text())
    state = load_file(out / "model.safetensors")
    save_file({f"medusa_heads.{k}": v for k, v in state.items()}, out / "model.safetensors")
    (out / "config.json").write_text(
        json.dumps({k: v for k, v in config.items() if k != "num_hidden_layers"})
    )
    assert same_logits(head, load_head(out))
    with torch.no_grad():
        head.heads[1][1].weight.copy_(head.heads[0][1].weight)
    shared = {k: v for k, v in state.items() if not k.startswith("lm_heads.")}
    save_file({**shared, "lm_head.weight": head.heads[0][1].weight}, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps({**config, "original_lm_head": True}))
    assert same_logits(head, load_head(out))
    directory = tmp_path / "fd"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1}))
    torch.save({"medusa_head." + k.removeprefix("heads."): v for k, v in head.state_dict().items()},
               directory / "medusa_lm_head.pt")  # fmt: skip
    assert same_logits(head, load_head(directory))


def test_heads_that_need_their_lora_adapter_are_not_exported(tmp_path) -> None:
    """A Medusa-2 head was trained with a LoRA adapter inside the target: neither engine can run it."""
    for fmt in ("medusa", "fasterdecoding"):
        with pytest.raises(HeadError, match="LoRA adapter merged into the target"):
            export_head(random_head(lora_adapter="adapter", target_name_or_path="t"), fmt, tmp_path / fmt)


def test_exports_write_their_dtype_and_every_resblock(tmp_path) -> None:
    """`dtype=bfloat16` writes bf16 tensors (as torch_dtype says) in both layouts; FasterDecoding's config
    counts the head's ResBlocks (2 here), so their MedusaModel builds the blocks the file holds."""
    head = random_head(num_heads=2, num_layers=2, target_name_or_path="org/tiny")
    vllm = export_head(head, "medusa", tmp_path / "vllm", dtype=torch.bfloat16)
    assert json.loads((vllm / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert {t.dtype for t in load_file(vllm / "model.safetensors").values()} == {torch.bfloat16}
    fd = export_head(head, "fasterdecoding", tmp_path / "fd", dtype=torch.bfloat16)
    config = json.loads((fd / "config.json").read_text())
    assert config["medusa_num_layers"] == 2 and config["torch_dtype"] == "bfloat16"
    state = torch.load(fd / "medusa_lm_head.pt", weights_only=True)
    assert {t.dtype for t in state.values()} == {torch.bfloat16} and "0.2.weight" in state
    back = load_head(fd, dtype=torch.float32)
    assert back.config.num_layers == 2 and same_logits(head.to(torch.bfloat16).float(), back)
