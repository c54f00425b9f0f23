"""The import graph of the project's own modules (lra/, models/, hydra_plugins/), read with ``ast``: every import,
at module level or inside a function, relative ones resolved. It has no cycle, its arrows run downward through the
layers below, and an import inside a function says why it is there (an optional dependency, or a command's start
kept fast). Imports made by ``importlib`` (the task and model registries load their modules so) are not read."""
from __future__ import annotations

import ast
import importlib.util
import io
import re
import tokenize
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from tests.conftest import ROOT

PACKAGES = ("lra", "models", "hydra_plugins")

# From the top down: a module imports modules of its own layer or of a lower one, never of a higher one. The first
# prefix that names a module places it; any other module of lra/ is a command-line entry, at the top.
LAYERS = (
    ("entries", ("hydra_plugins",)),  # the commands (the rest of lra/) and the launcher plugin, which runs them
    ("bench", ("lra.bench",)),  # LRA Table 2 and the per-layer bench: they time what the runner trains
    ("train", ("lra.train",)),  # the runner, its step, the encoder around the mixer, checkpoints
    ("report", ("lra.report",)),  # the results rows (written by the runner and the bench), tables and charts
    ("config", ("lra.config",)),  # the schema and its checks, which ask the task and model registries
    ("data", ("lra.data",)),  # the tasks
    ("leaves", ("lra.errors", "lra.io", "lra.launchers", "lra.provenance", "lra.conf", "lra")),
    ("models", ("models",)),  # the mixers: torch only
)
LEAVES = ("lra.errors", "lra.io", "lra.launchers")  # import nothing of the project


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the project module imported
    line: int
    local: bool  # inside a function


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))
            if "__pycache__" not in p.parts}


def project_module(dotted: str) -> str | None:
    """The project module that ``dotted`` names, or the one that holds it (``lra.io.atomic_save`` -> ``lra.io``)."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules():
            return ".".join(parts[:end])
    return None


def function_local(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The imports inside a function, in the order of their lines."""
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    found = {node for f in functions for node in ast.walk(f) if isinstance(node, (ast.Import, ast.ImportFrom))}
    return sorted(found, key=lambda node: node.lineno)


@cache
def imports() -> list[Import]:
    found = []
    for name, path in modules().items():
        tree = ast.parse(path.read_text(), str(path))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        local = set(function_local(tree))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                named = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # from . import x, from .common import y
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                named = [f"{base}.{alias.name}" for alias in node.names]  # a submodule, or a name in `base`
            else:
                continue
            for dotted in named:
                target = project_module(dotted)
                if target is not None and target != name:
                    found.append(Import(name, target, node.lineno, node in local))
    return found


def where(imp: Import) -> str:
    return f"{modules()[imp.source].relative_to(ROOT)}:{imp.line}"


def find_cycle(edges: dict[str, list[Import]]) -> list[Import] | None:
    """One cycle of the graph, as its imports in order, or None (a depth-first search)."""
    done: set[str] = set()
    stack: list[str] = []  # the modules on the current path; path[i] imports stack[i + 1] from stack[i]
    path: list[Import] = []

    def visit(module: str) -> list[Import] | None:
        stack.append(module)
        for imp in edges.get(module, []):
            if imp.target in stack:
                return [*path[stack.index(imp.target):], imp]
            if imp.target not in done:
                path.append(imp)
                cycle = visit(imp.target)
                if cycle:
                    return cycle
                path.pop()
        stack.pop()
        done.add(module)
        return None

    for module in sorted(edges):
        cycle = None if module in done else visit(module)
        if cycle:
            return cycle
    return None


def test_the_graph_is_read():
    """The reader sees the imports it is meant to: module level, inside a function, relative."""
    seen = {(i.source, i.target, i.local) for i in imports()}
    assert ("lra.data.common", "lra.errors", False) in seen  # from lra.errors import DataError
    assert ("lra.data.image", "lra.data", False) in seen  # from . import register_task
    assert ("lra.data.pathfinder", "lra.data.pathfinder_gen", True) in seen  # from . import pathfinder_gen, in a def
    assert len(modules()) > 60


def test_no_import_cycle():
    """Counting the imports inside functions: a module never needs itself to be imported first."""
    edges: dict[str, list[Import]] = {}
    for imp in imports():
        edges.setdefault(imp.source, []).append(imp)
    cycle = find_cycle(edges)
    assert cycle is None, "an import cycle: " + " -> ".join(
        [*(where(i) for i in cycle), str(modules()[cycle[0].source].relative_to(ROOT))])


def layer(module: str) -> int:
    for rank, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or (p != "lra" and module.startswith(p + ".")) for p in prefixes):
            return rank
    return 0  # a command-line entry (lra/<command>.py, lra/__main__.py)


def test_the_arrows_run_downward():
    upward = sorted({f"{where(i)}: {i.source} ({LAYERS[layer(i.source)][0]}) imports {i.target} "
                     f"({LAYERS[layer(i.target)][0]})" for i in imports() if layer(i.target) < layer(i.source)})
    assert not upward, "imports of a higher layer:\n" + "\n".join(upward)


def test_models_never_import_lra():
    """The mixers know nothing of tasks, data or results: ``lra`` knows them through the registry alone."""
    found = [where(i) for i in imports() if i.source.split(".")[0] == "models" and i.target.split(".")[0] == "lra"]
    assert not found, f"models/ imports lra: {found}"


def test_nothing_in_lra_imports_the_launcher_plugin():
    """The plugin calls the runner; the runner never calls on the plugin (what the CLI checks, the plugin records in
    lra.launchers as Hydra loads it)."""
    found = [where(i) for i in imports() if i.source.split(".")[0] == "lra" and i.target.startswith("hydra_plugins")]
    assert not found, f"lra imports the launcher plugin: {found}"


@pytest.mark.parametrize("leaf", LEAVES)
def test_the_leaves_import_nothing_of_the_project(leaf):
    assert leaf in modules()
    found = [f"{where(i)}: {i.target}" for i in imports() if i.source == leaf]
    assert not found, f"{leaf} imports the project: {found}"


def test_an_import_inside_a_function_says_why():
    """A function-local import is for an optional dependency or a command's start kept fast, and says which in a
    comment (on its line, or on the import above it that it goes with); any other import goes to the top."""
    silent = []
    for path in modules().values():
        source = path.read_text()
        comments = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                    if tok.type == tokenize.COMMENT}
        explained_until = -1  # the last line of the import before, where it gave a reason
        for node in function_local(ast.parse(source)):
            ok = bool(comments & set(range(node.lineno, node.end_lineno + 1))) or explained_until == node.lineno - 1
            explained_until = node.end_lineno if ok else -1
            if not ok:
                silent.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.get_source_segment(source, node)}")
    assert not silent, "imports inside a function without a reason:\n" + "\n".join(silent)


def documented_commands() -> list[str]:
    """Every ``python -m lra...`` that the READMEs, docs/ and the notebook tell a user to type."""
    docs = [ROOT / "README.md", ROOT / "lra" / "conf" / "README.md", ROOT / "results" / "README.md",
            *sorted((ROOT / "docs").glob("*.md")), ROOT / "notebooks" / "leaderboard.ipynb"]
    return sorted({m for doc in docs for m in re.findall(r"python -m\s+(lra(?:\.\w+)*)", doc.read_text())})


@pytest.mark.parametrize("command", documented_commands())
def test_every_documented_command_has_its_module(command):
    """The commands users know keep working wherever their code lives: a module, or a package with a __main__."""
    spec = importlib.util.find_spec(command)
    assert spec is not None, f"python -m {command}: no such module"
    if spec.submodule_search_locations is not None:  # a package: python -m runs its __main__
        assert importlib.util.find_spec(f"{command}.__main__") is not None, f"python -m {command}: no __main__"


def test_the_default_suite_leaves_the_heavy_tier_to_ci():
    """The README's test command (``python -m pytest -q``) leaves out the ``heavy`` tests (compiles on the CPU, many
    processes, registry-wide runs) to stay within minutes on two cores; CI (``.ci/run``) runs them after it, and the
    README says both."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    addopts = re.search(r"^addopts = (.*)$", pyproject, re.MULTILINE).group(1)
    assert "not heavy" in addopts and '"heavy: ' in pyproject
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert ci.index("python3 -m pytest -q -m heavy") == ci.index("python3 -m pytest -q") + 1
    assert "-m heavy" in (ROOT / "README.md").read_text()
