"""Code in training/ and heads/formats asks the family registry: changing a registration changes what
the ZeRO-3 and offline checks, the model card and export do (no family names hard-coded there)."""

from __future__ import annotations

import dataclasses

import pytest

from spechead.heads import MedusaConfig, MedusaHead
from spechead.heads.errors import HeadError
from spechead.heads.families import _FAMILIES, Family, family_named
from spechead.heads.formats import export_head
from spechead.training import model_card, offline, zero
from spechead.training.errors import TrainError


@pytest.fixture
def reregistered(monkeypatch):
    """Replace a registered family's fields for one test."""

    def replace(name: str, **fields) -> Family:
        fam = dataclasses.replace(family_named(name), **fields)
        monkeypatch.setitem(_FAMILIES, name, fam)
        return fam

    return replace


def test_trainer_checks_ask_the_registry(reregistered, tmp_path, tiny_target_dir, chat_file, training_kit):
    def settings(**extra):
        return training_kit.settings(training_kit.overrides(tiny_target_dir, chat_file, tmp_path, **extra))

    zero.check_zero3(settings(head="eagle3"))
    reregistered("eagle3", trains_target="it trains an adapter inside the target")
    with pytest.raises(TrainError, match="head=eagle3: it trains an adapter inside the target.*zero2.yaml"):
        zero.check_zero3(settings(head="eagle3"))
    cached = settings(
        head="eagle3", **{"data.hidden_states": "offline", "data.cache_dir": str(tmp_path / "c")}
    )
    with pytest.raises(TrainError, match="head eagle3 cannot train from a hidden-state cache"):
        offline.offline_data(cached, None)
    reregistered("eagle3", default_layers=lambda num_layers: [1, 2, 3])
    assert offline.stored_layers(settings(head="eagle3").head, 4) == [1, 2, 3, 4]


def test_model_card_and_export_ask_the_registry(reregistered, tmp_path):
    head = MedusaHead(MedusaConfig(hidden_size=16, vocab_size=32))
    saved = {**head.config.to_dict(), "family": "medusa"}  # as config.json holds it
    reregistered("medusa", summary="a test summary", tags=("test-tag",), exports={})
    card = model_card.render_card(saved, repo_id="me/h", files=[], num_parameters=1, run=model_card.RunInfo())
    assert "a test summary" in card
    assert model_card.card_metadata(saved, base_model=None, license=None).tags[-1] == "test-tag"
    with pytest.raises(HeadError, match="cannot be exported as 'medusa'"):
        export_head(head, "medusa", tmp_path / "out")
