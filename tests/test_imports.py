"""The package's import graph, read with ``ast``: no circles, every import down the layers that
docs/architecture.md draws (or within one), and ``integrations/`` for the training frameworks
only. Every import counts, a function's lazy one too; ``if TYPE_CHECKING:`` blocks do not."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"ulysses_sp": "ulysses_sp", "backends": "ulysses_sp.backends", "mixers": "ulysses_sp.mixers", "cli": "ulysses_sp.cli"}
"""Folders of the repository and the packages they install as."""

LAYERS = (
    ("kernels", "comm", "layout", "devices", "streams", "eager_ops", "spec", "profile", "tasks"),
    ("topology", "blocks", "ring_pass"),
    ("registry", "backends"),
    ("attention", "data", "loss", "rl", "decoder_layers", "dropout", "tiling", "mixers"),
    ("models",),
    ("step_memory", "meta_scans", "testing"),
    ("integrations",),
    ("job", "cli", "launch", ""),  # "": the package's own __init__, the public names
)
"""Bottom to top: a module imports from its own layer or a lower one."""

FRAMEWORKS = {"__init__", "deepspeed", "fsdp", "trainer", "trl"}


def modules(root: Path = ROOT, sources: dict = SOURCES) -> dict[str, Path]:
    found = {}
    for folder, package in sources.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def import_graph(found: dict[str, Path]) -> dict[str, set[str]]:
    """``{module: the package modules it imports}``; ``from a import b`` counts ``a.b`` where that is a module."""
    graph = {}
    for name, path in found.items():
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
                       for n in ast.walk(block)}
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in found}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                if base in found:
                    edges |= {f"{base}.{a.name}" if f"{base}.{a.name}" in found else base for a in node.names}
        graph[name] = edges - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def layer(module: str) -> int | None:
    rest = module.removeprefix("ulysses_sp").removeprefix(".")
    for level, names in enumerate(LAYERS):
        if any(rest == n or (n and rest.startswith(n + ".")) for n in names):
            return level
    return None


@pytest.mark.quick
def test_the_package_has_no_import_circle():
    found = modules()
    assert len(found) > 80 and "ulysses_sp.models.switch" in found and "ulysses_sp.backends.ulysses" in found
    assert circles(import_graph(found)) == []


def test_imports_run_down_the_layers():
    graph = import_graph(modules())
    unplaced = sorted(m for m in graph if layer(m) is None)
    assert not unplaced, f"place these in LAYERS and docs/architecture.md: {unplaced}"
    upward = [f"{a} ({layer(a)}) -> {b} ({layer(b)})" for a in sorted(graph) for b in sorted(graph[a]) if layer(b) > layer(a)]
    assert not upward, upward


def test_integrations_hold_the_training_frameworks_only():
    assert {p.stem for p in (ROOT / "ulysses_sp" / "integrations").glob("*.py")} == FRAMEWORKS


def test_the_check_finds_a_circle_and_a_lazy_import(tmp_path):
    """The test's own reading: a circle closed by a function's import is found, one closed under
    ``TYPE_CHECKING`` is not."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import g\n")
    (pkg / "c.py").write_text("from .b import f\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import c2\n")
    (pkg / "c2.py").write_text("import pkg.c\n")
    graph = import_graph(modules(tmp_path, {"pkg": "pkg"}))
    assert graph["pkg.b"] == {"pkg.a"} and graph["pkg.c"] == {"pkg.b"} and graph["pkg.c2"] == {"pkg.c"}
    assert circles(graph) == [["pkg.a", "pkg.b"]]


def test_docstrings_use_plain_backticks():
    """One docstring style: `name`, as the rendered pages write it, not Sphinx roles."""
    import re

    role = re.compile(r":(py:)?(func|class|meth|mod|attr|data|obj|exc|ref):`")
    found = [f"{path.relative_to(ROOT)}:{n}" for path in modules().values() for n, line in enumerate(path.read_text().splitlines(), 1)
             if role.search(line)]
    assert not found, found
