"""The family registry: every registration resolves, a saved head finds its family, and the model card
and export ask it (changing a registration changes what they do; training's checks: tests/training)."""

from __future__ import annotations

import dataclasses

import pytest

from spechead.heads import MedusaConfig, MedusaHead
from spechead.heads.errors import HeadError
from spechead.heads.families import family_named, family_names, family_of, register_family
from spechead.heads.formats import FORMATS, export_head
from spechead.heads.hub import card
from spechead.training.errors import TrainError
from spechead.training.objectives import Recipe, family_for

SIZES = dict(hidden_size=16, vocab_size=32)


def test_every_registered_part_resolves():
    assert family_names() == ["dflash", "eagle", "eagle3", "medusa", "medusa2", "peagle"]
    for name in family_names():
        fam = family_named(name)
        assert isinstance(fam.load("recipe"), Recipe), name
        for part in ("drafter", "accuracy", "assumed_accuracy"):
            assert callable(fam.load(part)), (name, part)
        for fmt in fam.exports:
            assert callable(fam.exporter(fmt)), (name, fmt)
        assert fam.tree_option in ("choices", "tree") and set(fam.default_tree) == {fam.tree_option}
    assert FORMATS == ["eagle", "fasterdecoding", "medusa", "sglang", "speculators", "vllm"]


def test_a_saved_head_finds_its_family():
    assert family_of(MedusaConfig(**SIZES)).name == "medusa"
    assert family_of(MedusaConfig(**SIZES, lora_adapter="adapter")).name == "medusa2"  # Medusa-2 carries one
    assert family_of({"family": "medusa", "lora_adapter": "adapter"}).name == "medusa2"  # a config.json
    assert family_of({"family": "eagle3", "lora_adapter": ""}).name == "eagle3"
    with pytest.raises(HeadError, match="no registered family for a 'gpt' head"):
        family_of({"family": "gpt"})
    with pytest.raises(
        TrainError,
        match=r"unknown head family 'gpt' \(known: dflash, eagle, eagle3, medusa, medusa2, peagle\)",
    ):
        family_for("gpt")


def test_registrations_that_would_make_a_saved_head_ambiguous_are_refused():
    eagle = family_named("eagle")
    with pytest.raises(ValueError, match="'eagle' is already registered differently"):
        register_family(dataclasses.replace(eagle, summary="another"))
    with pytest.raises(ValueError, match="'eagle-kd' has the same head .* as 'eagle'"):
        register_family(dataclasses.replace(eagle, name="eagle-kd"))
    register_family(eagle)  # the same registration again (a module reload) is fine


def test_model_card_and_export_ask_the_registry(reregistered, tmp_path):
    head = MedusaHead(MedusaConfig(hidden_size=16, vocab_size=32))
    saved = {**head.config.to_dict(), "family": "medusa"}  # as config.json holds it
    reregistered("medusa", summary="a test summary", tags=("test-tag",), exports={})
    text = card.render_card(saved, repo_id="me/h", files=[], num_parameters=1, run=card.RunInfo())
    assert "a test summary" in text
    assert card.card_metadata(saved, base_model=None, license=None).tags[-1] == "test-tag"
    with pytest.raises(HeadError, match="cannot be exported as 'medusa'"):
        export_head(head, "medusa", tmp_path / "out")


def test_memory_plan_work_counts_each_eagle_decoder_layer(tiny_llama):
    """The memory plan's work of an EAGLE head: one logit set over the target vocabulary and one
    decoder-layer pass per draft layer (a two-layer head keeps twice the activations), one causal mask."""
    from spechead.heads.eagle import EagleConfig

    config = EagleConfig.from_target(tiny_llama(48, layers=2, hidden=32).config, num_layers=2)
    assert family_of(config).work(config) == (1, 48, 2, 1.0)
