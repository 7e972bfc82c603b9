# -*- test-case-name: tests.integration.test_client_interop -*-
"""
Our client next to the reference client (PyPI C{kcoral==0.1.1}):

- for the same program both send the same program JSON bytes and the same
  binary parts, attempt by attempt (a loopback capture server records them);
- our client's CACHE_MISS retries against a server restarted between
  attempts (its memory cache lost), through to the full resend.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from twisted.internet.threads import deferToThreadPool

from kcoral import Client, Program
from kcoral.client import blocking
from kcoral.testing.live_server import ServerProcess, free_port
from kcoral.wire.multipart import parse_request_body
from kcoral.wire.program import BLOB_KINDS

from .refclient import run_client, run_our_client

pytestmark = pytest.mark.integration

_COMPLETED = {
    "status": "COMPLETED",
    "request_id": "00000000-0000-4000-8000-000000000000",
    "queue_ms": 0,
    "elapsed_ms": 0,
    "lease_wait_ms": 0,
    "lease_held_ms": 0,
    "stdout": "",
    "stderr": "",
    "stdout_truncated": False,
    "stderr_truncated": False,
}


class _Capture(BaseHTTPRequestHandler):
    """Records each /execute body; misses every blob once, then completes."""

    protocol_version = "HTTP/1.1"
    requests: list[tuple[dict[str, str], bytes]] = []
    results: dict[str, Any] = {}

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.requests.append(({k.lower(): v for k, v in self.headers.items()}, body))
        parsed = parse_request_body(self.headers["Content-Type"], body)
        program = json.loads(parsed.program)
        digests = list(
            dict.fromkeys(
                i["blob"]
                for i in program["instructions"]
                if i["op"] == "upload" and i["kind"] in BLOB_KINDS
            )
        )
        if digests and not parsed.blobs:
            reply = {"status": "CACHE_MISS", "request_id": _COMPLETED["request_id"]}
            reply["missing_blobs"] = digests
        else:
            reply = {**_COMPLETED, "results": self.results}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("X-Request-ID", reply["request_id"])
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def capture() -> Iterator[tuple[str, type[_Capture]]]:
    handler = type("Capture", (_Capture,), {"requests": [], "results": {}})
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()


_PROGRAM = r"""
import os, sys, tempfile
import numpy as np
from kcoral import Client, Program

folder = tempfile.mkdtemp()
os.makedirs(os.path.join(folder, "y", "empty"))
for name, data in [(".h", b"hidden"), ("y/z.bin", b"\x00\x01"), ("a.txt", b"file")]:
    with open(os.path.join(folder, name), "wb") as f:
        f.write(data)

p = Program()
m = p.upload(kind="module", source="def f(*a, **k):\n    return '\u00fc'\n")
t = p.upload(kind="tensor", value=np.arange(12, dtype=np.float32).reshape(3, 4))
p.upload(kind="tensor", value=b"\x00" * 8, dtype="bfloat16", shape=[2, 2])
p.upload(kind="tensor", value=np.arange(3, dtype=">i8"))
b = p.upload(kind="bytes", value=bytearray(b"\r\n--x\x00"))
p.upload(kind="bytes", value=b"")
p.upload(kind="library", value=b"\x7fELF", id="lib")
fp = p.upload_file(blob=b"file", path="./d//a.txt")
p.upload_folder(folder, path="inputs")
f = p.get_function(module=m, name="f", cpu_only=True)
g = p.get_function(module={"$ref": "upload_0"}, name="f", id="g")
r = p.run(fn=f, args=[t, b, [1, "z"], {"$ref": "x"}, 1.5, "\u00fc", None, {"k": [1, 2]}, g])
p.run(fn=g)
p.return_(key="r", value=r)
p.return_file(key="file", path=fp)
p.return_folder(key="dir", path="inputs")
p.return_file(key="literal", path="d/a.txt")
client = Client(sys.argv[1])
client.execute(p, timeout_seconds=12.5, output_limit_bytes=4096, gpu_count=int(sys.argv[2]) or None)

@client.function(timeout=30, output_limit_bytes=4096)
def scale(x, factor=2, *, data=b""):
    return x * factor

print(scale.remote(5, data=b"ab"))
"""


def _requests(
    capture: tuple[str, type[_Capture]], run: Callable[..., Any], gpus: int
) -> list[tuple[dict[str, str], bytes]]:
    url, handler = capture
    handler.results = {"output": {"type": "integer", "value": 10}}
    proc = run(_PROGRAM, url, str(gpus))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "10"
    requests = list(handler.requests)
    handler.requests.clear()
    return requests


@pytest.mark.parametrize("gpus", [0, 2])
def test_same_program_and_parts(
    capture: tuple[str, type[_Capture]], refclient: Path, gpus: int
) -> None:
    """Both clients send byte-identical program parts and blob parts, attempt by attempt."""
    theirs = _requests(capture, run_client, gpus)
    ours = _requests(capture, run_our_client, gpus)
    assert len(theirs) == len(ours) == 4  # program: miss + resend; function: miss + resend
    for index, ((their_headers, their_body), (our_headers, our_body)) in enumerate(
        zip(theirs, ours, strict=True)
    ):
        their = parse_request_body(their_headers["content-type"], their_body)
        our = parse_request_body(our_headers["content-type"], our_body)
        if index < 2:
            assert our.program == their.program
        else:
            # The remote function's module text is each client's own code.
            their_program, our_program = json.loads(their.program), json.loads(our.program)
            their_program["instructions"][0].pop("source")
            our_program["instructions"][0].pop("source")
            assert our_program == their_program
        assert list(our.blobs) == list(their.blobs)
        assert {d: b.read() for d, b in our.blobs.items()} == {
            d: b.read() for d, b in their.blobs.items()
        }
        for headers, body in ((our_headers, our_body), (their_headers, their_body)):
            assert headers["content-type"].startswith("multipart/form-data; boundary=")
            assert int(headers["content-length"]) == len(body)
            assert "transfer-encoding" not in headers
    program = json.loads(parse_request_body(ours[0][0]["content-type"], ours[0][1]).program)
    expected = {"timeout_seconds": 12.5, "output_limit_bytes": 4096}
    if gpus:
        expected = {"gpu_count": gpus, **expected}
    assert program["options"] == expected
    assert list(program["options"]) == list(expected)


def test_cache_miss_after_restart(tmp_path: Path) -> None:
    """
    A server restarted between attempts forgets blob A: attempt 1 misses B,
    attempt 2 (B only) misses A, attempt 3 resends both and completes.
    """
    server = ServerProcess(
        ["--device", "cpu", "--num-workers", "1", "--log-dir", "", "--disk-cache-dir", ""]
    ).start()
    try:
        url = f"http://127.0.0.1:{server.port}"
        client = Client(url)
        warm = Program()
        warm.upload(kind="bytes", value=b"A" * 1000)
        assert client.execute(warm).completed  # the server now holds A

        program = Program()
        module = program.upload(kind="module", source="def f(a, b):\n    return [len(a), len(b)]\n")
        a = program.upload(kind="bytes", value=b"A" * 1000)
        b = program.upload(kind="bytes", value=b"B" * 2000)
        function = program.get_function(module=module, name="f")
        program.return_(key="r", value=program.run(fn=function, args=[a, b]))

        instances: list[str] = []
        seen: list[tuple[int, int, str | None]] = []

        def restart_once(attempt: Any) -> Any:
            seen.append((attempt.number, attempt.blobs, attempt.status))
            if attempt.number != 1:
                return None

            def restart() -> None:
                instances.append(server.health()["instance_id"])
                server.stop()
                server.start()
                instances.append(server.health()["instance_id"])

            # Observers run on the blocking client's private reactor (never the
            # global one); the restart runs in a thread of that reactor, so the
            # reactor sees the old connection close while it waits.
            return deferToThreadPool(
                blocking._loop_reactor, blocking._loop_reactor.getThreadPool(), restart
            )

        client.attempt_observers.append(restart_once)
        result = client.execute(program)
        assert result.status == "COMPLETED", result.error
        assert result["r"] == [1000, 2000]
        assert instances[0] != instances[1]
        assert seen == [(1, 0, "CACHE_MISS"), (2, 1, "CACHE_MISS"), (3, 2, "COMPLETED")]
        client.close()
    finally:
        server.stop()
