"""Real Hydra composition of every shipped group combination, and strict typed settings."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from spechead.configs import register_resolvers
from spechead.training.cli import settings_from_config
from spechead.training.errors import TrainError

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
register_resolvers()


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


def settings(*overrides: str):
    with initialize_config_module("spechead.configs", version_base=None):
        return settings_from_config(compose("train", overrides=list(overrides)))


def test_defaults_are_the_offline_demo():
    s = settings()
    assert s.head.family == "eagle3"
    assert s.model.name == "demo" and Path(s.model.path).is_dir()
    assert s.data.name == "demo" and Path(s.data.path).is_file()
    assert s.trainer.output_dir == "outputs/eagle3-demo"
    assert s.trainer.max_steps > 0  # the demo tuning applies


def test_real_world_presets_keep_real_defaults():
    s = settings("head=medusa", "model=llama3-70b", "data=sharegpt")
    assert s.model.path == "meta-llama/Meta-Llama-3-70B" and s.model.dtype == "bfloat16"
    assert s.trainer.max_length == 2048 and s.trainer.max_steps == -1  # no demo tuning


def test_every_group_combination_composes():
    groups = ["head", "model", "data", "trainer", "logger"]
    combos = list(itertools.product(*(options(g) for g in groups)))
    assert len(combos) >= 80
    with initialize_config_module("spechead.configs", version_base=None):
        for combo in combos:
            overrides = [f"{g}={o}" for g, o in zip(groups, combo)]
            if "data=jsonl" in overrides:
                overrides.append("data.path=/some/file.jsonl")
            s = settings_from_config(compose("train", overrides=overrides))
            assert s.model.name == combo[1] and s.data.name == combo[2]


def test_stable_keys_override():
    s = settings(
        "model.path=/models/mine",
        "data=jsonl",
        "data.path=my.jsonl",
        "trainer.output_dir=/tmp/x",
        "trainer.max_steps=7",
        "trainer.resume=true",
    )
    assert (s.model.path, s.data.path, s.trainer.output_dir, s.trainer.max_steps) == (
        "/models/mine",
        "my.jsonl",
        "/tmp/x",
        7,
    )
    assert s.trainer.resume == "true"


@pytest.mark.parametrize(
    "override, needle",
    [
        ("+trainer.lrr=1", "trainer.lrr"),
        ("+model.dtyp=float16", "model.dtyp"),
        ("+data.pth=x", "data.pth"),
        ("+logger.projectt=x", "logger.projectt"),
        ("+head.num_head=3", None),  # head keys are checked against the family when the head is built
        ("trainer.lr=fast", "trainer.lr"),
        ("trainer.schedule=cosin", "trainer.schedule"),
        ("model.dtype=float64", "model.dtype"),
        ("trainer.resume=maybe", "trainer.resume"),
        ("trainer.log_every=0", "trainer.log_every"),
    ],
)
def test_bad_keys_and_values_name_the_key(override, needle):
    if needle is None:
        settings(override)  # composes; see test_trainer for the failure at build time
        return
    with pytest.raises(TrainError, match=needle.replace(".", r"\.")):
        settings(override)


def test_missing_data_path_for_jsonl():
    with pytest.raises(TrainError, match="data.path"):
        settings("data=jsonl")
