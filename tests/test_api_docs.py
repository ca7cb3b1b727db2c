"""Every public method of cma's public classes says what it does (``help()`` shows it).

Public: a class or method whose name has no leading underscore, in a module whose path
has none (``cma/_linux.py`` is private). Each such method needs a docstring of its own;
an override that only inherits its base's text still needs a line, since cma's overrides
are where cma differs (the mpi4py wrapper's methods, the transports' copies). The source
is parsed, not imported, so ``cma.mpi`` is checked without starting MPI.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def public_modules(root: Path) -> list[Path]:
    return [path for path in sorted((root / "cma").rglob("*.py"))
            if not any(part.startswith("_") and part not in ("__init__.py", "__main__.py")
                       for part in path.relative_to(root).parts)]


def undocumented(source: str) -> list[str]:
    """``Class.method`` for each public method of a public top-level class without a docstring."""
    missing = []
    for cls in ast.parse(source).body:
        if not isinstance(cls, ast.ClassDef) or cls.name.startswith("_"):
            continue
        for node in cls.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) \
                    and not node.name.startswith("_") \
                    and not any(isinstance(d, ast.Name) and d.id == "overload"
                                for d in node.decorator_list) \
                    and ast.get_docstring(node) is None:
                missing.append(f"{cls.name}.{node.name}")
    return missing


def test_every_public_method_has_a_docstring() -> None:
    missing = [f"{path.relative_to(ROOT)}: {name}"
               for path in public_modules(ROOT) for name in undocumented(path.read_text())]
    assert not missing, "public methods without a docstring:\n" + "\n".join(missing)


def test_the_check_sees_a_missing_docstring() -> None:
    source = '''
class Comm:
    def Send(self):
        return None

    @property
    def rank(self):
        """Documented."""

    def _private(self):
        pass


class _Hidden:
    def Recv(self):
        pass
'''
    assert undocumented(source) == ["Comm.Send"]


def test_the_walk_reaches_the_mpi_plugin_and_skips_private_modules() -> None:
    names = {str(path.relative_to(ROOT)) for path in public_modules(ROOT)}
    assert {"cma/comm.py", "cma/requests.py", "cma/mpi/comm.py"} <= names
    assert "cma/_linux.py" not in names
