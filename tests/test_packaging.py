"""The distribution maps exactly the top-level folders to spechead.* packages, and ships its data."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
MAPPED = ["configs", "data", "heads", "inference", "training"]


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _python_packages_under(folder: Path) -> list[Path]:
    """Every directory below `folder` (itself included) that holds Python modules."""
    return sorted({p.parent for p in folder.rglob("*.py") if "__pycache__" not in p.parts})


def test_package_list_matches_folders():
    setup = _pyproject()["tool"]["setuptools"]
    expected = []
    for name in MAPPED:
        for pkg_dir in _python_packages_under(ROOT / name):
            assert (pkg_dir / "__init__.py").is_file(), f"{pkg_dir} holds modules but has no __init__.py"
            rel = pkg_dir.relative_to(ROOT / name).parts
            expected.append(".".join(("spechead", name, *rel)))
    assert sorted(setup["packages"]) == sorted(expected)
    for name in MAPPED:
        assert setup["package-dir"][f"spechead.{name}"] == name


def test_imports_resolve_to_the_folders():
    import spechead.configs
    import spechead.data
    import spechead.heads
    import spechead.inference
    import spechead.training

    for mod, name in [
        (spechead.configs, "configs"),
        (spechead.data, "data"),
        (spechead.heads, "heads"),
        (spechead.inference, "inference"),
        (spechead.training, "training"),
    ]:
        assert Path(mod.__file__).resolve() == ROOT / name / "__init__.py"


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("folder", MAPPED + ["scripts", "tests"])
def test_no_bare_folder_imports(folder):
    for path in (ROOT / folder).rglob("*.py"):
        for name in _imports(path):
            assert name.split(".")[0] not in MAPPED, f"{path}: bare `import {name}`; use spechead.{name}"


@pytest.mark.parametrize("folder", ["heads", "inference"])
def test_pure_packages_do_not_import_frameworks(folder):
    banned = {"accelerate", "deepspeed", "hydra", "omegaconf", "wandb", "spechead.training"}
    for path in (ROOT / folder).rglob("*.py"):
        for name in _imports(path):
            assert not any(name == b or name.startswith(b + ".") for b in banned), f"{path} imports {name}"


def test_inference_and_training_never_import_each_other():
    for a, b in [("inference", "training"), ("training", "inference")]:
        for path in (ROOT / a).rglob("*.py"):
            assert not any(n.startswith(f"spechead.{b}") for n in _imports(path)), (
                f"{path} imports spechead.{b}"
            )


@pytest.mark.slow
def test_wheel_holds_packages_configs_and_demo_assets(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
    )
    (wheel,) = tmp_path.glob("spechead-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in MAPPED:
        assert f"spechead/{name}/__init__.py" in names
    assert "spechead/configs/train.yaml" in names
    assert "spechead/configs/head/medusa.yaml" in names
    assert "spechead/configs/tuning/demo.yaml" in names
    assert "spechead/data/demo/chat.jsonl" in names
    assert "spechead/data/demo/prompts/demo.jsonl" in names  # the built-in prompt sets ship as files
    assert not any("demo_corpus" in n or "demo_tasks" in n for n in names)  # their generators do not
    assert any(n.startswith("spechead/data/demo/target/model-") and n.endswith(".safetensors") for n in names)
    assert not any(n.startswith("spechead/__init__") for n in names)  # spechead is a namespace package


@pytest.mark.skipif(os.environ.get("CI") != "true", reason="only CI is sure to run the README's set-up")
def test_ci_installs_speculators_so_the_export_round_trip_runs():
    """The README's set-up installs `speculators` (--no-deps, requirements-speculators.txt): in CI its
    round-trip tests must run, not skip."""
    import speculators.models.eagle3  # noqa: F401


def test_ci_runs_exactly_the_readme_set_up_and_test_commands():
    """`.ci/run` runs the README's set-up and test commands, word for word (a fresh clone's CI tests
    what a new user types)."""
    readme = (ROOT / "README.md").read_text()
    commands = [
        line
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line and not line.startswith(("#", "set ", "cd "))
    ]
    assert len(commands) == 2, commands  # set-up, tests
    for command in commands:
        assert f"\n{command}\n" in readme, command
