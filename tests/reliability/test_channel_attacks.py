"""
Attacks on the control channel from an uploaded program (issue 13, item 1).

The program has code execution inside its worker, so it can write anything
to the worker's channel fd.  The parent must bound what it keeps by what the
request may legitimately send, fail only that request, and retire the worker.
"""

from __future__ import annotations

from collections.abc import Callable

import psutil
import pytest

from kcoral.testing.live_server import ServerProcess
from tests.reliability.conftest import assert_serves, body_of, requires_bwrap, run_program

pytestmark = [pytest.mark.integration, requires_bwrap]

#: Writes a frame prefix claiming a 2**39-byte payload, then floods the
#: channel with C{mbytes} MiB; returns how far it got (it should be killed).
FLOOD = r"""
import os
import struct


def flood(mbytes):
    header = b'{"type":"outcome"}'
    os.write(4, struct.pack(">IQ", len(header), 1 << 39) + header)
    chunk = b"x" * (1 << 20)
    written = 0
    try:
        for _ in range(mbytes):
            os.write(4, chunk)
            written += 1
    except OSError as e:
        return ["stopped", written, e.errno]
    return ["flooded", written]
"""


#: Writes the parent's own C{lease_next} message to the parent, as if the
#: worker could tell the parent who is next in line.
FORGED_LEASE_NEXT = r"""
import os
import struct


def forge():
    header = b'{"type":"lease_next"}'
    os.write(4, struct.pack(">IQ", len(header), 0) + header)
    return "sent"
"""


@pytest.fixture(scope="module")
def server(attacked_server: Callable[..., ServerProcess]) -> ServerProcess:
    return attacked_server("--num-workers", "1", "--max-response-bytes", "1000000")


def test_flood_frame_header(server: ServerProcess) -> None:
    """
    A 2**39-byte frame claim is refused from its prefix: the server's memory
    stays bounded, the request fails as an invalid worker response, and the
    next request is served by a fresh worker.
    """
    process = psutil.Process(server.process.pid)  # type: ignore[union-attr]
    assert_serves(server)
    before = process.memory_info().rss
    response = server.execute(run_program(FLOOD, "flood", 1024))
    grown = process.memory_info().rss - before
    assert response.status == 500, response.body[:2000]
    body = body_of(response)
    assert body["status"] == "ERROR"
    assert body["error"]["kind"] == "engine"
    assert "over the limit" in body["error"]["message"]
    # The old server kept every flooded byte (1 GiB here).
    assert grown < 64 * 1024 * 1024, grown
    assert_serves(server)


def test_a_worker_sending_lease_next_is_refused(server: ServerProcess) -> None:
    """
    C{lease_next} goes from the parent to a worker only: a program that
    sends one fails its own request as an invalid worker response, and the
    next request is served by a fresh worker.
    """
    assert_serves(server)
    response = server.execute(run_program(FORGED_LEASE_NEXT, "forge"))
    assert response.status == 500, response.body[:2000]
    body = body_of(response)
    assert body["error"]["kind"] == "engine"
    assert "lease_next" in body["error"]["message"]
    assert_serves(server)
