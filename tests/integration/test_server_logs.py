# -*- test-case-name: tests.integration.test_server_logs -*-
"""
The server's operator-visible output: the run directory, events.jsonl, saved
programs, the console mirror, /metrics and /status (server spec §8).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kcoral.testing.live_server import ServerProcess, request

pytestmark = pytest.mark.integration

ARGS = ["--device", "cpu", "--sandbox", "none", "--num-workers", "1", "--disk-cache-dir", ""]

ECHO = "def f(x):\n    print('hi')\n    return x * 2\n"
CRASH = "import os\ndef f():\n    os._exit(3)\n"
SPIN = "def f():\n    print('spinning', flush=True)\n    while True:\n        pass\n"

RUN_NAME = re.compile(r"^\d{8}T\d{6}\.\d{6}Z(-\d+)?$")


def program(source: str, args: list[Any] | None = None, **options: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "instructions": [
            {"op": "upload", "kind": "module", "id": "m", "source": source},
            {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "f"},
            {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": list(args or [])},
            {"op": "return", "key": "r", "value": {"$ref": "r"}},
        ]
    }
    if options:
        body["options"] = options
    return body


def run_dir(log_dir: Path) -> Path:
    runs = list((log_dir / "runs").iterdir())
    assert len(runs) == 1, runs
    assert RUN_NAME.match(runs[0].name), runs[0].name
    return runs[0]


def events(log_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir(log_dir) / "events.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def wait_for_events(log_dir: Path, predicate: Any, timeout: float = 15.0) -> list[dict[str, Any]]:
    """Events once C{predicate(events)} holds (the log is written as things happen)."""
    deadline = time.monotonic() + timeout
    while True:
        found = events(log_dir)
        if predicate(found):
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"events never matched: {[e['event'] for e in found]}")
        time.sleep(0.05)


def of_request(found: list[dict[str, Any]], rid: str) -> list[dict[str, Any]]:
    return [e for e in found if e.get("request_id") == rid]


@pytest.fixture
def log_dir(tmp_path: Path) -> Path:
    return tmp_path / "logs"


@pytest.fixture
def server(tmp_path: Path, log_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess([*ARGS, "--log-dir", str(log_dir)], log_path=tmp_path / "server.log") as s:
        yield s


def test_run_directory(server: ServerProcess, log_dir: Path) -> None:
    directory = run_dir(log_dir)
    assert (directory / "events.jsonl").is_file()
    # Lines that belong to no request reach the file from a writer thread
    # within 50 ms (kcoral.server.observe.logs), so start-up events may still be on
    # their way when /health first answers.
    deadline = time.monotonic() + 5
    while True:
        found = events(log_dir)
        names = [e["event"] for e in found]
        if {"pool_ready", "server_listening"} <= set(names) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert names[0] == "server_started"
    assert "pool_ready" in names
    assert names.index("pool_ready") < names.index("server_listening")
    for event in found:
        assert re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$", event["timestamp"])
        assert event["level"] in ("INFO", "WARNING", "ERROR")


def test_instruction_events_only_at_debug(server: ServerProcess, log_dir: Path) -> None:
    """At the default level a request's events are its own five, no instruction's."""
    response = server.execute(program(ECHO, [2]))
    assert response.status == 200
    rid = response.headers["x-request-id"]
    found = wait_for_events(
        log_dir, lambda f: any(e["event"] == "request_finished" for e in of_request(f, rid))
    )
    assert [e["event"] for e in of_request(found, rid)] == [
        "request_received",
        "request_accepted",
        "request_routed",
        "request_finished",
    ]


def test_request_events_in_order(tmp_path: Path, log_dir: Path) -> None:
    """With --log-level debug every instruction's start and end are logged too."""
    with ServerProcess(
        [*ARGS, "--log-dir", str(log_dir), "--log-level", "debug"],
        log_path=tmp_path / "server.log",
    ) as server:
        response = server.execute(program(ECHO, [2]))
        assert response.status == 200
        rid = response.headers["x-request-id"]
        found = wait_for_events(
            log_dir, lambda f: any(e["event"] == "request_finished" for e in of_request(f, rid))
        )
    mine = of_request(found, rid)
    steps = [
        [
            {"event": "instruction_started", "index": i, "op": op},
            {"event": "instruction_finished", "index": i, "op": op},
        ]
        for i, op in enumerate(["upload", "get_function", "run", "return"])
    ]
    assert [e["event"] for e in mine] == [
        "request_received",
        "request_accepted",
        "request_routed",
        *[step["event"] for pair in steps for step in pair],
        "request_finished",
    ]
    instructions = [e for e in mine if e["event"].startswith("instruction_")]
    assert [{k: e[k] for k in ("event", "index", "op")} for e in instructions] == [
        step for pair in steps for step in pair
    ]
    assert all(e["worker_id"] == "cpu/w0" and e["level"] == "DEBUG" for e in instructions)
    assert all(e["elapsed_ms"] >= 0 for e in instructions if e["event"] == "instruction_finished")
    mine = [e for e in mine if not e["event"].startswith("instruction_")]
    finished = mine[-1]
    assert finished["finish_reason"] == "completed"
    assert finished["http_status"] == 200
    assert finished["level"] == "INFO"
    routed = mine[2]
    assert routed["worker_id"] == "cpu/w0"
    assert routed["gpu_id"] is None
    # The saved program is named by request_accepted.program.
    accepted = mine[1]
    assert accepted["program"] == f"{rid}.json"
    assert accepted["instructions"] == 4
    saved = run_dir(log_dir) / "programs" / accepted["program"]
    assert json.loads(saved.read_bytes()) == program(ECHO, [2])


def test_upload_timings(server: ServerProcess, log_dir: Path) -> None:
    """
    A 12 MiB blob (written and hashed by threads past 4 MiB): the body's
    arrival (request_received.body_ms) and the moment its blob was hashed
    and sealed (request_accepted.body_ready_ms), in that order.
    """
    blob = os.urandom(12 << 20)
    digest = hashlib.sha256(blob).hexdigest()
    upload = {"op": "upload", "kind": "bytes", "id": "b", "blob": digest}
    response = server.execute({"instructions": [upload]}, [blob])
    assert response.json()["status"] == "COMPLETED"
    rid = response.headers["x-request-id"]
    found = wait_for_events(
        log_dir, lambda f: any(e["event"] == "request_finished" for e in of_request(f, rid))
    )
    events = {e["event"]: e for e in of_request(found, rid)}
    received, accepted = events["request_received"], events["request_accepted"]
    assert accepted["blob_bytes"] == len(blob)
    assert 0 <= received["body_ms"] <= accepted["body_ready_ms"]


def test_no_log_programs(tmp_path: Path, log_dir: Path) -> None:
    with ServerProcess(
        [*ARGS, "--log-dir", str(log_dir), "--no-log-programs"],
        log_path=tmp_path / "server.log",
    ) as server:
        response = server.execute(program(ECHO, [1]))
        rid = response.headers["x-request-id"]
        found = wait_for_events(
            log_dir, lambda f: any(e["event"] == "request_accepted" for e in of_request(f, rid))
        )
    accepted = [e for e in of_request(found, rid) if e["event"] == "request_accepted"]
    assert accepted[0]["program"] is None
    programs = run_dir(log_dir) / "programs"
    assert not programs.exists() or list(programs.iterdir()) == []


def test_crash_events(server: ServerProcess, log_dir: Path) -> None:
    response = server.execute(program(CRASH))
    rid = response.headers["x-request-id"]
    assert response.json()["status"] == "FAILED"
    found = wait_for_events(
        log_dir,
        lambda f: (
            any(e["event"] == "request_finished" for e in of_request(f, rid))
            and any(e["event"] == "worker_retired" for e in f)
        ),
    )
    retired = [e for e in found if e["event"] == "worker_retired"]
    assert retired[0]["reason"] == "crashed"
    assert retired[0]["level"] == "ERROR"
    assert retired[0]["worker_id"] == "cpu/w0"
    assert retired[0]["generation"] == 1
    finished = [e for e in of_request(found, rid) if e["event"] == "request_finished"][0]
    assert finished["finish_reason"] == "crashed"
    assert finished["level"] == "ERROR"
    assert finished["http_status"] == 200
    assert finished["exitcode"] == 3
    assert "output_tail" in finished
    assert finished["instruction_index"] == 2
    # The seat comes back with the next generation.
    wait_for_events(
        log_dir,
        lambda f: any(e["event"] == "worker_ready" and e["generation"] == 2 for e in f),
    )


def test_timeout_events(server: ServerProcess, log_dir: Path) -> None:
    response = server.execute(program(SPIN, timeout_seconds=1))
    assert response.status == 504
    rid = response.headers["x-request-id"]
    found = wait_for_events(
        log_dir,
        lambda f: (
            any(e["event"] == "request_finished" for e in of_request(f, rid))
            and any(e["event"] == "worker_retired" for e in f)
        ),
    )
    retired = [e for e in found if e["event"] == "worker_retired"]
    assert retired[0]["reason"] == "timeout"
    assert retired[0]["level"] == "WARNING"
    finished = [e for e in of_request(found, rid) if e["event"] == "request_finished"][0]
    assert finished["finish_reason"] == "timeout"
    assert finished["level"] == "WARNING"
    assert finished["http_status"] == 504
    assert finished["timeout_seconds"] == 1
    assert finished["worker_id"] == "cpu/w0"
    assert "output_tail" in finished
    assert "queue_ms" in finished and "elapsed_ms" in finished


def test_empty_log_dir_creates_nothing(tmp_path: Path) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    text = _serve_and_capture(["--log-dir", ""], cwd, tmp_path / "stderr.txt")
    assert "request_finished" in text
    assert list(cwd.iterdir()) == []


def _serve_and_capture(args: list[str], cwd: Path, err_path: Path) -> str:
    """Run a server with stderr captured, do one request, return stderr."""
    from kcoral.testing.live_server import free_port, post_program

    port = free_port()
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    with open(err_path, "wb") as err:
        process = subprocess.Popen(
            [sys.executable, "-m", "kcoral", "server", "--port", str(port), *ARGS, *args],
            cwd=cwd,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
        try:
            deadline = time.monotonic() + 60
            while True:
                assert process.poll() is None, "server exited during start"
                try:
                    if request(port, "GET", "/health", timeout=2).status == 200:
                        break
                except OSError:
                    pass
                assert time.monotonic() < deadline
                time.sleep(0.1)
            assert post_program(port, program(ECHO, [1])).status == 200
        finally:
            process.terminate()
            process.wait(60)
    return err_path.read_text()


def test_console_mirror(tmp_path: Path) -> None:
    text = _serve_and_capture(["--log-dir", ""], tmp_path, tmp_path / "stderr.txt")
    assert re.search(r"INFO\s+request_finished request_id=", text)
    assert re.search(r"INFO\s+pool_ready ", text)
    # Skipped keys never appear on the console.
    assert "config=" not in text


def test_no_log_console(tmp_path: Path) -> None:
    text = _serve_and_capture(
        ["--log-dir", "", "--no-log-console"], tmp_path, tmp_path / "stderr.txt"
    )
    assert "request_finished" not in text
    assert "pool_ready" not in text
    # Really quiet: no twistd start-up lines, no access log either.
    assert text == ""


def test_metrics(server: ServerProcess) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    def completed() -> float:
        response = request(server.port, "GET", "/metrics")
        assert response.status == 200
        total = 0.0
        for family in text_string_to_metric_families(response.body.decode()):
            for sample in family.samples:
                if (
                    sample.name == "kcoral_requests_total"
                    and sample.labels.get("outcome") == "completed"
                ):
                    total += sample.value
        return total

    before = completed()
    assert server.execute(program(ECHO, [1])).status == 200
    deadline = time.monotonic() + 10
    while completed() < before + 1:
        assert time.monotonic() < deadline, "kcoral_requests_total did not increase"
        time.sleep(0.05)


def test_status_pages(server: ServerProcess) -> None:
    page = request(server.port, "GET", "/status")
    assert page.status == 200
    assert page.headers["content-type"].startswith("text/html")
    assert b"<" in page.body
    snapshot = request(server.port, "GET", "/status.json")
    assert snapshot.status == 200
    body = snapshot.json()
    assert [w["worker_id"] for w in body["workers"]] == ["cpu/w0"]
