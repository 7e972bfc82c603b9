"""
What a program writes to its workspace is bounded and never reaches the
host's disk (issue 32, item 5, "host disk").

The workspace (C{/work} in the sandbox) was a bind of a host directory:
a program filled the host's disk at about 460 MB/s, without a quota.  A
worker that serves one request now gets a private tmpfs of
C{--workspace-bytes} there instead (forked and spawned workers alike):
writes past it fail with C{ENOSPC}, nothing is written to the host's disk,
and it is gone with the worker.
"""

from __future__ import annotations

import glob
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable

import pytest

from kcoral.testing.live_server import Response, ServerProcess
from tests.reliability.conftest import assert_serves, body_of, requires_bwrap, run_program

pytestmark = [pytest.mark.integration, requires_bwrap]

MIB = 1 << 20

#: Writes up to C{mib} MiB to a file in the workspace, then waits
#: C{linger} seconds holding it; returns what it wrote, the error that
#: stopped it and the size of the workspace's file system.
FILL = r"""
import errno
import json
import os
import time


def fill(mib, linger):
    chunk = b"z" * (1 << 20)
    written = 0
    error = None
    with open("/work/fill", "wb") as f:
        try:
            for _ in range(mib):
                f.write(chunk)
                f.flush()
                written += 1
        except OSError as e:
            error = errno.errorcode.get(e.errno, str(e.errno))
    st = os.statvfs("/work")
    time.sleep(linger)
    return json.dumps([written, error, st.f_blocks * st.f_frsize])
"""

LIST = r"""
import json
import os


def listing():
    return json.dumps(sorted(os.listdir("/work")))
"""


@pytest.fixture(scope="module", params=["fork", "spawn"])
def server(
    attacked_server: Callable[..., ServerProcess], request: pytest.FixtureRequest
) -> ServerProcess:
    return attacked_server(
        "--num-workers", "1", "--worker-start", request.param, "--workspace-bytes", str(64 * MIB)
    )


def _scratch_files(server: ServerProcess, smallest: int) -> list[str]:
    """Files of at least C{smallest} bytes under the server's scratch directory."""
    assert server.process is not None
    found = []
    pattern = os.path.join(tempfile.gettempdir(), f"kcoral-{server.process.pid}-*")
    for root in glob.glob(pattern):
        for directory, _, files in os.walk(root):
            for name in files:
                path = os.path.join(directory, name)
                try:
                    if os.lstat(path).st_size >= smallest:
                        found.append(path)
                except OSError:
                    pass
    return found


def test_workspace_is_bounded(server: ServerProcess) -> None:
    """
    Writing 200 MiB to the workspace stops at the 64 MiB bound with
    C{ENOSPC} (the old server wrote all of it to the host's disk); the next
    request's workspace is empty.
    """
    response = server.execute(run_program(FILL, "fill", 200, 0))
    assert response.status == 200, response.body[:2000]
    body = body_of(response)
    assert body["status"] == "COMPLETED", body
    written, error, size = json.loads(body["results"]["out"]["value"])
    assert error == "ENOSPC", (written, error, size)
    assert written <= 64, written
    assert size == 64 * MIB, size
    listed = body_of(server.execute(run_program(LIST, "listing")))
    assert json.loads(listed["results"]["out"]["value"]) == [".kcoral"], listed
    assert_serves(server)


def test_workspace_never_reaches_the_host_disk(server: ServerProcess) -> None:
    """
    While a program holds a 32 MiB file in its workspace, no such file
    exists anywhere under the server's scratch directory on the host.
    """
    assert _scratch_files(server, MIB) == []
    answer: list[Response] = []
    thread = threading.Thread(
        target=lambda: answer.append(server.execute(run_program(FILL, "fill", 32, 4)))
    )
    thread.start()
    try:
        seen: list[str] = []
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and thread.is_alive():
            seen += _scratch_files(server, MIB)
            time.sleep(0.1)
    finally:
        thread.join()
    body = body_of(answer[0])
    assert body["status"] == "COMPLETED", body
    written, error, _ = json.loads(body["results"]["out"]["value"])
    assert (written, error) == (32, None)
    assert seen == [], seen
    assert_serves(server)
