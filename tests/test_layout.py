"""The layers of the tree (docs/design.md), read statically from the sources (every `import` statement, also
inside functions, so a circle that only closes at run time counts too):

- no import circles anywhere; the library (kernels/tritonattn/) imports nothing but itself, the standard
  library and its runtime dependencies (no harness: no pandas, no benchmarks, notebooks or tests);
- inside the library each layer imports only the layers below it (`LAYERS`);
- no name with a leading underscore is used across modules -- imported, read as `module._name`, or
  patched with setattr -- by the library, the tests, the benchmarks, the scripts or the notebooks: what
  another module needs has a public name (flash-attn's own `_flash_attn_*` primitives excepted);
- no library module is over `MAX_LINES` lines, and hardware facts (capabilities, device properties) are
  read only in config/.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Dict, List, Set

REPO = Path(__file__).resolve().parents[1]
# Folders whose files are top-level modules on sys.path (scripts run from scripts/, notebooks put
# notebooks/ on the path for nbsetup and nb_hardening, tests put tests/ on the path for helpers).
FLAT_DIRS = ("scripts", "notebooks", "tests")
# Folders holding packages: benchmarks/ is one, kernels/ is the library's source root (kernels/tritonattn/ is
# the package `tritonattn`, found on sys.path through kernels/).
PACKAGES = ("kernels", "benchmarks")
SOURCE_ROOTS = ("kernels",)
# What the library may import besides itself: the standard library and these; kernels/tritonattn/integrations/<lib>
# imports the library it adapts (an optional extra, never imported by `import tritonattn`).
LIBRARY_MAY_IMPORT = {"torch", "triton", "numpy"}
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


def _from_target(node: ast.ImportFrom, package: str) -> str:
    """The module a `from ... import` statement reads from, relative imports resolved against `package`."""
    if not node.level:
        return node.module or ""
    base = package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(name: str, path: Path, known: Set[str]) -> Set[str]:
    """Every module `name` imports (first-party ones resolved to their module names, others by their
    top-level name)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = _from_target(node, package)
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
    """tritonattn imports only tritonattn, the standard library, torch, triton, numpy (an integration its
    library): never the benchmark harness, the notebooks' helpers, scripts or tests, nor pandas."""
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
    assert "tritonattn.api.kvcache" in graph["tritonattn.cache.paged"]  # `from ..api.kvcache import ...`
    assert "benchmarks.measure" in graph["benchmarks.suite"]  # `from . import measure, results`
    assert "tritonattn" in graph["benchmarks.suite"]


def test_nothing_imports_the_old_package_name():
    """No module of the tree imports `kernels` (PyPI's hub-kernels package since the rename): the library is
    `tritonattn`, and kernels/ only its source root."""
    graph = import_graph()
    stale = {name: sorted(m for m in imported if m.split(".")[0] == "kernels") for name, imported in graph.items()}
    assert not {name: mods for name, mods in stale.items() if mods}, stale
    assert "tritonattn" in graph and not any(name.split(".")[0] == "kernels" for name in graph)


# ------------------------------------------------------------------------------------------------
# Layers
# ------------------------------------------------------------------------------------------------
# What each layer of the library may import besides itself (and the standard library, torch, triton,
# numpy): the layers below it. The package's __init__ and flash_attn_interface (flash-attn's module
# path) gather public names from any layer.
LAYERS = {
    "config": {"errors"},
    "jit": {"errors", "config"},
    "launch": {"errors", "config", "jit"},
    "api": {"errors", "config", "launch"},
    "cache": {"errors", "config", "launch", "api"},
    "compile": {"errors", "config", "launch", "api"},
    "parallel": {"errors", "config", "launch", "api"},
    "integrations": {"errors", "config", "api"},
    "testing": {"errors", "config", "api", "cache"},
    "errors": set(),
    "_versions": set(),
}
MAX_LINES = 600


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer_violations(graph: Dict[str, Set[str]]) -> Dict[str, List[str]]:
    bad = {}
    for name, imported in graph.items():
        if name.split(".")[0] != "tritonattn" or _layer(name) not in LAYERS:
            continue
        layer = _layer(name)
        wrong = sorted(m for m in imported if m.split(".")[0] == "tritonattn" and m != "tritonattn"
                       and _layer(m) != layer and _layer(m) not in LAYERS[layer])
        wrong += sorted(m for m in imported if m == "tritonattn")  # the package's __init__ imports every layer
        if wrong:
            bad[name] = wrong
    return bad


def test_layers_import_only_the_layers_below():
    """config <- jit <- launch <- api <- (cache, compile, integrations); testing checks the public layers (api,
    cache) against references built on config alone."""
    graph = import_graph()
    assert {_layer(m) for m in graph if m.startswith("tritonattn.")} <= set(LAYERS) | {"flash_attn_interface"}
    assert not layer_violations(graph), layer_violations(graph)
    planted = {"tritonattn.config.x": {"tritonattn.launch.fast"}, "tritonattn.api.y": {"tritonattn.jit.common"}}
    assert layer_violations(planted) == {"tritonattn.config.x": ["tritonattn.launch.fast"],
                                         "tritonattn.api.y": ["tritonattn.jit.common"]}


# ------------------------------------------------------------------------------------------------
# Private names
# ------------------------------------------------------------------------------------------------
# flash-attn's primitives keep flash-attn's underscored names: they are its interface, and ours.
FLASH_ATTN_NAMES = {"_flash_attn_forward", "_flash_attn_backward", "_flash_attn_varlen_forward",
                    "_flash_attn_varlen_backward"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in FLASH_ATTN_NAMES


def _notebook_sources() -> Dict[str, str]:
    """Each notebook's code cells as one module's source (shell and magic lines dropped)."""
    import json

    found = {}
    for path in sorted((REPO / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        found[path.stem] = "\n".join(line for line in code.splitlines() if not line.lstrip().startswith(("%", "!")))
    return found


def private_uses(name: str, source: str, known: Set[str], package: str) -> List[str]:
    """The private names of other first-party modules that `source` (module `name`) uses."""
    tree = ast.parse(source)
    modules: Dict[str, str] = {}  # local name -> first-party module it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in {k.split(".")[0] for k in known}:
                    modules[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else (
                        alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            target = _from_target(node, package)
            if target not in known and target.split(".")[0] not in {k.split(".")[0] for k in known}:
                continue
            for alias in node.names:
                full = f"{target}.{alias.name}"
                if full in known:
                    modules[alias.asname or alias.name] = full
                elif _private(alias.name) and target != name:
                    found.append(f"from {target} import {alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            if _private(node.attr) and modules[node.value.id] != name:
                found.append(f"{modules[node.value.id]}.{node.attr}")
        if isinstance(node, ast.Call) and len(node.args) >= 2 and isinstance(node.args[0], ast.Name):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            target, attr = node.args[0].id, node.args[1]
            if func in ("setattr", "getattr", "delattr") and target in modules and isinstance(attr, ast.Constant) \
                    and isinstance(attr.value, str) and _private(attr.value):
                found.append(f"{func}({modules[target]}, {attr.value!r})")
    return found


def test_no_private_name_crosses_a_module():
    """No module of the tree (library, tests, benchmarks, scripts, notebooks) uses another's private names."""
    sources = _sources()
    known = set(sources)
    bad = {}
    for name, path in sources.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        uses = private_uses(name, path.read_text(encoding="utf-8"), known, package)
        if uses:
            bad[name] = uses
    for name, source in _notebook_sources().items():
        uses = private_uses(name, source, known, "")
        if uses:
            bad[name] = uses
    assert not bad, bad


def test_the_private_name_check_sees_each_use():
    """A planted import, attribute read and monkeypatch of a private name are each found."""
    known = {"tritonattn", "tritonattn.launch.decode"}
    source = ("import tritonattn.launch.decode as decode\nfrom tritonattn.launch.decode import _plan\n"
              "decode._replays.clear()\nmonkeypatch.setattr(decode, '_one_loop', None)\n"
              "from tritonattn.flash_attn_interface import _flash_attn_forward\n")
    assert sorted(private_uses("tests.x", source, known, "")) == [
        "from tritonattn.launch.decode import _plan", "setattr(tritonattn.launch.decode, '_one_loop')",
        "tritonattn.launch.decode._replays"]


def test_library_modules_are_small():
    """No module of the library is over MAX_LINES lines: each folder is one job, each file a part of it."""
    big = {str(p.relative_to(REPO)): n for p in (REPO / "kernels" / "tritonattn").rglob("*.py")
           if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not big, big


HARDWARE_READS = {"capability", "get_device_capability", "get_device_properties", "multi_processor_count",
                  "shared_memory_per_block_optin"}


def hardware_reads(source: str) -> List[str]:
    return sorted({node.attr for node in ast.walk(ast.parse(source))
                   if isinstance(node, ast.Attribute) and node.attr in HARDWARE_READS})


def test_hardware_facts_live_in_config():
    """Only config/ reads a GPU's capability or properties; every other layer asks config (has_tma, the tables)."""
    root = REPO / "kernels" / "tritonattn"
    bad = {str(p.relative_to(root)): hardware_reads(p.read_text(encoding="utf-8")) for p in root.rglob("*.py")
           if "config" not in p.relative_to(root).parts}
    assert not {k: v for k, v in bad.items() if v}, bad
    assert hardware_reads("ok = target.capability[0] >= 9") == ["capability"]
