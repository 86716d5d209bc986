"""The packages form layers, read from the source with ``ast`` (nothing is imported).

Every ``import`` counts, the ones inside functions too: a deferred import hides a loop, it does
not break it. Inside a function only third-party modules may be imported (optional dependencies
such as cupy or streamlit load there so that the core does not need them).
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OURS = ("mpipar", "simulator", "viz")


def modules(package: str) -> dict[str, str]:
    """Dotted module name -> file path, for every .py file of ``package``."""
    found: dict[str, str] = {}
    root = os.path.join(REPO, package)
    for folder, _, files in os.walk(root):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            parts = os.path.relpath(path, REPO)[:-3].split(os.sep)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` names (relative imports resolved against ``module``)."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(module: str, path: str, known: set[str]) -> Iterator[tuple[str, bool, int]]:
    """(imported module, inside a function?, line) for each import in the file.

    ``from pkg import name`` counts as importing ``pkg.name`` when that is a module of ours,
    else ``pkg``: importing a name re-exported by a package's ``__init__`` depends on the package.
    """
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    is_package = path.endswith("__init__.py")

    def walk(node: ast.AST, in_function: bool) -> Iterator[tuple[str, bool, int]]:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name, in_function, child.lineno
            elif isinstance(child, ast.ImportFrom):
                target = resolve(module, is_package, child)
                for alias in child.names:
                    sub = f"{target}.{alias.name}"
                    yield (sub if sub in known else target), in_function, child.lineno
            yield from walk(child, inner)

    yield from walk(tree, False)


def ours(name: str) -> bool:
    return name.split(".")[0] in OURS


def owner(name: str, known: set[str]) -> str | None:
    """The module of ours that ``name`` is, or the nearest enclosing one (``a.b.c`` -> ``a.b``)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


ALL = {**modules("mpipar"), **modules("simulator"), **modules("viz")}
KNOWN = set(ALL)


def graph(package: str) -> dict[str, set[str]]:
    """Edges among ``package``'s own modules (a submodule import also loads its parent packages)."""
    edges: dict[str, set[str]] = {m: set() for m in ALL if m.split(".")[0] == package}
    for module in edges:
        for name, _, _ in imports(module, ALL[module], KNOWN):
            target = owner(name, KNOWN)
            if target is not None and target.split(".")[0] == package and target != module:
                edges[module].add(target)
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path ``a -> ... -> a``, or None (iterative DFS, colour marking)."""
    colour: dict[str, int] = dict.fromkeys(edges, 0)  # 0 unseen, 1 on the stack, 2 done
    for start in sorted(edges):
        if colour[start]:
            continue
        stack: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(edges[start])))]
        colour[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                colour[node] = 2
                stack.pop()
            elif colour.get(child, 2) == 1:
                path = [n for n, _ in stack]
                return [*path[path.index(child) :], child]
            elif colour.get(child, 2) == 0:
                colour[child] = 1
                stack.append((child, iter(sorted(edges[child]))))
    return None


def test_the_graph_reader_sees_a_loop() -> None:
    # The checker itself must be able to fail: a two-module loop and a three-module loop.
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


@pytest.mark.parametrize("package", OURS)
def test_no_import_cycle_among_a_packages_modules(package: str) -> None:
    cycle = find_cycle(graph(package))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize(("package", "forbidden"), [("mpipar", ("simulator", "viz")), ("simulator", ("viz",))])
def test_a_lower_package_never_imports_a_higher_one(package: str, forbidden: tuple[str, ...]) -> None:
    bad = [
        f"{ALL[m]}:{line} imports {name}"
        for m in ALL
        if m.split(".")[0] == package
        for name, _, line in imports(m, ALL[m], KNOWN)
        if name.split(".")[0] in forbidden
    ]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("package", OURS)
def test_functions_import_only_third_party_modules(package: str) -> None:
    bad = [
        f"{os.path.relpath(ALL[m], REPO)}:{line} imports {name} inside a function"
        for m in ALL
        if m.split(".")[0] == package
        for name, in_function, line in imports(m, ALL[m], KNOWN)
        if in_function and ours(name)
    ]
    assert not bad, "\n".join(bad)


def unit(module: str) -> str | None:
    """The folder a module of ``mpipar`` lives in (``mpipar.compile/``), or the module itself when it
    sits at the package's root (``mpipar.tensor``); None for the package's front door, ``mpipar``."""
    parts = module.split(".")
    if len(parts) == 1:
        return None
    if os.path.isdir(os.path.join(REPO, *parts[:2])):
        return f"{parts[0]}.{parts[1]}/"
    return module


def folder_graph(package: str) -> dict[str, set[str]]:
    """Edges among ``package``'s folders and root modules: the layers as a newcomer sees them."""
    edges: dict[str, set[str]] = {}
    for module, targets in graph(package).items():
        source = unit(module)
        if source is None:
            continue
        edges.setdefault(source, set())
        for target in targets:
            dest = unit(target)
            if dest is not None and dest != source:
                edges[source].add(dest)
                edges.setdefault(dest, set())
    return edges


def test_folders_form_layers_too() -> None:
    # No folder sits above a folder (or root module) that imports it: ``runtime/`` below ``compile/``,
    # ``debug/`` below ``compile/``, the core modules below every folder that uses them.
    assert find_cycle({"a/": {"b"}, "b": {"a/"}}) == ["a/", "b", "a/"]
    cycle = find_cycle(folder_graph("mpipar"))
    assert cycle is None, "folder cycle: " + " -> ".join(cycle or [])
    runtime = folder_graph("mpipar")["mpipar.runtime/"]
    # mpipar.env (the MPIPAR_* parser) is a leaf: it imports nothing of mpipar.
    allowed = {"mpipar._threads", "mpipar.backend", "mpipar.comm", "mpipar.env", "mpipar.mesh", "mpipar.spec"}
    assert runtime <= allowed, runtime
    assert not folder_graph("mpipar")["mpipar.env"]
