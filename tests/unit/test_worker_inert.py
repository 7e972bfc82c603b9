"""
Tests for L{kcoral.worker.inert}: which uploaded modules import without
running code of their own (so the engine places no lease for them).
"""

from __future__ import annotations

import builtins
import textwrap
import types

import pytest

from kcoral.worker.inert import MAX_SOURCE, import_is_inert

INERT = {
    "definitions": """
        '''A docstring.'''
        def add(a, b=1, *rest, c=-2.5, **kw):
            return a + b
        async def later():
            pass
        """,
    "loaded imports": """
        from __future__ import annotations
        import os
        import os.path
        import json as j
        from collections import OrderedDict as OD, deque
        """,
    "constants": "SIZE = 3\nNAMES = ('a', ['b', {1: b'c', 'd': None}], {1.5})\n"
    "LIMIT: int = -4\nFLAG: bool\n",
    "a plain class": """
        class Point:
            '''x and y.'''
            dims = 2
            def __init__(self, x: int, y: int) -> None:
                self.x = x
        """,
    "annotations postponed": """
        from __future__ import annotations
        def f(x: list[int] = ()) -> dict[str, int]:
            return {}
        """,
    "empty": "",
}

ACTIVE = {
    "a call": "import os\nos.getpid()\n",
    "a decorator": "import functools\n@functools.lru_cache\ndef f():\n    pass\n",
    "a computed default": "import os\ndef f(x=os.getpid()):\n    pass\n",
    "a base class": "class A(dict):\n    pass\n",
    "a metaclass": "class A(metaclass=type):\n    pass\n",
    "a class body call": "class A:\n    x = len('abc')\n",
    "an unloaded import": "import kcoral_no_such_module_anywhere\n",
    "a from-import that would run __getattr__": "from os import kcoral_no_such_name\n",
    "a star import": "from os import *\n",
    "a relative import": "from . import sibling\n",
    "a name assigned": "import os\nX = os\n",
    "an evaluated annotation": "def f(x: list[int]) -> None:\n    pass\n",
    "an operator": "X = 2 ** 1000\n",
    "a loop": "for i in ():\n    pass\n",
    "a syntax error": "def f(:\n",
    "a global statement": "global X\n",
}


@pytest.mark.parametrize("name", sorted(INERT))
def test_inert(name: str) -> None:
    assert import_is_inert(textwrap.dedent(INERT[name]))


@pytest.mark.parametrize("name", sorted(ACTIVE))
def test_active(name: str) -> None:
    assert not import_is_inert(textwrap.dedent(ACTIVE[name]))


def test_inert_really_runs_nothing() -> None:
    """What the analysis calls inert executes without calling anything we can see."""
    calls: list[str] = []

    def profile(frame: types.FrameType, event: str, arg: object) -> None:
        if event in ("call", "c_call") and frame.f_code.co_filename == "<inert>":
            calls.append(getattr(arg, "__name__", frame.f_code.co_name))

    import sys

    for name, source in INERT.items():
        code = compile(textwrap.dedent(source), "<inert>", "exec")
        sys.setprofile(profile)
        try:
            exec(code, {"__name__": "inert_test"})
        finally:
            sys.setprofile(None)
        # The module's own frame, and a class statement's body, are all it enters.
        assert [c for c in calls if c not in ("<module>", "Point", "__build_class__")] == [], name
        calls.clear()


def test_import_of_a_loaded_module_of_another_class() -> None:
    """A module object of another class may compute its attributes: active."""

    class Lazy(types.ModuleType):
        pass

    modules = {"lazy": Lazy("lazy"), "plain": types.ModuleType("plain")}
    assert import_is_inert("import plain\n", modules)
    assert not import_is_inert("import lazy\n", modules)


def test_dotted_import_needs_every_package() -> None:
    modules = {"pkg.sub": types.ModuleType("pkg.sub")}
    assert not import_is_inert("import pkg.sub\n", modules)
    modules["pkg"] = types.ModuleType("pkg")
    assert import_is_inert("import pkg.sub\n", modules)
    # `as` fetches the submodule from the package.
    assert not import_is_inert("import pkg.sub as s\n", modules)
    modules["pkg"].sub = modules["pkg.sub"]  # type: ignore[attr-defined]
    assert import_is_inert("import pkg.sub as s\n", modules)


def test_a_replaced_import_function_makes_every_import_active() -> None:
    original = builtins.__import__

    def spy(*args: object, **kwargs: object) -> object:
        return original(*args, **kwargs)  # type: ignore[arg-type]

    builtins.__import__ = spy
    try:
        assert not import_is_inert("import os\n")
        assert not import_is_inert("def f():\n    pass\n")
    finally:
        builtins.__import__ = original
    assert import_is_inert("import os\n")


def test_long_sources_are_not_analysed() -> None:
    source = "X = 1\n" * (MAX_SOURCE // 6 + 1)
    assert len(source) > MAX_SOURCE
    assert not import_is_inert(source)
