# -*- test-case-name: tests.unit.test_client_results -*-
"""
Tests for L{kcoral.client.results}, L{kcoral.client.files} and
L{kcoral.client.errors}: response validation and returned files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from kcoral.client.errors import KCoralError, ProtocolError
from kcoral.client.files import ReturnedFile, ReturnedFolder
from kcoral.client.results import ProgramResult, missing_blobs, program_result, server_error
from kcoral.testing.fakes import completed


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


_ERROR = {
    "kind": "gpu_access",
    "message": "m",
    "instruction_index": 1,
    "instruction_op": "run",
    "instruction_id": "x",
    "traceback": "",
    "cuda_call": "cuMemAlloc",
    "location": "a.py:1 in f",
    "interfered_request_id": None,
}


class ProgramResultTests(SynchronousTestCase):
    """program_result accepts exactly the protocol §8.1 shapes."""

    def test_completed(self) -> None:
        result = program_result(completed({"n": {"type": "number", "value": 3}}), {})
        self.assertEqual(result.results, {"n": 3.0})
        self.assertIsInstance(result.results["n"], float)
        self.assertEqual(result.check(), result)
        self.assertEqual(result.gpu_ids, ())
        self.assertIsInstance(result.queue_ms, float)
        self.assertTrue(dataclasses.is_dataclass(result))

    def test_gpus(self) -> None:
        result = program_result(completed(gpu_ids=[3, 1], gpu_count=2), {})
        self.assertEqual(result.gpu_ids, (3, 1))

    def test_measurements(self) -> None:
        """The server's records are exposed, and a returned value checked against them."""
        record = {
            "id": 0,
            "instruction_index": 3,
            "latency_ms_median": 2.5,
            "repeat": 20,
            "timing": "cupti_activity",
            "validity": {"ok": True, "reasons": []},
        }
        result = program_result(completed(measurements=[record]), {})
        self.assertEqual(result.measurements, (record,))
        value = {**record, "measurement_id": 0}
        del value["id"], value["instruction_index"]
        self.assertEqual(result.verify_measurement(value), record)
        for forged in (
            {**value, "latency_ms_median": 0.001},
            {**value, "measurement_id": 1},
            {"latency_ms_median": 2.5},
        ):
            with self.assertRaises(ValueError):
                result.verify_measurement(forged)
        flagged = {**record, "validity": {"ok": False, "reasons": ["no_activity: x"]}}
        result = program_result(completed(measurements=[flagged]), {})
        with self.assertRaisesRegex(ValueError, "not valid"):
            result.verify_measurement({**value, "validity": flagged["validity"]})
        self.assertEqual(program_result(completed(), {}).measurements, ())
        with self.assertRaises(ProtocolError):
            program_result(completed(measurements={"id": 0}), {})

    def test_failed_gpu_access(self) -> None:
        result = program_result(completed(status="FAILED", error=dict(_ERROR)), {})
        self.assertEqual(result.error, _ERROR)

    def test_malformed(self) -> None:
        """Every deviation is a ProtocolError."""
        bad: list[dict[str, Any]] = [
            completed(status="ERROR"),
            completed(status="CACHE_MISS"),
            completed(request_id=""),
            completed(queue_ms=True),
            completed(elapsed_ms=None),
            completed(stdout=1),
            completed(stdout_truncated="no"),
            completed(gpu_ids=[0]),
            completed(gpu_ids=[0, 0], gpu_count=2),
            completed(gpu_ids=[0], gpu_count=2),
            {**completed(), "results": []},
            completed(error=None),
            completed(status="FAILED", error={**_ERROR, "kind": "timeout"}),
            completed(status="FAILED", error={**_ERROR, "extra": 1}),
            completed(status="FAILED", error={**_ERROR, "instruction_index": None}),
            completed(status="FAILED", error={**_ERROR, "location": 3}),
            completed({"x": {"type": "integer", "value": True}}),
            completed({"x": {"type": "string", "value": "s", "more": 1}}),
            completed({"x": {"type": "bytes", "part": "return:1", "sha256": _sha(b"")}}),
        ]
        for body in bad:
            self.assertRaises(ProtocolError, program_result, body, {})
        unreferenced = completed()
        self.assertRaises(ProtocolError, program_result, unreferenced, {"return:0": b""})

    def test_folder(self) -> None:
        results = {
            "o": {
                "type": "folder",
                "files": {
                    "d/x": {"type": "file", "part": "return:0", "sha256": _sha(b"x"), "size": 1}
                },
                "directories": ["d", "e"],
            }
        }
        folder = program_result(completed(results), {"return:0": b"x"}).results["o"]
        self.assertEqual(folder, ReturnedFolder({"d/x": ReturnedFile(b"x")}, ("d", "e")))
        results["o"]["directories"] = ["e"]
        self.assertRaises(ProtocolError, program_result, completed(results), {"return:0": b"x"})


class ServerErrorTests(SynchronousTestCase):
    """server_error reads the body as 0.1.1 does."""

    def test_variants(self) -> None:
        e = server_error(
            503, b'{"status":"ERROR","request_id":"r","error":{"kind":"busy","message":"s"}}'
        )
        self.assertEqual((e.status_code, e.kind, e.message, e.request_id), (503, "busy", "s", "r"))
        self.assertEqual(str(e), "HTTP 503: s")
        e = server_error(500, b'{"error":"plain"}')
        self.assertEqual((e.message, e.kind), ("plain", None))
        e = server_error(502, b"<html>")
        self.assertEqual(e.message, "HTTP 502")
        self.assertIsInstance(e, KCoralError)

    def test_missing_blobs(self) -> None:
        known = {_sha(b"a"): b"a"}
        self.assertEqual(missing_blobs({"missing_blobs": [_sha(b"a")]}, known), [_sha(b"a")])
        for bad in (None, [], [_sha(b"a")] * 2, ["A" * 64], [_sha(b"b")]):
            self.assertRaises(ProtocolError, missing_blobs, {"missing_blobs": bad}, known)


class SaveTests(SynchronousTestCase):
    """ReturnedFile.save and ReturnedFolder.save write new paths only."""

    def test_file(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            target = Path(tmp, "x.bin")
            self.assertEqual(ReturnedFile(b"one").save(target), target)
            self.assertRaises(FileExistsError, ReturnedFile(b"two").save, target)
            ReturnedFile(b"two").save(target, overwrite=True)
            self.assertEqual(target.read_bytes(), b"two")
            os.symlink(target, Path(tmp, "link"))
            self.assertRaises(
                ValueError, ReturnedFile(b"3").save, Path(tmp, "link"), overwrite=True
            )
            self.assertEqual(sorted(os.listdir(tmp)), ["link", "x.bin"])
            self.assertRaises(TypeError, ReturnedFile, "text")

    def test_folder(self) -> None:
        folder = ReturnedFolder({"a/b": ReturnedFile(b"b"), "c": ReturnedFile(b"")}, ("a", "e"))
        with tempfile.TemporaryDirectory() as tmp:
            target = Path(tmp, "out")
            folder.save(target)
            self.assertEqual((target / "a" / "b").read_bytes(), b"b")
            self.assertTrue((target / "e").is_dir())
            self.assertRaises(FileExistsError, folder.save, target)
        self.assertRaises(
            ValueError, ReturnedFolder, {"b": ReturnedFile(b""), "a": ReturnedFile(b"")}
        )
        self.assertRaises(TypeError, ReturnedFolder, {"a": b""})


class ResultTypeTests(SynchronousTestCase):
    def test_getitem(self) -> None:
        result = ProgramResult("COMPLETED", "r", 0, 0, 0, 0, {"k": 1}, "", "", False, False)
        self.assertEqual(result["k"], 1)
        self.assertRaises(KeyError, result.__getitem__, "z")


class ModulePathTests(SynchronousTestCase):
    """The 0.1.1 import paths of the client's names still work."""

    def test_paths(self) -> None:
        import kcoral
        from kcoral.artifacts import ReturnedFile as F
        from kcoral.client import Client, KCoralError, Program, ProgramResult, Register
        from kcoral.client.functions import RemoteExecutionError, RemoteFunction
        from kcoral.client.http import Client as HttpClient
        from kcoral.client.program import Program as P
        from kcoral.client.result import ProgramResult as R
        from kcoral.errors import KCoralError as E
        from kcoral.errors import ProtocolError, TransportError

        self.assertIs(F, kcoral.ReturnedFile)
        self.assertIs(HttpClient, Client)
        self.assertIs(P, Program)
        self.assertIs(R, ProgramResult)
        self.assertIs(E, KCoralError)
        self.assertIs(RemoteFunction, kcoral.RemoteFunction)
        self.assertIs(RemoteExecutionError, kcoral.RemoteExecutionError)
        self.assertIs(Register, kcoral.Register)
        self.assertTrue(issubclass(ProtocolError, Exception))
        self.assertTrue(issubclass(TransportError, Exception))
