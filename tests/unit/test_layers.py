"""
The layer rules of DESIGN.md, checked on every module of each package by
walking its imports (C{ast}), lazy imports inside functions included and
C{if TYPE_CHECKING:} blocks excluded: C{wire} knows nothing of Twisted,
C{worker} nothing of the reactor, C{server} nothing of CUDA, and imports
run downward only (server, worker, client -> ipc -> wire; compilers, config).

C{wire} is values and pure functions: no threads, sockets, mappings,
descriptors or files (L{OS_RESOURCES}); those live in C{ipc}, which may use
the wire, never the other way (the wire names C{ipc}'s types only for a
type checker).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import kcoral

PACKAGE = Path(kcoral.__file__).resolve().parent

CUDA = ("pycuda", "cupy", "torch", "numba", "cuda", "nvidia")
HTTP = ("klein", "treq", "werkzeug")
UPPER = ("kcoral.server", "kcoral.worker", "kcoral.client", "kcoral.testing")
#: What makes a module impure: threads, native calls, sockets, mappings,
#: descriptors and files (kcoral.ipc's room, not kcoral.wire's).
OS_RESOURCES = (
    "threading",
    "ctypes",
    "socket",
    "mmap",
    "select",
    "os",
    "tempfile",
    "fcntl",
    "subprocess",
)

#: Layer -> module prefixes none of its modules may import.
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "wire": ("twisted", *HTTP, *CUDA, *UPPER, "kcoral.compilers", "kcoral.ipc", *OS_RESOURCES),
    "ipc": ("twisted", *HTTP, *CUDA, *UPPER, "kcoral.compilers"),
    "worker": ("twisted.internet", *HTTP, "kcoral.server", "kcoral.client", "kcoral.testing"),
    "server": (*CUDA, "kcoral.worker", "kcoral.client", "kcoral.testing"),
    "client": (*CUDA, "kcoral.server", "kcoral.worker", "kcoral.testing"),
    "compilers": ("twisted.internet", *HTTP, *UPPER),
    "config": ("twisted", *HTTP, *CUDA, *UPPER, "kcoral.compilers", "kcoral.wire"),
    "gateway": (*CUDA, "kcoral.worker", "kcoral.client", "kcoral.testing"),
}


def _modules(layer: str) -> list[Path]:
    path = PACKAGE / layer
    if path.is_dir():
        return sorted(path.rglob("*.py"))
    return [path.with_suffix(".py")]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST) -> Iterator[ast.AST]:
    """Every node below C{node}, except inside C{if TYPE_CHECKING:}."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child):
            for other in child.orelse:
                yield other
                yield from _walk(other)
            continue
        yield child
        yield from _walk(child)


def imports(path: Path) -> set[str]:
    """The absolute names of the modules that C{path} imports."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    return imports_in(path.read_text(encoding="utf-8"), package)


def imports_in(source: str, package: str) -> set[str]:
    """The absolute names of the modules imported by C{source}, a module of C{package}."""
    found = set()
    for node in _walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            found.add(module)
            # "from kcoral import server" imports kcoral.server.
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def _matches(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def violations(layer: str) -> dict[str, list[str]]:
    """C{{module: [forbidden imports]}} for one layer."""
    found = {}
    for path in _modules(layer):
        bad = sorted(
            module
            for module in imports(path)
            if any(_matches(module, prefix) for prefix in FORBIDDEN[layer])
        )
        if bad:
            found[_module_name(path)] = bad
    return found


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports(layer: str) -> None:
    """No module of the layer imports what its layer rule forbids."""
    assert _modules(layer), f"no modules found for layer {layer}"
    assert violations(layer) == {}


def test_walker_sees_lazy_and_relative_imports() -> None:
    """
    The walk finds imports inside functions, resolves relative ones, and
    skips those only a type checker sees.
    """
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    import klein\n"
        "def f():\n"
        "    from twisted.internet import reactor\n"
        "from . import program\n"
        "from ..server import app\n"
    )
    names = imports_in(source, "kcoral.wire")
    assert "twisted.internet.reactor" in names
    assert "kcoral.wire.program" in names
    assert "kcoral.server.app" in names
    assert not any(_matches(name, "klein") for name in names)
