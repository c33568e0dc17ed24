"""Training asks the family registry: changing a registration changes what the ZeRO-3 and offline
checks do (no family names hard-coded there; the model card and export: tests/heads/test_families.py)."""

from __future__ import annotations

import pytest

from spechead.training import zero
from spechead.training.errors import TrainError
from spechead.training.hidden_cache import match as offline


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
