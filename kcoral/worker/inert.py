# -*- test-case-name: tests.unit.test_worker_inert -*-
"""
Whether importing an uploaded Python module can run any code of its own.

Most uploaded modules are definitions: functions, constants, imports of
libraries the worker has loaded already.  Executing such a top level calls
nothing (a C{def} does not run its body; importing a loaded module is a
lookup in C{sys.modules}), so it cannot touch the GPU, and the engine need
neither take the lease for it nor switch on the CUPTI driver watch that a
lazily leased import needs (about 0.13 ms a module on an H200,
a one-off probe, C{bench/cupti_cost.py}, removed from
the tree with the other probes on private names; git history keeps it).

The analysis is conservative: anything it does not recognise (a call, a
decorator, a base class, a default that is not a constant, an import that
would load a module) makes the module I{active}, and the engine places the
lease as for any module.  It guards a measurement convention, not a
security boundary: a program that wants the GPU off the lease has other
ways (a thread it starts), and the lease was never the sandbox.
"""

from __future__ import annotations

import ast
import builtins
import sys
import types
from collections.abc import Iterable, Mapping
from functools import lru_cache

import attrs

__all__ = ["import_is_inert"]

#: Longer sources are not analysed (nor kept in the cache): importing them
#: costs more than the driver watch saves.
MAX_SOURCE = 64 * 1024

#: The import function a worker starts with: a program that replaces it
#: makes every import statement a call of its own.
_IMPORT = builtins.__import__


@attrs.frozen
class _Shape:
    """
    What a module's source needs to be inert: its statements are all inert
    (C{inert}), given that these modules are loaded (C{modules}) and that
    these names are attributes of these modules (C{names}).
    """

    inert: bool
    modules: tuple[str, ...] = ()
    names: tuple[tuple[str, str], ...] = ()


def import_is_inert(source: str, modules: Mapping[str, object] | None = None) -> bool:
    """
    Whether executing C{source} as a module runs no code but definitions
    and lookups, given the loaded C{modules} (C{sys.modules} by default).
    """
    if builtins.__import__ is not _IMPORT or len(source) > MAX_SOURCE:
        return False
    shape = _shape(source)
    if not shape.inert:
        return False
    loaded = sys.modules if modules is None else modules
    for name in shape.modules:
        module = loaded.get(name)
        # A module of another class may compute attributes (a property, a
        # __getattr__ of its type): only plain modules are lookups.
        if type(module) is not types.ModuleType:
            return False
    for name, attribute in shape.names:
        module = loaded[name]
        if attribute not in vars(module):
            # A module's __getattr__ (PEP 562) or a submodule import would run.
            return False
    return True


@lru_cache(maxsize=256)
def _shape(source: str) -> _Shape:
    """The structural part of the analysis, by source (a reused worker sees the same ones)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return _Shape(False)  # compile() reports it when the module runs
    modules: list[str] = []
    names: list[tuple[str, str]] = []
    future_annotations = any(
        isinstance(node, ast.ImportFrom)
        and node.module == "__future__"
        and any(alias.name == "annotations" for alias in node.names)
        for node in tree.body
    )
    checker = _Checker(modules, names, evaluated_annotations=not future_annotations)
    if not checker.statements(tree.body):
        return _Shape(False)
    return _Shape(True, tuple(modules), tuple(names))


@attrs.define
class _Checker:
    modules: list[str]
    names: list[tuple[str, str]]
    evaluated_annotations: bool

    def statements(self, body: Iterable[ast.stmt]) -> bool:
        return all(self.statement(node) for node in body)

    def statement(self, node: ast.stmt) -> bool:
        if isinstance(node, ast.Pass):
            return True
        if isinstance(node, ast.Expr):
            return isinstance(node.value, ast.Constant)  # a docstring
        if isinstance(node, ast.Import):
            for alias in node.names:
                # `import a.b` binds `a`; both must be loaded.
                parts = alias.name.split(".")
                self.modules.extend(".".join(parts[: i + 1]) for i in range(len(parts)))
                if alias.asname is not None and len(parts) > 1:
                    # `import a.b as c` fetches b from a.
                    self.names.append((".".join(parts[:-1]), parts[-1]))
            return True
        if isinstance(node, ast.ImportFrom):
            if node.level or node.module is None:
                return False  # relative: resolved against a package we do not know
            if node.module == "__future__":
                return True
            self.modules.append(node.module)
            for alias in node.names:
                if alias.name == "*":
                    return False
                self.names.append((node.module, alias.name))
            return True
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            return (
                not node.decorator_list
                and not getattr(node, "type_params", None)
                and self.arguments(node.args)
                and self.annotation(node.returns)
            )
        if isinstance(node, ast.ClassDef):
            # Bases, keywords (a metaclass) and decorators run code; the
            # body runs now, so it must be inert itself.
            return (
                not node.bases
                and not node.keywords
                and not node.decorator_list
                and not getattr(node, "type_params", None)
                and self.statements(node.body)
            )
        if isinstance(node, ast.Assign):
            return all(isinstance(t, ast.Name) for t in node.targets) and _literal(node.value)
        if isinstance(node, ast.AnnAssign):
            return (
                isinstance(node.target, ast.Name)
                and (node.value is None or _literal(node.value))
                and self.annotation(node.annotation)
            )
        return False

    def arguments(self, args: ast.arguments) -> bool:
        defaults = [*args.defaults, *(d for d in args.kw_defaults if d is not None)]
        every = [*args.posonlyargs, *args.args, *args.kwonlyargs]
        every += [a for a in (args.vararg, args.kwarg) if a is not None]
        return all(_literal(d) for d in defaults) and all(
            self.annotation(a.annotation) for a in every
        )

    def annotation(self, node: ast.expr | None) -> bool:
        """An annotation evaluated at definition time must be a name or a constant."""
        if node is None or not self.evaluated_annotations:
            return True
        return isinstance(node, ast.Name | ast.Constant)


def _literal(node: ast.expr) -> bool:
    """A constant, or a tuple/list/set/dict of them: building it calls nothing."""
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return all(_literal(e) for e in node.elts)
    if isinstance(node, ast.Dict):
        # A key's hash is a constant's own (str, int, ...): no user code.
        return all(k is not None and _literal(k) for k in node.keys) and all(
            _literal(v) for v in node.values
        )
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        return isinstance(node.operand, ast.Constant)
    return False
