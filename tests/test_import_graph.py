"""The package's import graph (issue 20's targets, DESIGN "Package layout"), read with ``ast``.

- no import cycle among the product's modules (a package ``__init__`` that hands on its own
  children's names is not a cycle);
- no ``_private`` name imported from another module;
- the front ends (``cli/``, ``api/``) are on top: no module of the core imports them, and
  neither front end imports the other's modules;
- ``protocol/`` is pure math: it imports no MPI, no threads and no other sub-package but
  itself (``config`` and ``errors`` at the top are shared by all).

Function-local imports count as imports here: they are how cycles hide.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "flodl_mpi"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _graph() -> tuple[dict[str, set[str]], list[str], dict[str, set[str]]]:
    """``(edges, private imports, third-party top-level imports)`` of every product module."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges: dict[str, set[str]] = {m: set() for m in files}
    external: dict[str, set[str]] = {m: set() for m in files}
    private: list[str] = []
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(parts + ([base] if base else []))
                if not base.startswith("flodl_mpi"):
                    external[mod].add(base.split(".")[0])
                    continue
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    if full in files:
                        edges[mod].add(full)
                    elif base in files:
                        edges[mod].add(base)
                        if alias.name.startswith("_") and not alias.name.startswith("__") and base != mod:
                            private.append(f"{mod} imports {base}.{alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in files:
                        edges[mod].add(alias.name)
                    elif not alias.name.startswith("flodl_mpi"):
                        external[mod].add(alias.name.split(".")[0])
        edges[mod].discard(mod)
    return edges, private, external


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), ignoring ``__init__`` re-exports."""

    def reexport(a: str, b: str) -> bool:
        return b.startswith(a + ".") or a.startswith(b + ".")

    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if reexport(v, w):
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

    for v in edges:
        if v not in index:
            visit(v)
    return found


def _sub_package(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 2 else ""


def test_the_graph_is_read():
    edges, _, external = _graph()
    assert len(edges) > 60 and "flodl_mpi.transport.bridge" in edges
    assert "flodl_mpi.protocol.wire" in edges["flodl_mpi.transport.reduce"]   # a known edge is seen
    assert "mpi4py" in external["flodl_mpi.transport.reduce"]


def test_no_import_cycle():
    cycles = _cycles(_graph()[0])
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_a_cycle_is_found_when_there_is_one():
    # the checker itself: a hand-made graph with one loop
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"p": {"p.x"}, "p.x": {"p"}}) == []   # a package handing on its child's names


def test_no_private_name_imported_from_another_module():
    private = _graph()[1]
    assert not private, "\n".join(private)


@pytest.mark.parametrize("front, other", [("cli", "api"), ("api", "cli")])
def test_a_front_end_never_imports_the_other(front, other):
    edges = _graph()[0]
    bad = [f"{m} -> {d}" for m, ds in edges.items() if _sub_package(m) == front
           for d in ds if _sub_package(d) == other]
    assert not bad, "\n".join(bad)


def test_the_core_never_imports_a_front_end():
    edges = _graph()[0]
    bad = [f"{m} -> {d}" for m, ds in edges.items() if _sub_package(m) not in ("cli", "api", "")
           for d in ds if _sub_package(d) in ("cli", "api")]
    assert not bad, "\n".join(bad)


def test_protocol_is_pure_math():
    edges, _, external = _graph()
    for mod in edges:
        if _sub_package(mod) != "protocol":
            continue
        assert not external[mod] & {"mpi4py", "threading", "time", "h5py"}, (mod, external[mod])
        inward = {d for d in edges[mod] if _sub_package(d) not in ("protocol", "")}
        assert not inward, (mod, inward)
