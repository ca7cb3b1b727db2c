"""The package's import floors: no module imports one above it, so no import circles.

The order is the one docs/architecture.md writes down ("Import floors"); this test reads
it from there, parses every module of cma/ (nothing is imported) and fails on any import
of a module that is not strictly below the importer, naming the edge.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "cma"


def floors() -> list[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    found = re.search(r"```floors\n(.*?)```", text, re.S)
    assert found, "docs/architecture.md has no ```floors block"
    return found.group(1).split()


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return isinstance(test, ast.Name) and test.id == "TYPE_CHECKING" or \
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The cma modules ``name`` imports when it runs (in functions too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking_only(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "cma")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "cma":
                for alias in node.names:  # `from . import x`: the submodule x if there is one
                    sub = f"{target}.{alias.name}"
                    found.add(sub if sub in known else target)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    found.discard(name)
    return found


def test_every_module_has_a_floor() -> None:
    assert sorted(modules()) == sorted(floors()), "modules and docs/architecture.md's floors differ"


def drawn() -> list[str]:
    """The modules of docs/architecture.md's opening picture, top first."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    found = re.search(r"```\n(.*?)```", text, re.S)
    assert found, "docs/architecture.md has no picture"
    return [module_name(ROOT / (path.rstrip("/") + ("/__init__.py" if path.endswith("/") else "")))
            for path in re.findall(r"^(cma/\S+)", found.group(1), re.M)]


def test_the_picture_agrees_with_the_floors() -> None:
    """The picture draws each module above the ones it may import: top to bottom is the
    floors' order read upward (world.py imports channel.py, so channel.py is drawn below)."""
    order = {name: i for i, name in enumerate(floors())}
    names = drawn()
    assert len(names) >= 10 and set(names) <= set(order), names
    out_of_order = [f"{upper} drawn above {lower}"
                    for upper, lower in zip(names, names[1:], strict=False)
                    if order[upper] <= order[lower]]
    assert not out_of_order, out_of_order


def test_no_module_imports_upward() -> None:
    order = {name: i for i, name in enumerate(floors())}
    known = set(modules())
    upward = [f"{name} -> {target}"
              for name, path in modules().items()
              for target in sorted(imports(name, path, known))
              if order.get(target, len(order)) >= order[name]]
    assert not upward, "imports at or above their own floor:\n" + "\n".join(upward)


def test_the_protocol_stays_free_of_io() -> None:
    """protocol.py (sans-IO) reaches, through everything it imports, no transport, no ring
    and no ctypes binding."""
    known = set(modules())
    seen: set[str] = set()
    todo = ["cma.protocol"]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(imports(name, modules()[name], known))
    assert seen <= {"cma.protocol", "cma.wire", "cma.errors"}, sorted(seen)


@pytest.mark.parametrize("edge", ["cma.world -> cma.comm", "cma.protocol -> cma.transports.base",
                                  "cma.progress -> cma.comm", "cma.connect -> cma.progress"])
def test_the_check_sees_an_upward_edge(edge: str, tmp_path: Path) -> None:
    """The walker finds an upward import when one is there (as the first two once were;
    the others are the split of Comm's: Progress and connect time never reach up to it)."""
    importer, target = edge.split(" -> ")
    source = f"def f():\n    from {target} import x\n"
    path = tmp_path / "mod.py"
    path.write_text(source)
    assert target in imports(importer, path, set(modules()))
