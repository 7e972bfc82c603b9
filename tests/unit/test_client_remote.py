# -*- test-case-name: tests.unit.test_client_remote -*-
"""
Tests for L{kcoral.client.remote}: which functions can be sent, the program
one call builds, and C{.remote()} on the async client.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from twisted.internet.defer import Deferred
from twisted.trial.unittest import SynchronousTestCase

from kcoral.client.errors import ProtocolError, RemoteExecutionError
from kcoral.client.remote import RemoteFunction, check_literal, function_source
from kcoral.testing.fakes import FakeServer, completed, json_reply

LIMIT = 3


def scale(x, factor=2, *, data=b""):  # type: ignore[no-untyped-def]
    return x * factor


def uses_global(x):  # type: ignore[no-untyped-def]
    return x + LIMIT


def uses_builtin(x: int) -> list[int]:
    import math

    return sorted([x, len(str(math.pi))])


def recursive(n):  # type: ignore[no-untyped-def]
    return 1 if n <= 1 else n * recursive(n - 1)


class SourceTests(SynchronousTestCase):
    """function_source accepts self-contained functions only."""

    def test_module_text_runs(self) -> None:
        """The module defines the function (no defaults, no annotations) and its entry."""
        source, entry = function_source(uses_builtin)
        self.assertEqual(entry, "_kcoral_invoke_uses_builtin")
        self.assertTrue(source.startswith("from __future__ import annotations\n\n"))
        self.assertNotIn("-> list", source)
        namespace: dict[str, Any] = {}
        exec(compile(source, "m", "exec"), namespace)
        self.assertEqual(namespace[entry](1, [], [True], {"value": 5}), [5, 17])
        source, entry = function_source(recursive)
        namespace = {}
        exec(compile(source, "m", "exec"), namespace)
        self.assertEqual(namespace[entry](0, ["n"], [True], {"value": 4}), 24)

    def test_refused(self) -> None:
        def closure():  # type: ignore[no-untyped-def]
            return LIMIT + x

        x = 1

        async def coroutine():  # type: ignore[no-untyped-def]
            return 1

        def generator():  # type: ignore[no-untyped-def]
            yield 1

        self.assertRaises(ValueError, function_source, uses_global)
        self.assertRaises(ValueError, function_source, closure)
        self.assertRaises(TypeError, function_source, coroutine)
        self.assertRaises(TypeError, function_source, generator)
        self.assertRaises(TypeError, function_source, len)
        self.assertRaises(ValueError, function_source, lambda: 1)
        self.assertRaises(ValueError, function_source, functools.wraps(scale)(lambda: 1))

    def test_literals(self) -> None:
        check_literal({"a": [1, 2.5, None, True, "s"]})
        loop: list[Any] = []
        loop.append(loop)
        self.assertRaises(ValueError, check_literal, loop)
        self.assertRaises(TypeError, check_literal, {1: 2})
        self.assertRaises(TypeError, check_literal, (1, 2))
        self.assertRaises(TypeError, check_literal, object())


class ProgramTests(SynchronousTestCase):
    """The program of protocol §11, with its fixed ids."""

    def test_build(self) -> None:
        function = RemoteFunction(scale, client=None, timeout=30, output_limit_bytes=4096)
        program = function.build_program(5, data=b"ab")
        instructions = program.instructions
        self.assertEqual(
            [(i["op"], i.get("id")) for i in instructions],
            [
                ("upload", "module"),
                ("get_function", "function"),
                ("upload", "arg_2"),
                ("run", "output"),
                ("return", None),
            ],
        )
        self.assertEqual(instructions[1]["name"], "_kcoral_invoke_scale")
        self.assertNotIn("cpu_only", instructions[1])
        self.assertEqual(
            instructions[3]["args"],
            [2, ["data"], [True, True, False], {"value": 5}, {"value": 2}, {"$ref": "arg_2"}],
        )
        self.assertEqual(function(2), 4)
        tensor = RemoteFunction(scale, client=None, cpu_only=True).build_program(np.ones(2), 3)
        self.assertEqual(tensor.instructions[2]["kind"], "tensor")
        self.assertTrue(tensor.instructions[1]["cpu_only"])
        self.assertRaises(TypeError, function.build_program, 1, 2, 3)
        self.assertRaises(TypeError, function.build_program, {1, 2})
        self.assertRaises(TypeError, RemoteFunction, scale, client=None, cpu_only="yes")


class AsyncRemoteTests(SynchronousTestCase):
    """With an AsyncClient, .remote() fires with the value or fails typed."""

    def test_value(self) -> None:
        server = FakeServer(json_reply(completed({"output": {"type": "integer", "value": 10}})))
        client = server.client()
        d = client.function(timeout=5)(scale).remote(5)
        self.assertIsInstance(d, Deferred)
        server.settle()
        self.assertEqual(self.successResultOf(d), 10)
        self.assertEqual(server.seen[0].program["options"], {"timeout_seconds": 5})

    def test_failure_and_missing_output(self) -> None:
        error = {
            "kind": "engine",
            "message": "ZeroDivisionError: division by zero",
            "instruction_index": 3,
            "instruction_op": "run",
            "instruction_id": "output",
            "traceback": "",
        }
        server = FakeServer(
            json_reply(completed(status="FAILED", error=error)), json_reply(completed())
        )
        remote = server.client().function()(scale)
        d = remote.remote(1)
        server.settle()
        failure = self.failureResultOf(d, RemoteExecutionError)
        self.assertIn("ZeroDivisionError", str(failure.value))
        self.assertEqual(failure.value.result.error, error)
        d = remote.remote(1)
        server.settle()
        self.failureResultOf(d, ProtocolError)


class ObserverTests(SynchronousTestCase):
    """An attempt observer that returns a Deferred holds the next attempt."""

    def test_hold(self) -> None:
        from kcoral.testing.fakes import cache_miss

        from .test_client_async import _sha, blob_program

        server = FakeServer(json_reply(cache_miss(_sha(b"a"))), json_reply(completed()))
        client = server.client()
        gate: Deferred[None] = Deferred()
        client.attempt_observers.append(lambda attempt: gate if attempt.number == 1 else None)
        d = client.execute(blob_program(b"a"))
        server.settle()
        self.assertEqual(len(server.seen), 1)
        self.assertNoResult(d)
        gate.callback(None)
        server.settle()
        self.successResultOf(d)
        self.assertEqual(len(server.seen), 2)
