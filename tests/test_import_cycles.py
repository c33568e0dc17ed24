"""The import graph of the package has no cycles, and the engine never imports tuning or measurement.

The graph is built from the source by `ast`, not by importing: every `import` / `from ... import` at ANY
depth of every module under configs/, data/, heads/, inference/ and training/ (inside functions and
methods too: an import moved into a function to dodge a cycle still counts), EXCEPT those inside an
`if TYPE_CHECKING:` block: these never run, so they cannot make an import-order cycle, and a module
naming its caller's class in an annotation (drafters/eagle/rows.py's `EagleDrafter`) is not a
dependency. Files map to spechead.* names as pyproject.toml's package-dir maps the folders.
`from spechead.X import Y` is an edge to spechead.X.Y when that is a module, else to spechead.X (the
package's __init__ when X is a package); relative imports resolve the same way.

Layers (docs/architecture.md): inference/tuning/ (calibration, tree search, skip search) and
inference/evaluation/ (measurement shared by the benchmarks) import the engine; the engine never
imports them. Only loading.py (the wiring layer behind `SpeculativeGenerator.from_pretrained`, which
plugs the per-batch-size tree picker into the engine: generator.BATCH_TREE) may import them from outside.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ["configs", "data", "heads", "inference", "training"]
TUNING, EVALUATION = "spechead.inference.tuning", "spechead.inference.evaluation"
WIRING = {"spechead.inference.loading"}  # may import TUNING and EVALUATION from inside the engine's package


def module_files() -> dict[str, Path]:
    """{spechead.* module name: file} as pyproject.toml's package-dir maps the folders."""
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    out = {}
    for package, folder in package_dir.items():
        assert folder in FOLDERS, f"{folder} is mapped but not scanned here"
        for path in (ROOT / folder).rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([package, *parts])] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes inside `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`) blocks."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            skip.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    return skip


def imported(name: str, path: Path, modules: set[str]) -> set[str]:
    """The spechead modules that module `name` (file `path`) imports, at any depth but TYPE_CHECKING."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = _type_checking_nodes(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, one level up per extra dot
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*parts, base] if base else parts)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                targets.add(full if full in modules else base)
    out = set()
    for target in targets:
        while target not in modules and "." in target:  # a name inside a module: that module
            target = target.rpartition(".")[0]
        if target in modules and target != name:
            out.add(target)
    return out


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    modules = set(files)
    return {name: imported(name, path, modules) for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph[step]))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_the_scan_sees_the_packages(graph):
    """The graph holds every folder's modules and real edges (a scan that finds nothing proves nothing)."""
    for folder in FOLDERS:
        assert f"spechead.{folder}" in graph
    assert "spechead.inference.engine.loop" in graph["spechead.inference.generator"]
    assert f"{TUNING}.calibrate" in graph["spechead.inference.loading"]


def test_no_import_cycles(graph):
    found = cycles(graph)
    assert not found, "import cycles (each a strongly connected component):\n" + "\n".join(
        " <-> ".join(component) for component in found
    )


def test_cycles_are_found():
    """The search itself: a two-module and a three-module cycle, a self-contained tail left out."""
    graph = {"a": {"b"}, "b": {"a", "c"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert sorted(cycles(graph)) == [["a", "b"], ["c", "d", "e"]]


def test_the_engine_never_imports_tuning_or_evaluation(graph):
    """Inside spechead.inference, only tuning/, evaluation/ and the wiring layer import tuning/ or
    evaluation/."""
    wrong = [
        f"{name} imports {target}"
        for name, targets in sorted(graph.items())
        if _in(name, "spechead.inference")
        and not (_in(name, TUNING) or _in(name, EVALUATION) or name in WIRING)
        for target in sorted(targets)
        if _in(target, TUNING) or _in(target, EVALUATION)
    ]
    assert not wrong, "\n".join(wrong)


def test_what_the_generator_runs_imports_no_tuning(graph):
    """Everything the generator imports, directly or not, is engine: no tuning/, evaluation/ or the
    loading layer above it (which plugs tuning in through generator.LOAD / BATCH_TREE)."""
    seen, todo = set(), ["spechead.inference.generator"]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(graph[name])
    above = sorted(n for n in seen if _in(n, TUNING) or _in(n, EVALUATION) or n in WIRING)
    assert not above, f"spechead.inference.generator reaches {above}"
