"""
C{kcoral gateway} end to end: a real C{nats-server} on loopback
(L{kcoral.testing.nats}), a real gateway and real CPU nodes that join it
(C{kcoral server --join}), driven by the reference client 0.1.1 unchanged
where the client matters and by raw HTTP where the exact answer does.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from kcoral.testing.gateway import GatewayPool, GatewayProcess
from kcoral.testing.live_server import post_program
from kcoral.testing.nats import nats_server_binary

from .refclient import RefClientUnavailable, ensure_venv, run_client

pytestmark = pytest.mark.skipif(
    nats_server_binary() is None, reason="nats-server is not installed (./dev.sh install)"
)

NODES = ("node-a", "node-b", "node-c")
PRESENCE_TIMEOUT = 3.0

#: A module whose function appends a line to a file (the proof of each run),
#: sleeps, and returns the pid and interval it ran in.
SIDE_EFFECT = (
    "import os, time\n"
    "def f(path, seconds):\n"
    "    start = time.time()\n"
    "    with open(path, 'a') as fh:\n"
    "        fh.write('ran %d\\n' % os.getpid())\n"
    "    time.sleep(seconds)\n"
    "    return '%d %r %r' % (os.getpid(), start, time.time())\n"
)


def side_effect_program(path: Path, seconds: float) -> dict[str, Any]:
    return {
        "instructions": [
            {"op": "upload", "id": "m", "kind": "module", "source": SIDE_EFFECT},
            {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "f"},
            {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": [str(path), seconds]},
            {"op": "return", "key": "out", "value": {"$ref": "r"}},
        ]
    }


class Pool(GatewayPool):
    """The pool of these tests: nodes C{NODES}, a short presence timeout."""

    def __init__(self, tmp: Path, *gateway_args: str) -> None:
        super().__init__(
            tmp,
            NODES,
            gateway_args=["--presence-timeout", str(PRESENCE_TIMEOUT), *gateway_args],
        )


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[Pool]:
    pool = Pool(tmp_path).start()
    try:
        yield pool
    finally:
        pool.stop()


@pytest.fixture(scope="module")
def refclient_python() -> Path:
    try:
        return ensure_venv() / "bin" / "python"
    except RefClientUnavailable as e:  # pragma: no cover - needs PyPI
        pytest.skip(str(e))


#: Runs in the reference client's virtualenv: argv = URL, headers JSON, the
#: program kind; prints one JSON line with the results and each HTTP attempt.
REF_SCRIPT = r"""
import json, sys, hashlib
from kcoral import Client, Program, KCoralError

url, headers, blob_path = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
attempts = []

def hook(response):
    response.read()
    response.request.read()
    status = None
    if response.headers.get("content-type", "").startswith("application/json"):
        status = json.loads(response.content).get("status")
    elif response.headers.get("content-type", "").startswith("multipart/form-data"):
        status = "multipart"
    attempts.append({"http": response.status_code, "status": status,
                     "blobs": response.request.content.count(b'name="blob:'),
                     "node": response.headers.get("x-kcoral-node")})

client = Client(url, headers=headers or None)
client._http.event_hooks["response"].append(hook)
blob = open(blob_path, "rb").read()
p = Program()
m = p.upload(kind="module", source="import hashlib\ndef f(x):\n    return hashlib.sha256(x).hexdigest()\n")
f = p.get_function(module=m, name="f")
x = p.upload(kind="bytes", value=blob)
p.return_(key="h", value=p.run(fn=f, args=[x]))
out = {"attempts": attempts}
try:
    r = client.execute(p)
    out.update(status=r.status, h=r.results.get("h"), error=r.error)
except KCoralError as e:
    out.update(status="raised", code=e.status_code, kind=e.kind, message=str(e))
print("RESULT " + json.dumps(out), flush=True)
"""


def ref_execute(url: str, blob: Path, headers: dict[str, str] | None = None) -> dict[str, Any]:
    """One C{execute} of the hashing program by the reference client, with its attempts."""
    result = run_client(REF_SCRIPT, url, json.dumps(headers or {}), str(blob), timeout=180)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, result.stdout + result.stderr
    out: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    return out


def test_cache_miss_answered_by_gateway_then_reused_on_other_node(
    pool: Pool, refclient_python: Path
) -> None:
    """
    The gateway answers the first CACHE_MISS for the whole pool; a request
    that then lands on the other node sends no blob again: that node
    fetches it from the gateway.
    """
    pool.node("node-a")
    pool.node("node-b")
    blob = os.urandom(70_000)
    blob_file = pool.tmp / "blob"
    blob_file.write_bytes(blob)
    expected = hashlib.sha256(blob).hexdigest()
    first = ref_execute(pool.url, blob_file)
    assert first["status"] == "COMPLETED", first
    assert first["h"] == expected
    assert [(a["status"], a["blobs"]) for a in first["attempts"]] == [
        ("CACHE_MISS", 0),
        ("COMPLETED", 1),
    ]
    ran_on = first["attempts"][-1]["node"]
    assert ran_on in ("node-a", "node-b")
    other = "node-b" if ran_on == "node-a" else "node-a"
    # The client asks for the other node (a preference): no miss, no blob sent.
    second = ref_execute(pool.url, blob_file, {"X-KCoral-Node": other})
    assert second["status"] == "COMPLETED", second
    assert second["h"] == expected
    assert [(a["status"], a["blobs"], a["node"]) for a in second["attempts"]] == [
        ("COMPLETED", 0, other)
    ]


def _run_concurrently(pool: Pool, programs: list[dict[str, Any]]) -> list[Any]:
    results: list[Any] = [None] * len(programs)

    def one(i: int) -> None:
        try:
            results[i] = post_program(pool.port, programs[i], timeout=300)
        except Exception as e:  # recorded, asserted below
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(programs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_seat_limits_under_concurrency(pool: Pool, tmp_path: Path) -> None:
    """
    Eight concurrent programs on two one-seat nodes: every one completes,
    and no node ever runs two at once (their run intervals never overlap).
    """
    pool.node("node-a")
    pool.node("node-b")
    marks = tmp_path / "marks"
    programs = [side_effect_program(marks, 0.5) for _ in range(8)]
    responses = _run_concurrently(pool, programs)
    by_node: dict[str, list[tuple[float, float]]] = {}
    for response in responses:
        assert not isinstance(response, Exception), response
        assert response.status == 200, response.body
        body = response.json()
        assert body["status"] == "COMPLETED", body
        _pid, start, end = body["results"]["out"]["value"].split()
        by_node.setdefault(response.headers["x-kcoral-node"], []).append((float(start), float(end)))
    assert set(by_node) <= {"node-a", "node-b"}
    for intervals in by_node.values():
        intervals.sort()
        for (_, end), (start, _) in zip(intervals, intervals[1:], strict=False):
            assert start >= end, intervals
    assert len(marks.read_text().splitlines()) == 8


def test_node_joining_mid_run_takes_work(pool: Pool, tmp_path: Path) -> None:
    """
    With the only node's seat held by a long program, a node that joins
    takes the next job; nothing about the gateway changes.
    """
    pool.node("node-a")
    long_result: list[Any] = []
    holder = threading.Thread(
        target=lambda: long_result.append(
            post_program(pool.port, side_effect_program(tmp_path / "long", 20.0), timeout=300)
        )
    )
    holder.start()
    pool.wait_for(lambda h: h["load"]["requests_in_progress"] == 1)
    pool.node("node-b")
    response = post_program(pool.port, side_effect_program(tmp_path / "short", 0.0), timeout=300)
    assert response.status == 200 and response.json()["status"] == "COMPLETED"
    assert response.headers["x-kcoral-node"] == "node-b"
    holder.join()
    assert long_result[0].headers["x-kcoral-node"] == "node-a"


def test_sigkill_mid_program_gives_502_and_no_second_run(pool: Pool, tmp_path: Path) -> None:
    """
    SIGKILL of the node running a program: the client gets 502 "outcome
    unknown", and the side-effect file proves no other node ran it again.
    """
    pool.node("node-a")
    pool.node("node-b")
    marks = tmp_path / "marks"
    answer: list[Any] = []
    client = threading.Thread(
        target=lambda: answer.append(
            post_program(pool.port, side_effect_program(marks, 60.0), timeout=300)
        )
    )
    client.start()
    deadline = time.monotonic() + 120
    while not marks.exists() or not marks.read_text():
        assert time.monotonic() < deadline, "the program never started"
        time.sleep(0.05)
    pool.wait_for(lambda h: h["load"]["requests_in_progress"] == 1)
    # Which node holds it: the one whose free seats dropped, or ask both.
    busy = [n["node"] for n in pool.health()["gateway"]["nodes"] if n["free"] == 0]
    victim = busy[0] if busy else "node-a"
    pool.kill_node(victim)
    client.join()
    response = answer[0]
    assert response.status == 502, response.body
    body = response.json()
    assert body["status"] == "ERROR"
    assert "outcome is unknown" in body["error"]["message"]
    assert response.headers.get("x-kcoral-node") == victim
    # The surviving node is idle and would have taken a retry by now.
    time.sleep(PRESENCE_TIMEOUT)
    assert len(marks.read_text().splitlines()) == 1


def test_every_node_gone_gives_503_never_run(pool: Pool, tmp_path: Path) -> None:
    """With every node gone, the gateway answers 503 with Retry-After and nothing runs."""
    pool.node("node-a")
    pool.kill_node("node-a")
    pool.wait_for(lambda h: h["gateway"]["pool"]["nodes"] == 0)
    marks = tmp_path / "marks"
    response = post_program(pool.port, side_effect_program(marks, 0.0))
    assert response.status == 503, response.body
    assert response.headers.get("retry-after") == "1"
    assert response.json()["error"]["kind"] == "busy"
    # A node joining later does not run it either.
    pool.node("node-b")
    time.sleep(PRESENCE_TIMEOUT)
    assert not marks.exists()


def test_nats_restart_loses_no_queued_job(pool: Pool, tmp_path: Path) -> None:
    """
    Jobs queued behind a busy node survive a nats-server restart (file
    storage): every one completes once the node and gateway reconnect.
    """
    pool.node("node-a")
    marks = tmp_path / "marks"
    programs = [side_effect_program(marks, 3.0)] + [
        side_effect_program(marks, 0.0) for _ in range(3)
    ]
    results: list[Any] = []
    # The long one first, so the short ones queue behind it.
    first = threading.Thread(target=lambda: results.extend(_run_concurrently(pool, programs[:1])))
    first.start()
    pool.wait_for(lambda h: h["load"]["requests_in_progress"] == 1)
    runner = threading.Thread(target=lambda: results.extend(_run_concurrently(pool, programs[1:])))
    runner.start()
    pool.wait_for(
        lambda h: h["load"]["requests_in_progress"] == 1 and h["load"]["requests_waiting"] == 3
    )
    pool.nats.restart()
    first.join()
    runner.join()
    assert len(results) == 4
    for response in results:
        assert not isinstance(response, Exception), response
        assert response.status == 200, response.body
        assert response.json()["status"] == "COMPLETED", response.body
    assert len(marks.read_text().splitlines()) == 4


ROUND_TRIP = "import hashlib\ndef f(x):\n    return bytes(x)\n"


@pytest.mark.slow
def test_256_mib_blob_and_result_round_trip(tmp_path: Path) -> None:
    """A 256 MiB blob up and the same 256 MiB back, through the gateway, intact."""
    limit = str(300 * 1024 * 1024)
    # Moving 256 MiB keeps a node's reactor busy for seconds on a small
    # machine: a longer presence timeout than the other tests.
    pool = Pool(
        tmp_path,
        "--max-request-bytes",
        limit,
        "--max-response-bytes",
        limit,
        "--presence-timeout",
        "30",
    ).start()
    try:
        pool.node(
            "node-a",
            extra=("--max-request-bytes", limit, "--max-response-bytes", limit),
        )
        blob = os.urandom(256 * 1024 * 1024)
        digest = hashlib.sha256(blob).hexdigest()
        program = {
            "instructions": [
                {"op": "upload", "id": "m", "kind": "module", "source": ROUND_TRIP},
                {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "f"},
                {"op": "upload", "id": "b", "kind": "bytes", "blob": digest},
                {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": [{"$ref": "b"}]},
                {"op": "return", "key": "out", "value": {"$ref": "r"}},
            ]
        }
        response = post_program(pool.port, program, [blob], timeout=600)
        assert response.status == 200, response.body[:500]
        assert response.headers["content-type"].startswith("multipart/form-data")
        assert int(response.headers["content-length"]) == len(response.body)
        start = response.body.find(blob[:4096])
        assert start >= 0, (len(response.body), response.body[:600])
        assert hashlib.sha256(response.body[start : start + len(blob)]).hexdigest() == digest
    finally:
        pool.stop()


def test_client_disconnect_cancels_a_queued_job(pool: Pool, tmp_path: Path) -> None:
    """
    A client that leaves while its job waits behind a busy node: the job is
    cancelled, and the node never runs it once its seat frees.
    """
    import http.client

    from kcoral.testing.live_server import multipart_body

    pool.node("node-a")
    holder = threading.Thread(
        target=post_program,
        args=(pool.port, side_effect_program(tmp_path / "long", 5.0)),
        kwargs={"timeout": 300},
    )
    holder.start()
    pool.wait_for(lambda h: h["load"]["requests_in_progress"] == 1)
    marks = tmp_path / "marks"
    content_type, body = multipart_body(side_effect_program(marks, 0.0))
    connection = http.client.HTTPConnection("127.0.0.1", pool.port, timeout=60)
    connection.request("POST", "/execute", body=body, headers={"Content-Type": content_type})
    pool.wait_for(lambda h: h["load"]["requests_waiting"] == 1)
    connection.close()
    health = pool.wait_for(lambda h: h["load"]["requests_waiting"] == 0)
    assert health["gateway"]["requests"].get("client_disconnected") == 1
    holder.join()
    # The seat is free again and the queue has been drained: nothing ran.
    pool.wait_for(lambda h: h["gateway"]["pool"]["free_seats"] == 1)
    time.sleep(PRESENCE_TIMEOUT)
    assert not marks.exists()


def test_nats_down_503_for_new_work_running_jobs_still_answer(pool: Pool, tmp_path: Path) -> None:
    """
    With nats-server gone, a running job still delivers its result over
    HTTP, and a new request is answered 503 (never run).
    """
    pool.node("node-a", seats=2)
    answer: list[Any] = []
    running = threading.Thread(
        target=lambda: answer.append(
            post_program(pool.port, side_effect_program(tmp_path / "running", 4.0), timeout=300)
        )
    )
    running.start()
    pool.wait_for(lambda h: h["load"]["requests_in_progress"] == 1)
    pool.nats.kill()
    pool.wait_for(lambda h: h["gateway"]["nats"] == "disconnected")
    marks = tmp_path / "marks"
    refused = post_program(pool.port, side_effect_program(marks, 0.0), timeout=120)
    assert refused.status == 503, refused.body
    assert refused.headers.get("retry-after") == "1"
    running.join()
    assert answer[0].status == 200, answer[0].body
    assert answer[0].json()["status"] == "COMPLETED"
    assert not marks.exists()


def test_gateway_restart_with_new_settings(pool: Pool, tmp_path: Path) -> None:
    """
    A gateway started again with another --queue-size and --presence-timeout
    on the same nats-server adopts the stream and buckets, and serves.
    """
    assert pool.gateway is not None
    pool.gateway.stop()
    pool.gateway = GatewayProcess(
        pool.nats.url,
        pool.nats.credentials_file("gateway"),
        args=["--presence-timeout", "5", "--queue-size", "16"],
        log_path=tmp_path / "gateway-2.log",
    ).start()
    pool.node("node-a")
    health = pool.health()
    assert health["status"] == "ok"
    assert health["gateway"]["queue_size"] == 16
    response = post_program(pool.port, side_effect_program(tmp_path / "marks", 0.0))
    assert response.status == 200 and response.json()["status"] == "COMPLETED"


def test_a_starting_gateway_reads_the_pool_before_it_refuses(pool: Pool, tmp_path: Path) -> None:
    """
    A gateway process listens before it has reached NATS and read the
    nodes' presence.  Requests that arrive in that window, on both front
    ends of a restarted C{--front-ends 2} gateway, wait for the reading and
    run, rather than being refused with "no node in the pool".
    """
    pool.node("node-a", seats=2)
    assert pool.gateway is not None
    port = pool.gateway.port
    pool.gateway.stop()
    marks = tmp_path / "marks"
    answers: list[tuple[int, bytes]] = []

    def one() -> None:
        # Spin until the port takes a connection, then ask at once.
        deadline = time.monotonic() + 60.0
        while True:
            try:
                response = post_program(port, side_effect_program(marks, 0.0), timeout=30.0)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.001)
        answers.append((response.status, response.body))

    clients = [threading.Thread(target=one) for _ in range(12)]
    for client in clients:
        client.start()
    pool.gateway = GatewayProcess(
        pool.nats.url,
        pool.nats.credentials_file("gateway"),
        args=["--presence-timeout", str(PRESENCE_TIMEOUT), "--front-ends", "2"],
        port=port,
        log_path=tmp_path / "gateway-2.log",
    ).start()
    for client in clients:
        client.join(90.0)
    assert len(answers) == 12
    assert all(status == 200 and b"COMPLETED" in body for status, body in answers), [
        (status, body[:200]) for status, body in answers if status != 200
    ]
    assert marks.read_text().count("ran") == 12


def _gateway_events(log_dir: Path) -> list[dict[str, Any]]:
    """Every event in the run directories directly under C{log_dir}."""
    return [
        json.loads(line)
        for path in sorted(log_dir.glob("runs/*/events.jsonl"))
        for line in path.read_text().splitlines()
    ]


def test_gateway_events_are_logged(tmp_path: Path) -> None:
    """
    C{--log-dir}: the gateway's own events (its start, the node joining, the
    job's queueing and claim, the request's end, its stop) are written to
    C{events.jsonl} in a run directory, as the server's are.
    """
    log_dir = tmp_path / "gateway-logs"
    pool = Pool(tmp_path, "--log-dir", str(log_dir)).start()
    try:
        pool.node("node-a")
        response = post_program(pool.port, side_effect_program(tmp_path / "marks", 0.0))
        assert response.status == 200 and response.json()["status"] == "COMPLETED"
    finally:
        pool.stop()
    events = _gateway_events(log_dir)
    names = [e["event"] for e in events]
    for name in ("server_listening", "node_joined", "job_queued", "job_claimed"):
        assert name in names, names
    finished = [e for e in events if e["event"] == "request_finished"]
    assert [e["http_status"] for e in finished] == [200], finished
    assert names[-1] == "server_stopped", names


def test_front_ends_share_the_port_and_answer_their_own_jobs(tmp_path: Path) -> None:
    """
    C{--front-ends 2}: both processes answer on the client port, each
    publishes its jobs with its own node port and result subjects, so
    every node's result reaches the process that holds the client; stopping the gateway stops
    both.  Each logs under its own directory (C{front-end-1} for the second).
    """
    log_dir = tmp_path / "gateway-logs"
    pool = Pool(tmp_path, "--front-ends", "2", "--log-dir", str(log_dir)).start()
    try:
        assert pool.gateway is not None
        pool.node("node-a", seats=2)
        seen = pool.gateway.front_ends_answering(20)
        assert set(seen) == {0, 1}
        places = [h["gateway"]["front_end"] for h in seen.values()]
        assert len({p["public_url"] for p in places}) == 2
        assert all(p["count"] == 2 for p in places)
        other = next(p["pid"] for p in places if p["index"] == 1)
        marks = tmp_path / "marks"
        for _ in range(16):
            # A fresh connection each: the kernel spreads them over both.
            response = post_program(pool.port, side_effect_program(marks, 0))
            assert response.status == 200, response.body[:300]
            assert b"COMPLETED" in response.body
        assert marks.read_text().count("ran") == 16
        # Each result went back over NATS, to the subject of the process
        # that published its job (and so holds its client).
        # (The node logs it once the gateway's reply is in: after the client's answer.)
        finished = "join_job_finished via=nats gateway_status=200"
        for _ in range(100):
            node_log = (tmp_path / "node-a.log").read_text()
            if node_log.count(finished) >= 16:
                break
            time.sleep(0.05)
        assert node_log.count(finished) == 16, node_log
        # Each front end's new /health: each relayed some of the 16.
        for _ in range(100):
            seen = pool.gateway.front_ends_answering(20)
            if len(seen) == 2:
                break
        relayed = {i: h["gateway"]["requests"].get("relayed", 0) for i, h in seen.items()}
        assert sum(relayed.values()) == 16, relayed
        assert all(relayed.values()), relayed
    finally:
        pool.stop()
    queued = {
        where: len([e for e in _gateway_events(where) if e["event"] == "job_queued"])
        for where in (log_dir, log_dir / "front-end-1")
    }
    assert sum(queued.values()) == 16 and all(queued.values()), queued
    assert not psutil.pid_exists(other) or psutil.Process(other).status() == "zombie"


PID_SOURCE = "import os\n\ndef f():\n    return os.getpid()\n"
PID_PROGRAM = {
    "instructions": [
        {"op": "upload", "id": "m", "kind": "module", "source": PID_SOURCE},
        {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "f"},
        {"op": "run", "id": "r", "fn": {"$ref": "f"}},
        {"op": "return", "key": "pid", "value": {"$ref": "r"}},
    ]
}


def test_reused_node_workers_keep_the_gateways_clients_apart(tmp_path: Path) -> None:
    """
    A node that reuses workers (C{--max-requests-per-worker 0}, the default
    C{--reuse-scope address}) keeps the gateway's clients apart as it keeps
    its direct ones: the job carries who sent it (here its token's client
    name), so one client's later program never runs in the worker that ran
    another's, while one client's programs do share it.
    """
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice {'a' * 32}\nbob {'b' * 32}\n")
    tokens.chmod(0o600)
    pool = Pool(tmp_path, "--auth-token-file", str(tokens)).start()
    try:
        pool.node("node-a", seats=1, extra=["--max-requests-per-worker", "0"])

        def pid_for(token: str) -> int:
            response = post_program(
                pool.port, PID_PROGRAM, headers={"Authorization": f"Bearer {token}"}
            )
            assert response.status == 200, response.body[:300]
            body = response.json()
            assert body["status"] == "COMPLETED", body
            return int(body["results"]["pid"]["value"])

        alice = pid_for("a" * 32)
        assert pid_for("a" * 32) == alice
        bob = pid_for("b" * 32)
        assert bob != alice
        assert pid_for("b" * 32) == bob
    finally:
        pool.stop()


def test_a_gateway_that_cannot_start_says_why(pool: Pool, tmp_path: Path) -> None:
    """
    A second gateway on a port already taken exits 1, and its
    C{server_start_failed} event names the cause, on the console and in
    C{events.jsonl}, as the server's does.
    """
    assert pool.gateway is not None
    log_dir = tmp_path / "second-logs"
    second = GatewayProcess(
        pool.nats.url,
        pool.nats.credentials_file("gateway"),
        args=["--log-dir", str(log_dir)],
        port=pool.gateway.port,
        log_path=tmp_path / "second.log",
    )
    try:
        # /health on that port is the first gateway's: the start may return
        # before the second has failed, or raise once it has.
        second.start()
    except RuntimeError:
        pass
    assert second.process is not None
    assert second.process.wait(30) == 1
    (failed,) = [e for e in _gateway_events(log_dir) if e["event"] == "server_start_failed"]
    assert "CannotListenError" in failed["error"], failed
    assert "server_start_failed" in (tmp_path / "second.log").read_text()
