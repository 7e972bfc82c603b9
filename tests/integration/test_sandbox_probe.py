"""
Integration tests for L{kcoral.server.sandbox.bubblewrap} with the real reactor and
real processes: the startup probe against the installed bwrap and against
fake ones, the fallback choice, and what a program sees inside the sandbox.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.protocol import ProcessProtocol
from twisted.internet.testing import EventLoggingObserver
from twisted.logger import Logger, LogLevel
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase

from kcoral.config import ServerConfig
from kcoral.server.sandbox.bubblewrap import BubblewrapSandbox
from kcoral.server.sandbox.interface import SandboxError
from kcoral.server.sandbox.nosandbox import NoSandbox
from kcoral.server.sandbox.probe import FALLBACK_PREFIX, choose_sandbox, probe_sandbox

pytestmark = pytest.mark.integration

HAVE_BWRAP = sys.platform.startswith("linux") and shutil.which("bwrap") is not None
NO_BWRAP = "needs Linux and bwrap on PATH"


def _temp_dir(test: TestCase, **kwargs: Any) -> Path:
    path = Path(tempfile.mkdtemp(prefix="kcoral-test-", **kwargs))
    test.addCleanup(shutil.rmtree, path, True)
    return path


def _fake_bwrap(test: TestCase, body: str) -> str:
    """Write an executable shell script standing in for bwrap; return its path."""
    path = _temp_dir(test) / "bwrap"
    path.write_text("#!/bin/sh\n" + body + "\n")
    os.chmod(path, 0o755)
    return str(path)


def _processes_mentioning(text: str) -> list[int]:
    """Pids of live (non-zombie) processes whose command line contains C{text}."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode("utf-8", "replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(int(entry))
    return found


class ProbeTests(TestCase):
    """L{probe_sandbox} against the installed bwrap and against fakes."""

    def probe(self, sandbox: BubblewrapSandbox, **kwargs: Any) -> Deferred[str | None]:
        kwargs.setdefault("gpu_device_sets", [[]])
        return Deferred.fromCoroutine(probe_sandbox(reactor, sandbox, **kwargs))

    @pytest.mark.skipif(not HAVE_BWRAP, reason=NO_BWRAP)
    async def test_succeeds(self) -> None:
        """The real bwrap starts the probe program; the probe records bwrap's path and flags."""
        sandbox = BubblewrapSandbox([])
        self.assertIsNone(await self.probe(sandbox))
        self.assertEqual(sandbox.executable, os.path.abspath(shutil.which("bwrap") or ""))
        self.assertIsInstance(sandbox.disable_userns, bool)
        # (Every bwrap since 0.4 takes it: nvcc compiles use it, issue 38.)
        self.assertTrue(sandbox.share_net)

    @pytest.mark.skipif(not HAVE_BWRAP, reason=NO_BWRAP)
    async def test_succeeds_per_device_set(self) -> None:
        """Every distinct device configuration is probed in the same, cleared workspace."""
        node = _temp_dir(self) / "nvidia0"
        node.write_text("")
        sandbox = BubblewrapSandbox([])
        result = await self.probe(sandbox, gpu_device_sets=[[], [str(node)], [], [str(node)]])
        self.assertIsNone(result)

    async def test_timeout(self) -> None:
        """
        A bwrap that hangs fails the probe with the timeout message after about
        C{timeout} seconds, and nothing it started is left running.
        """
        marker = f"1000.{uuid.uuid4().int % 10**9}"
        bwrap = _fake_bwrap(self, f"sleep {marker}")
        start = time.monotonic()
        result = await self.probe(BubblewrapSandbox([], bwrap=bwrap), timeout=1.0)
        elapsed = time.monotonic() - start
        self.assertEqual(result, "bubblewrap startup probe timed out after 1.0s")
        self.assertLess(elapsed, 4.0)
        self.assertEqual(_processes_mentioning(marker), [])
        self.assertEqual(_processes_mentioning(bwrap), [])

    async def test_exit_status(self) -> None:
        """A bwrap that fails reports its status and output."""
        bwrap = _fake_bwrap(self, "echo 'bwrap: setting up uid map: Permission denied' >&2\nexit 1")
        result = await self.probe(BubblewrapSandbox([], bwrap=bwrap))
        self.assertEqual(
            result,
            "bubblewrap startup probe exited with status 1: "
            "bwrap: setting up uid map: Permission denied",
        )

    async def test_no_confirmation(self) -> None:
        """A bwrap that exits 0 without the readiness line fails too."""
        bwrap = _fake_bwrap(self, "exit 0")
        result = await self.probe(BubblewrapSandbox([], bwrap=bwrap))
        self.assertEqual(
            result, "bubblewrap startup probe exited with status 0: no readiness confirmation"
        )

    async def test_missing_binary(self) -> None:
        """Without bwrap the probe says to install it."""
        missing = str(_temp_dir(self) / "no-bwrap-here")
        for bwrap in (missing, f"kcoral-no-such-bwrap-{uuid.uuid4().hex}"):
            result = await self.probe(BubblewrapSandbox([], bwrap=bwrap))
            self.assertEqual(
                result, "bubblewrap isolation requires bwrap on PATH; install bubblewrap"
            )

    @pytest.mark.skipif(not HAVE_BWRAP, reason=NO_BWRAP)
    async def test_missing_readonly_path(self) -> None:
        """A missing extra read-only path fails the probe."""
        missing = str(_temp_dir(self) / "missing")
        result = await self.probe(BubblewrapSandbox([missing]))
        self.assertEqual(result, f"sandbox read-only path does not exist: {missing}")


class ChooseSandboxTests(TestCase):
    """L{choose_sandbox} probes and falls back."""

    def choose(self, config: ServerConfig, **kwargs: Any) -> tuple[Deferred[Any], list[Any]]:
        observer = EventLoggingObserver()
        log = Logger(namespace="kcoral.test", observer=observer)
        return choose_sandbox(reactor, config, log, **kwargs), observer

    @pytest.mark.skipif(not HAVE_BWRAP, reason=NO_BWRAP)
    async def test_bubblewrap(self) -> None:
        """A working bwrap gives a probed L{BubblewrapSandbox} and no warning."""
        extra = _temp_dir(self)
        config = ServerConfig(device="cpu", sandbox_readonly_paths=[extra])
        d, events = self.choose(config)
        sandbox = await d
        self.assertIsInstance(sandbox, BubblewrapSandbox)
        self.assertEqual(sandbox.readonly_paths, (str(extra),))
        self.assertIsNotNone(sandbox.executable)
        self.assertEqual(list(events), [])
        self.assertEqual(self.flushWarnings([self.test_bubblewrap]), [])

    async def test_required_sandbox_fails(self) -> None:
        """
        With C{sandbox="bubblewrap"} a failed probe stops the start: programs
        never run unsandboxed when the operator asked for the sandbox.
        """
        bwrap = _fake_bwrap(self, "echo nope >&2\nexit 1")
        d, events = self.choose(ServerConfig(device="cpu"), bwrap=bwrap)
        with self.assertRaises(SandboxError) as caught:
            await d
        self.assertIn("bubblewrap cannot run", str(caught.exception))
        self.assertIn("nope", str(caught.exception))
        self.assertIn("--sandbox auto", str(caught.exception))
        self.assertEqual(list(events), [])

    async def test_fallback(self) -> None:
        """
        With C{sandbox="auto"} a failed probe gives L{NoSandbox}, a
        C{sandbox_disabled} WARNING and a RuntimeWarning.
        """
        bwrap = _fake_bwrap(self, "echo nope >&2\nexit 1")
        d, events = self.choose(ServerConfig(device="cpu", sandbox="auto"), bwrap=bwrap)
        sandbox = await d
        self.assertIsInstance(sandbox, NoSandbox)
        error = "bubblewrap startup probe exited with status 1: nope"
        full_text = FALLBACK_PREFIX + error
        self.assertTrue(
            full_text.startswith(
                "bubblewrap could not start; filesystem isolation is disabled for this server run: "
            )
        )
        self.assertEqual(len(events), 1)
        event = events[0]
        self.assertEqual(event["log_level"], LogLevel.warn)
        self.assertEqual(event["kcoral_event"], "sandbox_disabled")
        self.assertEqual(event["sandbox"], "none")
        self.assertEqual(event["error"], error)
        self.assertEqual(event["message"], full_text)
        warned = self.flushWarnings()
        self.assertEqual(
            [(w["category"], w["message"]) for w in warned], [(RuntimeWarning, full_text)]
        )

    async def test_none_skips_probe(self) -> None:
        """C{sandbox="none"} returns L{NoSandbox} without probing (even with a broken bwrap)."""
        bwrap = _fake_bwrap(self, "exit 1")
        d, events = self.choose(ServerConfig(device="cpu", sandbox="none"), bwrap=bwrap)
        self.assertIsInstance(await d, NoSandbox)
        self.assertEqual(list(events), [])
        self.assertEqual(self.flushWarnings(), [])


_INSIDE = r"""
import json, os, socket, sys
secret, port = sys.argv[1], int(sys.argv[2])
res = {"cwd": os.getcwd(), "home": os.environ.get("HOME"), "uid": os.getuid()}
with open("/work/hello.txt", "w") as f:
    f.write("hi")
try:
    open("/rootfile", "w").close()
    res["root_write"] = "ok"
except OSError as e:
    res["root_write"] = e.errno
res["tmp"] = "/work/.kcoral/tmp" if os.path.samefile("/tmp", "/work/.kcoral/tmp") else os.path.realpath("/tmp")
with open("/tmp/t.txt", "w") as f:
    f.write("t")
res["secret_visible"] = os.path.exists(secret) or os.path.exists(os.path.dirname(secret))
res["etc"] = sorted(os.listdir("/etc"))
import kcoral.wire.channel
res["kcoral"] = kcoral.wire.channel.__file__
s = socket.socket()
s.settimeout(3)
try:
    s.connect(("127.0.0.1", port))
    res["connect"] = "ok"
except OSError as e:
    res["connect"] = repr(e)
line = b""
while not line.endswith(b"\n"):
    chunk = os.read(3, 100)
    if not chunk:
        break
    line += chunk
os.write(4, line.upper())
print(json.dumps(res), flush=True)
"""


class _ChannelProtocol(ProcessProtocol):
    def __init__(self) -> None:
        self.data: dict[int, bytes] = {1: b"", 2: b"", 4: b""}
        self.ended: Deferred[Any] = Deferred()

    def connectionMade(self) -> None:
        self.transport.closeStdin()
        self.transport.writeToChild(3, b"ping over fd three\n")
        self.transport.closeChildFD(3)

    def childDataReceived(self, childFD: int, data: bytes) -> None:
        self.data[childFD] = self.data.get(childFD, b"") + data

    def processEnded(self, reason: Failure) -> None:
        self.ended.callback(reason.value)


@pytest.mark.skipif(not HAVE_BWRAP, reason=NO_BWRAP)
class InsideTests(TestCase):
    """A real program run with the bubblewrap command line sees only what it should."""

    async def test_isolation(self) -> None:
        """
        cwd is a writable C{/work}; C{/} is read-only; C{/tmp} lies in
        C{/work/.kcoral/tmp}; host files outside the read-only binds are
        invisible; the kcoral package imports from its read-only bind; loopback TCP to the host fails; fds 3 and 4 work.
        """
        sandbox = BubblewrapSandbox([])
        self.assertIsNone(
            await Deferred.fromCoroutine(probe_sandbox(reactor, sandbox, gpu_device_sets=[[]]))
        )
        seat = _temp_dir(self)
        work = sandbox.prepare_seat(seat)

        hidden_parent = "/root" if os.access("/root", os.W_OK) else "/var"
        hidden = _temp_dir(self, dir=hidden_parent)
        secret = hidden / "secret.txt"
        secret.write_text("secret")

        listener = socket.socket()
        self.addCleanup(listener.close)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]

        executable, argv, env = sandbox.command(
            python=sys.executable, worker_args=[], work_dir=work, gpu_devices=[]
        )
        argv = argv[: argv.index("--") + 1] + [
            sandbox.path_inside(sys.executable),
            "-c",
            _INSIDE,
            str(secret),
            str(port),
        ]
        proto = _ChannelProtocol()
        reactor.spawnProcess(
            proto,
            executable,
            argv,
            env=env,
            childFDs={0: "w", 1: "r", 2: "r", 3: "w", 4: "r"},
        )
        reason = await proto.ended
        self.assertEqual(reason.exitCode, 0, proto.data[2].decode())
        res = json.loads(proto.data[1])

        self.assertEqual(res["cwd"], "/work")
        self.assertEqual(res["home"], "/work/.kcoral/home")
        self.assertEqual((work / "hello.txt").read_text(), "hi")
        self.assertEqual(res["root_write"], errno.EROFS)
        self.assertEqual(res["tmp"], "/work/.kcoral/tmp")
        self.assertEqual((work / ".kcoral" / "tmp" / "t.txt").read_text(), "t")
        self.assertFalse(res["secret_visible"])
        self.assertNotIn("passwd", res["etc"])
        self.assertFalse(res["kcoral"].startswith("/work/"), res["kcoral"])
        self.assertNotEqual(res["connect"], "ok")
        self.assertEqual(proto.data[4], b"PING OVER FD THREE\n")
