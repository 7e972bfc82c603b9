# -*- test-case-name: tests.integration.test_node_join -*-
"""
Real nodes (C{kcoral server --device cpu --join ...}) in a pool on a real
nats-server, with L{kcoral.testing.pool.PoolStandIn} in the gateway's
place: it publishes jobs, cancels, serves blobs and takes results.

Programs leave a side effect (a line in a file, one per run), so "never
run" and "run once" are read from the file system, not from what the node
says.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest

from kcoral.gateway.jobs import JOB_SUBJECTS, NODES_BUCKET, job_subject, node_inbox
from kcoral.gateway.natsbridge import load_credentials
from kcoral.testing.live_server import Response, ServerProcess, request
from kcoral.testing.nats import (
    GATEWAY_USER,
    NatsServer,
    NatsUser,
    gateway_permissions,
    node_permissions,
)
from kcoral.testing.pool import PoolStandIn

pytestmark = pytest.mark.integration

NODE_ARGS = ["--device", "cpu", "--sandbox", "none", "--log-dir", "", "--disk-cache-dir", ""]

#: Appends "<tag> <pid>" to a file, then returns the blob's length.
MARK = (
    "import os\n"
    "def f(path, tag, b):\n"
    "    with open(path, 'a') as out:\n"
    "        out.write(f'{tag} {os.getpid()}\\n')\n"
    "    return len(b)\n"
)

#: Waits until a file exists, then returns its argument.
GATE = (
    "import os, time\n"
    "def f(path, tag):\n"
    "    while not os.path.exists(path):\n"
    "        time.sleep(0.02)\n"
    "    return tag\n"
)

#: Sleeps, then appends its tag.
SLOW = (
    "import time\n"
    "def f(path, tag, s):\n"
    "    time.sleep(s)\n"
    "    with open(path, 'a') as out:\n"
    "        out.write(tag + '\\n')\n"
    "    return tag\n"
)


def program(source: str, args: list[Any], blob: bytes | None = None) -> dict[str, Any]:
    instructions: list[dict[str, Any]] = [
        {"op": "upload", "kind": "module", "id": "m", "source": source},
        {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "f"},
    ]
    run_args: list[Any] = list(args)
    if blob is not None:
        digest = hashlib.sha256(blob).hexdigest()
        instructions.append({"op": "upload", "kind": "bytes", "id": "b", "blob": digest})
        run_args.append({"$ref": "b"})
    instructions += [
        {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": run_args},
        {"op": "return", "key": "r", "value": {"$ref": "r"}},
    ]
    return {"instructions": instructions}


def marks(path: Path) -> list[str]:
    if not path.exists():
        return []
    return [line.split()[0] for line in path.read_text().splitlines() if line]


def wait_for(predicate: Any, timeout: float = 30.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what} not reached in time")


@pytest.fixture(scope="module")
def nats_server() -> Iterator[NatsServer]:
    with NatsServer(node_ids=("node-a", "node-b", "node-c")) as server:
        yield server


@pytest.fixture(scope="module")
def pool(nats_server: NatsServer) -> Iterator[PoolStandIn]:
    with PoolStandIn(nats_server) as stand_in:
        yield stand_in


def node_args(
    nats_server: NatsServer, node_id: str, *extra: str, credentials: Path | None = None
) -> list[str]:
    return [
        *NODE_ARGS,
        *extra,
        "--join",
        nats_server.url,
        "--node-id",
        node_id,
        "--credentials",
        str(credentials or nats_server.credentials_file(node_id)),
    ]


def start_node(nats_server: NatsServer, node_id: str, log: Path, *extra: str) -> ServerProcess:
    return ServerProcess(node_args(nats_server, node_id, *extra), log_path=log).start()


def exit_status(
    nats_server: NatsServer, node_id: str, log: Path, *extra: str, credentials: Path | None = None
) -> int | None:
    """
    The exit status of a node that must fail to start (its HTTP port may
    answer /health for a moment before the join fails the start).
    """
    node = ServerProcess(
        node_args(nats_server, node_id, *extra, credentials=credentials), log_path=log
    )
    try:
        node.start()
    except RuntimeError:
        pass
    assert node.process is not None
    try:
        return node.process.wait(60)
    finally:
        node.stop()


@pytest.fixture(scope="module")
def node_a(
    nats_server: NatsServer, pool: PoolStandIn, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("node-a") / "node.log"
    node = start_node(nats_server, "node-a", log, "--num-workers", "2")
    try:
        pool.wait_presence("node-a")
        yield node
    finally:
        node.stop()


def test_job_runs_with_blob_from_gateway(
    node_a: ServerProcess, pool: PoolStandIn, tmp_path: Path
) -> None:
    """
    A job runs on the node: the blob it lacks is fetched from the gateway
    with the job's token (once: the second job finds it cached), the
    node's own response is posted back, and the claim names the node.
    """
    presence = pool.wait_presence("node-a")
    assert presence.seats == 2 and presence.gpus == 0
    blob = os.urandom(3000)
    out = tmp_path / "runs"
    first = pool.publish(program(MARK, [str(out), "one"], blob), presence.compat, blobs=[blob])
    result = pool.wait_result(first.job)
    assert result.status == 200 and result.node == "node-a"
    body = result.json()
    assert body["status"] == "COMPLETED" and body["request_id"] == first.request_id
    assert body["results"]["r"]["value"] == len(blob)
    assert pool.fetches[first.job] == [hashlib.sha256(blob).hexdigest()]
    claim = pool.claim_of(first.job)
    assert claim is not None and claim.node == "node-a"
    second = pool.publish(program(MARK, [str(out), "two"], blob), presence.compat, blobs=[blob])
    assert pool.wait_result(second.job).json()["status"] == "COMPLETED"
    assert second.job not in pool.fetches
    # The fetched blob is in the server's own cache: a direct request that
    # names it without sending it runs (no CACHE_MISS).
    direct = node_a.execute(program(MARK, [str(out), "three"], blob))
    assert direct.json()["status"] == "COMPLETED"
    assert marks(out) == ["one", "two", "three"]


def test_small_result_over_nats_else_posted(
    node_a: ServerProcess, pool: PoolStandIn, tmp_path: Path
) -> None:
    """
    A job that names result subjects gets its small result back as a NATS
    request on them, from the node its subject names; when nobody listens
    there (no responders), the node posts it over HTTP instead.
    """
    presence = pool.wait_presence("node-a")
    out = tmp_path / "runs"
    pool.listen_results("standin")
    heard = pool.publish(
        program(MARK, [str(out), "nats"], b"n"), presence.compat, blobs=[b"n"], results="standin"
    )
    result = pool.wait_result(heard.job)
    assert (result.via, result.node, result.status) == ("nats", "node-a", 200)
    assert result.json()["request_id"] == heard.request_id
    unheard = pool.publish(
        program(MARK, [str(out), "http"], b"h"), presence.compat, blobs=[b"h"], results="nobody"
    )
    result = pool.wait_result(unheard.job)
    assert (result.via, result.node, result.status) == ("http", "node-a", 200)
    assert result.json()["status"] == "COMPLETED"
    assert marks(out) == ["nats", "http"]
    assert pool.refused == 0


def test_node_without_result_permission_posts(tmp_path: Path) -> None:
    """
    A node whose NATS user may not publish on its result subjects (its
    permissions from before results went over NATS) gets no reply: its
    first result is posted after the reply's timeout, and the next ones
    are posted at once (NATS results paused), all delivered.
    """
    old = node_permissions("node-old")
    old["publish"]["allow"] = [s for s in old["publish"]["allow"] if "results" not in s]
    users = {
        GATEWAY_USER: NatsUser(GATEWAY_USER, os.urandom(8).hex(), gateway_permissions()),
        "node-old": NatsUser("node-old", os.urandom(8).hex(), old),
    }
    with NatsServer(node_ids=("node-old",), users=users) as server, PoolStandIn(server) as pool:
        pool.listen_results("standin")
        node = start_node(server, "node-old", tmp_path / "node.log")
        try:
            presence = pool.wait_presence("node-old")
            out = tmp_path / "runs"
            first = pool.publish(
                program(MARK, [str(out), "one"], b"1"),
                presence.compat,
                blobs=[b"1"],
                results="standin",
            )
            result = pool.wait_result(first.job)
            assert (result.via, result.status) == ("http", 200)
            started = time.monotonic()
            second = pool.publish(
                program(MARK, [str(out), "two"], b"2"),
                presence.compat,
                blobs=[b"2"],
                results="standin",
            )
            result = pool.wait_result(second.job)
            assert (result.via, result.status) == ("http", 200)
            assert time.monotonic() - started < 4.0  # no second reply timeout
            assert marks(out) == ["one", "two"]
            log = (tmp_path / "node.log").read_text()
            assert log.count("join_result_nats_paused") == 1, log
        finally:
            node.stop()


def test_cancelled_claim_never_runs(
    node_a: ServerProcess, pool: PoolStandIn, tmp_path: Path
) -> None:
    """
    A job whose cancel claim came first is taken off the queue by the node
    and never run: no side effect, no result, and its blob (which the node
    lacks) not fetched: the node's checks begin while its claim is on its
    way, but a blob is fetched only once the claim is won.
    """
    presence = pool.wait_presence("node-a")
    out = tmp_path / "runs"
    job = "cancelled-" + os.urandom(4).hex()
    assert pool.cancel(job)
    blob = os.urandom(64)
    pool.publish(program(MARK, [str(out), "no"], blob), presence.compat, blobs=[blob], job=job)
    # The node claims before it acknowledges: an empty queue means it decided.
    wait_for(lambda: pool.queued() == 0, what="the job leaving the queue")
    # A job published after it runs, so the node is past the cancelled one.
    after = pool.publish(program(MARK, [str(out), "yes"], b"y"), presence.compat, blobs=[b"y"])
    pool.wait_result(after.job)
    assert marks(out) == ["yes"]
    assert job not in pool.results
    assert job not in pool.fetches
    claim = pool.claim_of(job)
    assert claim is not None and claim.cancelled


def test_claim_wins_once_under_a_race(
    node_a: ServerProcess, nats_server: NatsServer, pool: PoolStandIn, tmp_path: Path
) -> None:
    """
    Two nodes, each job published twice (the same job id on the queue, as
    after a redelivery): both nodes race for the claims, and each job runs
    exactly once and is posted once.
    """
    node_b = start_node(nats_server, "node-b", tmp_path / "node-b.log", "--num-workers", "2")
    try:
        presence = pool.wait_presence("node-b")
        out = tmp_path / "runs"
        jobs = [f"race-{i}-{os.urandom(3).hex()}" for i in range(12)]
        for job in jobs:
            message = pool.publish(
                program(MARK, [str(out), job], b"r"), presence.compat, blobs=[b"r"], job=job
            )
            pool.republish(message, presence.compat)
        for job in jobs:
            pool.wait_result(job)
        wait_for(lambda: pool.queued() == 0, what="an empty queue")
        runs = Counter(marks(out))
        assert runs == Counter(dict.fromkeys(jobs, 1))
        posts = Counter(job for job, _ in pool.posts if job in jobs)
        assert posts == Counter(dict.fromkeys(jobs, 1))
        winners = {job: pool.claim_of(job) for job in jobs}
        assert all(c is not None and c.node in ("node-a", "node-b") for c in winners.values())
    finally:
        node_b.stop()


def test_blob_hash_mismatch_refused(
    node_a: ServerProcess, pool: PoolStandIn, tmp_path: Path
) -> None:
    """
    A gateway serving bytes that do not match the blob's hash: the node
    refuses the blob, the program never runs, and the result is an engine
    error naming the blob.
    """
    presence = pool.wait_presence("node-a")
    blob = os.urandom(2048)
    digest = hashlib.sha256(blob).hexdigest()
    pool.corrupt[digest] = os.urandom(len(blob))
    out = tmp_path / "runs"
    job = pool.publish(program(MARK, [str(out), "bad"], blob), presence.compat, blobs=[blob])
    result = pool.wait_result(job.job)
    assert result.status == 500
    body = result.json()
    assert body["status"] == "ERROR" and body["error"]["kind"] == "engine"
    assert digest in body["error"]["message"] and "refused" in body["error"]["message"]
    assert marks(out) == []


def test_wrong_credentials_refused(nats_server: NatsServer, tmp_path: Path) -> None:
    """A node whose password nats-server refuses does not start, and says why."""
    wrong = nats_server.write_credentials(tmp_path / "wrong.json", "node-c", "not-its-password")
    log = tmp_path / "node.log"
    assert exit_status(nats_server, "node-c", log, credentials=wrong) == 1
    assert "refused the credentials of node node-c" in log.read_text()


def test_node_cannot_publish_jobs_or_pose_as_another(
    nats_server: NatsServer, pool: PoolStandIn
) -> None:
    """
    With a node's own credentials file and reply prefix (as C{--join} uses
    them), publishing a job, writing another node's presence key and
    sending a result as another node are refused by nats-server: none lands.
    """
    credentials = load_credentials(str(nats_server.credentials_file("node-c")))
    errors: list[str] = []

    async def attempt() -> tuple[int, list[str]]:
        async def error_cb(e: Exception) -> None:
            errors.append(str(e).lower())

        client = await nats.connect(
            nats_server.url,
            inbox_prefix=node_inbox("node-c"),
            allow_reconnect=False,
            error_cb=error_cb,
            **credentials.connect_options(),
        )
        try:
            js = client.jetstream()
            before = (await js.stream_info("KCORAL_JOBS")).state.messages
            with pytest.raises(nats.errors.TimeoutError):
                await js.publish(job_subject("0" * 16, 0), b'{"job": "forged"}', timeout=1)
            nodes = await js.key_value(NODES_BUCKET)
            with pytest.raises(nats.errors.TimeoutError):
                await nodes.put("node-a", b'{"node": "node-a"}')
            # A result as another node is refused; as itself it is allowed.
            await client.publish("kcoral.results.gw.node-a", b"forged")
            await client.publish("kcoral.results.gw.node-c", b"mine")
            await client.flush()
            # The server's -ERR reaches the error callback a moment later.
            for _ in range(100):
                if any("kcoral.results.gw.node-a" in e for e in errors):
                    break
                await asyncio.sleep(0.02)
            return before, errors
        finally:
            await client.close()

    before, seen = asyncio.run(attempt())
    assert pool.queued() == before
    assert any("permissions violation" in e and "kcoral.jobs." in e for e in seen), seen
    assert any("permissions violation" in e and "$kv.kcoral-nodes.node-a" in e for e in seen)
    assert any("permissions violation" in e and "kcoral.results.gw.node-a" in e for e in seen)
    assert not any("kcoral.results.gw.node-c" in e for e in seen), seen
    assert JOB_SUBJECTS.startswith("kcoral.jobs.")


def test_presence_expires_after_sigkill(
    nats_server: NatsServer, pool: PoolStandIn, tmp_path: Path
) -> None:
    """A node killed with SIGKILL leaves no presence behind once the TTL passes."""
    node = start_node(nats_server, "node-c", tmp_path / "node.log")
    try:
        pool.wait_presence("node-c")
        assert node.process is not None
        node.process.send_signal(signal.SIGKILL)
        node.process.wait(30)
        wait_for(lambda: "node-c" not in pool.presence(), what="node-c's key expiring")
    finally:
        node.stop()


def test_running_job_delivers_while_nats_is_down(
    nats_server: NatsServer, pool: PoolStandIn, tmp_path: Path
) -> None:
    """
    nats-server stops while a job runs: the job's result still reaches the
    gateway over HTTP; once nats-server is back, the node pulls again.
    """
    node = start_node(nats_server, "node-c", tmp_path / "node.log")
    try:
        presence = pool.wait_presence("node-c")
        out = tmp_path / "runs"
        slow = pool.publish(
            program(SLOW, [str(out), "slow", 3.0]), presence.compat, prefer="node-c", prefer_for=120
        )
        wait_for(lambda: pool.claim_of(slow.job) or None, what="the claim")
        nats_server.stop()
        try:
            result = pool.wait_result(slow.job)
            assert result.json()["results"]["r"]["value"] == "slow"
            assert result.node == "node-c"
        finally:
            nats_server.start()
            pool.reconnect()
        after = pool.publish(program(SLOW, [str(out), "after", 0]), presence.compat)
        assert pool.wait_result(after.job).json()["status"] == "COMPLETED"
        assert marks(out) == ["slow", "after"]
        log = (tmp_path / "node.log").read_text()
        assert "join_nats_lost" in log
    finally:
        node.stop()


def test_refuses_to_listen_beyond_loopback(nats_server: NatsServer, tmp_path: Path) -> None:
    """C{--join} with a port other machines could reach stops at once, saying so."""
    log = tmp_path / "node.log"
    status = exit_status(nats_server, "node-c", log, "--listen", "tcp:0:interface=0.0.0.0")
    assert status not in (0, None)
    assert "listens on loopback only" in log.read_text()


def test_node_with_tokens_runs_jobs(
    nats_server: NatsServer, pool: PoolStandIn, tmp_path: Path
) -> None:
    """
    A node whose port wants bearer tokens (--auth-token-file) still runs
    its pool's jobs: they run in process, not through its port.
    """
    tokens = tmp_path / "tokens"
    tokens.write_text("operator s3cret-token-for-the-test\n")
    tokens.chmod(0o600)
    node = start_node(
        nats_server, "node-c", tmp_path / "node.log", "--auth-token-file", str(tokens)
    )
    try:
        presence = pool.wait_presence("node-c")
        out = tmp_path / "runs"
        # Preferred for longer than the test: node-a, if running, leaves it alone.
        job = pool.publish(
            program(MARK, [str(out), "tok"], b"t"),
            presence.compat,
            blobs=[b"t"],
            prefer="node-c",
            prefer_for=120,
        )
        result = pool.wait_result(job.job)
        assert result.status == 200 and result.json()["status"] == "COMPLETED"
        assert result.node == "node-c"
        assert marks(out) == ["tok"]
    finally:
        node.stop()


def completed(node: ServerProcess) -> float:
    """The node's C{kcoral_requests_total{outcome="completed"}} (every front end)."""
    from prometheus_client.parser import text_string_to_metric_families

    response = request(node.port, "GET", "/metrics")
    assert response.status == 200
    return sum(
        sample.value
        for family in text_string_to_metric_families(response.body.decode())
        for sample in family.samples
        if sample.name == "kcoral_requests_total" and sample.labels["outcome"] == "completed"
    )


def request_events(log_dir: Path, request_id: str) -> list[dict[str, Any]]:
    runs = list((log_dir / "runs").iterdir())
    assert len(runs) == 1, runs
    lines = (runs[0] / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("request_id") == request_id]


def test_job_runs_in_process_like_a_request(
    nats_server: NatsServer, pool: PoolStandIn, tmp_path: Path
) -> None:
    """
    A pool job goes through the node's own /execute pipeline in process:
    the node's log has the request events a direct request has (received,
    accepted, routed, finished), under the job's request id, and its
    /metrics counts the job as it counts a direct request.
    """
    log_dir = tmp_path / "logs"
    node = start_node(nats_server, "node-c", tmp_path / "node.log", "--log-dir", str(log_dir))
    try:
        presence = pool.wait_presence("node-c")
        out = tmp_path / "runs"
        before = completed(node)
        job = pool.publish(
            program(MARK, [str(out), "job"], b"j"),
            presence.compat,
            blobs=[b"j"],
            prefer="node-c",
            prefer_for=120,
        )
        result = pool.wait_result(job.job)
        assert result.status == 200 and result.json()["request_id"] == job.request_id
        direct = node.execute(program(MARK, [str(out), "direct"], b"d"), [b"d"])
        assert direct.json()["status"] == "COMPLETED"
        assert completed(node) == before + 2
        direct_id = direct.json()["request_id"]

        def both_finished() -> Any:
            found = [request_events(log_dir, rid) for rid in (job.request_id, direct_id)]
            finished = all(any(e["event"] == "request_finished" for e in f) for f in found)
            return found if finished else None

        job_events, direct_events = wait_for(both_finished, what="both requests' events")
        names = [e["event"] for e in job_events if e["event"].startswith("request_")]
        assert names == [e["event"] for e in direct_events if e["event"].startswith("request_")]
        # Around them, the node's own: claimed, then finished and posted.
        assert [e["event"] for e in job_events if e["event"].startswith("join_")] == [
            "join_job_claimed",
            "join_job_finished",
        ]
        for name in ("request_received", "request_accepted", "request_routed"):
            assert name in names
        received = next(e for e in job_events if e["event"] == "request_received")
        assert received["via"] == "join"
        finished = next(e for e in job_events if e["event"] == "request_finished")
        assert finished["finish_reason"] == "completed"
        assert marks(out) == ["job", "direct"]
        # `kcoral server --join` runs on Twisted's asyncio reactor, so its
        # NATS client shares the reactor's loop (no thread hop per job).
        runs = list((log_dir / "runs").iterdir())
        events = map(json.loads, (runs[0] / "events.jsonl").read_text().splitlines())
        client = [e for e in events if e.get("event") == "join_nats_client"]
        assert [e["inline"] for e in client] == [True]
    finally:
        node.stop()


def test_program_error_answered_as_direct(
    node_a: ServerProcess, pool: PoolStandIn, tmp_path: Path
) -> None:
    """
    A program the pipeline refuses (a 4xx) is answered exactly as a direct
    /execute of it is: the same status, content type and ERROR body.
    """
    presence = pool.wait_presence("node-a")
    bad = {"instructions": [{"op": "no-such-op", "id": "x"}]}
    job = pool.publish(bad, presence.compat)
    result = pool.wait_result(job.job)
    direct = node_a.execute(bad)
    assert 400 <= direct.status < 500
    assert (result.status, result.content_type) == (
        direct.status,
        direct.headers["content-type"],
    )
    body = result.json()
    assert body["request_id"] == job.request_id
    body["request_id"] = direct.json()["request_id"]
    assert body == direct.json()


def seen_free(pool: PoolStandIn, node: str) -> int | None:
    """The free seats of C{node}'s presence key (C{None}: not read this time)."""
    presence = pool.presence().get(node)
    return None if presence is None else presence.free


def seen_at(pool: PoolStandIn, node: str) -> float:
    """When C{node} last put its presence key (0: not read this time)."""
    presence = pool.presence().get(node)
    return 0.0 if presence is None else presence.at


def test_free_seats_are_the_pools(
    nats_server: NatsServer, pool: PoolStandIn, tmp_path: Path
) -> None:
    """
    A node of one seat advertises no free seat while a direct request holds
    it, and pulls no job meanwhile; once the seat frees it says so and
    takes the job.
    """
    node = start_node(nats_server, "node-c", tmp_path / "node.log", "--num-workers", "1")
    gate = tmp_path / "gate"
    try:
        presence = pool.wait_presence("node-c")
        assert (presence.seats, presence.free) == (1, 1)
        answers: list[Response] = []
        direct = threading.Thread(
            target=lambda: answers.append(node.execute(program(GATE, [str(gate), "direct"])))
        )
        direct.start()
        wait_for(lambda: seen_free(pool, "node-c") == 0, what="no free seat")
        job = pool.publish(
            program(GATE, [str(gate), "job"]), presence.compat, prefer="node-c", prefer_for=120
        )
        # Two more presence puts: the node has had its chances to pull.
        seen = wait_for(lambda: seen_at(pool, "node-c"), what="the presence key")
        wait_for(lambda: seen_at(pool, "node-c") > seen + 1.5, what="two presence puts")
        assert pool.claim_of(job.job) is None
        assert pool.queued() == 1
        gate.touch()
        direct.join(60)
        assert answers[0].json()["results"]["r"]["value"] == "direct"
        result = pool.wait_result(job.job)
        assert result.json()["results"]["r"]["value"] == "job"
        assert result.node == "node-c"
        wait_for(lambda: seen_free(pool, "node-c") == 1, what="the seat free again")
    finally:
        gate.touch()
        node.stop()
