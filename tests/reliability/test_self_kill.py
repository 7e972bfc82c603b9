"""
A program that kills its own worker ends as a crashed worker (issue 32,
item 5, "self-kill ignored").

A forked worker used to be PID 1 of its PID namespace, and the kernel
ignores every signal a namespace's init sends itself without a handler,
C{SIGKILL} included: C{os.kill(os.getpid(), SIGKILL)} did nothing and the
request ended C{COMPLETED}.  The worker now runs as PID 2 under a tiny
init, as a spawned worker runs under bubblewrap's, so the signal kills it
and the answer is the protocol's crash (spec §6.3: 200 C{FAILED}, kind
C{runtime}, "worker exited while executing the instruction", empty
traceback and results).
"""

from __future__ import annotations

import json
import signal
from collections.abc import Callable

import pytest

from kcoral.testing.live_server import ServerProcess
from tests.reliability.conftest import assert_serves, body_of, requires_bwrap, run_program

pytestmark = [pytest.mark.integration, requires_bwrap]

SUICIDE = r"""
import os


def die(signum):
    os.kill(os.getpid(), signum)
    return "still alive"
"""

WHO = r"""
import json
import os


def who():
    pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    with open("/proc/1/comm") as f:
        init = f.read().strip()
    reached = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            reached.append(pid)
        except OSError:
            pass
    # Signals to the namespace's init from inside it are ignored.
    os.kill(1, 9)
    return json.dumps([os.getpid(), pids, init, reached])
"""


@pytest.fixture(scope="module", params=["fork", "spawn"])
def server(
    attacked_server: Callable[..., ServerProcess], request: pytest.FixtureRequest
) -> ServerProcess:
    return attacked_server("--num-workers", "1", "--worker-start", request.param)


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_self_kill_is_a_crash(server: ServerProcess, signum: int) -> None:
    """A program that sends its own process a deadly signal fails as a crash."""
    program = run_program(SUICIDE, "die", int(signum), options={"timeout_seconds": 60})
    response = server.execute(program)
    assert response.status == 200, response.body[:2000]
    body = body_of(response)
    assert body["status"] == "FAILED", body
    error = body["error"]
    assert error["kind"] == "runtime", error
    assert error["message"] == "worker exited while executing the instruction", error
    assert error["instruction_index"] == 2 and error["instruction_op"] == "run", error
    assert error["traceback"] == "", error
    assert body["results"] == {}, body
    assert_serves(server)


def test_worker_is_not_init_and_cannot_kill_it(server: ServerProcess) -> None:
    """
    The worker is not its namespace's PID 1; that init is the only other
    process it sees, and killing it does nothing.
    """
    body = body_of(server.execute(run_program(WHO, "who")))
    assert body["status"] == "COMPLETED", body
    pid, pids, init, reached = json.loads(body["results"]["out"]["value"])
    assert pid != 1, (pid, pids)
    assert pids == [1, pid], pids
    assert reached == [1, pid], reached
    assert init in ("kcoral-init", "bwrap"), init
    assert_serves(server)
