# -*- test-case-name: tests.integration.test_server -*-
"""
End-to-end tests of C{kcoral server} on the CPU: real worker processes, real
HTTP on 127.0.0.1 (server spec §3, §5, §10, §13; protocol §2, §9).
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import pytest

from kcoral.testing.live_server import ServerProcess, post_program, request, sha256

pytestmark = pytest.mark.integration

UUID_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")

BASE_ARGS = ["--device", "cpu", "--sandbox", "none", "--log-dir", "", "--disk-cache-dir", ""]


def program(
    source: str,
    args: list[Any] | None = None,
    options: dict[str, Any] | None = None,
    extra: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """upload m (0), get_function f (1), [extra…], run r (2+), return r."""
    instructions: list[dict[str, Any]] = [
        {"op": "upload", "kind": "module", "id": "m", "source": source},
        {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "f"},
        *(extra or []),
        {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": list(args or [])},
        {"op": "return", "key": "r", "value": {"$ref": "r"}},
    ]
    body: dict[str, Any] = {"instructions": instructions}
    if options is not None:
        body["options"] = options
    return body


PID = "import os\ndef f():\n    return os.getpid()\n"
ECHO = "def f(x):\n    return x * 2\n"
CRASH = "import os\ndef f():\n    os._exit(3)\n"
SLEEP = "import time, os\ndef f(s):\n    time.sleep(s)\n    return os.getpid()\n"


def result_value(response: Any, key: str = "r") -> Any:
    body = response.json()
    assert body["status"] == "COMPLETED", body
    return body["results"][key]["value"]


def kcoral_workers(pid: int) -> list[psutil.Process]:
    """
    Live C{kcoral.worker} descendants of C{pid}: spawned, or forked by a
    worker template (which is not one, nor is a forked child that only
    waits for its worker in a sandbox of its own).
    """
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
    found = []
    for child in children:
        try:
            if child.name() in ("kcoral-template", "kcoral-sandbox"):
                continue
            if "kcoral.worker" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:
            pass
    return found


def gone(pids: list[int], timeout: float = 15.0) -> bool:
    """Wait until none of C{pids} is a live (non-zombie) process."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive:
            return True
        time.sleep(0.1)
    return False


def wait_for(predicate: Any, timeout: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("condition not reached in time")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    """Two CPU workers, default mode (one request per process)."""
    with ServerProcess(
        [*BASE_ARGS, "--num-workers", "2", "--max-request-bytes", "4096"],
        log_path=tmp_path / "server.log",
    ) as s:
        yield s


@pytest.fixture
def reuse_server(tmp_path: Path) -> Iterator[ServerProcess]:
    """One CPU worker that serves many requests."""
    with ServerProcess(
        [*BASE_ARGS, "--num-workers", "1", "--max-requests-per-worker", "0"],
        log_path=tmp_path / "server.log",
    ) as s:
        yield s


# -- /health ------------------------------------------------------------------


def test_health_fields(server: ServerProcess) -> None:
    response = request(server.port, "GET", "/health")
    assert response.status == 200
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    for key in ("status", "instance_id", "started_at", "gpu_count", "load", "target", "versions"):
        assert key in body
    assert body["status"] == "ok"
    assert UUID_RE.match(body["instance_id"])
    assert body["started_at"].endswith("Z")
    assert body["gpu_count"] == 0
    assert body["target"] == {}
    assert body["load"] == {
        "request_capacity": 2,
        "requests_in_progress": 0,
        "requests_waiting": 0,
    }
    assert body["uptime_seconds"] >= 0
    assert body["active_requests"] == 0
    assert body["queue_length"] == 0
    assert body["gpus"] == []
    workers = body["workers"]
    assert [w["worker_id"] for w in workers] == ["cpu/w0", "cpu/w1"]
    for worker in workers:
        assert worker["gpu_id"] is None
        assert worker["generation"] == 1
        assert worker["status"] == "idle"
        assert psutil.pid_exists(worker["pid"])


# -- request ids ------------------------------------------------------------------


def test_request_id_echoed(server: ServerProcess) -> None:
    rid = str(uuid.uuid4())
    response = server.execute(program(ECHO, [21]), headers={"X-Request-ID": rid})
    assert response.status == 200
    assert response.headers["x-request-id"] == rid
    assert response.json()["request_id"] == rid
    assert result_value(response) == 42


@pytest.mark.parametrize("header", ["not-a-uuid", None])
def test_request_id_replaced(server: ServerProcess, header: str | None) -> None:
    rid = str(uuid.uuid4())
    value = header if header is not None else rid.upper()
    response = server.execute(program(ECHO, [1]), headers={"X-Request-ID": value})
    chosen = response.headers["x-request-id"]
    assert chosen not in (value, rid)
    assert UUID_RE.match(chosen)
    assert response.json()["request_id"] == chosen


def test_request_id_duplicated_replaced(server: ServerProcess) -> None:
    import http.client

    from kcoral.testing.live_server import multipart_body

    rid = str(uuid.uuid4())
    content_type, body = multipart_body(program(ECHO, [1]))
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        connection.putrequest("POST", "/execute")
        connection.putheader("Content-Type", content_type)
        connection.putheader("Content-Length", str(len(body)))
        connection.putheader("X-Request-ID", rid)
        connection.putheader("X-Request-ID", rid)
        connection.endheaders(body)
        response = connection.getresponse()
        data = json.loads(response.read())
        chosen = response.getheader("X-Request-ID")
    finally:
        connection.close()
    assert chosen is not None and chosen != rid
    assert UUID_RE.match(chosen)
    assert data["request_id"] == chosen


# -- simple programs and request-level errors ---------------------------------


def test_completed(server: ServerProcess) -> None:
    source = "def f(x):\n    print('hello')\n    return x + 1\n"
    response = server.execute(program(source, [41]))
    assert response.status == 200
    body = response.json()
    assert body["status"] == "COMPLETED"
    assert body["results"]["r"] == {"type": "integer", "value": 42}
    assert body["stdout"] == "hello\n"
    assert body["request_id"] == response.headers["x-request-id"]
    # CPU: no leases, and lease time never exceeds the elapsed time.
    assert body["lease_wait_ms"] == 0
    assert body["lease_held_ms"] == 0
    assert body["lease_wait_ms"] + body["lease_held_ms"] <= body["elapsed_ms"]


def test_malformed_body_400(server: ServerProcess) -> None:
    response = post_program(server.port, b"{not json")
    assert response.status == 400
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert body["status"] == "ERROR"
    assert body["error"]["kind"] == "parse"
    assert body["request_id"] == response.headers["x-request-id"]


def test_malformed_multipart_400(server: ServerProcess) -> None:
    response = request(
        server.port,
        "POST",
        "/execute",
        b"garbage",
        {"Content-Type": "multipart/form-data; boundary=xyz"},
    )
    assert response.status == 400
    body = response.json()
    assert body["error"]["kind"] == "parse"
    assert body["request_id"] == response.headers["x-request-id"]


def test_declared_length_too_large_413(server: ServerProcess) -> None:
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        connection.putrequest("POST", "/execute")
        connection.putheader("Content-Type", "multipart/form-data; boundary=xyz")
        connection.putheader("Content-Length", str(10 * 1024 * 1024))
        connection.endheaders()
        # No body is sent: the server must answer without reading it.
        response = connection.getresponse()
        data = json.loads(response.read())
    finally:
        connection.close()
    assert response.status == 413
    assert data["status"] == "ERROR"
    assert data["error"]["kind"] == "request_too_large"
    assert data["request_id"] == response.getheader("X-Request-ID")


def test_actual_body_too_large_413(server: ServerProcess) -> None:
    blob = os.urandom(8192)
    instructions = program(PID)
    instructions["instructions"].insert(
        0, {"op": "upload", "kind": "bytes", "id": "b", "blob": sha256(blob)}
    )
    response = server.execute(instructions, [blob])
    assert response.status == 413
    body = response.json()
    assert body["error"]["kind"] == "request_too_large"
    assert body["request_id"] == response.headers["x-request-id"]
    # The server is fine afterwards.
    assert server.execute(program(ECHO, [2])).status == 200


def test_cache_miss_then_supplied(server: ServerProcess) -> None:
    blob = os.urandom(64)
    digest = sha256(blob)
    source = "def f(b):\n    return len(b)\n"
    prog = program(
        source,
        [{"$ref": "b"}],
        extra=[{"op": "upload", "kind": "bytes", "id": "b", "blob": digest}],
    )
    miss = server.execute(prog)
    assert miss.status == 200
    body = miss.json()
    assert body["status"] == "CACHE_MISS"
    assert body["missing_blobs"] == [digest]
    assert body["request_id"] == miss.headers["x-request-id"]
    hit = server.execute(prog, [blob])
    assert hit.status == 200
    assert result_value(hit) == 64
    # Now cached: the blob need not be sent again.
    again = server.execute(prog)
    assert result_value(again) == 64


# -- crashes and timeouts --------------------------------------------------------


def test_crash_inside_instruction(server: ServerProcess) -> None:
    response = server.execute(program(CRASH))
    assert response.status == 200
    body = response.json()
    assert body["request_id"] == response.headers["x-request-id"]
    assert body["status"] == "FAILED"
    error = body["error"]
    assert error["kind"] == "runtime"
    assert error["instruction_index"] == 2
    assert error["instruction_op"] == "run"
    assert error["instruction_id"] == "r"
    assert error["message"] == "worker exited while executing the instruction"
    assert body["results"] == {}
    assert body["lease_wait_ms"] + body["lease_held_ms"] <= body["elapsed_ms"]
    following = server.execute(program(ECHO, [5]))
    assert following.status == 200
    assert result_value(following) == 10


def test_crash_outside_instruction(reuse_server: ServerProcess) -> None:
    """
    A program replaces the worker's engine entry point, so the next request
    on the seat kills the worker before announcing any instruction.
    """
    sabotage = (
        "import os\n"
        "import kcoral.worker.engine as engine\n"
        "def f():\n"
        "    engine.Engine.run = lambda *a, **k: os._exit(3)\n"
        "    return 1\n"
    )
    first = reuse_server.execute(program(sabotage))
    if first.status != 200 or first.json().get("status") != "COMPLETED":
        pytest.skip("cannot provoke a crash outside an instruction here")
    response = reuse_server.execute(program(ECHO, [1]))
    assert response.status == 500
    body = response.json()
    assert body == {
        "status": "ERROR",
        "request_id": response.headers["x-request-id"],
        "error": {"kind": "engine", "message": "worker crashed"},
    }
    assert result_value(reuse_server.execute(program(ECHO, [3]))) == 6


def test_timeout_kills_program_processes(server: ServerProcess, tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    source = (
        "import subprocess\n"
        "def f(path):\n"
        "    child = subprocess.Popen(['sleep', '1000'])\n"
        "    with open(path, 'w') as fh:\n"
        "        fh.write(str(child.pid))\n"
        "    while True:\n"
        "        pass\n"
    )
    started = time.monotonic()
    response = server.execute(program(source, [str(pid_file)], {"timeout_seconds": 1}))
    assert time.monotonic() - started < 30
    assert response.status == 504
    rid = response.headers["x-request-id"]
    assert response.json() == {
        "status": "ERROR",
        "request_id": rid,
        "error": {"kind": "timeout", "message": "execution timed out"},
    }
    child = int(pid_file.read_text())
    assert gone([child]), f"the program's child {child} survived the timeout"
    assert result_value(server.execute(program(ECHO, [4]))) == 8


def test_infinite_output_is_bounded(server: ServerProcess) -> None:
    assert server.process is not None
    before = psutil.Process(server.process.pid).memory_info().rss
    source = "def f():\n    while True:\n        print('x' * 1000)\n"
    response = server.execute(
        program(source, options={"timeout_seconds": 1, "output_limit_bytes": 1024})
    )
    assert response.status in (200, 504)
    assert len(response.body) < 64 * 1024
    after = psutil.Process(server.process.pid).memory_info().rss
    assert after - before < 64 * 1024 * 1024
    assert server.health()["status"] == "ok"
    assert result_value(server.execute(program(ECHO, [1]))) == 2


def test_output_limit_truncates(server: ServerProcess) -> None:
    source = "def f():\n    for _ in range(100):\n        print('x' * 1000)\n    return 1\n"
    response = server.execute(program(source, options={"output_limit_bytes": 1024}))
    body = response.json()
    assert body["status"] == "COMPLETED"
    assert len(body["stdout"]) <= 1024
    assert body["stdout_truncated"] is True


# -- concurrency and the wait queue ------------------------------------------------


def test_concurrent_requests(server: ServerProcess) -> None:
    def one(i: int) -> Any:
        return server.execute(program(ECHO, [i]), timeout=300)

    with ThreadPoolExecutor(64) as executor:
        responses = list(executor.map(one, range(64)))
    assert [r.status for r in responses] == [200] * 64
    assert [result_value(r) for r in responses] == [2 * i for i in range(64)]
    ids = {r.json()["request_id"] for r in responses}
    assert len(ids) == 64
    for r in responses:
        body = r.json()
        assert body["lease_wait_ms"] + body["lease_held_ms"] <= body["elapsed_ms"]


def test_wait_timeout_busy(tmp_path: Path) -> None:
    with ServerProcess(
        [*BASE_ARGS, "--num-workers", "2", "--worker-wait-timeout-seconds", "1"],
        log_path=tmp_path / "server.log",
    ) as server:
        with ThreadPoolExecutor(2) as executor:
            busy = [executor.submit(server.execute, program(SLEEP, [3])) for _ in range(2)]
            wait_for(lambda: server.health()["active_requests"] == 2)
            started = time.monotonic()
            response = server.execute(program(ECHO, [1]))
            waited = time.monotonic() - started
            results = [f.result() for f in busy]
        assert response.status == 503
        assert response.headers["retry-after"] == "1"
        assert 0.5 < waited < 2.9
        body = response.json()
        assert body == {
            "status": "ERROR",
            "request_id": response.headers["x-request-id"],
            "error": {"kind": "busy", "message": "server saturated"},
        }
        assert [r.status for r in results] == [200, 200]


# -- reuse and replacement -----------------------------------------------------------


def test_reuse_same_pid(reuse_server: ServerProcess) -> None:
    pids = [result_value(reuse_server.execute(program(PID))) for _ in range(3)]
    assert len(set(pids)) == 1
    assert reuse_server.health()["workers"][0]["generation"] == 1


def test_reuse_env_restored(reuse_server: ServerProcess) -> None:
    setter = (
        "import os\ndef f():\n    os.environ['KCORAL_TEST_VAR'] = 'x'\n    return os.getpid()\n"
    )
    getter = "import os\ndef f():\n    return [os.getpid(), os.environ.get('KCORAL_TEST_VAR')]\n"
    pid = result_value(reuse_server.execute(program(setter)))
    value = result_value(reuse_server.execute(program(getter)))
    assert value[0]["value"] == pid
    assert value[1]["type"] == "null"


def test_reuse_workspace_cleared(reuse_server: ServerProcess) -> None:
    writer = "import os\ndef f():\n    open('left.txt', 'w').write('x')\n    return os.getpid()\n"
    reader = "import os\ndef f():\n    return [os.getpid(), os.path.exists('left.txt')]\n"
    pid = result_value(reuse_server.execute(program(writer)))
    value = result_value(reuse_server.execute(program(reader)))
    assert value[0]["value"] == pid
    assert value[1]["value"] is False


def test_a_worker_watching_for_its_next_program_serves_it(tmp_path: Path) -> None:
    """
    With watching forced on (KCORAL_GRANT_WATCH=1; by default only where a
    core is spare for every worker), a reused worker that polls for its
    next program after each answer serves programs sent at once, soon and
    after its watch ended, and exits when told to.
    """
    import os
    import time

    with ServerProcess(
        [*BASE_ARGS, "--num-workers", "1", "--max-requests-per-worker", "0"],
        log_path=tmp_path / "server.log",
        env={**os.environ, "KCORAL_GRANT_WATCH": "1"},
    ) as watching:
        pids = []
        for pause in (0.0, 0.0, 0.002, 0.05, 0.0):
            time.sleep(pause)
            pids.append(result_value(watching.execute(program(PID))))
        assert len(set(pids)) == 1, pids


def test_reuse_background_child_replaces_seat(reuse_server: ServerProcess) -> None:
    source = (
        "import os, subprocess\n"
        "def f():\n"
        "    subprocess.Popen(['sleep', '1000'])\n"
        "    return os.getpid()\n"
    )
    body = reuse_server.execute(program(source)).json()
    # Background work must end with the program: it is terminated, reported,
    # and the results that ran are kept.
    assert body["status"] == "FAILED"
    assert body["error"]["kind"] == "runtime"
    assert body["error"]["message"] == (
        "program left background processes running; they were terminated"
    )
    first = body["results"]["r"]["value"]
    second = result_value(reuse_server.execute(program(PID)))
    assert first != second
    assert reuse_server.health()["workers"][0]["generation"] == 2


def test_default_mode_fresh_process(server: ServerProcess) -> None:
    pids = [result_value(server.execute(program(PID))) for _ in range(4)]
    assert len(set(pids)) == 4
    health = wait_for(
        lambda: (h := server.health()) and all(w["status"] == "idle" for w in h["workers"]) and h
    )
    assert sum(w["generation"] for w in health["workers"]) == 2 + 4
    assert health["load"]["request_capacity"] == 2


# -- graceful shutdown -----------------------------------------------------------------


def test_sigterm_finishes_running_request(tmp_path: Path) -> None:
    server = ServerProcess(
        [*BASE_ARGS, "--num-workers", "1"], log_path=tmp_path / "server.log"
    ).start()
    try:
        assert server.process is not None
        server_pid = server.process.pid
        workers_before = [p.pid for p in kcoral_workers(server_pid)]
        assert len(workers_before) == 1
        with ThreadPoolExecutor(3) as executor:
            running = executor.submit(server.execute, program(SLEEP, [3]))
            wait_for(lambda: server.health()["active_requests"] == 1)
            queued = [executor.submit(server.execute, program(ECHO, [i])) for i in range(2)]
            wait_for(lambda: server.health()["queue_length"] == 2)
            workers_during = [p.pid for p in kcoral_workers(server_pid)]
            server.process.send_signal(signal.SIGTERM)
            queued_responses = [f.result() for f in queued]
            running_response = running.result()
        assert [r.status for r in queued_responses] == [503, 503]
        for r in queued_responses:
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["kind"] == "busy"
        assert running_response.status == 200
        assert running_response.json()["status"] == "COMPLETED"
        assert server.process.wait(60) == 0
        assert gone(workers_before + workers_during)
        assert kcoral_workers(server_pid) == []
    finally:
        server.stop()


def test_sigterm_idle_exits_zero(server: ServerProcess) -> None:
    assert server.process is not None
    workers = [p.pid for p in kcoral_workers(server.process.pid)]
    assert len(workers) == 2
    assert server.stop() == 0
    assert gone(workers)


def test_lease_timings_zero_on_cpu(server: ServerProcess) -> None:
    response = server.execute(program(SLEEP, [0.2]))
    body = response.json()
    assert body["lease_wait_ms"] == 0
    assert body["lease_held_ms"] == 0
    assert body["elapsed_ms"] >= 200
    assert body["queue_ms"] >= 0
    assert body["lease_wait_ms"] + body["lease_held_ms"] <= body["elapsed_ms"]


def test_health_during_request(server: ServerProcess) -> None:
    done = threading.Event()

    def slow() -> Any:
        try:
            return server.execute(program(SLEEP, [1]))
        finally:
            done.set()

    with ThreadPoolExecutor(1) as executor:
        future = executor.submit(slow)
        health = wait_for(lambda: (h := server.health())["active_requests"] == 1 and h)
        assert health["load"]["requests_in_progress"] == 1
        assert {w["status"] for w in health["workers"]} == {"busy", "idle"}
        assert future.result().status == 200


# -- workspaces without a sandbox (issue 17, item 5) ---------------------------

WRITE_SECRET = (
    "import os\n"
    "def f():\n"
    "    with open('secret.txt', 'w') as fh:\n"
    "        fh.write('from the previous request')\n"
    "    return os.path.abspath('secret.txt')\n"
)
LOOK = "import os\ndef f(path):\n    return os.path.exists(path)\n"


def test_fresh_workers_next_request_cannot_see_previous_workspace(
    server: ServerProcess,
) -> None:
    """
    With C{--sandbox none} and fresh workers the previous request's
    workspace is emptied before its answer, so the next request (on the
    other worker, at once) cannot read its files.
    """
    path = result_value(post_program(server.port, program(WRITE_SECRET)))
    assert not os.path.exists(path)
    assert result_value(post_program(server.port, program(LOOK, [path]))) is False


def test_reused_worker_next_request_cannot_see_previous_workspace(
    reuse_server: ServerProcess,
) -> None:
    """The same with one reused worker: the answer comes after the workspace is empty."""
    path = result_value(post_program(reuse_server.port, program(WRITE_SECRET)))
    assert not os.path.exists(path)
    assert result_value(post_program(reuse_server.port, program(LOOK, [path]))) is False


def test_returns_before_crash_kept(server: ServerProcess) -> None:
    """
    Returns that finished before the worker crashed stay in C{results}
    (issue 17, item 4; protocol: results of completed returns are kept).
    """
    body = {
        "instructions": [
            {"op": "upload", "kind": "module", "id": "m", "source": ECHO},
            {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "f"},
            {"op": "run", "id": "a", "fn": {"$ref": "f"}, "args": [21]},
            {"op": "return", "key": "first", "value": {"$ref": "a"}},
            {"op": "upload", "kind": "module", "id": "c", "source": CRASH},
            {"op": "get_function", "id": "g", "module": {"$ref": "c"}, "name": "f"},
            {"op": "run", "id": "b", "fn": {"$ref": "g"}, "args": []},
            {"op": "return", "key": "second", "value": {"$ref": "b"}},
        ]
    }
    response = server.execute(body)
    assert response.status == 200
    answer = response.json()
    assert answer["status"] == "FAILED"
    assert answer["error"]["instruction_index"] == 6
    assert answer["error"]["message"] == "worker exited while executing the instruction"
    assert list(answer["results"]) == ["first"]
    assert answer["results"]["first"]["value"] == 42
