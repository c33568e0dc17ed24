"""Real Hydra composition of every shipped group combination, and strict typed settings."""

from __future__ import annotations

import itertools
import re
import shlex
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from spechead.configs import register_resolvers
from spechead.training.cli import check_overrides, settings_from_config, startup_line
from spechead.training.errors import TrainError
from spechead.training.settings import TrainerConfig

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
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
    assert s.tuning == "tuning/demo.yaml + head_tuning/eagle3-demo.yaml"
    assert (s.trainer.max_length, s.trainer.batch_size, s.trainer.decode_eval_every) == (384, 8, 600)
    assert (s.trainer.tree_tune_prompts, s.trainer.tree_tune_prompt_set) == (
        32,
        "demo-tune",
    )  # tuned at the end


def test_demo_eagle3_head_gets_its_head_tuning_only_there():
    """head_tuning/eagle3-demo.yaml: the demo EAGLE-3 head drafts over 1024 tokens, unrolls 4 TTT steps and
    trains longer at a higher lr; any other model keeps the family default (null: min(32000, vocab)), other demo heads keep
    tuning/demo.yaml's run, the command line wins."""
    demo = settings()
    assert demo.head.arch["draft_vocab_size"] == 1024
    assert demo.head.arch["ttt_steps"] == 4  # the depths a CPU tree mostly drafts
    assert (demo.trainer.max_steps, demo.trainer.lr) == (2600, 3e-3)
    assert settings("head=eagle3", "model=llama3-8b").head.arch["ttt_steps"] == 7
    assert (settings("head=medusa").trainer.max_steps, settings("head=medusa").trainer.lr) == (600, 1e-3)
    medusa2 = settings("head=medusa2")  # head_tuning/medusa2-demo.yaml: longer, same lr
    assert (medusa2.trainer.max_steps, medusa2.trainer.lr) == (1800, 1e-3)
    assert medusa2.tuning == "tuning/demo.yaml + head_tuning/medusa2-demo.yaml"
    assert settings("trainer.max_steps=50").trainer.max_steps == 50
    assert settings("head=eagle3", "model=llama3-8b").head.arch["draft_vocab_size"] is None
    assert settings("model=local", "model.path=/models/x").head.arch["draft_vocab_size"] is None
    assert settings("head.draft_vocab_size=512").head.arch["draft_vocab_size"] == 512
    for head in ("medusa", "medusa2", "eagle"):
        assert "draft_vocab_size" not in settings(f"head={head}").head.arch


def test_real_world_presets_keep_real_defaults():
    s = settings("head=medusa", "model=llama3-70b", "data=sharegpt")
    assert s.model.path == "meta-llama/Meta-Llama-3-70B" and s.model.dtype == "bfloat16"
    assert s.trainer.max_length == 2048 and s.trainer.max_steps == -1  # no demo tuning
    assert s.tuning is None


def trainer_defaults() -> dict:
    """configs/trainer/default.yaml as read by a model with no tuning (a Hub preset)."""
    return vars(settings("model=llama3-8b").trainer)


def test_own_model_gets_the_trainer_defaults():
    """The README's own-model command: no demo tuning, a run named after the model, no decode eval."""
    s = settings(
        "model=local",
        "model.path=/models/my-llama",
        "data=jsonl",
        "data.path=chats.jsonl",
        "trainer.max_steps=2000",
    )
    assert s.tuning is None and s.model.name == "my-llama" and s.model.path == "/models/my-llama"
    assert s.trainer.output_dir == "outputs/eagle3-my-llama"
    expected = {**trainer_defaults(), "max_steps": 2000, "output_dir": "outputs/eagle3-my-llama"}
    assert vars(s.trainer) == expected
    assert (s.trainer.max_length, s.trainer.batch_size, s.trainer.decode_eval_every) == (2048, 4, 0)
    assert s.trainer.tree_tune_prompts == 0  # no tree tuning unless asked (the tuning prompts are yours)


def test_own_model_path_with_the_demo_preset_is_refused():
    """model.path=... alone keeps model=demo, whose tuning is for the shipped demo target only."""
    with pytest.raises(
        TrainError, match=r"^model\.path=/models/my-llama .*use model=local model\.path=/models/my-llama$"
    ):
        settings("model.path=/models/my-llama", "data=jsonl", "data.path=chats.jsonl")
    with pytest.raises(TrainError, match="model=local"):
        settings("model=demo", "model.path=/models/my-llama")
    demo = settings()
    same = settings(f"model.path={demo.model.path}/")  # the demo target itself, spelled differently
    assert same.tuning == demo.tuning and vars(same.trainer) == vars(demo.trainer)


def test_local_model_needs_a_path():
    with pytest.raises(TrainError, match=r"^model\.path is required"):
        settings("model=local")


@pytest.mark.parametrize("model", options("model"))
def test_data_default_follows_the_model(model):
    """The demo corpus for the demo target; a real chat dataset (UltraChat) for every other model."""
    path = ["model.path=/models/x"] if model == "local" else []
    s = settings(f"model={model}", *path)
    assert s.data.name == ("demo" if model == "demo" else "ultrachat")
    assert s.data.path == (s.data.path if model == "demo" else "HuggingFaceH4/ultrachat_200k")
    for order in ([f"model={model}", "data=sharegpt"], ["data=sharegpt", f"model={model}"]):
        assert settings(*order, *path).data.name == "sharegpt"  # the command line wins, in any order


def readme_train_commands() -> list[list[str]]:
    """The overrides of every `train.py` command in the README's Real-world use section."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Real-world use") :]
    section = section[: section.index("\n### ")]
    commands = re.findall(r"^(?:accelerate launch|python)[^\n]*train\.py[^\n]*$", section, flags=re.M)
    assert len(commands) >= 4
    return [[a for a in shlex.split(c.split("train.py", 1)[1]) if "=" in a] for c in commands]


def test_readme_train_commands_compose_without_demo_tuning():
    for overrides in readme_train_commands():
        s = settings_from_config(check_overrides(overrides))
        if s.model.name != "demo":
            assert s.tuning is None and s.trainer.max_length == TrainerConfig.max_length, overrides


def test_every_group_combination_composes():
    """Every pair of options of two groups composes together (a covering set of the head x model x data
    product: every head with every model, each data option with every head and every model; ~100 ms a
    composition, so the whole product would cost about 30 s)."""
    heads, models, datas, trainers = (options(g) for g in ("head", "model", "data", "trainer"))
    loggers = options("logger")  # (read by the tracker only: each one taken in turn, not crossed)
    assert len(heads) * len(models) * len(datas) >= 80 and len(loggers) >= 2 and len(trainers) == 1
    combos = [
        (head, model, datas[(h + m) % len(datas)], trainers[0])
        for h, head in enumerate(heads)
        for m, model in enumerate(models)
    ]
    choices = (heads, models, datas, trainers)
    for a, b in itertools.combinations(range(4), 2):  # the set covers every pair of two groups' options
        assert {(c[a], c[b]) for c in combos} == set(itertools.product(choices[a], choices[b])), (a, b)
    groups = ["head", "model", "data", "trainer"]
    with initialize_config_module("spechead.configs", version_base=None):
        for i, combo in enumerate(combos):
            overrides = [f"{g}={o}" for g, o in zip(groups, combo)] + [f"logger={loggers[i % len(loggers)]}"]
            if "data=jsonl" in overrides:
                overrides.append("data.path=/some/file.jsonl")
            if "model=local" in overrides:
                overrides.append("model.path=/models/mine")
            s = settings_from_config(compose("train", overrides=overrides))
            assert s.model.name == (combo[1] if combo[1] != "local" else "mine") and s.data.name == combo[2]


def test_stable_keys_override():
    s = settings(
        "model=local",
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


@pytest.mark.parametrize(
    "values, needle",
    [
        ({"max_length": 7}, "max_length"),
        ({"keep_checkpoints": 0}, "keep_checkpoints"),  # 0 would keep every checkpoint
        ({"save_every": 0}, "save_every"),
        ({"eval_every": 0}, "eval_every"),
        ({"epochs": 0}, "epochs"),
        ({"batch_size": 0}, "batch_size"),
        ({"grad_accum": 0}, "grad_accum"),
        ({"lr": 0.0}, "lr"),
        ({"mixed_precision": "fp8"}, "mixed_precision"),
        ({"decode_eval_every": -1}, "decode_eval_every"),
        ({"tree_tune_prompts": -1}, "tree_tune_prompts"),
        ({"decode_eval_prompts": 0}, "decode_eval_prompts"),
    ],
)
def test_trainer_values_out_of_range_are_refused(values, needle):
    """Each trainer setting outside its range fails at once with a message naming it."""
    with pytest.raises(TrainError, match=rf"trainer\.{needle}"):
        TrainerConfig(**values)
    assert TrainerConfig(epochs=0, max_steps=5).max_steps == 5  # max_steps > 0 stands in for epochs


def test_missing_data_path_for_jsonl():
    with pytest.raises(TrainError, match="data.path"):
        settings("data=jsonl")


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "trainer.lrr=1",
            r"^trainer\.lrr=1: unknown key trainer\.lrr \(valid keys for trainer: output_dir, .* lr, ",
        ),
        ("model.dtyp=float16", r"unknown key model\.dtyp \(valid keys for model: name, path, dtype, "),
        (
            "head=eagle4",
            r"^head=eagle4: head has no option 'eagle4' \(valid head options: dflash, eagle, eagle3, medusa, medusa2, peagle\)$",
        ),
        (
            "model=llama4",
            r"^model=llama4: model has no option 'llama4' \(valid model options: demo, .*local, ",
        ),
        (
            "foo=1",
            r"^foo=1: there is no config group or section 'foo' \(groups: head, model, data, trainer, logger\)$",
        ),
        ("trainer.lr", r"^Error parsing override 'trainer\.lr' \(overrides look like key=value"),
    ],
)
def test_bad_command_line_is_one_line_naming_it(override, message):
    """What Hydra reports in several lines (exit 1) is checked first: one line, the valid choices."""
    with pytest.raises(TrainError, match=message) as err:
        check_overrides([override])
    assert "\n" not in str(err.value)


def test_good_command_lines_pass_the_check():
    assert check_overrides(["head=eagle", "+head.foo=1", "head.layers=[1,2]", "~logger"]) is not None
    # keys whose defaults interpolate a value set later on the same line (output_dir <- model.name <- path)
    cfg = check_overrides(
        ["model=local", "model.path=/m/x", "trainer.output_dir=/tmp/o", "trainer.max_steps=3"]
    )
    assert (cfg.trainer.output_dir, cfg.model.name, cfg.trainer.max_steps) == ("/tmp/o", "x", 3)
    assert check_overrides(["head=eagle,eagle3"]) is None  # a sweep: Hydra's -m handles it


def test_startup_line_names_the_tuning_file():
    assert "tuning=tuning/demo.yaml + head_tuning/eagle3-demo.yaml " in startup_line(settings())
    assert "tuning=tuning/demo.yaml " in startup_line(settings("head=medusa"))
    own = startup_line(settings("model=local", "model.path=/models/my-llama"))
    assert "model=my-llama (/models/my-llama)" in own and "tuning=none (trainer defaults)" in own
