# -*- test-case-name: tests.unit.test_client_remote -*-
"""
Remote functions (protocol §11): a decorated, self-contained Python
function whose C{.remote(...)} call becomes an ordinary program.

At decoration the function's source is regenerated without decorators,
defaults and annotations (defaults are bound locally and sent as values)
and a small entry point is appended that unwraps literal arguments and
calls it.  Bytes-like arguments travel as C{bytes} uploads, arrays and
DLPack tensors as C{tensor} uploads, anything else as a JSON literal.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import json
import symtable
import sys
import textwrap
from collections.abc import Callable
from functools import update_wrapper
from typing import Any, Generic, ParamSpec, TypeVar

from twisted.internet.defer import Deferred

from kcoral.client.errors import ProtocolError, RemoteExecutionError
from kcoral.client.program import Program
from kcoral.client.results import ProgramResult

_P = ParamSpec("_P")
_R = TypeVar("_R")

_ENTRY = """
def {entry}(nargs, names, literals, *values):
    import builtins as _kcoral_builtins
    unwrapped = [value["value"] if literal else value
                 for literal, value in _kcoral_builtins.zip(literals, values)]
    target = _kcoral_builtins.globals()[{name!r}]
    keywords = _kcoral_builtins.dict(_kcoral_builtins.zip(names, unwrapped[nargs:]))
    return target(*unwrapped[:nargs], **keywords)
"""


def _strip(node: ast.FunctionDef) -> None:
    """Drop what may depend on the caller's scope: decorators, defaults, annotations."""
    node.decorator_list = []
    node.returns = None
    node.args.defaults = []
    node.args.kw_defaults = [None for _ in node.args.kwonlyargs]
    every = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
    every += [a for a in (node.args.vararg, node.args.kwarg) if a is not None]
    for argument in every:
        argument.annotation = None


def _external_globals(source: str, fn: Callable[..., Any]) -> set[str]:
    """Global names the function uses that the server's module would not have."""
    namespace = getattr(fn, "__globals__", {})
    found: set[str] = set()
    scopes = list(symtable.symtable(source, "<remote function>", "exec").get_children())
    while scopes:
        scope = scopes.pop()
        scopes.extend(scope.get_children())
        for symbol in scope.get_symbols():
            if not symbol.is_global():
                continue
            name = symbol.get_name()
            if symbol.is_declared_global():
                found.add(name)
            elif not symbol.is_referenced() or name == fn.__name__:
                continue
            elif not hasattr(builtins, name):
                found.add(name)
            elif name in namespace and namespace[name] is not getattr(builtins, name):
                found.add(name)  # a module-level object shadows the builtin
    return found


def function_source(fn: Callable[..., Any]) -> tuple[str, str]:
    """
    The module text to upload for C{fn}, and the name of its entry point.

    @raise TypeError: for anything but a plain synchronous function.
    @raise ValueError: for closures, other decorators, external globals or
        functions without source.
    """
    if (
        not inspect.isfunction(fn)
        or inspect.iscoroutinefunction(fn)
        or inspect.isgeneratorfunction(fn)
        or inspect.isasyncgenfunction(fn)
    ):
        raise TypeError("remote functions must be synchronous Python functions, not generators")
    if fn.__closure__:
        raise ValueError("remote functions cannot capture variables; pass them as arguments")
    if hasattr(fn, "__wrapped__"):
        raise ValueError("remote functions cannot have other decorators")
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError) as e:
        raise ValueError(
            "remote functions require Python source in a file; use Program otherwise"
        ) from e
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.FunctionDef):
        raise ValueError("remote functions require a regular def statement, not a lambda")
    node = tree.body[0]
    if len(node.decorator_list) > 1:
        raise ValueError("remote functions cannot have other decorators")
    _strip(node)
    source = "from __future__ import annotations\n\n" + ast.unparse(tree) + "\n"
    external = _external_globals(source, fn)
    if external:
        raise ValueError(
            f"remote function references external globals: {', '.join(sorted(external))}; "
            "import dependencies inside the function or pass values as arguments"
        )
    entry = f"_kcoral_invoke_{fn.__name__}"
    return source + _ENTRY.format(entry=entry, name=fn.__name__), entry


def check_literal(value: Any, active: set[int] | None = None) -> None:
    """Accept only JSON values (string-keyed dicts, lists, scalars), without cycles."""
    if value is None or type(value) in (bool, int, float, str):
        return
    if type(value) not in (list, dict):
        raise TypeError(
            f"unsupported argument type {type(value).__name__}; use JSON values or pass "
            "bytes and tensors as whole arguments"
        )
    active = set() if active is None else active
    if id(value) in active:
        raise ValueError("remote function arguments cannot contain circular containers")
    active.add(id(value))
    try:
        if isinstance(value, dict):
            if not all(isinstance(key, str) for key in value):
                raise TypeError("remote function dictionary arguments require string keys")
            children = list(value.values())
        else:
            children = value
        for child in children:
            check_literal(child, active)
    finally:
        active.discard(id(value))


def _is_tensor(value: Any) -> bool:
    if hasattr(value, "__dlpack__"):
        return True
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.ndarray)


class RemoteFunction(Generic[_P, _R]):
    """
    A function with explicit remote execution: C{remote()} returns the
    decoded value, C{execute()} the whole L{ProgramResult},
    C{build_program()} the program; calling it runs it locally.

    With an L{AsyncClient}, C{remote()} and C{execute()} return Deferreds.
    """

    def __init__(
        self,
        fn: Callable[_P, _R],
        *,
        client: Any,
        timeout: float | None = None,
        output_limit_bytes: int | None = None,
        cpu_only: bool = False,
    ) -> None:
        if not isinstance(cpu_only, bool):
            raise TypeError("cpu_only must be a bool")
        self._source, self._entry = function_source(fn)
        self._signature = inspect.signature(fn)
        self._fn = fn
        self._client = client
        self._timeout = timeout
        self._output_limit_bytes = output_limit_bytes
        self._cpu_only = cpu_only
        update_wrapper(self, fn, updated=())

    def __call__(self, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        """Run the original function here, without the server."""
        return self._fn(*args, **kwargs)

    def build_program(self, *args: _P.args, **kwargs: _P.kwargs) -> Program:
        """The program one call sends (returning key C{output}); contacts nothing."""
        bound = self._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        program = Program()
        module = program.upload(id="module", kind="module", source=self._source)
        function = program.get_function(
            id="function", module=module, name=self._entry, cpu_only=self._cpu_only
        )
        values: list[Any] = []
        literals: list[bool] = []
        for index, value in enumerate([*bound.args, *bound.kwargs.values()]):
            if isinstance(value, bytes | bytearray | memoryview):
                values.append(program.upload(id=f"arg_{index}", kind="bytes", value=value))
                literals.append(False)
            elif _is_tensor(value):
                values.append(program.upload(id=f"arg_{index}", kind="tensor", value=value))
                literals.append(False)
            else:
                check_literal(value)
                # A wrapped copy: a user dict shaped like {"$ref": ...} stays data.
                values.append({"value": json.loads(json.dumps(value, allow_nan=False))})
                literals.append(True)
        output = program.run(
            id="output",
            fn=function,
            args=[len(bound.args), list(bound.kwargs), literals, *values],
        )
        program.return_(key="output", value=output)
        return program

    def execute(self, *args: _P.args, **kwargs: _P.kwargs) -> Any:
        """Run remotely; return the L{ProgramResult} (a Deferred of it with an async client)."""
        return self._client.execute(
            self.build_program(*args, **kwargs),
            timeout_seconds=self._timeout,
            output_limit_bytes=self._output_limit_bytes,
        )

    def remote(self, *args: _P.args, **kwargs: _P.kwargs) -> Any:
        """
        Run remotely and return the function's value (tensors as NumPy arrays).

        @raise RemoteExecutionError: when the program failed.
        """
        outcome = self.execute(*args, **kwargs)
        if isinstance(outcome, Deferred):
            return outcome.addCallback(output_of)
        return output_of(outcome)


def output_of(result: ProgramResult) -> Any:
    """A remote function's value, or L{RemoteExecutionError}."""
    if not result.completed:
        raise RemoteExecutionError(result)
    if "output" not in result.results:
        raise ProtocolError("remote function response is missing its output")
    return result.results["output"]


__all__ = ["RemoteFunction", "check_literal", "function_source", "output_of"]
