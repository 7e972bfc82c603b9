"""
What workers send may not make the server use more than its channel
budget, however many workers send at once (issue 32, item 5, "channel
memory").

Each frame was checked against its own request's limits only: an outcome
whose JSON header is as large as the largest response, written by the
program itself on fd 4, took about 0.8 GB of server memory to read and
decode, per worker.  Now every frame over 64 KiB first reserves what it may
cost from one budget for all workers (C{--max-channel-bytes}), a worker
whose reservation does not fit is not read until it does, and a header
that may take more than half the budget to decode is refused.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from kcoral.testing.live_server import ServerProcess
from tests.reliability.conftest import assert_serves, body_of, requires_bwrap, run_program

pytestmark = [pytest.mark.integration, requires_bwrap]

MIB = 1 << 20

#: Writes, on fd 4, a complete outcome whose results are a list of
#: C{count} zeros (two bytes of JSON each, about ten bytes decoded).
DENSE_OUTCOME = r"""
import os
import struct


def send(count):
    head = b'{"type":"outcome","status":"COMPLETED","results":{"out":{"value":['
    tail = (
        b'0]}},"error":null,"stdout":"","stderr":"","stdout_truncated":false,'
        b'"stderr_truncated":false,"retire":null,"oversize":null,"part_sizes":[],'
        b'"streamed_parts":0}'
    )
    body = b"0," * (count - 1)
    length = len(head) + len(body) + len(tail)
    os.write(4, struct.pack(">IQ", length, 0))
    for chunk in (head, body, tail):
        view = memoryview(chunk)
        while view:
            view = view[os.write(4, view):]
    return "sent"
"""


@pytest.fixture(scope="module")
def server(attacked_server: Callable[..., ServerProcess]) -> ServerProcess:
    # The default budget: 512 MiB for frames being read, as much for what
    # decoded messages keep.
    return attacked_server("--num-workers", "4")


@pytest.fixture(scope="module")
def small_budget(attacked_server: Callable[..., ServerProcess]) -> ServerProcess:
    return attacked_server("--num-workers", "3", "--max-channel-bytes", str(64 * MIB))


class _Peak:
    """The largest RSS a process reached while this sampled it."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.peak = self.process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self.process.memory_info().rss)
            except psutil.Error:
                return
            time.sleep(0.02)

    def __enter__(self) -> _Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture
def rss(server: ServerProcess) -> Iterator[int]:
    assert server.process is not None
    yield psutil.Process(server.process.pid).memory_info().rss


def test_dense_outcomes_from_every_worker(server: ServerProcess, rss: int) -> None:
    """
    Four programs at once each write an 80 MB outcome of dense JSON (the
    old server read and decoded each at once, over half a gigabyte apiece):
    they are read one at a time, each header is refused before it is
    decoded, each request fails as an invalid worker response naming the
    budget, the server grows by less than a gigabyte, and it serves on.
    """
    assert server.process is not None
    count = 40_000_000
    with _Peak(server.process.pid) as peak, ThreadPoolExecutor(4) as pool:
        responses = list(
            pool.map(lambda _: server.execute(run_program(DENSE_OUTCOME, "send", count)), range(4))
        )
    for response in responses:
        assert response.status == 500, response.body[:2000]
        error = body_of(response)["error"]
        assert error["kind"] == "engine", error
        assert "invalid worker response" in error["message"], error
        assert "--max-channel-bytes" in error["message"], error
    grown = peak.peak - rss
    assert grown < 1024 * MIB, grown
    assert_serves(server)


def test_outcome_over_the_whole_budget(server: ServerProcess) -> None:
    """A frame that could never fit is refused from its prefix, nothing of it kept."""
    response = server.execute(run_program(DENSE_OUTCOME, "send", 100_000_000))
    assert response.status == 500, response.body[:2000]
    error = body_of(response)["error"]
    assert "over the channel budget" in error["message"], error
    assert_serves(server)


def test_costly_results_are_too_large(small_budget: ServerProcess) -> None:
    """
    An honest program whose JSON results would take the server more than
    the budget's decode share is answered C{response_too_large} (the
    worker leaves them out), from the outcome and from returns sent ahead;
    results within it come back.
    """
    source = "def many(n):\n    return list(range(n))\n"
    response = small_budget.execute(run_program(source, "many", 2_000_000))
    assert response.status == 500, response.body[:2000]
    assert body_of(response)["error"]["kind"] == "response_too_large", response.body[:2000]
    program = run_program(source, "many", 2_000_000)
    program["instructions"].append({"op": "return", "key": "again", "value": {"$ref": "r"}})
    response = small_budget.execute(program)
    assert response.status == 500, response.body[:2000]
    assert body_of(response)["error"]["kind"] == "response_too_large", response.body[:2000]
    response = small_budget.execute(run_program(source, "many", 20_000))
    assert response.status == 200, response.body[:2000]
    body = body_of(response)
    assert body["status"] == "COMPLETED", body
    assert [item["value"] for item in body["results"]["out"]["value"]] == list(range(20_000))
    # A large binary result is not JSON: it goes through.
    blob = "def big():\n    return b'x' * (24 << 20)\n"
    response = small_budget.execute(run_program(blob, "big"))
    assert response.status == 200, response.body[:200]
    assert_serves(small_budget)


def test_budget_serves_concurrent_large_results(small_budget: ServerProcess) -> None:
    """
    Under a budget smaller than what several large results need at once,
    they wait their turn rather than fail.
    """
    source = "import json\ndef text(n):\n    return 'y' * n\n"
    size = 6 * MIB
    with ThreadPoolExecutor(4) as pool:
        responses = list(
            pool.map(lambda _: small_budget.execute(run_program(source, "text", size)), range(4))
        )
    for response in responses:
        assert response.status == 200, response.body[:2000]
        assert len(json.loads(response.body)["results"]["out"]["value"]) == size
    assert_serves(small_budget)
