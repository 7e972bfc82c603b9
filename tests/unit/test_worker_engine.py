# -*- test-case-name: tests.unit.test_worker_engine -*-
"""
Tests for L{kcoral.worker.engine}: protocol §6 semantics on the CPU backend.

Each test runs the engine in this process against a temporary workspace, a
recording lease and an in-memory sink for the messages it emits.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import textwrap
from typing import Any

import attrs
import numpy
import psutil
import pytest

from kcoral.errors import ExecutionError
from kcoral.ipc import shared
from kcoral.testing.fakes import RecordingLease
from kcoral.wire.channel import ChannelMessage, Execute, Instruction, Outcome, Returned, encode
from kcoral.worker.builtins import cpu_builtins
from kcoral.worker.devices import CpuBackend, make_backend
from kcoral.worker.engine import Engine
from kcoral.worker.lease import NullLease


@attrs.define(slots=False)
class Harness:
    """Runs programs on one engine with a fresh workspace each time."""

    root: Any
    lease: RecordingLease = attrs.field(factory=RecordingLease)
    sent: list[ChannelMessage] = attrs.field(factory=list)
    blobs: dict[str, bytes] = attrs.field(factory=dict)
    count: int = 0

    def __attrs_post_init__(self) -> None:
        self.engine = Engine(CpuBackend(), self.lease, cpu_builtins(), send=self.sent.append)

    def blob(self, data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        self.blobs[digest] = data
        return digest

    def run(
        self,
        instructions: list[dict[str, Any]],
        *,
        retiring: bool = False,
        settle: bool = True,
        **kwargs: Any,
    ) -> Outcome:
        """
        Run a program in a new workspace; then, with C{settle}, put host
        state back as the worker does once the outcome is sent.
        """
        self.count += 1
        workspace = self.root / f"ws{self.count}"
        workspace.mkdir()
        self.workspace = str(workspace)
        program = json.dumps({"instructions": instructions})
        outcome = self.engine.run(
            Execute(program, str(workspace), **kwargs), dict(self.blobs), retiring=retiring
        )
        if settle:
            self.engine.settle()
        return outcome


@pytest.fixture
def harness(tmp_path: Any) -> Harness:
    return Harness(tmp_path)


def module(id: str, source: str) -> dict[str, Any]:
    return {"op": "upload", "kind": "module", "id": id, "source": textwrap.dedent(source)}


def get(id: str, mod: str, name: str, **kw: Any) -> dict[str, Any]:
    return {"op": "get_function", "id": id, "module": {"$ref": mod}, "name": name, **kw}


def run(id: str, fn: str, *args: Any) -> dict[str, Any]:
    return {"op": "run", "id": id, "fn": {"$ref": fn}, "args": list(args)}


def ret(key: str, ref: str) -> dict[str, Any]:
    return {"op": "return", "key": key, "value": {"$ref": ref}}


def ref(id: str) -> dict[str, str]:
    return {"$ref": id}


def decode(outcome: Outcome, node: dict[str, Any]) -> Any:
    """Decode a value tree node against the outcome's parts (a small client)."""
    kind = node["type"]
    if kind == "null":
        return None
    if kind in ("boolean", "integer", "number", "string"):
        return node["value"]
    if kind == "array":
        return [decode(outcome, n) for n in node["value"]]
    if kind == "object":
        return {k: decode(outcome, n) for k, n in node["value"].items()}
    if kind in ("bytes", "file", "tensor"):
        data = outcome.parts[int(node["part"].split(":")[1])]
        assert hashlib.sha256(data).hexdigest() == node["sha256"]
        if kind == "tensor":
            return numpy.frombuffer(data, dtype=node["dtype"]).reshape(node["shape"])
        return data
    if kind == "folder":
        return {
            "files": {k: decode(outcome, n) for k, n in node["files"].items()},
            "directories": node["directories"],
        }
    raise AssertionError(kind)


def values(outcome: Outcome) -> dict[str, Any]:
    return {key: decode(outcome, node) for key, node in outcome.results.items()}


def error(outcome: Outcome) -> tuple[str, str, int]:
    assert outcome.status == "FAILED", outcome
    assert outcome.error is not None
    return outcome.error["kind"], outcome.error["message"], outcome.error["instruction_index"]


ADD = module("m", "def add(a, b):\n    return a + b\n")
#: The same module with top-level code of its own (a call): its import may
#: touch the device, so it is placed on the lease (ADD's is inert).
ACTIVE_ADD = module("m", "import os\nPID = os.getpid()\ndef add(a, b):\n    return a + b\n")


# -- modules and functions ------------------------------------------------


def test_completed_program(harness: Harness) -> None:
    """A module, a function, a run and a return complete with the value."""
    outcome = harness.run([ADD, get("f", "m", "add"), run("r", "f", 2, 3), ret("out", "r")])
    assert outcome.status == "COMPLETED"
    assert outcome.error is None
    assert outcome.results == {"out": {"type": "integer", "value": 5}}
    assert harness.sent == [Instruction(i) for i in range(4)]
    assert outcome.retire is None


def test_syntax_error_is_parse(harness: Harness) -> None:
    """A module that does not compile fails with C{parse} "syntax error: ..."."""
    kind, message, index = error(harness.run([module("m", "def f(:\n")]))
    assert (kind, index) == ("parse", 0)
    assert message.startswith("syntax error: ")


def test_import_time_exception_is_parse(harness: Harness) -> None:
    """An exception at import time fails the upload with C{parse} "{Type}: {msg}"."""
    outcome = harness.run([module("m", "raise KeyError('nope')\n")])
    assert error(outcome) == ("parse", "KeyError: 'nope'", 0)
    assert "<uploaded:" in outcome.error["traceback"]


def test_missing_name_is_parse(harness: Harness) -> None:
    """get_function of a name the module lacks fails with C{parse}."""
    outcome = harness.run([ADD, get("f", "m", "sub")])
    assert error(outcome) == ("parse", "the uploaded Python module defines no name 'sub'", 1)
    assert outcome.error["instruction_op"] == "get_function"
    assert outcome.error["instruction_id"] == "f"


def test_get_function_on_non_module(harness: Harness) -> None:
    """get_function on a bytes handle is C{unavailable} on CPU."""
    digest = harness.blob(b"x")
    outcome = harness.run(
        [{"op": "upload", "kind": "bytes", "id": "b", "blob": digest}, get("f", "b", "x")]
    )
    assert error(outcome) == ("unavailable", "get_function expects an uploaded Python module", 1)


def test_not_callable_is_runtime(harness: Harness) -> None:
    """Running a non-callable handle fails with C{runtime}."""
    outcome = harness.run([module("m", "x = 3\n"), get("x", "m", "x"), run("r", "x")])
    assert error(outcome) == ("runtime", "handle 'x' is not callable", 2)


def test_value_error_is_engine(harness: Harness) -> None:
    """An ordinary exception from user code is C{engine} "{Type}: {msg}" with a traceback."""
    outcome = harness.run(
        [module("m", "def f():\n    raise ValueError('boom')\n"), get("f", "m", "f"), run("r", "f")]
    )
    assert error(outcome) == ("engine", "ValueError: boom", 2)
    tb = outcome.error["traceback"]
    assert tb.startswith("Traceback (most recent call last):")
    assert "ValueError: boom" in tb
    assert "engine.py" not in tb


def test_execution_error_keeps_kind(harness: Harness) -> None:
    """An C{ExecutionError} raised by user code keeps its kind and message."""
    source = """
    from kcoral.errors import ExecutionError
    def f():
        raise ExecutionError("correctness", "outputs differ")
    def g():
        raise ExecutionError("strange", "odd kind")
    """
    outcome = harness.run([module("m", source), get("f", "m", "f"), run("r", "f")])
    assert error(outcome) == ("correctness", "outputs differ", 2)
    outcome = harness.run([module("m", source), get("g", "m", "g"), run("r", "g")])
    assert error(outcome)[0] == "engine"


def test_builtins_importable_and_unavailable_on_cpu(harness: Harness) -> None:
    """Uploaded code imports kcoral.builtins; on CPU its helpers are C{unavailable}."""
    source = """
    import kcoral.builtin
    from kcoral.builtins import zeros, compile_tirx
    def f():
        return zeros({"shape": [4]})
    def g():
        return compile_tirx(None)
    """
    outcome = harness.run([module("m", source), get("f", "m", "f"), run("r", "f")])
    assert error(outcome) == ("unavailable", "builtin.zeros is unavailable in CPU mode", 2)
    outcome = harness.run([module("m", source), get("g", "m", "g"), run("r", "g")])
    assert error(outcome)[0] == "unavailable"


def test_legacy_builtin_names(harness: Harness) -> None:
    """
    A string C{fn} names a builtin; a legacy name missing from the worker's
    table fails with C{runtime}.
    """
    outcome = harness.run([{"op": "run", "id": "z", "fn": "builtin.zeros", "args": [{}]}])
    assert error(outcome) == ("unavailable", "builtin.zeros is unavailable in CPU mode", 0)
    harness.engine.builtins.pop("builtin.zeros")
    outcome = harness.run([{"op": "run", "id": "z", "fn": "builtin.zeros", "args": []}])
    assert error(outcome) == ("runtime", "unknown function: 'builtin.zeros'", 0)


def test_cuda_module_and_compile_cuda_binary_without_compiler(harness: Harness) -> None:
    """A CUDA module binds its source; get_function checks the name."""
    cuda = {
        "op": "upload",
        "kind": "module",
        "id": "cu",
        "language": "cuda",
        "source": "__global__ void k() {}",
    }
    outcome = harness.run([cuda, get("main", "cu", "main")])
    assert error(outcome)[0::2] == ("parse", 1)
    outcome = harness.run([cuda, get("k", "cu", "1k")])
    assert error(outcome)[0::2] == ("parse", 1)
    outcome = harness.run(
        [
            cuda,
            get("k", "cu", "k"),
            {"op": "run", "id": "b", "fn": "builtin.compile_cuda_binary", "args": [ref("k"), {}]},
        ]
    )
    assert error(outcome) == ("parse", "compile_cuda_binary: 'arch' must be a string", 2)


# -- uploads --------------------------------------------------------------


def test_bytes_uploads(harness: Harness) -> None:
    """Bytes uploads bind bytes, including the empty blob."""
    full, empty = harness.blob(b"abc"), harness.blob(b"")
    outcome = harness.run(
        [
            {"op": "upload", "kind": "bytes", "id": "a", "blob": full},
            {"op": "upload", "kind": "bytes", "id": "e", "blob": empty},
            module("m", "def f(a, e):\n    return [type(a).__name__, len(a), e]\n"),
            get("f", "m", "f"),
            run("r", "f", ref("a"), ref("e")),
            ret("r", "r"),
        ]
    )
    assert values(outcome) == {"r": ["bytes", 3, b""]}


def test_tensor_and_library_uploads_unavailable(harness: Harness) -> None:
    """Tensor and library uploads fail with C{unavailable} on CPU."""
    digest = harness.blob(b"\0" * 8)
    outcome = harness.run(
        [
            {
                "op": "upload",
                "kind": "tensor",
                "id": "t",
                "blob": digest,
                "dtype": "float32",
                "shape": [2],
            }
        ]
    )
    assert error(outcome) == ("unavailable", "tensor uploads require a GPU worker", 0)
    outcome = harness.run([{"op": "upload", "kind": "library", "id": "l", "blob": digest}])
    assert error(outcome) == ("unavailable", "library uploads require a GPU worker", 0)


def test_file_upload(harness: Harness) -> None:
    """A file upload creates the file (0600) and parents (0700) and binds the path."""
    digest = harness.blob(b"data")
    outcome = harness.run(
        [
            {"op": "upload", "kind": "file", "id": "p", "blob": digest, "path": "./a//b/c.txt"},
            module("m", "def f(p):\n    return [p, open(p).read()]\n"),
            get("f", "m", "f"),
            run("r", "f", ref("p")),
            ret("r", "r"),
        ]
    )
    assert values(outcome) == {"r": ["a/b/c.txt", "data"]}
    ws = harness.workspace
    assert os.stat(os.path.join(ws, "a/b/c.txt")).st_mode & 0o777 == 0o600
    assert os.stat(os.path.join(ws, "a")).st_mode & 0o777 == 0o700


def test_file_upload_over_existing_path(harness: Harness) -> None:
    """Uploading to a path that user code already created fails with C{runtime}."""
    digest = harness.blob(b"data")
    outcome = harness.run(
        [
            module("m", "open('x.txt', 'w').close()\n"),
            {"op": "upload", "kind": "file", "id": "p", "blob": digest, "path": "x.txt"},
        ]
    )
    kind, message, index = error(outcome)
    assert (kind, index) == ("runtime", 1)
    assert message.startswith("cannot materialize file 'x.txt': FileExistsError: ")


def test_file_upload_through_symlink(harness: Harness, tmp_path: Any) -> None:
    """A symlinked parent directory is never followed."""
    digest = harness.blob(b"data")
    outside = tmp_path / "outside"
    outside.mkdir()
    source = f"import os\nos.symlink({str(outside)!r}, 'd')\n"
    outcome = harness.run(
        [
            module("m", source),
            {"op": "upload", "kind": "file", "id": "p", "blob": digest, "path": "d/x"},
        ]
    )
    assert error(outcome)[0::2] == ("runtime", 1)
    assert list(outside.iterdir()) == []


def test_reserved_directory(harness: Harness) -> None:
    """A file upload into the reserved top-level directory fails with C{runtime}."""
    digest = harness.blob(b"data")
    outcome = harness.run(
        [{"op": "upload", "kind": "file", "id": "p", "blob": digest, "path": ".kcoral/x"}],
        reserved=".kcoral",
    )
    assert error(outcome) == ("runtime", "'.kcoral' is reserved for sandbox runtime files", 0)


# -- runs -----------------------------------------------------------------


def test_arguments(harness: Harness) -> None:
    """Top-level refs resolve; nested refs stay dicts; function handles are arguments."""
    source = """
    def double(x):
        return 2 * x
    def apply(fn, value, nested):
        return [fn(value), nested]
    def make(n):
        return lambda x: x + n
    """
    outcome = harness.run(
        [
            module("m", source),
            get("double", "m", "double"),
            get("apply", "m", "apply"),
            get("make", "m", "make"),
            run("r", "apply", ref("double"), 21, [ref("double"), {"k": ref("x")}]),
            run("adder", "make", 10),
            run("s", "adder", 5),
            ret("r", "r"),
            ret("s", "s"),
        ]
    )
    assert values(outcome) == {
        "r": [42, [{"$ref": "double"}, {"k": {"$ref": "x"}}]],
        "s": 15,
    }


# -- value returns --------------------------------------------------------


def test_value_snapshot_and_order(harness: Harness) -> None:
    """Returns encode the value when they run, keep key order and number parts."""
    source = """
    state = {"b": b"one"}
    def get():
        return state
    def change():
        state["b"] = b"two"
        state["n"] = 1.5
    """
    outcome = harness.run(
        [
            module("m", source),
            get("g", "m", "get"),
            get("c", "m", "change"),
            run("s", "g"),
            ret("z_first", "s"),
            run("x", "c"),
            ret("a_second", "s"),
        ]
    )
    assert list(outcome.results) == ["z_first", "a_second"]
    assert values(outcome) == {
        "z_first": {"b": b"one"},
        "a_second": {"b": b"two", "n": 1.5},
    }
    assert outcome.results["a_second"]["value"]["b"]["part"] == "return:1"


def test_encodings(harness: Harness) -> None:
    """Every supported Python type has its protocol §7.1 encoding; numpy arrays are tensors."""
    source = """
    import numpy
    def f():
        return [None, True, 7, 2.5, "s", bytearray(b"b"), (1,), {"k": None},
                numpy.arange(6, dtype=numpy.int16).reshape(2, 3)]
    """
    outcome = harness.run([module("m", source), get("f", "m", "f"), run("r", "f"), ret("r", "r")])
    nodes = outcome.results["r"]["value"]
    assert [n["type"] for n in nodes] == [
        "null",
        "boolean",
        "integer",
        "number",
        "string",
        "bytes",
        "array",
        "object",
        "tensor",
    ]
    assert nodes[8]["dtype"] == "int16"
    assert nodes[8]["shape"] == [2, 3]
    decoded = values(outcome)["r"]
    assert decoded[8].tolist() == [[0, 1, 2], [3, 4, 5]]


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("float('nan')", "cannot return a non-finite number"),
        ("[b'x', float('inf')]", "cannot return a non-finite number"),
        ("{1: 2}", "returned objects must have string keys"),
        ("object()", "cannot return value of type object"),
        ("numpy.zeros(2, dtype=numpy.complex64)", "cannot return tensor dtype complex64"),
    ],
)
def test_serialization_failures(harness: Harness, expression: str, message: str) -> None:
    """Values that cannot be encoded fail with C{serialization} and register no parts."""
    source = f"import numpy\ndef f():\n    return {expression}\n"
    outcome = harness.run([module("m", source), get("f", "m", "f"), run("r", "f"), ret("r", "r")])
    assert error(outcome) == ("serialization", message, 3)
    assert outcome.parts == ()
    assert outcome.error["instruction_id"] is None
    assert outcome.error["instruction_op"] == "return"


def test_partial_results(harness: Harness) -> None:
    """Returns completed before a failure survive; later instructions do not run."""
    source = "def ok():\n    return b'kept'\ndef bad():\n    raise RuntimeError('x')\n"
    outcome = harness.run(
        [
            module("m", source),
            get("ok", "m", "ok"),
            get("bad", "m", "bad"),
            run("a", "ok"),
            ret("a", "a"),
            run("b", "bad"),
            ret("b", "a"),
        ]
    )
    assert error(outcome) == ("engine", "RuntimeError: x", 5)
    assert values(outcome) == {"a": b"kept"}
    assert len(outcome.parts) == 1
    assert harness.sent == [Instruction(i) for i in range(6)]


# -- file and folder returns ----------------------------------------------


FILES = """
import os
os.makedirs("out/e", exist_ok=True)
os.makedirs("out/empty/inner")
with open("out/x.txt", "w") as f:
    f.write("x")
with open("out/e/.hidden", "w") as f:
    f.write("hidden")
os.chdir("out")
"""


def test_file_and_folder_returns(harness: Harness) -> None:
    """Folder returns list files (hidden too) and every directory, even after chdir."""
    outcome = harness.run(
        [
            module("m", FILES),
            {"op": "return", "key": "f", "kind": "file", "path": "out/x.txt"},
            {"op": "return", "key": "d", "kind": "folder", "path": "out"},
        ]
    )
    assert outcome.status == "COMPLETED", outcome.error
    assert outcome.results["f"]["size"] == 1
    folder = outcome.results["d"]
    assert folder["type"] == "folder"
    assert list(folder["files"]) == ["e/.hidden", "x.txt"]
    assert folder["directories"] == ["e", "empty", "empty/inner"]
    assert [n["part"] for n in folder["files"].values()] == ["return:1", "return:2"]
    assert values(outcome)["d"]["files"] == {"e/.hidden": b"hidden", "x.txt": b"x"}


def test_return_path_from_handle(harness: Harness) -> None:
    """A file return may take its path from a string handle; other types fail."""
    digest = harness.blob(b"abc")
    outcome = harness.run(
        [
            {"op": "upload", "kind": "file", "id": "p", "blob": digest, "path": "dir/a"},
            {"op": "return", "key": "f", "kind": "file", "path": {"$ref": "p"}},
            {"op": "return", "key": "g", "kind": "folder", "path": {"$ref": "p"}},
        ]
    )
    assert values(outcome)["f"] == b"abc"
    kind, message, index = error(outcome)
    assert (kind, index) == ("serialization", 2)
    assert message.startswith("cannot return folder: ")


@pytest.mark.parametrize(
    ("setup", "kind", "path"),
    [
        ("os.makedirs('out'); os.symlink('/etc', 'out/link')", "folder", "out"),
        ("os.symlink('/etc/hostname', 'link')", "file", "link"),
        ("os.makedirs('out'); os.mkfifo('out/fifo')", "folder", "out"),
        ("", "file", "missing"),
        ("os.makedirs('d')", "file", "d"),
    ],
)
def test_file_return_failures(harness: Harness, setup: str, kind: str, path: str) -> None:
    """Symlinks, special files, missing paths and wrong kinds fail with C{serialization}."""
    outcome = harness.run(
        [
            module("m", f"import os\n{setup}\n"),
            {"op": "return", "key": "r", "kind": kind, "path": path},
        ]
    )
    kind_, message, index = error(outcome)
    assert (kind_, index) == ("serialization", 1)
    assert message.startswith(f"cannot return {kind}: ")
    assert outcome.parts == ()


def test_file_return_budget(harness: Harness) -> None:
    """File contents may not exceed max_response_bytes minus registered parts."""
    source = "open('f', 'wb').write(b'x' * 10)\ndef f():\n    return b'12345'\n"
    outcome = harness.run(
        [
            module("m", source),
            get("f", "m", "f"),
            run("b", "f"),
            ret("b", "b"),
            {"op": "return", "key": "r", "kind": "file", "path": "f"},
        ],
        max_response_bytes=14,
    )
    assert error(outcome) == (
        "serialization",
        "cannot return file: SerializationError: file return exceeds max_response_bytes binary budget",
        4,
    )
    assert values(outcome) == {"b": b"12345"}


# -- lease placement --------------------------------------------------------


def test_lease_placement(harness: Harness) -> None:
    """
    Leases follow spec/server.md §4.3 narrowed to GPU work: instructions
    that need no device (a name from a module, a cpu_only run, a host value's
    return) take no lease, and a program that ends off the lease is cleaned
    up without a second hold.
    """
    digest = harness.blob(b"x")
    harness.run(
        [
            {"op": "upload", "kind": "bytes", "id": "b", "blob": digest},  # unchanged
            ACTIVE_ADD,  # acquire
            {"op": "upload", "kind": "file", "id": "p", "blob": digest, "path": "p"},  # release
            get("f", "m", "add", cpu_only=True),  # a dictionary lookup: unchanged
            run("r", "f", 1, 2),  # cpu_only: release (not held)
            ret("r", "r"),  # a host value: unchanged
            {"op": "return", "key": "p", "kind": "file", "path": "p"},  # release (not held)
        ]
    )
    assert harness.lease.events == ["acquire", "release"]


@attrs.define
class _OrderedLease(RecordingLease):
    """Records lease changes, drains and instruction starts in one list."""

    def drained(self) -> None:
        self.events.append("drain")


def _ordered(harness: Harness) -> _OrderedLease:
    lease = _OrderedLease()
    harness.lease = lease

    class Backend(CpuBackend):
        def drain(self) -> None:
            lease.drained()

    backend = Backend()
    harness.engine = Engine(
        backend,
        lease,
        cpu_builtins(),
        send=lambda m: lease.events.append(f"#{m.index}") if isinstance(m, Instruction) else None,
    )
    return lease


def test_last_gpu_instruction_ends_the_hold(harness: Harness) -> None:
    """
    After the last instruction that needs the GPU, the drain and the release
    come before the host value is returned; cleanup takes no second hold.
    """
    lease = _ordered(harness)
    outcome = harness.run([ACTIVE_ADD, get("f", "m", "add"), run("r", "f", 2, 3), ret("out", "r")])
    assert outcome.status == "COMPLETED", outcome.error
    assert lease.events == ["#0", "acquire", "#1", "#2", "#3", "drain", "release"]
    assert not lease.held


def test_hold_kept_for_a_later_gpu_instruction(harness: Harness) -> None:
    """A host return between two GPU runs does not give the lease back and take it again."""
    lease = _ordered(harness)
    outcome = harness.run(
        [ACTIVE_ADD, get("f", "m", "add"), run("r", "f", 2, 3), ret("a", "r"), run("s", "f", 1, 1)]
    )
    assert outcome.status == "COMPLETED", outcome.error
    # Cleanup runs under the hold the last run left, then the reused worker releases.
    assert lease.events == ["#0", "acquire", "#1", "#2", "#3", "#4", "release"]


def test_device_value_returned_under_the_lease(harness: Harness) -> None:
    """A value that may live on the device (not a host value) is returned under the lease."""
    lease = _ordered(harness)
    # Top-level code of its own (a call): the import takes the lease.
    source = "import os\nos.getpid()\nclass T:\n    pass\ndef make():\n    return T()\n"
    outcome = harness.run(
        [
            module("m", source),
            get("f", "m", "make", cpu_only=True),  # no GPU work follows for sure: drain, release
            run("r", "f"),  # cpu_only
            ret("out", "r"),  # not a host value: acquire
        ]
    )
    assert outcome.status == "FAILED"  # a CPU server cannot encode it
    assert lease.events == [
        "#0",
        "acquire",
        "#1",
        "drain",
        "release",
        "#2",
        "#3",
        "acquire",
        "drain",
        "release",
    ]


def test_retiring_after_an_unleased_end_takes_no_lease(harness: Harness) -> None:
    """
    A retiring worker whose program ended off the lease answers without
    taking it: its context is torn down later under the maintenance lease
    the parent takes (WorkerProcess.retire).
    """
    workspace = harness.root / "solo-off"
    workspace.mkdir()
    digest = harness.blob(b"x")
    program = json.dumps(
        {
            "instructions": [
                ADD,
                {"op": "upload", "kind": "file", "id": "p", "blob": digest, "path": "p"},
            ]
        }
    )
    outcome = harness.engine.run(
        Execute(program, str(workspace)), dict(harness.blobs), retiring=True
    )
    assert outcome.retire == "request_limit"
    assert not harness.lease.held


def test_retiring_keeps_lease(harness: Harness) -> None:
    """A retiring worker keeps the lease it holds and reports C{request_limit}."""
    workspace = harness.root / "solo"
    workspace.mkdir()
    program = json.dumps({"instructions": [ACTIVE_ADD]})
    outcome = harness.engine.run(Execute(program, str(workspace)), retiring=True)
    assert outcome.retire == "request_limit"
    assert harness.lease.held


# -- reuse ------------------------------------------------------------------


def test_instructions_posted_on_the_board_unless_announced(harness: Harness) -> None:
    """
    With a progress board, each instruction's index is posted there and no
    Instruction message is sent, except for a cpu_only run (the parent
    needs its start time) or when the Execute asks for announcements.
    """
    posted: list[int] = []
    harness.engine.progress = posted.append
    program = [ACTIVE_ADD, get("f", "m", "add", cpu_only=True), run("r", "f", 1, 2), ret("o", "r")]
    outcome = harness.run(program, announce=False)
    assert outcome.status == "COMPLETED", outcome.error
    assert posted == [0, 1, 3]
    assert [m.index for m in harness.sent if isinstance(m, Instruction)] == [2]
    posted.clear()
    harness.sent.clear()
    harness.run(program, announce=True)
    assert posted == []
    assert [m.index for m in harness.sent if isinstance(m, Instruction)] == [0, 1, 2, 3]


def test_reuse_restores_process_state(harness: Harness) -> None:
    """The environment and sys.path are restored; workspace modules are unloaded."""
    source = """
    import os, sys
    os.environ["KCORAL_TEST_ADDED"] = "1"
    sys.path.insert(0, os.getcwd())
    open("kcoral_ws_mod.py", "w").write("X = 1\\n")
    import kcoral_ws_mod
    """
    before = dict(os.environ)
    path = list(sys.path)
    outcome = harness.run([module("m", source)])
    assert outcome.status == "COMPLETED", outcome.error
    assert outcome.retire is None
    assert dict(os.environ) == before
    assert sys.path == path
    assert "kcoral_ws_mod" not in sys.modules


def test_reuse_puts_back_the_module_table(harness: Harness) -> None:
    """
    A module the worker had is put back when a program replaced or removed
    it; a library a program imported stays, the same object, run after run.
    """
    import colorsys  # noqa: F401  (the worker's own: in the baseline)
    import json as original_json

    harness.run([ADD])  # the baseline is the module table before the first program
    source = """
    import sys, types, wave
    sys.modules["json"] = types.ModuleType("json")
    del sys.modules["colorsys"]
    sys.modules["kcoral_blocked_import"] = None
    """
    outcome = harness.run([module("m", source)])
    assert outcome.status == "COMPLETED", outcome.error
    assert sys.modules["json"] is original_json
    assert "colorsys" in sys.modules
    assert "kcoral_blocked_import" not in sys.modules
    kept = sys.modules["wave"]
    assert harness.run([module("m", "import wave\n")]).status == "COMPLETED"
    assert sys.modules["wave"] is kept


def test_reuse_puts_back_the_builtins(harness: Harness) -> None:
    """
    Builtins a program replaced, added or deleted are as the first program
    found them for the next one (a replaced import function included).
    """
    import builtins

    original_print, original_import = builtins.print, builtins.__import__
    original_callable = builtins.callable
    harness.run([ADD])
    source = """
    import builtins
    builtins.print = lambda *a, **k: None
    builtins.kcoral_leaked = "from the last program"
    original = builtins.__import__
    builtins.__import__ = lambda *a, **k: original(*a, **k)
    del builtins.callable
    """
    try:
        outcome = harness.run([module("m", source)])
        harness.engine.settle()
        assert outcome.status == "COMPLETED", outcome.error
        assert builtins.print is original_print
        assert builtins.__import__ is original_import
        assert not hasattr(builtins, "kcoral_leaked")
        assert builtins.callable(len)
    finally:
        builtins.print, builtins.__import__ = original_print, original_import
        builtins.__dict__.pop("kcoral_leaked", None)
        builtins.__dict__.setdefault("callable", original_callable)


def test_reuse_drops_the_workspace_path_finders(harness: Harness) -> None:
    """
    After a program imported from its workspace, no path finder of a
    directory there is left (the next program's files are read afresh).
    """
    source = """
    import os, sys
    sys.path.insert(0, os.getcwd())
    os.mkdir("pkg_in_ws")
    open("pkg_in_ws/__init__.py", "w").write("")
    open("pkg_in_ws/inner.py", "w").write("Y = 2\\n")
    import pkg_in_ws.inner
    """
    outcome = harness.run([module("m", source)])
    assert outcome.status == "COMPLETED", outcome.error
    root = os.path.realpath(harness.workspace)
    left = [k for k in sys.path_importer_cache if os.path.realpath(k).startswith(root)]
    assert left == []
    assert "pkg_in_ws" not in sys.modules and "pkg_in_ws.inner" not in sys.modules


def test_first_settle_freezes_what_survives(harness: Harness) -> None:
    """
    With C{freeze_after_first_settle} (a worker's engine), what outlives the
    first program's settle is frozen, once; later settles freeze nothing.
    """
    import gc

    harness.engine.freeze_after_first_settle = True
    try:
        before = gc.get_freeze_count()
        harness.run([module("m", "import wave\n")])
        after_first = gc.get_freeze_count()
        assert after_first > before
        # The library the program imported is kept and frozen with the rest.
        assert all(o is not sys.modules["wave"] for o in gc.get_objects())
        harness.run([module("m", "import wave, tabnanny\n")])
        # Nothing more is frozen (frozen objects may still be freed, so the
        # count can drop): a library the second program imported stays with
        # the collector.
        assert gc.get_freeze_count() <= after_first
        assert any(o is sys.modules["tabnanny"] for o in gc.get_objects())
    finally:
        # (This test process's objects go back to its collector.)
        gc.unfreeze()


def test_host_state_is_put_back_after_the_answer(harness: Harness) -> None:
    """
    The restore waits for L{Engine.settle} (the worker sends the outcome
    first), and the next run settles first if nobody did.
    """
    source = 'import os\nos.environ["KCORAL_TEST_UNSETTLED"] = "1"\n'
    outcome = harness.run([module("m", source)], settle=False)
    assert outcome.status == "COMPLETED", outcome.error
    assert os.environ.get("KCORAL_TEST_UNSETTLED") == "1"
    second = harness.run([ADD])
    assert second.status == "COMPLETED", second.error
    assert "KCORAL_TEST_UNSETTLED" not in os.environ


def test_reuse_leftover_thread_retires(harness: Harness) -> None:
    """A thread left running makes the worker retire with C{request_limit}."""
    source = """
    import threading
    stop = threading.Event()
    threading.Thread(target=stop.wait, daemon=True).start()
    def finish():
        stop.set()
    """
    outcome = harness.run([module("m", source)])
    assert outcome.retire == "request_limit"
    # The GPU went back when the device was clean; the thread is frozen and
    # the context torn down by the parent (WorkerProcess.retire).
    assert not harness.lease.held


def test_reuse_leftover_child_retires(harness: Harness) -> None:
    """A child process left running makes the worker retire."""
    source = """
    import subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    """
    outcome = harness.run([module("m", source)])
    assert outcome.retire == "request_limit"
    for child in psutil.Process().children():
        child.kill()
        child.wait()


def test_reuse_leftover_open_file_retires(harness: Harness) -> None:
    """A file under the workspace left open makes the worker retire."""
    source = "import builtins\nbuiltins._kcoral_test_file = open('held', 'w')\n"
    try:
        outcome = harness.run([module("m", source)])
        assert outcome.retire == "request_limit"
    finally:
        import builtins

        builtins._kcoral_test_file.close()  # type: ignore[attr-defined]
        del builtins._kcoral_test_file  # type: ignore[attr-defined]


# -- capture ------------------------------------------------------------------


def test_capture_includes_subprocess_output(harness: Harness) -> None:
    """Output of Python code and of subprocesses is captured per stream."""
    source = """
    import subprocess, sys
    print("from python")
    print("to stderr", file=sys.stderr)
    subprocess.run([sys.executable, "-c", "print('from child')"], check=True)
    """
    outcome = harness.run([module("m", source)])
    assert outcome.stdout == "from python\nfrom child\n"
    assert outcome.stderr == "to stderr\n"
    assert not outcome.stdout_truncated
    assert os.listdir(os.path.join(harness.workspace, ".kcoral", "output")) == []


def test_capture_limit(harness: Harness) -> None:
    """With limit 10 the first ten bytes come back, flagged as truncated."""
    source = "import os\nos.write(1, b'0123456789abc')\n"
    outcome = harness.run([module("m", source)], output_limit=10)
    assert (outcome.stdout, outcome.stdout_truncated) == ("0123456789", True)
    assert (outcome.stderr, outcome.stderr_truncated) == ("", False)


def test_capture_disabled(harness: Harness) -> None:
    """With limit 0 both streams are empty and not truncated."""
    outcome = harness.run([module("m", "print('hello')\n")], output_limit=0)
    assert (outcome.stdout, outcome.stdout_truncated) == ("", False)


# -- protocol §11 and §12 programs --------------------------------------------


REMOTE_MODULE = """from __future__ import annotations

def scale(x, factor, *, data):
    return {"x": x * factor, "data": data, "len": len(data)}

def _kcoral_invoke_scale(nargs, names, literals, *values):
    import builtins
    values = [value["value"] if literal else value for literal, value in zip(literals, values)]
    function = builtins.globals()["scale"]
    return function(*values[:nargs], **dict(zip(names, values[nargs:])))
"""


def test_remote_function_program(harness: Harness) -> None:
    """The program of protocol §11 (scale.remote(5, data=b"ab")) completes."""
    data = harness.blob(b"ab")
    outcome = harness.run(
        [
            {"op": "upload", "kind": "module", "source": REMOTE_MODULE, "id": "module"},
            get("function", "module", "_kcoral_invoke_scale"),
            {"op": "upload", "kind": "bytes", "blob": data, "id": "arg_2"},
            run(
                "output",
                "function",
                2,
                ["data"],
                [True, True, False],
                {"value": 5},
                {"value": 2},
                ref("arg_2"),
            ),
            ret("output", "output"),
        ]
    )
    assert outcome.status == "COMPLETED", outcome.error
    assert values(outcome) == {"output": {"x": 10, "data": b"ab", "len": 2}}


def test_remote_function_literal_ref_and_empty_bytes(harness: Harness) -> None:
    """A wrapped literal shaped like a reference stays data; empty bytes work."""
    empty = harness.blob(b"")
    outcome = harness.run(
        [
            {"op": "upload", "kind": "module", "source": REMOTE_MODULE, "id": "module"},
            get("function", "module", "_kcoral_invoke_scale"),
            {"op": "upload", "kind": "bytes", "blob": empty, "id": "arg_2"},
            run(
                "output",
                "function",
                2,
                ["data"],
                [True, True, False],
                {"value": [ref("module")]},
                {"value": 1},
                ref("arg_2"),
            ),
            ret("output", "output"),
        ]
    )
    assert values(outcome) == {"output": {"x": [{"$ref": "module"}], "data": b"", "len": 0}}


RUNNER = """
import io, os, shutil, sys, tarfile

def run(inputs, tool_run, argv, env, fetch):
    os.mkdir("inputs")
    with tarfile.open(fileobj=io.BytesIO(inputs)) as archive:
        archive.extractall("inputs")
    directory = os.path.abspath("inputs")
    os.environ["KCORAL_DIR"] = directory
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    returncode = tool_run(argv, env, directory)
    os.mkdir("outputs")
    missing = []
    for path in fetch:
        source = os.path.join(directory, path)
        if not os.path.isfile(source):
            missing.append(path)
            continue
        target = os.path.join("outputs", path)
        os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
        shutil.copyfile(source, target)
    return {"returncode": returncode, "missing": missing}
"""

PYTHON_TOOL = """
import os, subprocess, sys

def run(args, env, cwd):
    completed = subprocess.run(
        [sys.executable, *args], cwd=cwd, env={**os.environ, **env}, stdin=subprocess.DEVNULL
    )
    return completed.returncode
"""


def test_kcoral_run_python_program(harness: Harness) -> None:
    """The `kcoral run python` program of protocol §12 completes with its output."""
    script = b"import os\nprint('hello', os.environ['GREETING'])\nos.makedirs('res', exist_ok=True)\nopen('res/out.txt', 'w').write('result')\n"
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        info = tarfile.TarInfo("exp/check.py")
        info.size = len(script)
        info.mode = 0o600
        archive.addfile(info, io.BytesIO(script))
    inputs = harness.blob(buffer.getvalue())
    outcome = harness.run(
        [
            {"op": "upload", "kind": "module", "source": RUNNER, "id": "tool_runner"},
            get("runner", "tool_runner", "run"),
            {"op": "upload", "kind": "module", "source": PYTHON_TOOL, "id": "definition"},
            get("tool_run", "definition", "run"),
            {"op": "upload", "kind": "bytes", "blob": inputs, "id": "inputs"},
            run(
                "run",
                "runner",
                ref("inputs"),
                ref("tool_run"),
                ["exp/check.py"],
                {"GREETING": "world"},
                ["res/out.txt", "absent.txt"],
            ),
            ret("outcome", "run"),
            {"op": "return", "key": "artifacts", "kind": "folder", "path": "outputs"},
        ],
        output_limit=268435456,
    )
    assert outcome.status == "COMPLETED", outcome.error
    assert outcome.stdout == "hello world\n"
    decoded = values(outcome)
    assert decoded["outcome"] == {"returncode": 0, "missing": ["absent.txt"]}
    assert decoded["artifacts"] == {"files": {"res/out.txt": b"result"}, "directories": ["res"]}
    assert "KCORAL_DIR" not in os.environ


# -- modules without Twisted ------------------------------------------------


def test_no_twisted_import() -> None:
    """kcoral.errors, kcoral.builtins and the engine import no Twisted, Klein or treq."""
    code = (
        "import sys, kcoral.errors, kcoral.builtins, kcoral.builtin, kcoral.worker.engine\n"
        "bad = [m for m in ('twisted', 'klein', 'treq') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_backend_registry() -> None:
    """make_backend builds the CPU backend and rejects unknown names."""
    backend = make_backend("cpu", gpu_ordinal=3)
    assert backend.name == "cpu" and backend.target() == {}
    with pytest.raises(LookupError):
        make_backend("tpu")


def test_execution_error_attributes() -> None:
    """ExecutionError carries kind and message."""
    e = ExecutionError("runtime", "m")
    assert (e.kind, e.message, str(e)) == ("runtime", "m", "m")


def test_null_lease() -> None:
    """NullLease tracks state without I/O."""
    lease = NullLease()
    lease.acquire()
    assert lease.held
    lease.release()
    assert not lease.held


def test_stream_returns(harness: Harness) -> None:
    """
    With C{stream_returns} each finished return is sent at once with its
    parts, and the outcome carries only the parts after them (issue 17,
    item 4: the parent keeps returns that ran before a crash).
    """
    harness.engine.stream_returns = True
    digest = harness.blob(b"abc")
    outcome = harness.run(
        [
            {"op": "upload", "kind": "bytes", "id": "b", "blob": digest},
            {"op": "return", "key": "k", "value": ref("b")},
            module("m", "def f():\n    raise ValueError('late')\n"),
            get("f", "m", "f"),
            run("r", "f"),
        ]
    )
    returned = [m for m in harness.sent if isinstance(m, Returned)]
    assert [m.key for m in returned] == ["k"]
    assert returned[0].parts == (b"abc",)
    assert returned[0].value == outcome.results["k"]
    assert outcome.status == "FAILED"
    assert outcome.parts == ()
    assert outcome.streamed_parts == 1


def test_no_stream_by_default(harness: Harness) -> None:
    """Without C{stream_returns} the outcome carries every part itself."""
    digest = harness.blob(b"abc")
    outcome = harness.run(
        [
            {"op": "upload", "kind": "bytes", "id": "b", "blob": digest},
            {"op": "return", "key": "k", "value": ref("b")},
        ]
    )
    assert not [m for m in harness.sent if isinstance(m, Returned)]
    assert outcome.parts == (b"abc",)
    assert outcome.streamed_parts == 0


@pytest.mark.parametrize(
    ("expression", "words"),
    [
        ("'\\ud800'", "surrogates not allowed"),
        ("10**5000", "integer string conversion"),
        ("{'a': ['\\udfff']}", "surrogates not allowed"),
    ],
)
def test_unencodable_return_is_serialization(harness: Harness, expression: str, words: str) -> None:
    """
    A value without a JSON text fails its return as C{serialization}; the
    returns that ran before it are kept (issue 13, item 3).
    """
    source = f"def ok():\n    return b'kept'\ndef bad():\n    return {expression}\n"
    outcome = harness.run(
        [
            module("m", source),
            get("ok", "m", "ok"),
            get("bad", "m", "bad"),
            run("a", "ok"),
            ret("a", "a"),
            run("b", "bad"),
            ret("b", "b"),
        ]
    )
    kind, message, index = error(outcome)
    assert (kind, index) == ("serialization", 6)
    assert message.startswith("cannot encode the returned value: ")
    assert words in message
    assert values(outcome) == {"a": b"kept"}
    # The outcome itself has a JSON text.
    encode(outcome)


def test_streamed_returns_stop_at_the_response_limit(harness: Harness) -> None:
    """Returns sent ahead stay within max_response_bytes in all."""
    harness.engine.stream_returns = True
    source = "def f():\n    return 'x' * 600\n"
    outcome = harness.run(
        [module("m", source), get("f", "m", "f"), run("r", "f")]
        + [ret(f"k{i}", "r") for i in range(4)],
        max_response_bytes=2000,
    )
    returned = [m for m in harness.sent if isinstance(m, Returned)]
    assert [m.key for m in returned] == ["k0", "k1"]
    # The outcome carries the rest (the server answers response_too_large).
    assert sorted(outcome.results) == ["k0", "k1", "k2", "k3"]


class _LazyBackend(CpuBackend):
    """A backend whose driver can be watched: module imports run off the lease."""

    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log
        self.subscribed = False

    def drain(self) -> None:
        self.log.append("drain")

    def lazy_lease(self, acquire: Any, *, subscribe: bool = True) -> Any:
        import contextlib

        log = self.log
        if not subscribe and not self.subscribed:
            return None
        self.subscribed = True

        @contextlib.contextmanager
        def leasing() -> Any:
            # Uploaded code "touches the device" by calling this module's hook.
            hook = sys.modules[__name__]
            hook._device_call = acquire  # type: ignore[attr-defined]
            log.append("lazy")
            try:
                yield
            finally:
                hook._device_call = _unwatched  # type: ignore[attr-defined]

        return leasing()


def _unwatched() -> None:
    """A device call nothing watches: it just runs."""


_device_call: Any = _unwatched


def _lazy(harness: Harness) -> _OrderedLease:
    lease = _OrderedLease()
    harness.lease = lease
    harness.engine = Engine(
        _LazyBackend(lease.events),
        lease,
        cpu_builtins(),
        send=lambda m: lease.events.append(f"#{m.index}") if isinstance(m, Instruction) else None,
    )
    return lease


def test_module_import_off_the_lease(harness: Harness) -> None:
    """
    Where the driver can be watched, a module upload takes no lease; a
    cpu_only run and its host return follow without one, and the program
    never holds the GPU.
    """
    lease = _lazy(harness)
    outcome = harness.run(
        [ACTIVE_ADD, get("f", "m", "add", cpu_only=True), run("r", "f", 2, 3), ret("out", "r")]
    )
    assert outcome.status == "COMPLETED", outcome.error
    assert lease.events == ["#0", "lazy", "#1", "#2", "#3"]
    assert not lease.held


def test_inert_module_takes_neither_lease_nor_watch(harness: Harness) -> None:
    """
    A module of definitions and loaded imports runs no code of its own when
    imported: no lease, no driver watch.  Its GPU function's run starts off
    the lease under the watch; one that never touches the device (a null
    program's) holds nothing, cleanup included.
    """
    lease = _lazy(harness)
    outcome = harness.run([ADD, get("f", "m", "add"), run("r", "f", 2, 3), ret("out", "r")])
    assert outcome.status == "COMPLETED", outcome.error
    assert lease.events == ["#0", "#1", "#2", "lazy", "#3"]
    assert not lease.held


TOUCHING_RUN = module(
    "m",
    f"""
    import sys
    def add(a, b):
        sys.modules[{__name__!r}]._device_call()
        return a + b
    """,
)


def test_run_touching_the_device_takes_the_lease_then(harness: Harness) -> None:
    """
    A GPU function's first device call takes the lease inside the run; the
    host return after it is the program's last instruction, so the drain
    and release come before it.
    """
    lease = _lazy(harness)
    outcome = harness.run(
        [TOUCHING_RUN, get("f", "m", "add"), run("r", "f", 2, 3), ret("out", "r")]
    )
    assert outcome.status == "COMPLETED", outcome.error
    assert values(outcome) == {"out": 5}
    assert lease.events == ["#0", "#1", "#2", "lazy", "acquire", "#3", "drain", "release"]


def test_second_run_keeps_the_lease_the_first_took(harness: Harness) -> None:
    """Once a run took the lease, a later GPU run starts under it: no watch."""
    lease = _lazy(harness)
    outcome = harness.run(
        [
            TOUCHING_RUN,
            get("f", "m", "add"),
            run("a", "f", 1, 2),
            ret("x", "a"),
            run("b", "f", 3, 4),
            ret("y", "b"),
        ]
    )
    assert outcome.status == "COMPLETED", outcome.error
    assert lease.events == [
        *("#0", "#1", "#2", "lazy", "acquire", "#3", "#4", "#5"),
        *("drain", "release"),
    ]


def test_a_function_seen_touching_the_device_takes_the_lease_up_front(harness: Harness) -> None:
    """
    After a lazily leased run of a function took the lease, the next
    program's run of the same uploaded function takes it before the run
    (no watch inside the hold); a function that never touched it stays lazy.
    """
    lease = _lazy(harness)
    program = [TOUCHING_RUN, get("f", "m", "add"), run("r", "f", 2, 3), ret("out", "r")]
    first = harness.run(program)
    assert first.status == "COMPLETED", first.error
    assert lease.events[3:5] == ["lazy", "acquire"]
    del lease.events[:]
    again = harness.run(program)
    assert again.status == "COMPLETED", again.error
    assert lease.events == ["#0", "#1", "#2", "acquire", "#3", "drain", "release"]
    del lease.events[:]
    plain = harness.run([ADD, get("f", "m", "add"), run("r", "f", 2, 3), ret("out", "r")])
    assert plain.status == "COMPLETED", plain.error
    assert lease.events == ["#0", "#1", "#2", "lazy", "#3"]


def test_code_key_names_uploaded_functions_only() -> None:
    from kcoral.worker.engine import code_key

    namespace: dict[str, Any] = {}
    exec(compile("def f():\n    pass\n", "<uploaded:abc>", "exec"), namespace)
    assert code_key(namespace["f"]) == ("<uploaded:abc>", 1, "f")
    assert code_key(len) is None and code_key(test_code_key_names_uploaded_functions_only) is None


def test_cpu_only_and_builtin_runs_are_not_watched_for_the_lease(harness: Harness) -> None:
    """A cpu_only run drains and releases as before; only GPU functions start lazily."""
    lease = _lazy(harness)
    outcome = harness.run(
        [TOUCHING_RUN, get("f", "m", "add"), get("c", "m", "add", cpu_only=True)]
        + [run("r", "f", 1, 2), run("s", "c", 0, 0)]
    )
    assert outcome.status == "COMPLETED", outcome.error
    assert lease.events == [
        *("#0", "#1", "#2", "#3", "lazy", "acquire"),
        *("#4", "drain", "release"),
    ]


def test_lazy_run_lease_switched_off(harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """With KCORAL_LAZY_RUN_LEASE=0 a GPU function's run takes the lease up front."""
    monkeypatch.setenv("KCORAL_LAZY_RUN_LEASE", "0")
    lease = _lazy(harness)
    outcome = harness.run([ADD, get("f", "m", "add"), run("r", "f", 2, 3), ret("out", "r")])
    assert outcome.status == "COMPLETED", outcome.error
    assert lease.events == ["#0", "#1", "#2", "acquire", "#3", "drain", "release"]


def test_inert_module_in_a_last_program_takes_no_lease(harness: Harness) -> None:
    """A retiring worker (no driver watch) takes no lease for an inert import either."""
    lease = _lazy(harness)
    outcome = harness.run(
        [ADD, get("f", "m", "add", cpu_only=True), run("r", "f", 2, 3), ret("out", "r")],
        retiring=True,
    )
    assert outcome.status == "COMPLETED", outcome.error
    assert "acquire" not in lease.events and "lazy" not in lease.events


def test_module_after_an_import_hook_is_placed_on_the_lease(harness: Harness) -> None:
    """
    Once a program replaces the import function, even a module of imports
    runs its code: the lease is placed for it as for any module.
    """
    lease = _lazy(harness)
    hook = module(
        "h",
        """
        import builtins
        original = builtins.__import__
        def spy(*args, **kwargs):
            return original(*args, **kwargs)
        builtins.__import__ = spy
        """,
    )
    imports = module("m", "import os\ndef add(a, b):\n    return a + b\n")
    import builtins

    original = builtins.__import__
    try:
        outcome = harness.run(
            [hook, imports, get("f", "m", "add", cpu_only=True), run("r", "f", 1, 2)]
        )
    finally:
        builtins.__import__ = original
    assert outcome.status == "COMPLETED", outcome.error
    assert lease.events[:4] == ["#0", "lazy", "#1", "lazy"]


def test_module_touching_the_device_takes_the_lease_then(harness: Harness) -> None:
    """A module whose top level touches the device gets the lease at that moment."""
    lease = _lazy(harness)
    source = f"""
    import sys
    before = True
    sys.modules[{__name__!r}]._device_call()
    def add(a, b):
        return a + b
    """
    outcome = harness.run(
        [module("m", source), get("f", "m", "add"), run("r", "f", 2, 3), ret("out", "r")]
    )
    assert outcome.status == "COMPLETED", outcome.error
    assert lease.events == ["#0", "lazy", "acquire", "#1", "#2", "#3", "drain", "release"]


def test_last_program_does_not_subscribe_for_an_import(harness: Harness) -> None:
    """
    A worker that exits after this program does not set up the driver watch
    for its imports (it costs a fresh process more than the lease it saves):
    the module upload takes the lease up front, as spec/server.md says.
    """
    lease = _lazy(harness)
    outcome = harness.run(
        [ACTIVE_ADD, get("f", "m", "add"), run("r", "f", 2, 3), ret("out", "r")], retiring=True
    )
    assert outcome.status == "COMPLETED", outcome.error
    assert "lazy" not in lease.events
    assert lease.events[:2] == ["#0", "acquire"]


def test_last_program_uses_a_subscription_it_has(harness: Harness) -> None:
    """A subscription an earlier program made is used by the last one too."""
    lease = _lazy(harness)
    first = harness.run([ACTIVE_ADD, get("f", "m", "add", cpu_only=True), run("r", "f", 1, 2)])
    assert first.status == "COMPLETED", first.error
    del lease.events[:]
    outcome = harness.run(
        [ACTIVE_ADD, get("f", "m", "add", cpu_only=True), run("r", "f", 2, 3), ret("out", "r")],
        retiring=True,
    )
    assert outcome.status == "COMPLETED", outcome.error
    assert lease.events[:2] == ["#0", "lazy"]
    assert "acquire" not in lease.events


def test_device_tensors_copied_under_the_lease_encoded_off_it(harness: Harness) -> None:
    """
    Returning the last GPU work's tensors: they are copied to the host under
    the lease, then the drain and release come, then the encoding (hashing).
    """
    lease = _OrderedLease()
    harness.lease = lease

    class Backend(CpuBackend):
        def drain(self) -> None:
            lease.events.append("drain")

        def tensor_parts(self, value: Any) -> Any:
            if type(value).__name__ == "Dev":
                lease.events.append(f"copy held={lease.held}")
                return ("float32", (1,), b"\0\0\x80\x3f")
            return super().tensor_parts(value)

    harness.engine = Engine(
        Backend(),
        lease,
        cpu_builtins(),
        send=lambda m: lease.events.append(f"#{m.index}") if isinstance(m, Instruction) else None,
    )
    source = "import os\nos.getpid()\nclass Dev:\n    pass\ndef make():\n    return [Dev(), 2, {'d': Dev()}]\n"
    outcome = harness.run(
        [module("m", source), get("f", "m", "make"), run("r", "f"), ret("out", "r")]
    )
    assert outcome.status == "COMPLETED", outcome.error
    assert lease.events == [
        "#0",
        "acquire",
        "#1",
        "#2",
        "#3",
        "copy held=True",
        "copy held=True",
        "drain",
        "release",
    ]
    node = outcome.results["out"]
    assert node["type"] == "array"
    assert [v["type"] for v in node["value"]] == ["tensor", "integer", "object"]


@pytest.mark.skipif(not shared.available(), reason="no sealed memfds here")
def test_device_copy_into_a_shared_buffer_is_the_part(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """
    A backend that copies a returned device tensor straight into a sealed
    buffer (a GPU worker, from 4 MiB): the copy is made under the lease, the
    buffer is hashed after the release and is the response part itself.
    """
    lease = _OrderedLease()
    harness.lease = lease
    data = bytes(range(256)) * 512
    made: list[shared.SharedBuffer] = []

    class Backend(CpuBackend):
        def drain(self) -> None:
            lease.events.append("drain")

        def tensor_parts(self, value: Any) -> Any:
            if type(value).__name__ == "Dev":
                lease.events.append(f"copy held={lease.held}")
                made.append(
                    shared.fill(len(data), lambda view: view.__setitem__(slice(None), data))
                )
                return ("uint8", (len(data),), made[-1])
            return super().tensor_parts(value)

    original = shared.SharedBuffer.map

    def map_and_note(self: shared.SharedBuffer) -> memoryview:
        lease.events.append(f"hash held={lease.held}")
        return original(self)

    monkeypatch.setattr(shared.SharedBuffer, "map", map_and_note)
    harness.engine = Engine(Backend(), lease, cpu_builtins(), share_parts=True)
    source = "class Dev:\n    pass\ndef make():\n    return Dev()\n"
    outcome = harness.run(
        [module("m", source), get("f", "m", "make"), run("r", "f"), ret("out", "r")]
    )
    assert outcome.status == "COMPLETED", outcome.error
    assert lease.events[-4:] == ["copy held=True", "drain", "release", "hash held=False"]
    node = outcome.results["out"]
    assert node["sha256"] == hashlib.sha256(data).hexdigest()
    assert list(outcome.parts) == made


def test_lent_host_memory_given_back_after_the_parts_are_made(harness: Harness) -> None:
    """
    A backend that lends a view of its own memory for a device tensor (a GPU
    worker's staging buffer) hears C{returned()} once the parts are made, after
    the lease is given back; the part holds the bytes as they were.
    """
    lease = _OrderedLease()
    harness.lease = lease
    staging = bytearray(b"\x01" * 4)

    class Backend(CpuBackend):
        def drain(self) -> None:
            lease.events.append("drain")

        def tensor_parts(self, value: Any) -> Any:
            if type(value).__name__ == "Dev":
                lease.events.append(f"copy held={lease.held}")
                return ("uint8", (4,), memoryview(staging))
            return super().tensor_parts(value)

        def returned(self) -> None:
            lease.events.append(f"returned held={lease.held}")
            staging[:] = b"\x00" * 4  # reused by the next return

    harness.engine = Engine(Backend(), lease, cpu_builtins())
    source = "class Dev:\n    pass\ndef make():\n    return Dev()\n"
    outcome = harness.run(
        [module("m", source), get("f", "m", "make"), run("r", "f"), ret("out", "r")]
    )
    assert outcome.status == "COMPLETED", outcome.error
    assert lease.events[-4:] == ["copy held=True", "drain", "release", "returned held=False"]
    assert outcome.results["out"]["sha256"] == hashlib.sha256(b"\x01" * 4).hexdigest()
    assert [bytes(part) for part in outcome.parts] == [b"\x01" * 4]


@pytest.mark.skipif(not shared.available(), reason="no sealed memfds here")
def test_shared_tensor_blob_mapped_before_the_lease(harness: Harness) -> None:
    """
    A tensor upload's sealed buffer is mapped (populated) before the lease
    is taken; the backend copies from that read-only mapping.
    """
    lease = _ordered(harness)
    seen: list[tuple[bool, bool, bytes]] = []

    class Backend(CpuBackend):
        def upload_tensor(self, data: Any, dtype: str, shape: tuple[int, ...]) -> Any:
            view = memoryview(data)
            seen.append((lease.held, view.readonly, view.tobytes()))
            return numpy.frombuffer(view, dtype=numpy.float32).reshape(shape)

    harness.engine = Engine(Backend(), lease, cpu_builtins())
    data = numpy.arange(1 << 15, dtype=numpy.float32).tobytes()
    digest = hashlib.sha256(data).hexdigest()
    upload = {"op": "upload", "kind": "tensor", "id": "t", "blob": digest}
    upload.update(dtype="float32", shape=[1 << 15])
    program = json.dumps({"instructions": [upload]})
    maps: list[bool] = []
    buffer = shared.share(data)
    original = shared.SharedBuffer.map

    def map_and_note(self: shared.SharedBuffer) -> memoryview:
        maps.append(lease.held)
        return original(self)

    workspace = harness.root / "mapped"
    workspace.mkdir()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(shared.SharedBuffer, "map", map_and_note)
        outcome = harness.engine.run(Execute(program, str(workspace)), {digest: buffer})
    assert outcome.status == "COMPLETED", outcome.error
    assert maps == [False]
    assert seen == [(True, True, data)]


def test_host_values() -> None:
    """Host values are told apart from what may live on the device, within a budget."""
    from kcoral.worker.engine import _is_host_value

    assert _is_host_value([1, 2.0, "x", b"y", None, {"a": [numpy.zeros(3), numpy.float32(1)]}])
    assert not _is_host_value([object()])
    assert _is_host_value([0.5] * 9000)
    # Too large to look through: the careful answer.
    assert not _is_host_value([0.5] * 20000)
    cycle: list[Any] = []
    cycle.append(cycle)
    assert not _is_host_value(cycle)


def test_children_from_before_the_program_are_not_its_leftovers(harness: Harness) -> None:
    """
    Only processes started during the program count as left behind: a child
    the process had before (a test's own server, say) is neither blamed nor
    killed.
    """
    import subprocess

    before = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        outcome = harness.run([ADD, get("f", "m", "add"), run("r", "f", 2, 3), ret("out", "r")])
        assert outcome.status == "COMPLETED", outcome.error
        assert before.poll() is None
    finally:
        before.kill()
        before.wait()
