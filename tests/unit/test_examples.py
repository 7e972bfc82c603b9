# -*- test-case-name: tests.unit.test_examples -*-
"""
examples/remote_compile.py builds, with L{kcoral.Program}, the programs the
remote-compilation flow sends (protocol §10.2's builtins, a C{language:
"cuda"} module), without contacting a server.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path
from types import ModuleType

import numpy as np
from twisted.trial.unittest import SynchronousTestCase

from kcoral.client.program import program_json
from kcoral.wire.program import BUILTIN_NAMES, parse_program

ROOT = Path(__file__).resolve().parents[2]


def _example() -> ModuleType:
    path = ROOT / "examples" / "remote_compile.py"
    spec = importlib.util.spec_from_file_location("kcoral_example_remote_compile", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class RemoteCompileProgramTests(SynchronousTestCase):
    def test_compile_program(self) -> None:
        """The compile program: a CUDA module, its kernel, compile_cuda_binary for the arch."""
        example = _example()
        program = example.compile_program("sm_90a")
        self.assertEqual(
            program.instructions,
            [
                {
                    "op": "upload",
                    "kind": "module",
                    "language": "cuda",
                    "source": example.SAXPY,
                    "id": "upload_0",
                },
                {
                    "op": "get_function",
                    "id": "get_function_1",
                    "module": {"$ref": "upload_0"},
                    "name": "saxpy",
                },
                {
                    "op": "run",
                    "id": "run_2",
                    "fn": "builtin.compile_cuda_binary",
                    "args": [
                        {"$ref": "get_function_1"},
                        {"arch": "sm_90a", "extra_cuda_cflags": ["-O3"]},
                    ],
                },
                {"op": "return", "key": "image", "value": {"$ref": "run_2"}},
            ],
        )
        self.assertEqual(program.blobs, {})

    def test_run_program(self) -> None:
        """
        The GPU program loads the image as a library, makes a launch handle
        with builtin.kernel, runs it, checks it with builtin.check_close and
        times it with builtin.benchmark; the server's parser accepts it.
        """
        example = _example()
        image = b"\x7fELF not really a cubin"
        x = np.arange(512, dtype=np.float32)
        program = example.run_program(image, x)
        functions = [i["fn"] for i in program.instructions if i["op"] == "run"]
        self.assertEqual(
            functions,
            [
                "builtin.kernel",
                "builtin.zeros",
                {"$ref": "run_1"},
                "builtin.check_close",
                "builtin.benchmark",
            ],
        )
        self.assertIn(hashlib.sha256(image).hexdigest(), program.blobs)
        self.assertIn(hashlib.sha256(x.tobytes()).hexdigest(), program.blobs)
        self.assertEqual(
            [i["key"] for i in program.instructions if i["op"] == "return"],
            ["check", "y", "timing"],
        )
        parse_program(program_json(program), builtin_names=BUILTIN_NAMES)
