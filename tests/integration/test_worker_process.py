# -*- test-case-name: tests.integration.test_worker_process -*-
"""
Tests for C{python -m kcoral.worker}: the real process over fds 3 and 4.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from typing import IO, Any

import attrs
import pytest

from kcoral.ipc.channel_io import read_message, write_message
from kcoral.wire.channel import (
    Blob,
    ChannelMessage,
    Execute,
    Exit,
    Instruction,
    LeaseGranted,
    Outcome,
    Returned,
)

pytestmark = pytest.mark.integration


class Worker:
    """A worker process with both ends of its control channel."""

    def __init__(self, *args: str) -> None:
        p2w_read, p2w_write = os.pipe()
        w2p_read, w2p_write = os.pipe()
        # The child sees the pipes as fds 3 and 4.
        os.dup2(p2w_read, 103)
        os.dup2(w2p_write, 104)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kcoral.worker", "--device", "cpu", *args],
            pass_fds=(3, 4),
            preexec_fn=_move_fds,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for fd in (p2w_read, w2p_write, 103, 104):
            os.close(fd)
        self.outbox: IO[bytes] = os.fdopen(p2w_write, "wb")
        self.inbox: IO[bytes] = os.fdopen(w2p_read, "rb")

    def send(self, message: ChannelMessage) -> None:
        write_message(self.outbox, message)

    def receive(self) -> ChannelMessage | None:
        return read_message(self.inbox)

    def execute(
        self, workspace: str, instructions: list[Any], last: bool = True, **blobs: bytes
    ) -> None:
        for data in blobs.values():
            self.send(Blob(hashlib.sha256(data).hexdigest(), data))
        self.send(
            Execute(
                request_id="r",
                program=json.dumps({"instructions": instructions}),
                workspace=workspace,
                output_limit=1024,
                max_response_bytes=1 << 20,
                reserved=None,
                last=last,
            )
        )

    def outcome(self) -> tuple[Outcome, list[int]]:
        """
        Read messages up to the outcome; return it, with the parts its
        returns sent ahead (C{returned} messages) put back in front as the
        parent does, and the announced indexes.
        """
        indexes = []
        streamed: list[bytes] = []
        while True:
            message = self.receive()
            assert message is not None
            if isinstance(message, Instruction):
                indexes.append(message.index)
            elif isinstance(message, Returned):
                streamed.extend(message.parts)
            elif isinstance(message, Outcome):
                assert message.streamed_parts == len(streamed)
                joined = attrs.evolve(message, parts=(*streamed, *message.parts), streamed_parts=0)
                return joined, indexes

    def close(self) -> int:
        for stream in (self.outbox, self.inbox):
            try:
                stream.close()
            except OSError:
                pass
        code = self.process.wait(timeout=30)
        self.process.stdout.close()  # type: ignore[union-attr]
        self.process.stderr.close()  # type: ignore[union-attr]
        return code


def _move_fds() -> None:
    os.dup2(103, 3)
    os.dup2(104, 4)


@pytest.fixture
def workspace(tmp_path: Any) -> str:
    path = tmp_path / "ws"
    path.mkdir()
    return str(path)


PROGRAM = [
    {
        "op": "upload",
        "kind": "module",
        "id": "m",
        "source": "def f(b):\n    print('hi')\n    return b + b'!'\n",
    },
    {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "f"},
    {
        "op": "upload",
        "kind": "bytes",
        "id": "b",
        "blob": hashlib.sha256(b"abc").hexdigest(),
    },
    {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": [{"$ref": "b"}]},
    {"op": "return", "key": "r", "value": {"$ref": "r"}},
]


def test_handshake_execute_and_retire(workspace: str) -> None:
    """ready, then one program, then the worker retires after its one request."""
    worker = Worker()
    try:
        ready = worker.receive()
        assert ready is not None and ready.TYPE == "ready"
        assert ready.header()["pid"] == worker.process.pid
        assert ready.header()["device"] == "cpu"
        assert ready.header()["target"] == {}
        worker.execute(workspace, PROGRAM, b=b"abc")
        outcome, indexes = worker.outcome()
        assert indexes == [0, 1, 2, 3, 4]
        header = outcome.header()
        assert header["status"] == "COMPLETED", header["error"]
        assert header["stdout"] == "hi\n"
        assert header["retire"] == "request_limit"
        assert header["part_sizes"] == [4]
        assert outcome.payload() == b"abc!"
        assert header["results"]["r"]["type"] == "bytes"
        assert worker.receive() is None
    finally:
        assert worker.close() == 0


def test_crash_inside_instruction(workspace: str) -> None:
    """os._exit inside a run: the channel ends right after that instruction's announcement."""
    worker = Worker()
    try:
        assert worker.receive().TYPE == "ready"  # type: ignore[union-attr]
        worker.execute(
            workspace,
            [
                {
                    "op": "upload",
                    "kind": "module",
                    "id": "m",
                    "source": "import os\ndef f():\n    os._exit(7)\n",
                },
                {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "f"},
                {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": []},
            ],
        )
        headers = []
        while (message := worker.receive()) is not None:
            headers.append(message.header())
        assert headers[-1] == {"type": "instruction", "index": 2}
    finally:
        assert worker.close() == 7


def test_reuse_two_programs(tmp_path: Any) -> None:
    """Told it may serve another, one process serves two programs, then exits on `exit`."""
    worker = Worker()
    try:
        assert worker.receive().TYPE == "ready"  # type: ignore[union-attr]
        for n in range(2):
            ws = tmp_path / f"ws{n}"
            ws.mkdir()
            source = f"import os\nos.environ['KCORAL_N'] = '{n}'\ndef f():\n    return os.environ.get('KCORAL_PREV')\n"
            worker.execute(
                str(ws),
                [
                    {
                        "op": "upload",
                        "kind": "module",
                        "id": "m",
                        "source": source + "os.environ['KCORAL_PREV'] = 'x'\n",
                    },
                    {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "f"},
                    {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": []},
                    {"op": "return", "key": "r", "value": {"$ref": "r"}},
                ],
                last=False,
            )
            outcome, _ = worker.outcome()
            assert outcome.status == "COMPLETED", outcome.error
            assert outcome.retire is None
            assert outcome.results == {"r": {"type": "string", "value": "x"}}
        worker.send(Exit())
        assert worker.receive() is None
    finally:
        assert worker.close() == 0


def test_last_program_retires(tmp_path: Any) -> None:
    """The program the parent marks as the last one carries retire request_limit."""
    worker = Worker()
    try:
        assert worker.receive().TYPE == "ready"  # type: ignore[union-attr]
        retire = []
        for n in range(2):
            ws = tmp_path / f"ws{n}"
            ws.mkdir()
            worker.execute(str(ws), PROGRAM, last=n == 1, b=b"abc")
            outcome, _ = worker.outcome()
            retire.append(outcome.retire)
        assert retire == [None, "request_limit"]
    finally:
        assert worker.close() == 0


def test_eof_exits(workspace: str) -> None:
    """Closing the parent's end makes an idle worker exit 0."""
    worker = Worker()
    assert worker.receive().TYPE == "ready"  # type: ignore[union-attr]
    assert worker.close() == 0


def test_failed_startup() -> None:
    """An unavailable device backend sends `failed` and exits 1."""
    p2w_read, p2w_write = os.pipe()
    w2p_read, w2p_write = os.pipe()
    os.dup2(p2w_read, 103)
    os.dup2(w2p_write, 104)
    process = subprocess.Popen(
        [sys.executable, "-m", "kcoral.worker", "--device", "gpu", "--gpu-ordinal", "9999"],
        pass_fds=(3, 4),
        preexec_fn=_move_fds,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for fd in (p2w_read, w2p_write, 103, 104):
        os.close(fd)
    with os.fdopen(w2p_read, "rb") as inbox, os.fdopen(p2w_write, "wb") as outbox:
        # A GPU worker creates its context under its lease: grant the lease
        # if it gets that far (a machine without PyCUDA fails before).
        message = read_message(inbox)
        if message is not None and message.TYPE == "lease_acquire":
            write_message(outbox, LeaseGranted())
            message = read_message(inbox)
    assert message is not None and message.TYPE == "failed"
    assert message.header()["error"]
    assert process.wait(timeout=30) == 1
