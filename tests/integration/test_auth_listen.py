"""
A real server behind bearer tokens, on several C{--listen} endpoints (TCP,
TLS and a UNIX socket), driven with curl and with L{kcoral.Client}.  Loopback
addresses only; "beyond loopback" is a wildcard bind inside a network
namespace of the test's own (C{unshare -rn}), which nothing outside can reach.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kcoral import Client, KCoralError, Program
from kcoral.testing.live_server import ServerProcess, free_port

ALICE = "alice-token-0123456789abcdef"
BOB = "bob-token-fedcba9876543210xyz"

pytestmark = pytest.mark.skipif(
    shutil.which("curl") is None or shutil.which("openssl") is None,
    reason="needs curl and openssl",
)


def events(log_dir: Path) -> list[dict[str, Any]]:
    (run,) = list((log_dir / "runs").iterdir())
    lines = (run / "events.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def wait_for(log_dir: Path, name: str, timeout: float = 15.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        found = [e for e in events(log_dir) if e.get("event") == name]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def curl(*args: str) -> tuple[int, dict[str, Any] | str]:
    """Run curl; the status code and the (JSON if possible) body."""
    done = subprocess.run(
        ["curl", "-sS", "--max-time", "60", "-w", "\n%{http_code}", *args],
        capture_output=True,
        text=True,
        check=True,
    )
    body, _, code = done.stdout.rpartition("\n")
    try:
        return int(code), json.loads(body)
    except ValueError:
        return int(code), body


def program() -> Program:
    p = Program()
    module = p.upload(kind="module", source="def f(x):\n    return x * 2\n")
    p.return_(key="y", value=p.run(fn=p.get_function(module=module, name="f"), args=[21]))
    return p


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("secured")
    tokens = root / "tokens"
    tokens.write_text(f"# who may run code\nalice {ALICE}\nbob {BOB}\n")
    key, cert = root / "key.pem", root / "cert.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],  # fmt: skip
        check=True,
        capture_output=True,
    )
    socket = root / "kcoral.sock"
    tls_port = free_port()
    server = ServerProcess(
        [
            "--device",
            "cpu",
            "--num-workers",
            "1",
            "--sandbox",
            "none",
            "--log-dir",
            str(root / "logs"),
            "--auth-token-file",
            str(tokens),
        ],  # fmt: skip
    )
    server.args += [
        "--listen",
        f"tcp:{server.port}:interface=127.0.0.1",
        "--listen",
        f"unix:{socket}",
        "--listen",
        f"ssl:{tls_port}:interface=127.0.0.1:privateKey={key}:certKey={cert}",
    ]
    with server:
        yield {
            "server": server,
            "url": f"http://127.0.0.1:{server.port}",
            "tls": f"https://127.0.0.1:{tls_port}",
            "cert": str(cert),
            "socket": str(socket),
            "logs": root / "logs",
        }


def test_health_open_execute_closed(secured: dict[str, Any]) -> None:
    """/health answers anyone; /execute, /metrics and /status need a token (JSON 401)."""
    url = secured["url"]
    assert curl(f"{url}/health")[0] == 200
    for path in ("/metrics", "/status", "/status.json"):
        code, body = curl(f"{url}{path}")
        assert code == 401
        assert isinstance(body, dict) and body["error"]["kind"] == "unauthorized"
        assert curl("-H", f"Authorization: Bearer {ALICE}", f"{url}{path}")[0] == 200
    code, body = curl(
        "-X", "POST", "-H", "Authorization: Bearer wrong-wrong-wrong", f"{url}/execute"
    )
    assert code == 401
    assert isinstance(body, dict) and set(body) == {"status", "request_id", "error"}


def test_client_with_token(secured: dict[str, Any]) -> None:
    """kcoral.Client sends its token= and runs code; without one it gets a 401 KCoralError."""
    with Client(secured["url"], token=BOB) as client:
        assert client.execute(program())["y"] == 42
    with Client(secured["url"]) as anonymous:
        with pytest.raises(KCoralError) as caught:
            anonymous.execute(program())
    assert caught.value.status_code == 401
    assert caught.value.kind == "unauthorized"
    received = wait_for(secured["logs"], "request_received")
    assert "bob" in {e.get("client_name") for e in received}


def test_curl_over_tls_and_unix_socket(secured: dict[str, Any]) -> None:
    """The same API answers over the ssl: and unix: endpoints."""
    code, body = curl("--cacert", secured["cert"], f"{secured['tls']}/health")
    assert code == 200 and isinstance(body, dict) and body["status"] == "ok"
    code, body = curl(
        "--cacert", secured["cert"], "-H", f"Authorization: Bearer {ALICE}",
        f"{secured['tls']}/status.json",
    )  # fmt: skip
    assert code == 200
    code, body = curl("--unix-socket", secured["socket"], "http://localhost/nope")
    assert code == 401
    code, body = curl(
        "--unix-socket", secured["socket"], "-H", f"Authorization: Bearer {ALICE}",
        "http://localhost/nope",
    )  # fmt: skip
    assert code == 404 and isinstance(body, dict) and body["error"]["kind"] == "not_found"
    listening = wait_for(secured["logs"], "server_listening")
    assert len(listening) == 3
    assert wait_for(secured["logs"], "unauthenticated_exposure", timeout=0) == []


def test_no_warning_on_other_loopback_address(tmp_path: Path) -> None:
    """127.0.0.2 is loopback: no token, and no warning."""
    server = ServerProcess(
        ["--device", "cpu", "--num-workers", "1", "--sandbox", "none", "--log-dir", str(tmp_path)]
    )
    server.args += ["--listen", f"tcp:{server.port}:interface=127.0.0.1"]
    server.args += ["--listen", f"tcp:{free_port()}:interface=127.0.0.2"]
    with server:
        assert len(wait_for(tmp_path, "server_listening")) == 2
        assert wait_for(tmp_path, "unauthenticated_exposure", timeout=0) == []


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    done = subprocess.run(["unshare", "-rn", "true"], capture_output=True)
    return done.returncode == 0


@pytest.mark.skipif(not _can_unshare(), reason="needs unshare -rn (user and network namespaces)")
def test_warning_beyond_loopback(tmp_path: Path) -> None:
    """
    A wildcard bind without a token is announced loudly.  The server runs in
    a network namespace of its own, so its 0.0.0.0 is reachable from nowhere.
    """
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    argv = [
        "unshare", "-rn", sys.executable, "-m", "kcoral", "server",
        "--listen", "tcp:8000:interface=0.0.0.0", "--device", "cpu", "--num-workers", "1",
        "--sandbox", "none", "--log-dir", str(tmp_path),
    ]  # fmt: skip
    process = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        found: list[dict[str, Any]] = []
        while not found and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.1)
            if (tmp_path / "runs").is_dir() and list((tmp_path / "runs").iterdir()):
                found = wait_for(tmp_path, "unauthenticated_exposure", timeout=0)
    finally:
        process.terminate()
        process.wait(60)
    (warning,) = found
    assert warning["level"] == "CRITICAL"
    assert warning["addresses"] == ["0.0.0.0"]
