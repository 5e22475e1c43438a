"""The layers of the tree (docs/design.md): no import circles anywhere, and the library (kernels/tritonattn/)
imports nothing but itself, the standard library and its runtime dependencies.

The import graph is read statically (every `import` statement, also inside functions) from the
sources, so a circle that only closes at run time counts too.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Dict, List, Set

REPO = Path(__file__).resolve().parents[1]
# Folders whose files are top-level modules on sys.path (scripts run from scripts/, notebooks put
# notebooks/ on the path for nbutils, tests put tests/ on the path for helpers).
FLAT_DIRS = ("scripts", "notebooks", "tests")
# Folders holding packages: benchmarks/ is one, kernels/ is the library's source root (kernels/tritonattn/ is
# the package `tritonattn`, found on sys.path through kernels/).
PACKAGES = ("kernels", "benchmarks")
SOURCE_ROOTS = ("kernels",)
# What the library may import besides itself: the standard library and these; kernels/tritonattn/integrations/<lib>
# imports the library it adapts (an optional extra, never imported by `import tritonattn`).
LIBRARY_MAY_IMPORT = {"torch", "triton", "numpy", "pandas"}
INTEGRATIONS = {"tritonattn.integrations.transformers": {"transformers"}}


def _module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[0] in SOURCE_ROOTS:
        parts = parts[1:]
    if parts[0] in FLAT_DIRS:
        return parts[-1]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _sources() -> Dict[str, Path]:
    files = [p for d in PACKAGES for p in (REPO / d).rglob("*.py")]
    files += [p for d in FLAT_DIRS for p in (REPO / d).glob("*.py")]
    return {_module_name(p): p for p in files if "__pycache__" not in p.parts}


def _imports(name: str, path: Path, known: Set[str]) -> Set[str]:
    """Every module `name` imports (first-party ones resolved to their module names, others by their
    top-level name)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in known)
    resolved = set()
    for target in found:
        while target and target not in known and "." in target:  # a name inside a module: the module
            target = target.rpartition(".")[0]
        resolved.add(target if target in known else target.split(".")[0])
    resolved.discard(name)
    return resolved


def import_graph() -> Dict[str, Set[str]]:
    """module -> the modules it imports, for every Python file of the tree."""
    sources = _sources()
    known = set(sources)
    return {name: _imports(name, path, known) for name, path in sources.items()}


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    """No set of modules in the tree imports each other in a circle."""
    cycles = _cycles(import_graph())
    assert not cycles, "import circles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_library_imports_only_itself():
    """tritonattn imports only tritonattn, the standard library, torch, triton, numpy (pandas for the serving
    engine's optional tables, an integration its library): never the benchmark harness, the notebooks'
    helpers, scripts or tests."""
    graph = import_graph()
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    bad = {}
    for name, imported in graph.items():
        if name.split(".")[0] != "tritonattn":
            continue
        outside = {m for m in imported if m.split(".")[0] != "tritonattn" and m.split(".")[0] not in stdlib
                   and m.split(".")[0] not in LIBRARY_MAY_IMPORT | INTEGRATIONS.get(name, set())}
        if outside:
            bad[name] = sorted(outside)
    assert not bad, f"tritonattn imports from outside the library: {bad}"


def test_the_checks_see_a_circle():
    """The circle detector finds a planted circle and the first-party resolver maps relative imports."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = import_graph()
    assert "tritonattn.decode" in graph["tritonattn.kv_cache"]  # `from .decode import ...`
    assert "benchmarks.measure" in graph["benchmarks.suite"]  # `from . import measure, results`
    assert "tritonattn" in graph["benchmarks.suite"]


def test_nothing_imports_the_old_package_name():
    """No module of the tree imports `kernels` (PyPI's hub-kernels package since the rename): the library is
    `tritonattn`, and kernels/ only its source root."""
    graph = import_graph()
    stale = {name: sorted(m for m in imported if m.split(".")[0] == "kernels") for name, imported in graph.items()}
    assert not {name: mods for name, mods in stale.items() if mods}, stale
    assert "tritonattn" in graph and not any(name.split(".")[0] == "kernels" for name in graph)
