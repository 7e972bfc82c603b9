# -*- test-case-name: tests.integration.test_server -*-
"""
Helpers for tests and benchmarks that drive a real kcoral server.

L{ServerProcess} starts C{python -m kcoral server} on a free loopback port and
waits for C{/health}; L{multipart_body} and L{post_program} speak the wire
protocol with nothing but the standard library, the way an HTTP client would.
These are blocking helpers: use them from tests and scripts, never from the
reactor thread.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import attrs


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = f.read().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port_run(count: int) -> int:
    """
    The first of C{count} consecutive TCP ports on 127.0.0.1 that were all
    free a moment ago, below the kernel's ephemeral range: a port there is
    never some outgoing connection's local port, as the one after a
    L{free_port} may be by the time a server binds it.
    """
    low, _ = _ephemeral_ports()
    top = max(10_000 + count, low - count)
    picker = random.Random()
    for _ in range(500):
        first = picker.randrange(10_000, top)
        if all(_bindable(first + i) for i in range(count)):
            return first
    raise RuntimeError(f"no run of {count} free ports below {low}")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def multipart_body(
    program: dict[str, Any] | bytes, blobs: Sequence[bytes] = (), boundary: str | None = None
) -> tuple[str, bytes]:
    """The C{(content type, body)} the reference client would send."""
    boundary = boundary or uuid.uuid4().hex
    program_bytes = (
        program
        if isinstance(program, bytes)
        else json.dumps(program, separators=(",", ":"), ensure_ascii=False).encode()
    )
    chunks = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="program"\r\n'
        "Content-Type: application/json\r\n\r\n".encode(),
        program_bytes,
        b"\r\n",
    ]
    for blob in blobs:
        digest = hashlib.sha256(blob).hexdigest()
        chunks += [
            f'--{boundary}\r\nContent-Disposition: form-data; name="blob:{digest}"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n".encode(),
            blob,
            b"\r\n",
        ]
    chunks.append(f"--{boundary}--\r\n".encode())
    return f"multipart/form-data; boundary={boundary}", b"".join(chunks)


@attrs.frozen
class Response:
    """A raw HTTP response."""

    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def request(
    port: int,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 120.0,
    host: str = "127.0.0.1",
) -> Response:
    """One HTTP request on a fresh connection."""
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        data = response.read()
        return Response(response.status, {k.lower(): v for k, v in response.getheaders()}, data)
    finally:
        connection.close()


def post_program(
    port: int,
    program: dict[str, Any] | bytes,
    blobs: Sequence[bytes] = (),
    headers: dict[str, str] | None = None,
    timeout: float = 120.0,
) -> Response:
    """POST C{program} (and C{blobs}) to C{/execute}."""
    content_type, body = multipart_body(program, list(blobs))
    all_headers = {"Content-Type": content_type, **(headers or {})}
    return request(port, "POST", "/execute", body, all_headers, timeout)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sandbox_readonly_flags() -> list[str]:
    """
    C{--sandbox-readonly-path} for each C{PYTHONPATH} entry outside the
    project (a C{--target} directory of wheels, as on the GPU machine), so
    sandboxed workers can import what lives there.
    """
    flags = []
    for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        if entry and os.path.isdir(entry) and not os.path.exists(os.path.join(entry, "kcoral")):
            flags += ["--sandbox-readonly-path", entry]
    return flags


def _interruptible() -> None:
    """
    SIGINT at its default in the server: a test run started in the background
    by a shell without job control inherits it ignored, and then neither
    Python nor Twisted installs a handler (the shutdown tests send it).
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _limited(fd_limit: int) -> None:
    """L{_interruptible}, and at most C{fd_limit} open files, soft and hard."""
    import resource

    _interruptible()
    resource.setrlimit(resource.RLIMIT_NOFILE, (fd_limit, fd_limit))


def spawn_kcoral(
    argv: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    log_path: Path | None = None,
    append: bool = False,
    preexec_fn: Callable[[], None] | None = _interruptible,
) -> subprocess.Popen[bytes]:
    """
    C{python -m kcoral ARGV...} from the checkout (or site-packages) that
    holds this package, its output to C{log_path} (appended to with
    C{append}) or nowhere.
    """
    env = dict(os.environ if env is None else env)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    output = open(log_path, "ab" if append else "wb") if log_path else subprocess.DEVNULL
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "kcoral", *argv],
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            preexec_fn=preexec_fn,
        )
    finally:
        if log_path:
            output.close()  # type: ignore[union-attr]


def wait_until_up(
    process: subprocess.Popen[bytes], ready: Callable[[], bool], deadline: float, what: str
) -> None:
    """
    Ask C{ready()} every 0.1 s until it says yes (an L{OSError}, L{ValueError}
    or L{KeyError} is a no).

    @raise RuntimeError: the process exited first.
    @raise TimeoutError: C{deadline} (monotonic) passed first.
    """
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode} during start")
        try:
            if ready():
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.1)
    raise TimeoutError(what)


@attrs.define
class ServerProcess:
    """
    A C{kcoral server} subprocess on a free loopback port.

    Use as a context manager; C{stop()} sends SIGTERM and returns the exit code.
    """

    args: list[str]
    env: dict[str, str] | None = None
    port: int = attrs.field(factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    #: Soft and hard limit on the server's open files, when set (to start it
    #: under a low hard limit, which it cannot raise).
    fd_limit: int | None = None

    def start(self, timeout: float = 60.0) -> ServerProcess:
        self.process = spawn_kcoral(
            ["server", "--host", "127.0.0.1", "--port", str(self.port), *self.args],
            env=self.env,
            log_path=self.log_path,
            preexec_fn=_interruptible
            if self.fd_limit is None
            else partial(_limited, self.fd_limit),
        )
        deadline = time.monotonic() + timeout
        try:
            wait_until_up(
                self.process,
                lambda: request(self.port, "GET", "/health", timeout=2).status == 200,
                deadline,
                "server",
            )
        except TimeoutError:
            self.stop()
            raise RuntimeError("server did not answer /health in time") from None
        # With several front ends, the first answers before the others
        # listen: wait until the kernel has handed a connection to each.
        while len(self.front_ends_answering(10)) < self.front_ends:
            if time.monotonic() > deadline or self.process.poll() is not None:
                self.stop()
                raise RuntimeError("not every front end answered /health in time")
            time.sleep(0.1)
        return self

    @property
    def front_ends(self) -> int:
        """The C{--front-ends} count in L{args} (1 without the flag)."""
        if "--front-ends" in self.args:
            return int(self.args[self.args.index("--front-ends") + 1])
        return 1

    def front_ends_answering(self, tries: int) -> dict[int, dict[str, Any]]:
        """
        Each front end's C{/health} seen from C{tries} new connections (the
        kernel spreads them over the processes sharing the port), by index.
        """
        seen: dict[int, dict[str, Any]] = {}
        for _ in range(tries):
            try:
                health = self.health()
            except OSError:
                continue
            front_end = health.get("front_end") or {"index": 0}
            seen[front_end["index"]] = health
        return seen

    def health(self) -> dict[str, Any]:
        result: dict[str, Any] = request(self.port, "GET", "/health").json()
        return result

    def execute(
        self, program: dict[str, Any] | bytes, blobs: Sequence[bytes] = (), **kw: Any
    ) -> Response:
        return post_program(self.port, program, blobs, **kw)

    def stop(self, timeout: float = 60.0) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def servers_by_flags(base: Sequence[str]) -> Iterator[Callable[..., ServerProcess]]:
    """
    A generator for pytest fixtures: yields C{start(*flags)}, which starts
    (once per distinct flag list) C{kcoral server} with C{base} plus the
    flags and returns the running L{ServerProcess}; every server started is
    stopped when the generator is closed.
    """
    servers: dict[tuple[str, ...], ServerProcess] = {}

    def start(*args: str) -> ServerProcess:
        key = tuple(args)
        if key not in servers:
            servers[key] = ServerProcess([*base, *args]).start()
        return servers[key]

    try:
        yield start
    finally:
        for server in servers.values():
            server.stop()
