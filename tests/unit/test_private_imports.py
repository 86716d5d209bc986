"""Private names imported across modules, and private attributes written on another module's
objects: the lists in ``tests/golden/private_imports.txt`` and ``tests/golden/private_writes.txt``
may only shrink.

A leading underscore says "this module's own"; another module importing it couples the two
through a detail neither promises. Each such import is listed (importing module, source module,
name); a new one fails until it is made public (renamed, documented) or the need for it goes, and
a line whose import is gone fails until it is removed from the list. Private *modules* (``_threads``)
are not counted: the underscore there marks a module users never import, not a name another
module reaches into; but no other package (``simulator``, ``viz``) may import one.

    .venv/bin/python tests/unit/test_private_imports.py --update
"""

from __future__ import annotations

import ast
import os
import sys
from collections import Counter
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GOLDEN = os.path.join(REPO, "tests", "golden", "private_imports.txt")
WRITES = os.path.join(REPO, "tests", "golden", "private_writes.txt")
OWN_FIELDS = {"mpipar/tensor.py"}
"""Modules whose classes' private fields they set themselves (the class's own constructors)."""
PACKAGES = ("mpipar", "simulator", "viz")


def private_imports(root: str = REPO) -> list[str]:
    """``importer: module.name`` for every ``from module import _name`` between our modules."""
    rows: list[str] = []
    modules = {
        os.path.relpath(os.path.join(folder, f), root)[:-3].replace(os.sep, ".").removesuffix(".__init__")
        for package in PACKAGES
        for folder, _, files in os.walk(os.path.join(root, package))
        for f in files
        if f.endswith(".py")
    }
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(root, package)):
            for f in sorted(files):
                if not f.endswith(".py"):
                    continue
                path = os.path.join(folder, f)
                with open(path, encoding="utf-8") as fh:
                    tree = ast.parse(fh.read(), filename=path)
                for node in ast.walk(tree):
                    if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module):
                        continue
                    if node.module.split(".")[0] not in PACKAGES:
                        continue
                    for alias in node.names:
                        name = alias.name
                        if (
                            name.startswith("_")
                            and not name.startswith("__")
                            and f"{node.module}.{name}" not in modules
                        ):
                            rows.append(f"{os.path.relpath(path, root)}: {node.module}.{name}")
    return sorted(rows)


def _sources(root: str) -> list[tuple[str, ast.Module]]:
    out = []
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(root, package)):
            for f in sorted(files):
                if f.endswith(".py"):
                    path = os.path.join(folder, f)
                    with open(path, encoding="utf-8") as fh:
                        out.append((os.path.relpath(path, root), ast.parse(fh.read(), filename=path)))
    return out


def private_writes(root: str = REPO) -> list[str]:
    """``module: obj._field`` for every assignment to a private attribute of an object that is not
    the method's own (``self``/``cls``), outside the modules that own those fields. A module that
    writes another's private fields depends on how that object keeps its state; the owner's
    constructor or method is where such a write belongs."""
    rows: list[str] = []
    for rel, tree in _sources(root):
        if rel in OWN_FIELDS:
            continue
        for node in ast.walk(tree):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            for target in targets:
                for e in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if not (isinstance(e, ast.Attribute) and e.attr.startswith("_") and not e.attr.startswith("__")):
                        continue
                    if isinstance(e.value, ast.Name) and e.value.id in ("self", "cls"):
                        continue
                    rows.append(f"{rel}: {ast.unparse(e.value)}.{e.attr}")
    return sorted(rows)


def test_the_writer_check_sees_a_write(tmp_path: Path) -> None:
    package = tmp_path / "mpipar"
    package.mkdir()
    (package / "a.py").write_text("def f(t, self):\n    t._x = 1\n    self._y = 2\n    t.z = 3\n")
    assert private_writes(str(tmp_path)) == ["mpipar/a.py: t._x"]


def test_private_writes_only_shrink() -> None:
    found, golden = private_writes(), read_golden(WRITES)
    new = sorted((Counter(found) - Counter(golden)).elements())
    gone = sorted((Counter(golden) - Counter(found)).elements())
    assert not new, "private attributes of another module's objects written (add a method to the owner):\n" + "\n".join(
        new
    )
    assert not gone, "gone: remove these lines from tests/golden/private_writes.txt:\n" + "\n".join(gone)


def read_golden(path: str = GOLDEN) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return sorted(line.strip() for line in f if line.strip() and not line.startswith("#"))


def test_the_reader_sees_a_private_import(tmp_path: Path) -> None:
    package = tmp_path / "mpipar"
    package.mkdir()
    (package / "_threads.py").write_text("")
    (package / "b.py").write_text("_x = 1\nY = 2\n")
    (package / "a.py").write_text("from mpipar.b import _x, Y\nfrom mpipar import _threads\nfrom numpy import _core\n")
    assert private_imports(str(tmp_path)) == ["mpipar/a.py: mpipar.b._x"]


def private_modules_across_packages(root: str = REPO) -> list[str]:
    """``importer: module`` for every import by one of our packages of another's private module
    (a module or folder whose name starts with one underscore, such as ``mpipar._tape``): internal
    modules serve their own package; the others reach it through its public modules."""

    def private(dotted: str) -> bool:
        return any(p.startswith("_") and not p.startswith("__") for p in dotted.split(".")[1:])

    def is_module(dotted: str) -> bool:
        path = os.path.join(root, *dotted.split("."))
        return os.path.isdir(path) or os.path.isfile(path + ".py")

    rows: list[str] = []
    for rel, tree in _sources(root):
        own = rel.split("/")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                subs = [f"{node.module}.{a.name}" for a in node.names]
                names = [node.module] + [m for m in subs if is_module(m)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            rows += [
                f"{rel}: {n}" for n in names if n.split(".")[0] in PACKAGES and n.split(".")[0] != own and private(n)
            ]
    return sorted(set(rows))


def test_the_module_check_sees_a_private_module(tmp_path: Path) -> None:
    (tmp_path / "mpipar").mkdir()
    (tmp_path / "mpipar" / "_tape.py").write_text("x = 1\n")
    (tmp_path / "mpipar" / "a.py").write_text("from mpipar import _tape\n")
    (tmp_path / "simulator").mkdir()
    (tmp_path / "simulator" / "b.py").write_text(
        "from mpipar import _tape, a\nimport mpipar._tape\nfrom mpipar.a import _x\n"
    )
    assert private_modules_across_packages(str(tmp_path)) == ["simulator/b.py: mpipar._tape"]


def test_no_package_imports_anothers_private_module() -> None:
    bad = private_modules_across_packages()
    assert not bad, "private modules of another package imported (use a public module):\n" + "\n".join(bad)


def test_private_imports_only_shrink() -> None:
    found, golden = set(private_imports()), set(read_golden())
    new, gone = sorted(found - golden), sorted(golden - found)
    assert not new, "private names imported across modules (make them public or drop the need):\n" + "\n".join(new)
    assert not gone, "gone: remove these lines from tests/golden/private_imports.txt:\n" + "\n".join(gone)


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        raise SystemExit(__doc__)
    rows = private_imports()
    with open(GOLDEN, "w", encoding="utf-8") as f:
        f.write("# Private names imported across modules (tests/unit/test_private_imports.py): may only shrink.\n")
        f.writelines(f"{r}\n" for r in rows)
    writes = private_writes()
    with open(WRITES, "w", encoding="utf-8") as f:
        f.write(
            "# Private attributes written on other modules' objects (tests/unit/test_private_imports.py): may only shrink.\n"
        )
        f.writelines(f"{r}\n" for r in writes)
    print(f"{len(rows)} private imports, {len(writes)} private writes listed")
