"""
Output without end (issue 13, item 4): captured stdout goes to the worker's
own size-limited tmpfs, not the host's disk.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kcoral.testing.live_server import ServerProcess
from tests.reliability.conftest import assert_serves, body_of, requires_bwrap, run_program

pytestmark = [pytest.mark.integration, requires_bwrap]

#: Writes C{mbytes} MiB to fd 1; returns how many it wrote and why it stopped.
FLOOD = r"""
import errno
import os


def flood(mbytes):
    chunk = b"y" * (1 << 20)
    written = 0
    try:
        for _ in range(mbytes):
            written += os.write(1, chunk)
    except OSError as e:
        return [written, errno.errorcode.get(e.errno, "")]
    return [written, ""]
"""

SPACE = 4 * 1024 * 1024


@pytest.fixture(scope="module")
def server(attacked_server: Callable[..., ServerProcess]) -> ServerProcess:
    return attacked_server(
        "--num-workers",
        "1",
        "--max-output-limit-bytes",
        "1048576",
        "--output-space-bytes",
        str(SPACE),
    )


def test_stdout_flood_is_bounded(server: ServerProcess) -> None:
    response = server.execute(run_program(FLOOD, "flood", 256))
    assert response.status == 200, response.body[:2000]
    body = body_of(response)
    assert body["status"] == "COMPLETED", body
    written, reason = [item["value"] for item in body["results"]["out"]["value"]]
    assert reason == "ENOSPC"
    assert written <= SPACE
    assert body["stdout_truncated"] is True
    assert_serves(server)
