"""
Hostile and careless clients against a real CPU server (issue 18): slow
clients, too many connections, clients that leave, and a load of 2,000
requests from 64 clients.  Loopback only.  The programs are ordinary (they
sleep or add), so the server runs without a sandbox for speed.
"""

from __future__ import annotations

import contextlib
import json
import resource
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kcoral.testing.live_server import ServerProcess, multipart_body, post_program
from tests.reliability.conftest import body_of, run_program

pytestmark = [pytest.mark.integration]

SLEEP = "import time\n\ndef f(s):\n    time.sleep(s)\n    return s\n"
ADD = "def f(a, b):\n    return a + b\n"


def events(log_dir: Path) -> list[dict[str, Any]]:
    (run,) = list((log_dir / "runs").iterdir())
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]


def wait_for(log_dir: Path, predicate: Any, timeout: float = 60.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        found = [e for e in events(log_dir) if predicate(e)]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def raw_post(port: int, program: dict[str, Any], request_id: str) -> socket.socket:
    """Send a whole /execute request and return the socket, unread."""
    content_type, body = multipart_body(program)
    head = (
        f"POST /execute HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nX-Request-ID: {request_id}\r\n\r\n"
    ).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(head + body)
    return sock


def read_all(sock: socket.socket) -> bytes:
    chunks = []
    while True:
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            break
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks)


def split_response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers, body


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    logs = tmp_path_factory.mktemp("client-logs")
    args = [
        "--device", "cpu", "--sandbox", "none", "--num-workers", "2",
        "--max-requests-per-worker", "0", "--log-dir", str(logs),
        "--header-timeout-seconds", "2", "--body-timeout-seconds", "3",
        "--max-connections", "100",
    ]  # fmt: skip
    with ServerProcess(args) as process:
        yield process, logs


def test_slowloris_head_gets_408(server: tuple[ServerProcess, Path]) -> None:
    """
    A request head trickled a byte every 0.3 s is cut off at the head
    deadline with a JSON 408, though each byte arrives well within any idle
    timeout.
    """
    process, _ = server
    sock = socket.create_connection(("127.0.0.1", process.port), timeout=30)
    sent = 0
    head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Padding: " + b"a" * 200
    try:
        for byte in head:
            sock.sendall(bytes([byte]))
            sent += 1
            time.sleep(0.3)
    except (BrokenPipeError, ConnectionResetError):
        pass
    status, headers, body = split_response(read_all(sock))
    sock.close()
    assert sent < len(head)
    assert status == 408
    assert headers["content-type"] == "application/json"
    assert json.loads(body)["error"]["kind"] == "request_timeout"


def test_slow_body_gets_408(server: tuple[ServerProcess, Path]) -> None:
    """A body trickled after a prompt head is cut off at the body deadline."""
    process, _ = server
    sock = socket.create_connection(("127.0.0.1", process.port), timeout=30)
    sock.sendall(
        b"POST /execute HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; "
        b"boundary=b\r\nContent-Length: 100000\r\n\r\n"
    )
    try:
        for _ in range(100):
            sock.sendall(b"x")
            time.sleep(0.2)
    except (BrokenPipeError, ConnectionResetError):
        pass
    status, _, body = split_response(read_all(sock))
    sock.close()
    assert status == 408
    assert json.loads(body)["status"] == "ERROR"


def test_connection_cap_refuses_cleanly(server: tuple[ServerProcess, Path]) -> None:
    """
    Past --max-connections, with every connection in a request (a head in,
    its body to come), a connection gets a JSON 503 with Retry-After; then
    all is well.  (Connections still waiting for a head would be closed to
    make room instead: tests/reliability/test_connection_floods.py.)
    """
    process, _ = server
    idle = [socket.create_connection(("127.0.0.1", process.port), timeout=30) for _ in range(100)]
    try:
        for sock in idle:
            sock.sendall(
                b"POST /execute HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; "
                b"boundary=b\r\nContent-Length: 1000\r\n\r\n"
            )
        time.sleep(0.5)  # let the server accept them all
        extra = socket.create_connection(("127.0.0.1", process.port), timeout=30)
        status, headers, body = split_response(read_all(extra))
        extra.close()
        assert status == 503
        assert headers["retry-after"] == "1"
        assert json.loads(body)["error"]["kind"] == "busy"
    finally:
        for sock in idle:
            sock.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if process.health()["status"] == "ok":
                break
        except Exception:
            time.sleep(0.1)
    assert process.health()["status"] == "ok"


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
def test_listen_backlog(server: tuple[ServerProcess, Path]) -> None:
    """The listening socket's queue is 1,024 (or the kernel's cap), not Twisted's 50."""
    process, _ = server
    out = subprocess.run(
        ["ss", "-Hltn", f"sport = :{process.port}"], capture_output=True, text=True, check=True
    ).stdout.split()
    somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
    assert int(out[2]) == min(1024, somaxconn)


def test_disconnected_clients_work_is_dropped(server: tuple[ServerProcess, Path]) -> None:
    """
    Clients that leave: the queued request leaves the line at once and the
    running programs' workers are replaced, so a new short program runs at
    once rather than behind 600 s of abandoned sleeps.
    """
    process, logs = server
    sleeper = run_program(SLEEP, "f", 600, options={"timeout_seconds": 900})
    running = [str(uuid.uuid4()) for _ in range(2)]
    queued = str(uuid.uuid4())
    sockets = [raw_post(process.port, sleeper, rid) for rid in running]
    for rid in running:
        assert wait_for(
            logs, lambda e, r=rid: e["event"] == "request_routed" and e["request_id"] == r
        )
    waiting = raw_post(process.port, sleeper, queued)
    assert wait_for(logs, lambda e: e["event"] == "request_accepted" and e["request_id"] == queued)
    waiting.close()
    for sock in sockets:
        sock.close()
    for rid in [*running, queued]:
        (finished,) = wait_for(
            logs, lambda e, r=rid: e["event"] == "request_finished" and e["request_id"] == r
        )
        assert finished["finish_reason"] == "abandoned"
    retired = wait_for(
        logs, lambda e: e["event"] == "worker_retired" and e.get("reason") == "abandoned"
    )
    assert len(retired) == 2
    started = time.monotonic()
    response = process.execute(run_program(ADD, "f", 2, 3), timeout=120)
    print(f"disconnect: the next program answered in {time.monotonic() - started:.2f} s")
    assert response.status == 200
    assert body_of(response)["results"]["out"]["value"] == 5


def test_load_nothing_lost(server: tuple[ServerProcess, Path]) -> None:
    """2,000 requests from 64 concurrent clients: every one answered, correctly."""
    process, _ = server
    total, clients = 2000, 64
    results: list[tuple[int, int, Any]] = []
    lock = threading.Lock()
    counter = iter(range(total))

    def client() -> None:
        while True:
            with lock:
                n = next(counter, None)
            if n is None:
                return
            try:
                response = post_program(process.port, run_program(ADD, "f", n, 1), timeout=600)
                value = body_of(response).get("results", {}).get("out", {}).get("value")
                outcome: tuple[int, int, Any] = (n, response.status, value)
            except Exception as e:  # pragma: no cover - reported below
                outcome = (n, -1, repr(e))
            with lock:
                results.append(outcome)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wrong = [r for r in results if r[1] != 200 or r[2] != r[0] + 1]
    print(
        f"load: {len(results)} of {total} answered from {clients} clients in "
        f"{time.monotonic() - started:.1f} s, {len(wrong)} wrong or refused"
    )
    assert len(results) == total
    assert wrong == []


@contextlib.contextmanager
def soft_fd_limit(soft: int) -> Iterator[None]:
    """Lower this process's soft limit on open files (what a child inherits)."""
    old = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, old[1]), old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, old)


@pytest.fixture(scope="module")
def finishing_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[ServerProcess, Path]]:
    """
    A server started with systemd's soft fd limit (1,024), --finish-abandoned
    and a 2 s head deadline (the default connection cap, 4,096).
    """
    logs = tmp_path_factory.mktemp("finishing-logs")
    args = [
        "--device", "cpu", "--sandbox", "none", "--num-workers", "1",
        "--log-dir", str(logs), "--finish-abandoned", "--header-timeout-seconds", "2",
    ]  # fmt: skip
    with soft_fd_limit(1024):
        process = ServerProcess(args).start()
    try:
        yield process, logs
    finally:
        process.stop()


def test_fd_limit_raised(finishing_server: tuple[ServerProcess, Path]) -> None:
    """
    Started with a soft limit of 1,024 open files, the server raises it to
    the hard limit and says so (C{fd_limit_raised}).
    """
    process, logs = finishing_server
    assert process.process is not None
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard <= 1024:
        pytest.skip("the hard limit leaves nothing to raise")
    limits = Path(f"/proc/{process.process.pid}/limits").read_text()
    (line,) = [row for row in limits.splitlines() if row.startswith("Max open files")]
    soft_now = int(line.split()[3])
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    assert soft_now == target
    (raised,) = wait_for(logs, lambda e: e["event"] == "fd_limit_raised")
    assert (raised["old"], raised["new"]) == (1024, target)


def test_finish_abandoned_keeps_work(finishing_server: tuple[ServerProcess, Path]) -> None:
    """
    With --finish-abandoned the operator chose to finish abandoned work: a
    running and a queued program whose clients left both run to completion
    and no worker is replaced for it.
    """
    process, logs = finishing_server
    sleeper = run_program(SLEEP, "f", 2)
    running, queued = str(uuid.uuid4()), str(uuid.uuid4())
    first = raw_post(process.port, sleeper, running)
    assert wait_for(logs, lambda e: e["event"] == "request_routed" and e["request_id"] == running)
    second = raw_post(process.port, sleeper, queued)
    assert wait_for(logs, lambda e: e["event"] == "request_accepted" and e["request_id"] == queued)
    first.close()
    second.close()
    for rid in (running, queued):
        (finished,) = wait_for(
            logs, lambda e, r=rid: e["event"] == "request_finished" and e["request_id"] == r
        )
        assert finished["finish_reason"] == "completed", finished
    assert not [e for e in events(logs) if e.get("reason") == "abandoned"]


def test_slowloris_flood(finishing_server: tuple[ServerProcess, Path]) -> None:
    """
    Issue 18's flood: 1,100 connections trickling request heads against a
    server started at a 1,024-descriptor soft limit.  /health keeps
    answering throughout, and every slow connection gets its 408 at the head
    deadline instead of holding a descriptor forever.
    """
    process, _ = finishing_server
    count = 1100
    opened = time.monotonic()
    slow = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", process.port), timeout=30)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: a")
        slow.append(sock)
    probes = []
    while time.monotonic() - opened < 1.5 or len(probes) < 3:
        for sock in slow[:: max(1, count // 50)]:
            with contextlib.suppress(OSError):
                sock.sendall(b"a")
        started = time.monotonic()
        probes.append((process.health()["status"], time.monotonic() - started))
        time.sleep(0.1)
    statuses: dict[int, int] = {}
    for sock in slow:
        status, _, _ = split_response(read_all(sock))
        sock.close()
        statuses[status] = statuses.get(status, 0) + 1
    print(
        f"flood: {count} slow connections; {len(probes)} /health probes all "
        f"{sorted({p[0] for p in probes})}, slowest {max(p[1] for p in probes) * 1e3:.0f} ms; "
        f"answers {statuses} within {time.monotonic() - opened:.1f} s"
    )
    assert {p[0] for p in probes} == {"ok"}
    assert statuses == {408: count}
    assert process.health()["status"] == "ok"


def test_simultaneous_connections_not_reset(finishing_server: tuple[ServerProcess, Path]) -> None:
    """
    200 clients connecting at the same instant (issue 18 saw 12-15 of them
    reset with Twisted's backlog of 50): every one is answered.
    """
    process, _ = finishing_server
    count = 200
    barrier = threading.Barrier(count)
    outcomes: list[Any] = []
    lock = threading.Lock()

    def client() -> None:
        barrier.wait()
        try:
            outcome: Any = process.health()["status"]
        except Exception as e:  # pragma: no cover - reported below
            outcome = repr(e)
        with lock:
            outcomes.append(outcome)

    threads = [threading.Thread(target=client) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    failed = [o for o in outcomes if o != "ok"]
    print(f"simultaneous: {len(outcomes) - len(failed)} of {count} answered, {failed[:3]}")
    assert failed == []
    assert len(outcomes) == count
