"""DraftHead base: layer indices, config dicts, target checks, shared modules, safetensors save/load."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
import torch
from huggingface_hub import constants as hub_constants
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from spechead.heads import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    DraftHead,
    HeadConfig,
    HeadError,
    MedusaConfig,
    MedusaHead,
    known_families,
    load_head,
    register_head,
    resolve_layers,
)

H, V = 8, 16


@dataclass(kw_only=True)
class TiedConfig(HeadConfig):
    family = "test-tied"
    target_layers: list[int] = field(default_factory=lambda: [0, -1])


@register_head
class TiedHead(DraftHead):
    """Test-only family: two Linears sharing one weight, plus a persistent int buffer."""

    config_class = TiedConfig
    family = "test-tied"

    def __init__(self, config: TiedConfig) -> None:
        super().__init__(config)
        self.a = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.b = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.b.weight = self.a.weight
        self.register_buffer("ids", torch.arange(config.vocab_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def medusa(**kw) -> MedusaHead:
    torch.manual_seed(0)
    return MedusaHead(MedusaConfig(hidden_size=H, vocab_size=V, num_heads=2, target_num_layers=4, **kw))


def test_resolve_layers_maps_negative_indices_like_python_over_l_plus_1() -> None:
    assert resolve_layers([-1, 0, 2, 4, -5], 4) == [4, 0, 2, 4, 0]
    for bad in (5, -6):
        with pytest.raises(HeadError, match=r"valid hidden-state indices are 0\.\.4 \(or -5\.\.-1\)"):
            resolve_layers([bad], 4)
    with pytest.raises(HeadError, match="at least one layer"):
        resolve_layers([0], 0)


def test_config_resolves_layers_and_round_trips_through_dict() -> None:
    cfg = MedusaConfig(hidden_size=H, vocab_size=V, target_num_layers=4, target_name_or_path="tiny")
    assert cfg.target_layers == [4]
    assert MedusaConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert "family" not in cfg.to_dict() and MedusaConfig.family == "medusa"


def test_config_from_dict_rejects_unknown_keys_by_name() -> None:
    data = {**medusa().config.to_dict(), "medusa_num_heads": 5}
    with pytest.raises(HeadError, match="medusa_num_heads"):
        MedusaConfig.from_dict(data)


def test_config_rejects_bad_sizes() -> None:
    with pytest.raises(HeadError, match="hidden_size"):
        MedusaConfig(hidden_size=0, vocab_size=V)
    with pytest.raises(HeadError, match="layer index 9"):
        MedusaConfig(hidden_size=H, vocab_size=V, target_layers=[9], target_num_layers=4)


def test_check_target_accepts_its_target_and_explains_mismatches() -> None:
    head = medusa(target_name_or_path="org/tiny")
    head.check_target(hidden_size=H, vocab_size=V, num_layers=4)
    with pytest.raises(
        HeadError, match=r"expects hidden_size 8 \(it was trained on org/tiny\) but the target has 12"
    ):
        head.check_target(hidden_size=12, vocab_size=V, num_layers=4)
    with pytest.raises(HeadError, match="expects vocab_size 16 .* has 17: load the head trained"):
        head.check_target(hidden_size=H, vocab_size=17, num_layers=4)
    with pytest.raises(HeadError, match="target with 4 layers .* this target has 6"):
        head.check_target(hidden_size=H, vocab_size=V, num_layers=6)
    unknown_depth = MedusaHead(MedusaConfig(hidden_size=H, vocab_size=V, target_layers=[6]))
    with pytest.raises(HeadError, match="layer index 6 does not exist in a target with 4 layers"):
        unknown_depth.check_target(hidden_size=H, vocab_size=V, num_layers=4)


def test_attached_target_modules_are_references_not_parameters() -> None:
    head = medusa()
    lm_head = nn.Linear(H, V, bias=False)
    n_params, keys = len(list(head.parameters())), set(head.state_dict())
    head.attach_target_modules(lm_head=lm_head)
    assert head.target_lm_head is lm_head
    assert len(list(head.parameters())) == n_params and set(head.state_dict()) == keys
    assert all(m is not lm_head for m in head.modules())
    head.to(torch.float64)
    assert lm_head.weight.dtype == torch.float32  # head casts never touch the frozen target
    with pytest.raises(HeadError, match="no target embed_tokens attached.*get_input_embeddings"):
        _ = head.target_embed_tokens
    with pytest.raises(HeadError, match=r"weight shape \(16, 4\)"):
        head.attach_target_modules(embed_tokens=nn.Embedding(V, 4))


def test_save_writes_config_and_only_own_weights(tmp_path) -> None:
    head = medusa()
    head.attach_target_modules(lm_head=nn.Linear(H, V, bias=False))
    head.save_pretrained(tmp_path)
    config = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert config["family"] == "medusa" and config["format_version"] == 1 and config["spechead_version"]
    assert config["num_heads"] == 2 and config["target_layers"] == [4]
    assert set(load_file(tmp_path / WEIGHTS_NAME)) == set(head.state_dict())


def test_tied_weights_are_stored_once_and_stay_tied_after_load(tmp_path) -> None:
    torch.manual_seed(0)
    head = TiedHead(TiedConfig(hidden_size=H, vocab_size=V))
    head.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / WEIGHTS_NAME), framework="pt") as f:
        assert sorted(f.keys()) == ["a.weight", "ids"]
    loaded = load_head(tmp_path)
    assert isinstance(loaded, TiedHead) and loaded.a.weight is loaded.b.weight
    assert loaded.ids.dtype == torch.long and torch.equal(loaded.ids, head.ids)
    x = torch.randn(3, H)
    assert torch.equal(loaded(x), head(x))


def test_load_dispatches_on_family_and_casts_dtype(tmp_path) -> None:
    head = medusa()
    head.save_pretrained(tmp_path)
    for loaded in (
        load_head(tmp_path, dtype=torch.float64),
        DraftHead.from_pretrained(tmp_path, dtype=torch.float64),
    ):
        assert isinstance(loaded, MedusaHead) and not loaded.training
        assert all(p.dtype == torch.float64 and not p.is_meta for p in loaded.parameters())


def test_wrong_family_is_a_head_error(tmp_path) -> None:
    TiedHead(TiedConfig(hidden_size=H, vocab_size=V)).save_pretrained(tmp_path)
    with pytest.raises(HeadError, match="holds a 'test-tied' head, not 'medusa'"):
        MedusaHead.from_pretrained(tmp_path)


def test_unknown_family_lists_known_ones(tmp_path) -> None:
    medusa().save_pretrained(tmp_path)
    config = json.loads((tmp_path / CONFIG_NAME).read_text())
    (tmp_path / CONFIG_NAME).write_text(json.dumps({**config, "family": "hydra9"}))
    assert "medusa" in known_families()
    with pytest.raises(HeadError, match=r"unknown head family 'hydra9'.*'medusa'"):
        load_head(tmp_path)


def test_unknown_saved_config_key_is_a_head_error(tmp_path) -> None:
    medusa().save_pretrained(tmp_path)
    config = json.loads((tmp_path / CONFIG_NAME).read_text())
    (tmp_path / CONFIG_NAME).write_text(json.dumps({**config, "bogus": 1}))
    with pytest.raises(HeadError, match=r"unknown MedusaConfig keys \['bogus'\]"):
        MedusaHead.from_pretrained(tmp_path)


def test_missing_or_unexpected_weights_are_head_errors(tmp_path) -> None:
    medusa().save_pretrained(tmp_path)
    weights = load_file(tmp_path / WEIGHTS_NAME)
    dropped = weights.pop("heads.1.1.weight")
    save_file(weights, tmp_path / WEIGHTS_NAME)
    with pytest.raises(HeadError, match=r"missing weights \['heads.1.1.weight'\]"):
        MedusaHead.from_pretrained(tmp_path)
    save_file(
        {**weights, "heads.1.1.weight": dropped, "lm_head.weight": dropped.clone()}, tmp_path / WEIGHTS_NAME
    )
    with pytest.raises(HeadError, match=r"unexpected weights \['lm_head.weight'\]"):
        MedusaHead.from_pretrained(tmp_path)
    save_file({**weights, "heads.1.1.weight": dropped[:, :4].contiguous()}, tmp_path / WEIGHTS_NAME)
    with pytest.raises(HeadError, match="size mismatch"):
        MedusaHead.from_pretrained(tmp_path)
    (tmp_path / WEIGHTS_NAME).unlink()
    with pytest.raises(HeadError, match="has no model.safetensors"):
        MedusaHead.from_pretrained(tmp_path)


def test_not_a_directory_and_offline_hub_is_a_head_error(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(
        HeadError, match="head some-org/medusa-head is not a local directory and could not be fetched"
    ):
        load_head("some-org/medusa-head")
    with pytest.raises(HeadError, match="could not be fetched from the Hub"):
        MedusaHead.from_pretrained(str(tmp_path / "missing" / "dir"))
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(HeadError, match="is a file"):
        load_head(tmp_path / "file.txt")


def test_directory_without_head_config_is_a_head_error(tmp_path) -> None:
    with pytest.raises(HeadError, match="has no config.json"):
        load_head(tmp_path)
    (tmp_path / CONFIG_NAME).write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(HeadError, match="has no 'family'"):
        load_head(tmp_path)


def test_bool_layer_indices_and_negative_depths_are_refused() -> None:
    """True is an int to Python but never a layer index (it would read hidden state 1); a negative
    target depth is not "unknown" (0 is)."""
    with pytest.raises(HeadError, match="layer indices must be ints, got True"):
        resolve_layers([True], 4)
    with pytest.raises(HeadError, match="target_num_layers must be >= 0"):
        MedusaConfig(hidden_size=H, vocab_size=V, target_num_layers=-1)


def test_format_version_newer_or_missing_is_refused(tmp_path) -> None:
    """A head saved by a newer spechead (format_version 2) or a config.json without a format version is
    refused with the fix, never loaded as if it were format 1."""
    medusa().save_pretrained(tmp_path)
    config = json.loads((tmp_path / CONFIG_NAME).read_text())
    for bad in ({**config, "format_version": 2}, {k: v for k, v in config.items() if k != "format_version"}):
        (tmp_path / CONFIG_NAME).write_text(json.dumps(bad))
        with pytest.raises(HeadError, match="this spechead reads <= 1: upgrade spechead"):
            load_head(tmp_path)
