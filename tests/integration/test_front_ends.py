"""
C{--front-ends 2}: two server processes on one port (C{SO_REUSEPORT}),
each with its own share of the seats, the first keeping the leases and
restarting the second when it dies.  Real processes, real HTTP.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from kcoral.testing.live_server import ServerProcess, request

pytestmark = pytest.mark.integration

ADD = "def add(a, b):\n    return a + b\n"


def _program(a: int) -> dict[str, Any]:
    return {
        "instructions": [
            {"op": "upload", "id": "m", "kind": "module", "source": ADD},
            {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "add"},
            {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": [a, 1]},
            {"op": "return", "key": "out", "value": {"$ref": "r"}},
        ]
    }


def _front_ends_seen(server: ServerProcess, tries: int = 60) -> dict[int, dict[str, Any]]:
    """Each front end's /health, from new connections; each says it is one of two."""
    seen = server.front_ends_answering(tries)
    assert all(health["front_end"]["of"] == 2 for health in seen.values()), seen
    return seen


def _completed_by_front_end(server: ServerProcess) -> dict[str, float]:
    """C{kcoral_requests_total{outcome="completed"}} of one C{/metrics} answer, by front end."""
    from prometheus_client.parser import text_string_to_metric_families

    response = request(server.port, "GET", "/metrics")
    assert response.status == 200
    return {
        sample.labels["front_end"]: sample.value
        for family in text_string_to_metric_families(response.body.decode())
        for sample in family.samples
        if sample.name == "kcoral_requests_total" and sample.labels["outcome"] == "completed"
    }


def _events(log_dir: Path) -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for path in sorted(log_dir.rglob("events.jsonl"))
        for line in path.read_text().splitlines()
    ]


def _logged(log_dir: Path, event: str, timeout: float = 10.0) -> list[dict[str, Any]]:
    """
    The C{event} lines in the logs under C{log_dir}, waiting for at least
    one: each process's log lines are written by a writer thread in
    batches, so a line logged a moment ago by another front end may not be
    in its file yet when this process's answer arrives.
    """
    deadline = time.monotonic() + timeout
    while True:
        found = [e for e in _events(log_dir) if e.get("event") == event]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def _second(server: ServerProcess) -> psutil.Process:
    assert server.process is not None
    (child,) = [
        p
        for p in psutil.Process(server.process.pid).children()
        if "kcoral.server.frontend_main" in " ".join(p.cmdline())
    ]
    return child


def _started(tmp_path: Path, *flags: str) -> ServerProcess:
    """A CPU server of two front ends with a seat each, logging under C{tmp_path/logs}."""
    server = ServerProcess(
        [
            *("--device", "cpu", "--num-workers", "2", "--front-ends", "2", "--sandbox", "none"),
            *("--log-dir", str(tmp_path / "logs"), *flags),
        ],
        log_path=tmp_path / "server.out",
    )
    return server.start(timeout=120)


def test_two_front_ends_share_the_port(tmp_path: Path) -> None:
    log_dir = tmp_path / "logs"
    server = _started(tmp_path, "--max-requests-per-worker", "0")
    try:
        deadline = time.monotonic() + 30
        while True:
            seen = _front_ends_seen(server, 10)
            if len(seen) == 2 and all(h["front_end"]["reporting"] == [0, 1] for h in seen.values()):
                break
            assert time.monotonic() < deadline, seen
        # Either answers for the whole server: both seats, each with its front end.
        for health in seen.values():
            workers = sorted((w["worker_id"], w["front_end"]) for w in health["workers"])
            assert workers == [("cpu/w0", 0), ("cpu/w1", 1)], health
            assert health["load"]["request_capacity"] == 2
        for a in range(30):
            body = json.loads(server.execute(_program(a)).body)
            assert body["status"] == "COMPLETED", body
            assert body["results"]["out"]["value"] == a + 1
        second = _second(server)
        # Both front ends answered programs: each logged its own.
        time.sleep(1.0)
        finished = {
            path.relative_to(log_dir).parts[0]: sum(
                json.loads(line).get("event") == "request_finished"
                for line in path.read_text().splitlines()
            )
            for path in log_dir.rglob("events.jsonl")
        }
        assert finished.get("runs", 0) > 0 and finished.get("front-end-1", 0) > 0, finished
        assert finished["runs"] + finished["front-end-1"] == 30
        # /metrics from either front end has both front ends' series: their
        # completed requests add up to the 30 (the other's as of its last
        # report, at most a second old).
        deadline = time.monotonic() + 10
        while True:
            completed = _completed_by_front_end(server)
            if sum(completed.values()) == 30:
                break
            assert time.monotonic() < deadline, completed
            time.sleep(0.2)
        assert set(completed) == {"0", "1"} and all(completed.values()), completed
        # The second dies: the first starts it again.
        second.send_signal(signal.SIGKILL)
        second.wait(10)
        deadline = time.monotonic() + 30
        while True:
            try:
                replacement = _second(server)
                if replacement.pid != second.pid and 1 in _front_ends_seen(server, 10):
                    break
            except ValueError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.2)
        exited = _logged(log_dir, "front_end_exited")
        assert [(e["index"], e["code"]) for e in exited] == [(1, None)]
    finally:
        pids = [p.pid for p in psutil.Process(server.process.pid).children(recursive=True)]  # type: ignore[union-attr]
        assert server.stop() == 0
    time.sleep(0.5)
    assert not [
        pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"
    ]


def test_the_others_stop_when_the_first_dies(tmp_path: Path) -> None:
    """
    The first front end is SIGKILLed (its broker with it): the second
    stops by itself instead of serving with no lease, and says why.
    """
    log_dir = tmp_path / "logs"
    server = _started(tmp_path)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                second = _second(server)
                break
            except ValueError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        while 1 not in _front_ends_seen(server, 10):
            assert time.monotonic() < deadline
        assert server.process is not None
        server.process.kill()
        server.process.wait(10)
        second.wait(30)
    finally:
        server.stop()
    lost = [e for e in _events(log_dir / "front-end-1") if e.get("event") == "broker_lost"]
    assert len(lost) == 1
    names = [e.get("event") for e in _events(log_dir / "front-end-1")]
    assert names.index("broker_lost") < names.index("shutdown_complete")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--num-workers", "2", "--front-ends", "3"], "--front-ends (3) must not exceed"),
        (
            ["--front-ends", "2", "--num-workers", "2", "--listen", "unix:kcoral.sock"],
            "--front-ends needs plain TCP endpoints",
        ),
    ],
)
def test_front_ends_refused(tmp_path: Path, flags: list[str], message: str) -> None:
    import subprocess
    import sys

    completed = subprocess.run(
        [sys.executable, "-m", "kcoral", "server", "--device", "cpu", *flags],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert completed.returncode == 2, completed.stderr
    assert message in completed.stderr


def test_lame_duck_every_front_end(tmp_path: Path) -> None:
    """
    SIGTERM with --lame-duck-seconds goes to the first front end; within a
    report or two, /health answers 503 C{stopping} from every front end
    (the kernel spreads new connections over both), while programs are
    still run; a second SIGTERM ends the wait and the server exits 0.
    """
    server = _started(tmp_path, "--lame-duck-seconds", "60", "--max-requests-per-worker", "0")
    try:
        deadline = time.monotonic() + 30
        while True:
            seen = _front_ends_seen(server, 10)
            if len(seen) == 2 and all(h["front_end"]["reporting"] == [0, 1] for h in seen.values()):
                break
            assert time.monotonic() < deadline, seen
        assert server.process is not None
        server.process.send_signal(signal.SIGTERM)
        # A guard against a hang, far inside the 60 s lame duck.
        deadline = time.monotonic() + 30
        stopping: set[int] = set()
        while stopping != {0, 1}:
            assert time.monotonic() < deadline, stopping
            response = request(server.port, "GET", "/health")
            body = response.json()
            if response.status == 503:
                assert body["status"] == "stopping"
                stopping.add(body["front_end"]["index"])
            else:
                assert (response.status, body["status"]) == (200, "ok")
        answer = server.execute(_program(41))
        assert answer.status == 200
        assert answer.json()["status"] == "COMPLETED"
        started = _logged(tmp_path / "logs", "lame_duck_started")
        assert [e["seconds"] for e in started] == [60.0]
    finally:
        code = server.stop()
    assert code == 0
