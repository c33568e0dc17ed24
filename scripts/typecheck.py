"""Type-check spechead.heads and spechead.inference with mypy (settings: pyproject.toml's [tool.mypy]).

    python scripts/typecheck.py

The folders install as spechead.* through setuptools package-dir and an editable import hook that mypy
cannot follow, so this builds the same layout as symlinks (spechead/heads -> heads/, ...) in a temporary
directory and checks the packages there. mypy's report is printed and its exit status returned (non-zero
on errors); its cache stays in .mypy_cache/ so reruns are fast. Needs `pip install -e ".[dev]"`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: mypy itself depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ["spechead.heads", "spechead.inference"]


def main() -> int:
    pyproject = ROOT / "pyproject.toml"
    package_dir = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-dir"]
    with tempfile.TemporaryDirectory(prefix="spechead-mypy-") as tmp:
        for package, folder in package_dir.items():  # "spechead.heads" = "heads"
            link = Path(tmp).joinpath(*package.split("."))
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(ROOT / folder, target_is_directory=True)
        cmd = [sys.executable, "-m", "mypy", "--config-file", str(pyproject)]
        cmd += ["--python-executable", sys.executable, "--cache-dir", str(ROOT / ".mypy_cache")]
        for package in CHECKED:
            cmd += ["-p", package]
        # cwd is the farm, so mypy never sees the bare folders (heads, inference) as top-level packages
        return subprocess.run(cmd, cwd=tmp, env={**os.environ, "MYPYPATH": tmp}).returncode


if __name__ == "__main__":
    sys.exit(main())
