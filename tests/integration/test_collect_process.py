"""
L{kcoral.server.sandbox.collect} with real processes on the real reactor:
the input reaches the child, each sink keeps its bounded share, and a child
that does not end is killed with everything it started.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.trial.unittest import TestCase

from kcoral.server.sandbox.collect import Finished, Sink, kill_group, run_bounded

pytestmark = pytest.mark.integration

#: Answers its stdin upper-cased on fd 3, writes a lot on stdout and a line
#: on stderr, exits 7.
_CHILD = (
    "import os, sys\n"
    "data = sys.stdin.buffer.read()\n"
    "os.write(3, data.upper())\n"
    "sys.stdout.write('x' * 100000 + 'end'); sys.stdout.flush()\n"
    "sys.stderr.write('done\\n'); sys.stderr.flush()\n"
    "sys.exit(7)\n"
)


class RealProcessTests(TestCase):
    """A real child process, run through L{run_bounded}."""

    timeout = 60

    def test_output_bounded_and_status(self) -> None:
        """Stdin is fed; the answer, the bounded output and the status come back."""
        env = {"PATH": "/usr/bin:/bin"}
        d = run_bounded(
            reactor,
            sys.executable,
            [sys.executable, "-I", "-c", _CHILD],
            env=env,
            sinks={
                "answer": Sink((3,), 100),
                "out": Sink((1,), 1000, tail=True),
                "err": Sink((2,), 100),
            },
            timeout=30.0,
            stdin=b"request",
        )

        def check(finished: Finished) -> None:
            self.assertEqual(bytes(finished.output["answer"]), b"REQUEST")
            out = bytes(finished.output["out"])
            self.assertEqual(len(out), 1000)
            self.assertEqual(out, b"x" * 997 + b"end")
            self.assertEqual(bytes(finished.output["err"]), b"done\n")
            self.assertEqual(finished.overflowed, frozenset({"out"}))
            self.assertEqual((finished.status, finished.timed_out), (7, False))

        return d.addCallback(check)

    def test_killed_with_its_group(self) -> None:
        """A child that outlives its time is killed, its own child with it."""
        # The child leads a session of its own and starts a grandchild that
        # keeps the output pipe open: only the group kill ends them both
        # (until then the pipe never closes and the result never fires).
        child = (
            "import os, subprocess, sys, time\n"
            "os.setsid()\n"
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            "print('started', flush=True)\n"
            "time.sleep(600)\n"
        )
        d: Deferred[Any] = run_bounded(
            reactor,
            sys.executable,
            [sys.executable, "-I", "-c", child],
            env={"PATH": "/usr/bin:/bin"},
            sinks={"out": Sink((1, 2), 1000)},
            timeout=5.0,
            kill=kill_group,
        )

        def check(finished: Finished) -> None:
            self.assertTrue(finished.timed_out)
            self.assertEqual(finished.status, -9)
            self.assertIn(b"started", bytes(finished.output["out"]))

        return d.addCallback(check)
