# -*- test-case-name: tests.unit.test_client_program -*-
"""
Tests for L{kcoral.client.program}: the builder's wire output, ids,
snapshots and local validation (the 0.1.1 client's behaviour).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import numpy as np
from twisted.trial.unittest import SynchronousTestCase

from kcoral.client.program import Program, Register, execute_options, program_json
from kcoral.wire.program import parse_program


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class WireShapeTests(SynchronousTestCase):
    """Instructions carry the 0.1.1 keys, in its order, with its generated ids."""

    def test_every_instruction(self) -> None:
        p = Program()
        m = p.upload(kind="module", source="def f(*a):\n    return a\n")
        t = p.upload(kind="tensor", value=np.zeros((2, 2), dtype=np.float16))
        b = p.upload(kind="bytes", value=bytearray(b"ab"))
        p.upload(kind="library", value=b"\x7fELF", id="lib")
        fp = p.upload_file(blob=b"text", path="./d//x.txt")
        f = p.get_function(module=m, name="f", cpu_only=True)
        g = p.get_function(module={"$ref": m.id}, name="f")
        r = p.run(fn=f, args=[t, [b], {"$ref": "zz"}, 1.5])
        p.return_(key="r", value=r)
        p.return_file(key="file", path=fp)
        p.return_folder(key="dir", path="d/")
        self.assertEqual(
            [list(i) for i in p.instructions],
            [
                ["op", "kind", "source", "id"],
                ["op", "kind", "blob", "dtype", "shape", "id"],
                ["op", "kind", "blob", "id"],
                ["op", "kind", "blob", "id"],
                ["op", "id", "kind", "blob", "path"],
                ["op", "id", "module", "name", "cpu_only"],
                ["op", "id", "module", "name"],
                ["op", "id", "fn", "args"],
                ["op", "key", "value"],
                ["op", "key", "kind", "path"],
                ["op", "key", "kind", "path"],
            ],
        )
        ids = [i.get("id") for i in p.instructions]
        self.assertEqual(
            ids,
            [
                "upload_0",
                "upload_1",
                "upload_2",
                "lib",
                "upload_3",
                "get_function_4",
                "get_function_5",
                "run_6",
                None,
                None,
                None,
            ],
        )
        self.assertEqual((m, g), (Register("upload_0"), Register("get_function_5")))
        run = p.instructions[7]
        self.assertEqual(
            run["args"], [{"$ref": "upload_1"}, [Register("upload_2")], {"$ref": "zz"}, 1.5]
        )
        self.assertEqual(p.instructions[4]["path"], "d/x.txt")
        self.assertEqual(p.instructions[9]["path"], {"$ref": "upload_3"})
        self.assertEqual(p.instructions[10]["path"], "d")
        self.assertEqual(p.instructions[1]["shape"], [2, 2])
        self.assertEqual(p.instructions[1]["dtype"], "float16")

    def test_program_json_is_valid(self) -> None:
        """The encoded program passes the server's validator; options keep 0.1.1 order."""
        p = Program()
        m = p.upload(kind="module", source="x = 'ü'\ndef f():\n    return x\n")
        p.return_(key="r", value=p.run(fn=p.get_function(module=m, name="f")))
        options = execute_options(1e9, 1, 268435456)
        data = program_json(p, options)
        self.assertIn("ü".encode(), data)
        self.assertNotIn(b": ", data)
        self.assertEqual(
            list(json.loads(data)["options"]),
            ["gpu_count", "timeout_seconds", "output_limit_bytes"],
        )
        parse_program(data)
        self.assertNotIn(b"options", program_json(p, execute_options(None, None, None)))

    def test_explicit_ids(self) -> None:
        p = Program()
        p.upload(kind="module", source="", id="upload_0")
        self.assertEqual(p.upload(kind="module", source="").id, "upload_1")
        self.assertRaises(ValueError, p.upload, kind="module", source="", id="upload_0")
        self.assertRaises(ValueError, p.upload, kind="module", source="", id="")


class SnapshotTests(SynchronousTestCase):
    """Uploads copy their data when called; blobs are kept once per digest."""

    def test_bytes_snapshot(self) -> None:
        data = bytearray(b"abc")
        p = Program()
        p.upload(kind="bytes", value=data)
        data[0] = 0
        self.assertEqual(list(p.blobs.values()), [b"abc"])

    def test_tensor_snapshot_and_dedup(self) -> None:
        array = np.arange(4, dtype=np.int32)
        p = Program()
        p.upload(kind="tensor", value=array)
        p.upload(kind="bytes", value=array.tobytes())
        array[0] = 9
        self.assertEqual(list(p.blobs), [_sha(np.arange(4, dtype=np.int32).tobytes())])

    def test_big_endian_becomes_little(self) -> None:
        array = np.arange(3, dtype=">i4")
        p = Program()
        p.upload(kind="tensor", value=array)
        self.assertEqual(list(p.blobs.values()), [np.arange(3, dtype="<i4").tobytes()])
        self.assertEqual(p.instructions[0]["dtype"], "int32")

    def test_raw_tensor_bytes(self) -> None:
        p = Program()
        p.upload(kind="tensor", value=b"\0" * 8, dtype="bfloat16", shape=[2, 2])
        self.assertRaises(TypeError, p.upload, kind="tensor", value=b"\0" * 8)
        self.assertRaises(
            ValueError, p.upload, kind="tensor", value=b"\0" * 7, dtype="int8", shape=[8]
        )
        self.assertRaises(
            ValueError, p.upload, kind="tensor", value=b"\0" * 2, dtype="uint16", shape=[1]
        )
        self.assertRaises(
            ValueError,
            p.upload,
            kind="tensor",
            value=np.zeros(2, dtype=np.float32),
            dtype="float16",
        )
        self.assertRaises(TypeError, p.upload, kind="tensor", value=object())
        self.assertRaises(ValueError, p.upload, kind="tensor", value=np.zeros(2, dtype=np.uint16))


class ValidationTests(SynchronousTestCase):
    """Local checks raise before the program changes."""

    def test_kinds_and_types(self) -> None:
        p = Program()
        self.assertRaises(ValueError, p.upload, kind="file", value=b"")
        self.assertRaises(TypeError, p.upload, kind="module", source=None)
        self.assertRaises(TypeError, p.upload, kind="module", source="", value=b"")
        self.assertRaises(TypeError, p.upload, kind="bytes", value="text")
        self.assertRaises(TypeError, p.upload, kind="bytes", value=b"", source="")
        self.assertRaises(TypeError, p.upload_file, blob="text", path="a")
        self.assertEqual(p.instructions, [])

    def test_references(self) -> None:
        p = Program()
        self.assertRaises(ValueError, p.get_function, module=Register("nope"), name="f")
        self.assertRaises(TypeError, p.get_function, module="upload_0", name="f")
        m = p.upload(kind="module", source="")
        self.assertRaises(ValueError, p.get_function, module=m, name="")
        self.assertRaises(TypeError, p.get_function, module=m, name="f", cpu_only=1)
        self.assertRaises(TypeError, p.run, fn={"$ref": m.id})
        self.assertRaises(ValueError, p.run, fn=Register("x"))
        self.assertRaises(ValueError, p.return_, key="r", value=Register("x"))
        self.assertRaises(TypeError, p.return_, key="r", value="x")
        p.return_(key="r", value=m)
        self.assertRaises(ValueError, p.return_, key="r", value=m)
        self.assertRaises(ValueError, p.return_, key="", value=m)
        self.assertRaises(ValueError, p.return_file, key="f", path=".")
        self.assertRaises(ValueError, p.return_folder, key="f", path="../x")

    def test_file_conflicts(self) -> None:
        p = Program()
        p.upload_file(blob=b"", path="a")
        self.assertRaises(ValueError, p.upload_file, blob=b"", path="./a")
        self.assertRaises(ValueError, p.upload_file, blob=b"", path="a/b")
        self.assertRaises(ValueError, p.upload_file, blob=b"", path="/abs")
        self.assertEqual(len(p.instructions), 1)


class FolderTests(SynchronousTestCase):
    """upload_folder: sorted file uploads, hidden files, no links."""

    def test_folder(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp, "assets")
            (root / "sub" / "empty").mkdir(parents=True)
            (root / "b.bin").write_bytes(b"b")
            (root / ".hidden").write_bytes(b"h")
            (root / "sub" / "a.txt").write_bytes(b"b")
            p = Program()
            p.upload_folder(root, path="inputs")
            self.assertEqual(
                [(i["path"], i["id"]) for i in p.instructions],
                [
                    ("inputs/.hidden", "upload_0"),
                    ("inputs/b.bin", "upload_1"),
                    ("inputs/sub/a.txt", "upload_2"),
                ],
            )
            self.assertEqual(list(p.instructions[0]), ["op", "kind", "blob", "path", "id"])
            self.assertEqual(len(p.blobs), 2)
            self.assertRaises(ValueError, p.upload_folder, root, path="inputs/b.bin")
            os.symlink(root / "b.bin", root / "link")
            q = Program()
            self.assertRaises(ValueError, q.upload_folder, root, path="x")
            self.assertEqual(q.instructions, [])


class RemoteCompilationTests(SynchronousTestCase):
    """
    The additions to the 0.1.1 API for the remote-compilation flow: a module
    C{language} and server builtins named as C{run}'s C{fn}.
    """

    def test_cuda_module(self) -> None:
        """language="cuda" is written on the module upload; python is accepted too."""
        p = Program()
        p.upload(kind="module", language="cuda", source="__global__ void k() {}")
        p.upload(kind="module", language="python", source="x = 1\n")
        self.assertEqual(
            p.instructions,
            [
                {
                    "op": "upload",
                    "kind": "module",
                    "language": "cuda",
                    "source": "__global__ void k() {}",
                    "id": "upload_0",
                },
                {
                    "op": "upload",
                    "kind": "module",
                    "language": "python",
                    "source": "x = 1\n",
                    "id": "upload_1",
                },
            ],
        )

    def test_no_language_is_the_0_1_1_instruction(self) -> None:
        """Without language the module upload keeps 0.1.1's keys, in its order."""
        p = Program()
        p.upload(kind="module", source="x = 1\n")
        self.assertEqual(
            list(p.instructions[0].items()),
            [("op", "upload"), ("kind", "module"), ("source", "x = 1\n"), ("id", "upload_0")],
        )

    def test_bad_language(self) -> None:
        """An unknown language, or a language on another kind, is refused locally."""
        p = Program()
        with self.assertRaises(ValueError):
            p.upload(kind="module", language="fortran", source="")
        with self.assertRaises(TypeError):
            p.upload(kind="bytes", language="cuda", value=b"")
        self.assertEqual(p.instructions, [])

    def test_builtin_function(self) -> None:
        """run(fn="builtin.<name>") sends the name as the wire's string fn."""
        p = Program()
        source = p.upload(kind="module", language="cuda", source="__global__ void k() {}")
        kernel = p.get_function(module=source, name="k")
        image = p.run(fn="builtin.compile_cuda_binary", args=[kernel, {"arch": "sm_90a"}])
        self.assertEqual(
            p.instructions[-1],
            {
                "op": "run",
                "id": image.id,
                "fn": "builtin.compile_cuda_binary",
                "args": [{"$ref": kernel.id}, {"arch": "sm_90a"}],
            },
        )

    def test_bad_function_names(self) -> None:
        """A string fn must be builtin.<identifier>; anything else is refused locally."""
        p = Program()
        for name in ("compile_cuda", "builtin.", "builtin.a-b", "builtin.x y", "$ref"):
            with self.assertRaises(ValueError):
                p.run(fn=name)
        with self.assertRaises(TypeError):
            p.run(fn={"$ref": "x"})  # type: ignore[arg-type]
        self.assertEqual(p.instructions, [])
