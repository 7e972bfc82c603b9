"""
Every refusal is counted (issue 18): against a real CPU server on
127.0.0.1, one request (or connection) of each refusal reason, then the
same counts must be in C{/metrics} (C{kcoral_refusals_total}), in
C{/status.json} (C{refusal_counts}) and as C{request_refused} events in
C{events.jsonl}.  The programs only sleep, so the server runs without a
sandbox for speed.
"""

from __future__ import annotations

import json
import socket
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kcoral.server.http.refusals import REFUSALS
from kcoral.testing.live_server import ServerProcess, multipart_body, request
from tests.reliability.conftest import run_program
from tests.reliability.test_clients import events, read_all, split_response, wait_for

pytestmark = [pytest.mark.integration]

TOKEN = "refusal-test-0123456789"
AUTH = f"Authorization: Bearer {TOKEN}\r\n".encode()
SLEEP = "import time\n\ndef f(s):\n    time.sleep(s)\n    return s\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    work = tmp_path_factory.mktemp("refusals")
    (work / "tokens").write_text(f"tester {TOKEN}\n")
    logs = work / "logs"
    args = [
        "--device", "cpu", "--sandbox", "none", "--num-workers", "1",
        "--log-dir", str(logs), "--auth-token-file", str(work / "tokens"),
        "--header-timeout-seconds", "2", "--body-timeout-seconds", "3",
        "--body-stall-seconds", "2",
        "--max-connections", "8", "--max-request-bytes", "65536",
        "--max-bytes-in-flight", "4096", "--max-queued-requests", "1",
    ]  # fmt: skip
    with ServerProcess(args) as process:
        yield process, logs


def exchange(
    port: int, data: bytes, trickle: float = 0.0, prompt: bytes = b""
) -> tuple[int, dict[str, str], bytes]:
    """
    Send C{prompt} at once, then C{data} (a byte every C{trickle} seconds
    when set), and read the answer.
    """
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    try:
        sock.sendall(prompt)
        if trickle:
            try:
                for byte in data:
                    sock.sendall(bytes([byte]))
                    time.sleep(trickle)
            except (BrokenPipeError, ConnectionResetError):
                pass
        else:
            sock.sendall(data)
        return split_response(read_all(sock))
    finally:
        sock.close()


def dechunked(headers: dict[str, str], data: bytes) -> bytes:
    """The body of a response, without its chunked framing."""
    if headers.get("transfer-encoding") != "chunked":
        return data
    body = b""
    while True:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return body
        body, data = body + data[:size], data[size + 2 :]


def post_head(content_type: str, length: int, request_id: str = "") -> bytes:
    named = f"X-Request-ID: {request_id}\r\n" if request_id else ""
    return (
        b"POST /execute HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        + AUTH
        + f"{named}Content-Type: {content_type}\r\nContent-Length: {length}\r\n\r\n".encode()
    )


def scrape(port: int) -> Counter[tuple[int, str]]:
    """The non-zero C{kcoral_refusals_total} samples of C{/metrics}."""
    response = request(port, "GET", "/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status == 200
    found: Counter[tuple[int, str]] = Counter()
    for family in text_string_to_metric_families(response.body.decode()):
        for sample in family.samples:
            if sample.name == "kcoral_refusals_total" and sample.value:
                found[(int(sample.labels["status"]), sample.labels["reason"])] = int(sample.value)
    return found


def test_every_refusal_is_counted(server: tuple[ServerProcess, Path]) -> None:
    """
    One refusal of each reason: each is answered with its status and a JSON
    ERROR body, and /metrics, /status.json and events.jsonl count exactly
    those.
    """
    process, logs = server
    port = process.port
    answers: list[tuple[str, int, dict[str, str], bytes]] = []

    def refused(reason: str, data: bytes, trickle: float = 0.0, prompt: bytes = b"") -> None:
        answers.append((reason, *exchange(port, data, trickle, prompt)))

    refused("malformed", b"POST /execute HTTP/1.1\r\nHost: x\r\nContent-Length: ten\r\n\r\n")
    refused("unauthorized", b"GET /status.json HTTP/1.1\r\nHost: x\r\n\r\n")
    refused("head_timeout", b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 100, 0.1)
    slow_body = post_head("multipart/form-data; boundary=b", 1000)
    refused("body_timeout", b"x" * 10, 0.5, prompt=slow_body)
    refused("body_stalled", b"", prompt=post_head("multipart/form-data; boundary=b", 1000) + b"x")
    refused("body_too_large", post_head("multipart/form-data; boundary=b", 100_000))
    refused("uri_too_long", b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\n\r\n")
    refused("header_too_large", b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n")
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(600))
    refused("too_many_headers", b"GET /health HTTP/1.1\r\n" + many + b"\r\n")

    # Eight connections in a request (a head in, the body to come): the
    # server cannot close one of them to make room.
    idle = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(8)]
    try:
        for sock in idle:
            sock.sendall(post_head("multipart/form-data; boundary=b", 1000))
        time.sleep(0.3)
        refused("connection_cap", b"")
    finally:
        for sock in idle:
            sock.close()
    time.sleep(0.3)

    # A 5 s program holds the one worker and its body's bytes in flight.
    content_type, body = multipart_body(run_program(SLEEP, "f", 5))
    sleeper = socket.create_connection(("127.0.0.1", port), timeout=30)
    sleeper.sendall(post_head(content_type, len(body)) + body)
    assert wait_for(logs, lambda e: e["event"] == "request_routed")
    content_type, small = multipart_body(run_program(SLEEP, "f", 0))
    padding = b"p" * (4096 - len(body))
    refused("bytes_in_flight", post_head(content_type, len(small) + len(padding)) + small + padding)
    # One request waits for the worker (--max-queued-requests 1); the next is refused.
    queued_id = str(uuid.uuid4())
    queued = socket.create_connection(("127.0.0.1", port), timeout=60)
    queued.sendall(post_head(content_type, len(small), queued_id) + small)
    assert wait_for(
        logs, lambda e: e["event"] == "request_accepted" and e["request_id"] == queued_id
    )
    time.sleep(0.2)
    refused("busy", post_head(content_type, len(small)) + small)
    for sock in (sleeper, queued):
        status, _, _ = split_response(read_all(sock))
        sock.close()
        assert status == 200

    for reason, status, headers, data in answers:
        assert status == REFUSALS[reason], (reason, status, data[:200])
        assert headers["content-type"] == "application/json", reason
        document = json.loads(dechunked(headers, data))
        assert document["status"] == "ERROR", reason
        assert document["request_id"] == headers["x-request-id"], reason
        if status == 503:
            assert headers["retry-after"] == "1", reason
        if status == 401:
            assert headers["www-authenticate"] == 'Bearer realm="kcoral"'

    expected = Counter((REFUSALS[reason], reason) for reason in REFUSALS)
    assert scrape(port) == expected
    snapshot = request(
        port, "GET", "/status.json", headers={"Authorization": f"Bearer {TOKEN}"}
    ).json()
    counts = {(c["status"], c["reason"]): c["count"] for c in snapshot["refusal_counts"]}
    assert counts == dict(expected)
    assert {r["reason"] for r in snapshot["refusals"]} <= set(REFUSALS)
    logged: list[dict[str, Any]] = [e for e in events(logs) if e["event"] == "request_refused"]
    assert Counter((e["status"], e["reason"]) for e in logged) == expected
    ids = {e["request_id"] for e in logged}
    assert {headers["x-request-id"] for _, _, headers, _ in answers} <= ids
