"""
The shape targets of the server-wing redesign (issue 35), kept true: no
class in C{kcoral} over 600 lines, no module of the server wing over 900
lines, and no import circle among the server wing's modules (lazy imports
inside functions count; those only a type checker sees do not).
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.unit.test_layers import PACKAGE, _module_name, imports

MAX_CLASS_LINES = 600
MAX_SERVER_MODULE_LINES = 900

SERVER = PACKAGE / "server"


def _all_modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _server_modules() -> list[Path]:
    return sorted(SERVER.rglob("*.py"))


def long_classes(paths: list[Path], limit: int) -> dict[str, int]:
    """C{{"module.Class": lines}} for every class longer than C{limit} lines."""
    found = {}
    for path in paths:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found[f"{_module_name(path)}.{node.name}"] = lines
    return found


def long_modules(paths: list[Path], limit: int) -> dict[str, int]:
    """C{{module: lines}} for every module longer than C{limit} lines."""
    found = {}
    for path in paths:
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > limit:
            found[_module_name(path)] = lines
    return found


def import_graph(paths: list[Path]) -> dict[str, set[str]]:
    """Each module of C{paths} to the modules of C{paths} it imports."""
    names = {_module_name(path): path for path in paths}
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        targets = set()
        for module in imports(path):
            # "from package import name" may name a module or an attribute.
            while module and module not in names:
                module = module.rpartition(".")[0]
            if module and module != name and not name.startswith(module + "."):
                targets.add(module)
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_long_class() -> None:
    """No class anywhere in kcoral is over 600 lines."""
    assert long_classes(_all_modules(), MAX_CLASS_LINES) == {}


def test_no_long_server_module() -> None:
    """No module of the server wing is over 900 lines."""
    assert long_modules(_server_modules(), MAX_SERVER_MODULE_LINES) == {}


def test_no_import_circle_in_the_server_wing() -> None:
    """The server wing's imports form no circle."""
    assert cycles(import_graph(_server_modules())) == []


def test_cycle_finder_sees_a_circle() -> None:
    """The checker itself finds a three-module circle and ignores a chain."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_measures_see_a_long_class(tmp_path: Path) -> None:
    """The class and module measures count lines as the targets mean them."""
    source = "class Big:\n" + "    x = 1\n" * 700
    path = tmp_path / "big.py"
    path.write_text(source, encoding="utf-8")
    tree = ast.parse(source)
    node = tree.body[0]
    assert isinstance(node, ast.ClassDef)
    assert node.end_lineno == 701
    assert len(path.read_text(encoding="utf-8").splitlines()) == 701
