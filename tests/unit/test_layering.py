"""The package layers of docs/architecture.md, enforced on the import graph of src/mscale.

Every import counts: module level, inside functions (lazy imports only hide a cycle, they do not
remove it) and under ``TYPE_CHECKING``. A package may import only packages in lower layers;
packages of one layer do not import each other. The order lives here as data and the test checks
that the architecture document states the same order, so the two cannot drift apart.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src" / "mscale"
DOC = REPO / "docs" / "architecture.md"

LAYERS: list[tuple[str, ...]] = [
    ("__main__",), ("cli",), ("recover",), ("train", "watch", "preflight"), ("ckpt",), ("parallel", "planner"), ("model",), ("distributed",),
    ("topology", "runs", "data"), ("config",), ("urls",), ("errors", "hostlist"),
]
"""Top to bottom. A name is a subpackage or a top-level module of mscale."""

def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> list[tuple[str, int]]:
    """Every mscale module or package ``path`` imports, with its line, relative imports resolved."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            if base == "mscale":  # `from mscale import errors` names a module, `__version__` not
                found += [(f"mscale.{a.name}", node.lineno) for a in node.names
                          if (SRC / a.name).is_dir() or (SRC / f"{a.name}.py").is_file()]
            else:
                found.append((base, node.lineno))
    return [(name, line) for name, line in found if name.startswith("mscale.")]


def layer_of(module: str) -> str:
    return module.split(".")[1]


def edges() -> list[tuple[str, str, int]]:
    """(importer, imported, line) for every import that crosses from one layer name to another."""
    out = []
    for path in sorted(SRC.rglob("*.py")):
        src = module_name(path)
        for dst, line in imported(path):
            if src != "mscale" and layer_of(src) != layer_of(dst):
                out.append((src, dst, line))
    return out


def tier(name: str) -> int:
    return next(i for i, names in enumerate(LAYERS) if name in names)


def test_every_package_has_a_layer():
    names = {layer_of(module_name(p)) for p in SRC.rglob("*.py") if module_name(p) != "mscale"}
    placed = {n for names_ in LAYERS for n in names_}
    assert names == placed, f"unplaced: {sorted(names - placed)}; gone: {sorted(placed - names)}"


def test_the_root_package_imports_nothing():
    assert imported(SRC / "__init__.py") == []


def test_imports_point_down_only():
    bad = [f"{src} (line {line}) imports {dst}: {layer_of(src)} is not above {layer_of(dst)}"
           for src, dst, line in edges()
           if tier(layer_of(dst)) <= tier(layer_of(src))]
    assert not bad, "\n".join(bad)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_cycle_between_packages():
    graph: dict[str, set[str]] = {}
    for src, dst, _ in edges():
        graph.setdefault(layer_of(src), set()).add(layer_of(dst))
    assert cycles(graph) == []


def test_cycles_are_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def module_edges() -> dict[str, set[str]]:
    """importer → imported between modules of one package (``from pkg import mod`` counts as
    importing ``pkg.mod``; importing a package counts as importing its ``__init__``)."""
    modules = {module_name(p) for p in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        src = module_name(path)
        for dst in _imported_modules(path, modules):
            if dst != src and "." in src and "." in dst and layer_of(src) == layer_of(dst):
                graph.setdefault(src, set()).add(dst)
    return graph


def _imported_modules(path: Path, modules: set[str]) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [f"{node.module}.{a.name}" for a in node.names]
            out += [n for n in names if n in modules] or [node.module]
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
    resolved = []
    for name in out:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name.startswith("mscale."):
            resolved.append(name)
    return resolved


def test_no_cycle_between_modules_of_a_package():
    """A lazy import inside a function hides a cycle between two modules; it does not remove
    it (ckpt's manifest ⇄ checks and hf ⇄ hf_config were two)."""
    assert cycles(module_edges()) == []


def test_the_architecture_doc_states_this_order():
    text = " ".join(DOC.read_text().split())
    stated = re.search(r"Arrows point down only: `([^`]*)`", text)
    assert stated, "docs/architecture.md lost its 'Arrows point down only: `...`' line"
    assert stated.group(1) == " → ".join("/".join(names) for names in LAYERS)
