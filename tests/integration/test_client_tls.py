# -*- test-case-name: tests.integration.test_client_tls -*-
"""
The blocking client and the CLI over real TLS: a C{kcoral server} listening
on C{ssl:} on 127.0.0.1 with a freshly generated certificate, trusted through
C{SSL_CERT_FILE} as a user would trust it.

Twisted's TLS layer schedules its writes on a clock that defaults to the
global reactor; a blocking client that ran a private reactor and left the
global one idle sent the TLS handshake's first flight and then nothing, so
these calls hung until the server closed the connection.
"""

from __future__ import annotations

import os
import pty
import select
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Imported here so that the global reactor is installed (and not running)
# before this module's in-process clients start: the case of a process that
# owns the global reactor, where the client keeps a private one.
from twisted.internet import reactor  # noqa: F401

from kcoral import Client, Program
from kcoral.client import blocking
from kcoral.testing.live_server import ServerProcess, free_port

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl"),
]


def self_signed(root: Path) -> tuple[Path, Path]:
    """A key and a certificate for 127.0.0.1 (its own CA)."""
    key, cert = root / "key.pem", root / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return key, cert


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A CPU server on plain TCP and on TLS (127.0.0.1), and its certificate."""
    root = tmp_path_factory.mktemp("tls")
    key, cert = self_signed(root)
    tls_port = free_port()
    server = ServerProcess(
        ["--device", "cpu", "--num-workers", "2", "--sandbox", "none", "--log-dir", ""]
    )
    server.args += [
        "--listen",
        f"tcp:{server.port}:interface=127.0.0.1",
        "--listen",
        f"ssl:{tls_port}:interface=127.0.0.1:privateKey={key}:certKey={cert}",
    ]
    with server:
        yield {"url": f"https://127.0.0.1:{tls_port}", "cert": str(cert)}


@pytest.fixture
def trusted(tls: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The certificate trusted the way the issue's user trusted it."""
    monkeypatch.setenv("SSL_CERT_FILE", tls["cert"])
    return tls


def doubling_program() -> Program:
    p = Program()
    module = p.upload(kind="module", source="def f(x):\n    return x * 2\n")
    p.return_(key="y", value=p.run(fn=p.get_function(module=module, name="f"), args=[21]))
    return p


def _environment(cert: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KCORAL_")}
    env["SSL_CERT_FILE"] = cert
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    return env


def test_blocking_client_over_tls(trusted: dict[str, Any]) -> None:
    """
    In a process whose global reactor is installed but idle, the blocking
    client answers over TLS: health, then a program.
    """
    start = time.monotonic()
    with Client(trusted["url"], connect_timeout_seconds=5) as client:
        assert client.health()["status"] == "ok"
        first = time.monotonic() - start
        assert client.execute(doubling_program(), timeout_seconds=60)["y"] == 42
    print(f"blocking client over TLS: first /health in {first * 1000:.0f} ms")
    # This process already had a global reactor, so the client runs its own.
    from twisted.internet import reactor as global_reactor

    assert blocking._loop_reactor is not global_reactor


def test_fresh_process_client_runs_the_global_reactor(tls: dict[str, Any]) -> None:
    """
    In a fresh interpreter (a script, a notebook, the CLI) the client's
    reactor is Twisted's global reactor, run in crochet's thread, so every
    Twisted default that reaches for the global reactor finds the running one.
    """
    script = textwrap.dedent(
        f"""
        import time
        from kcoral import Client
        from kcoral.client import blocking
        start = time.monotonic()
        with Client({tls["url"]!r}, connect_timeout_seconds=5) as client:
            assert client.health()["status"] == "ok"
        elapsed = time.monotonic() - start
        from twisted.internet import reactor
        assert blocking._loop_reactor is reactor, (blocking._loop_reactor, reactor)
        assert reactor.running
        print(f"ok {{elapsed * 1000:.0f}} ms")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=_environment(tls["cert"]),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok ")
    print(f"fresh-process client over TLS: {done.stdout.strip()}")


def test_application_running_the_global_reactor(tls: dict[str, Any]) -> None:
    """
    In a process that runs the global reactor itself (in another thread
    here), the blocking client hands its calls to that reactor and starts
    none of its own; on the reactor's thread a blocking call is refused.
    """
    script = textwrap.dedent(
        f"""
        import threading
        from twisted.internet import reactor
        from kcoral import Client
        from kcoral.client import blocking
        thread = threading.Thread(target=reactor.run, kwargs={{"installSignalHandlers": False}})
        thread.start()
        while not reactor.running:
            pass
        try:
            with Client({tls["url"]!r}, connect_timeout_seconds=5) as client:
                assert client.health()["status"] == "ok"
            assert blocking._loop_reactor is reactor
            assert "CrochetReactor" not in [t.name for t in threading.enumerate()]
            refused = []

            def on_reactor_thread():
                try:
                    Client({tls["url"]!r}).health()
                except RuntimeError as e:
                    refused.append(str(e))

            from twisted.internet.threads import blockingCallFromThread
            blockingCallFromThread(reactor, on_reactor_thread)
            assert refused and "reactor thread" in refused[0], refused
            print("ok")
        finally:
            reactor.callFromThread(reactor.stop)
            thread.join()
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=_environment(tls["cert"]),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "ok\n"


def test_health_command_over_tls(tls: dict[str, Any]) -> None:
    """C{kcoral health --url https://...} prints the health object and exits 0."""
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "kcoral", "health", "--url", tls["url"]],
        env=_environment(tls["cert"]),
        capture_output=True,
        text=True,
        timeout=60,
    )
    elapsed = time.monotonic() - start
    assert done.returncode == 0, done.stderr
    assert '"status": "ok"' in done.stdout
    print(f"kcoral health over TLS: {elapsed * 1000:.0f} ms including interpreter start")


def test_untrusted_certificate_is_refused(tls: dict[str, Any]) -> None:
    """Without the certificate trusted, the CLI fails verification at once (exit 1)."""
    env = _environment(tls["cert"])
    del env["SSL_CERT_FILE"]
    env["SSL_CERT_DIR"] = str(Path(tls["cert"]).parent / "nothing")
    env["SSL_CERT_FILE"] = os.devnull
    done = subprocess.run(
        [sys.executable, "-m", "kcoral", "health", "--url", tls["url"]],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "kcoral health: TransportError" in done.stderr
    assert "certificate verify failed" in done.stderr


def test_run_command_over_tls_shows_waiting_line(tls: dict[str, Any], tmp_path: Path) -> None:
    """
    C{kcoral run python} over TLS, with stderr on a terminal: the program
    runs, and the "waiting for the server" progress line is drawn while it
    does (its ticker runs on the client's reactor).
    """
    main, child = pty.openpty()
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "kcoral", "run", "python", "--url", tls["url"],
             "--", "-c", "import time; time.sleep(2.5); print('slept')"],
            env=_environment(tls["cert"]),
            stdout=subprocess.PIPE,
            stderr=child,
            cwd=tmp_path,
        )  # fmt: skip
        os.close(child)
        child = -1
        terminal = b""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ready, _, _ = select.select([main], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(main, 4096)
                except OSError:
                    break
                if not chunk:
                    break
                terminal += chunk
            elif process.poll() is not None:
                break
        stdout, _ = process.communicate(timeout=60)
    finally:
        os.close(main)
        if child != -1:
            os.close(child)
    assert process.returncode == 0, terminal
    assert stdout == b"slept\n"
    assert b"kcoral: waiting for the server" in terminal
