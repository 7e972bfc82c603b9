"""
Stopping a real CPU server (issue 18, item 6): one SIGTERM drains, a second
one stops at once (running requests answered, workers killed, nothing
orphaned).  Loopback only; the programs only sleep.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from kcoral.testing.live_server import Response, ServerProcess
from tests.reliability.conftest import body_of, run_program

pytestmark = [pytest.mark.integration]

SLEEP = "import time\n\ndef f(s):\n    time.sleep(s)\n    return s\n"


def events(log_dir: Path) -> list[dict[str, Any]]:
    (run,) = list((log_dir / "runs").iterdir())
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]


def wait_for(log_dir: Path, name: str, count: int = 1, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sum(1 for e in events(log_dir) if e["event"] == name) >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"no {name} event")


def in_background(server: ServerProcess, seconds: float) -> tuple[threading.Thread, list[Any]]:
    answers: list[Any] = []

    def go() -> None:
        try:
            program = run_program(SLEEP, "f", seconds, options={"timeout_seconds": 900})
            answers.append(server.execute(program, timeout=300))
        except Exception as e:  # pragma: no cover - reported by the test
            answers.append(e)

    thread = threading.Thread(target=go)
    thread.start()
    return thread, answers


def start(log_dir: Path) -> ServerProcess:
    args = ["--device", "cpu", "--sandbox", "none", "--num-workers", "2", "--log-dir", str(log_dir)]
    return ServerProcess(args).start()


def test_one_sigterm_drains(tmp_path: Path) -> None:
    """A single SIGTERM lets a running program finish and answer, then exits 0."""
    server = start(tmp_path)
    assert server.process is not None
    thread, answers = in_background(server, 3)
    wait_for(tmp_path, "request_routed")
    server.process.send_signal(signal.SIGTERM)
    thread.join(120)
    assert server.process.wait(120) == 0
    (answer,) = answers
    assert isinstance(answer, Response) and answer.status == 200
    assert body_of(answer)["results"]["out"]["value"] == 3


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_second_sigterm_stops_at_once(tmp_path: Path, signum: signal.Signals) -> None:
    """
    A second SIGTERM (or SIGINT) during the drain kills the workers: the
    600 s programs are answered (FAILED, the worker exited), the request
    queued behind them was answered 503 by the first signal, and the server
    exits, leaving no process behind.
    """
    server = start(tmp_path)
    assert server.process is not None
    running = [in_background(server, 600) for _ in range(2)]
    wait_for(tmp_path, "request_routed", count=2)
    waiting = in_background(server, 600)
    wait_for(tmp_path, "request_accepted", count=3)
    children = set(psutil.Process(server.process.pid).children(recursive=True))
    assert children
    server.process.send_signal(signum)
    wait_for(tmp_path, "shutdown_started")
    time.sleep(0.5)
    assert server.process.poll() is None  # still draining
    children |= set(psutil.Process(server.process.pid).children(recursive=True))
    second = time.monotonic()
    server.process.send_signal(signum)
    assert server.process.wait(120) == 0
    print(f"exited {time.monotonic() - second:.2f} s after the second signal")
    for thread, _ in [*running, waiting]:
        thread.join(120)
    for _, answers in running:
        (answer,) = answers
        assert isinstance(answer, Response), answer
        # The worker died inside the run instruction: the protocol's FAILED
        # answer for that (kind runtime), not a hang or a dropped connection.
        assert answer.status == 200
        body = body_of(answer)
        assert body["status"] == "FAILED"
        assert body["error"]["kind"] == "runtime"
        assert body["error"]["message"] == "worker exited while executing the instruction"
    (answer,) = waiting[1]
    assert isinstance(answer, Response), answer
    assert (answer.status, body_of(answer)["error"]["kind"]) == (503, "busy")
    assert [e for e in events(tmp_path) if e["event"] == "shutdown_forced"]
    gone, alive = psutil.wait_procs(list(children), timeout=30)
    assert alive == []
