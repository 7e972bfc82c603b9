"""
A program that forges its outcome to read the next client's program
(issue 13, item 2).

With reused workers the next program runs in the same interpreter: a program
can answer for itself early on the channel and then read the parent's next
message.  The server keeps a reused worker to the client address it first
served (C{--reuse-scope address}, the default), so another client's program
never reaches that interpreter.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from kcoral.testing.live_server import ServerProcess
from tests.reliability.conftest import (
    assert_serves,
    body_of,
    post_from,
    requires_bwrap,
    run_program,
)

pytestmark = [pytest.mark.integration, requires_bwrap]

#: Answers for its own request with a forged outcome, then reads the next
#: program sent to its worker and returns that as its own (late) result.
THIEF = r"""
import os
from kcoral.ipc.channel_io import read_message
from kcoral.wire.channel import (
    Execute,
    Outcome,
    encode,
)


def steal():
    os.write(4, encode(Outcome(status="COMPLETED", results={})))
    inbox = os.fdopen(3, "rb", buffering=0, closefd=False)
    while True:
        message = read_message(inbox)
        if message is None:
            return "nothing"
        if isinstance(message, Execute):
            return message.program
"""

SECRET = "victim-secret-4f1c9a"

VICTIM = f"def secret():\n    return {SECRET!r}\n"


@pytest.fixture(scope="module")
def server(attacked_server: Callable[..., ServerProcess]) -> ServerProcess:
    return attacked_server("--num-workers", "1", "--max-requests-per-worker", "0")


def test_forged_outcome_cannot_read_next_client(server: ServerProcess) -> None:
    thief = post_from(server, "127.0.0.2", run_program(THIEF, "steal"))
    assert thief.status == 200, thief.body[:2000]
    victim = post_from(server, "127.0.0.3", run_program(VICTIM, "secret"))
    assert victim.status == 200, victim.body[:2000]
    body = body_of(victim)
    # The victim's own program answered, on a worker the thief never ran in.
    assert body["status"] == "COMPLETED", body
    assert body["results"]["out"]["value"] == SECRET
    assert json.dumps(body).count(SECRET) == 1
    # The thief's address gets nothing of it either.
    again = post_from(server, "127.0.0.2", run_program(VICTIM.replace(SECRET, "x"), "secret"))
    assert SECRET not in again.body.decode("utf-8", "replace")
    assert_serves(server)
