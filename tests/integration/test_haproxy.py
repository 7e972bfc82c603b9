# -*- test-case-name: tests.integration.test_haproxy -*-
"""
Two kcoral CPU nodes behind HAProxy with the shipped configuration
(contrib/haproxy/kcoral.cfg), driven by the unmodified reference client.

The client sends 200 programs, each uploading one of 20 blobs, with
C{X-KCoral-Affinity} naming the blob's key; one node is stopped while they
run.  The test shows that every request is answered (by the survivor, or a
503 the client retries), that a CACHE_MISS retry lands on the node that
answered it, and that a repeated blob is served from the cache of the node
that holds it, in one round trip.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kcoral.testing.live_server import ServerProcess, free_port, request

from .refclient import RefClientUnavailable, _clean_env, ensure_venv

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CONFIG = Path(__file__).resolve().parents[2] / "contrib" / "haproxy" / "kcoral.cfg"

KEYS = 20
ROUNDS = 10
THREADS = 4
#: Progress count at which the first node is stopped.
STOP_AFTER = 60

_CLIENT = r"""
import hashlib, json, os, sys, threading, time
from kcoral import Client, Program, KCoralError

URL, KEYS, ROUNDS, THREADS = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
SOURCE = "import hashlib\ndef f(x):\n    return hashlib.sha256(x).hexdigest()\n"
BLOBS = {k: os.urandom(4096) for k in range(KEYS)}
local = threading.local()
lock = threading.Lock()
records = []
failures = []


def hook(response):
    response.read()
    status = None
    kind = response.headers.get("content-type", "")
    if kind.startswith("application/json"):
        status = json.loads(response.content).get("status")
    elif kind.startswith("multipart/form-data"):
        status = "multipart"
    local.attempts.append({"http": response.status_code, "status": status,
                           "node": response.headers.get("x-kcoral-node")})


def program(k):
    p = Program()
    m = p.upload(kind="module", source=SOURCE)
    f = p.get_function(module=m, name="f")
    x = p.upload(kind="bytes", value=BLOBS[k])
    p.return_(key="h", value=p.run(fn=f, args=[x]))
    return p


def worker(t):
    try:
        clients = {}
        for k in range(t, KEYS, THREADS):
            c = Client(URL, headers={"X-KCoral-Affinity": f"key-{k}"})
            c._http.event_hooks["response"].append(hook)
            clients[k] = c
        for r in range(ROUNDS):
            for k, c in clients.items():
                tries = []
                ok = False
                for _ in range(100):
                    local.attempts = []
                    try:
                        result = c.execute(program(k))
                    except KCoralError as e:
                        tries.append(local.attempts)
                        if e.status_code in (502, 503):
                            time.sleep(0.2)
                            continue
                        raise
                    tries.append(local.attempts)
                    ok = result.results["h"] == hashlib.sha256(BLOBS[k]).hexdigest()
                    break
                with lock:
                    records.append({"key": k, "round": r, "tries": tries, "ok": ok})
                    print("PROGRESS", len(records), flush=True)
    except Exception as e:
        with lock:
            failures.append(f"{type(e).__name__}: {e}")


threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("RESULT " + json.dumps({"records": records, "failures": failures}), flush=True)
"""


@pytest.fixture(scope="module")
def refclient_python() -> Path:
    try:
        return ensure_venv() / "bin" / "python"
    except RefClientUnavailable as e:  # pragma: no cover - needs PyPI
        pytest.skip(str(e))


def _node(tmp: Path, name: str) -> ServerProcess:
    return ServerProcess(
        [
            "--device",
            "cpu",
            "--num-workers",
            "2",
            "--max-requests-per-worker",
            "0",
            "--log-dir",
            "",
            "--disk-cache-dir",
            str(tmp / f"{name}-files"),
        ],
        log_path=tmp / f"{name}.log",
    )


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """Two CPU nodes and HAProxy on loopback ports; stops all three."""
    haproxy = shutil.which("haproxy")
    assert haproxy, "haproxy is not installed (./dev.sh install installs it)"
    nodes = {"cpu1": _node(tmp_path, "cpu1"), "cpu2": _node(tmp_path, "cpu2")}
    proxy: subprocess.Popen[bytes] | None = None
    try:
        for node in nodes.values():
            node.start()
        front = free_port()
        env = dict(os.environ)
        env.update(
            KCORAL_CPU_BIND=f"127.0.0.1:{front}",
            KCORAL_GPU_BIND=f"127.0.0.1:{free_port()}",
            # No GPU nodes here: their checks fail and they stay down.
            KCORAL_GPU1=f"127.0.0.1:{free_port()}",
            KCORAL_GPU2=f"127.0.0.1:{free_port()}",
            KCORAL_CPU1=f"127.0.0.1:{nodes['cpu1'].port}",
            KCORAL_CPU2=f"127.0.0.1:{nodes['cpu2'].port}",
        )
        log = open(tmp_path / "haproxy.log", "wb")
        proxy = subprocess.Popen(
            [haproxy, "-db", "-f", str(CONFIG)], env=env, stdout=log, stderr=subprocess.STDOUT
        )
        log.close()
        _wait_for_both(front, proxy)
        yield {"port": front, "nodes": nodes, "logs": tmp_path}
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(10)
        for node in nodes.values():
            node.stop()


def _wait_for_both(port: int, proxy: subprocess.Popen[bytes]) -> None:
    """Poll /health through HAProxy until both nodes have answered."""
    seen: set[str] = set()
    deadline = time.monotonic() + 30
    while seen != {"cpu1", "cpu2"}:
        assert proxy.poll() is None, "haproxy exited"
        assert time.monotonic() < deadline, f"haproxy never reached both nodes: {seen}"
        try:
            response = request(port, "GET", "/health", timeout=5)
        except OSError:
            time.sleep(0.1)
            continue
        if response.status == 200:
            seen.add(response.headers["x-kcoral-node"])


def _metric(body: str, outcome: str) -> float:
    match = re.search(rf'^kcoral_requests_total{{outcome="{outcome}"}} (\S+)$', body, re.M)
    assert match, f"no kcoral_requests_total for {outcome}"
    return float(match.group(1))


def test_failover_and_cache_affinity(cluster: dict[str, Any], refclient_python: Path) -> None:
    """
    200 programs through HAProxy, one node stopped mid-run: all answered,
    CACHE_MISS retries pinned to the answering node, repeats served from cache.
    """
    nodes = cluster["nodes"]
    script = cluster["logs"] / "client.py"
    script.write_text(_CLIENT)
    url = f"http://127.0.0.1:{cluster['port']}"
    client = subprocess.Popen(
        [str(refclient_python), "-I", str(script), url, str(KEYS), str(ROUNDS), str(THREADS)],
        env=_clean_env(),
        cwd=cluster["logs"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # A watchdog keeps the test bounded even if the client hangs.
    watchdog = threading.Timer(150, client.kill)
    watchdog.start()
    result: dict[str, Any] | None = None
    stopped = False
    try:
        assert client.stdout is not None
        for line in client.stdout:
            if line.startswith("PROGRESS") and not stopped and int(line.split()[1]) >= STOP_AFTER:
                # Graceful stop: in-flight requests finish, new ones go elsewhere.
                stopped = True
                nodes["cpu1"].stop()
            elif line.startswith("RESULT "):
                result = json.loads(line[len("RESULT ") :])
        stderr = client.stderr.read() if client.stderr else ""
        client.wait()
    finally:
        watchdog.cancel()
    assert stopped, "the client finished before the node was stopped"
    assert result is not None, f"client failed ({client.returncode}): {stderr[-3000:]}"
    assert result["failures"] == []
    records = result["records"]

    # Every program was answered, correctly; only 503s (no node able to take
    # it while the stopped one was still marked up) were retried.
    assert len(records) == KEYS * ROUNDS
    assert all(r["ok"] for r in records)
    retried = [attempts for r in records for attempts in r["tries"][:-1]]
    assert all(attempts[-1]["http"] in (502, 503) for attempts in retried), retried

    executes = [r["tries"][-1] for r in records]
    assert all(a["node"] in ("cpu1", "cpu2") for attempts in executes for a in attempts)
    assert any(attempts[0]["node"] == "cpu1" for attempts in executes)

    # A CACHE_MISS retry goes to the node that answered it (it now has the
    # blobs); cpu2 never went away, so its misses always resolve there in two
    # round trips.
    for attempts in executes:
        if attempts[0]["status"] == "CACHE_MISS" and attempts[0]["node"] == "cpu2":
            assert [(a["node"], a["status"]) for a in attempts] == [
                ("cpu2", "CACHE_MISS"),
                ("cpu2", "COMPLETED"),
            ], attempts

    # Affinity: a key's requests go to a node that holds its blob (unless that
    # node is the stopped one), and there the blob comes from the cache.
    holders: dict[int, set[str]] = {}
    repeats = 0
    for r in sorted(records, key=lambda r: (r["key"], r["round"])):
        attempts = r["tries"][-1]
        held = holders.setdefault(r["key"], set())
        first = attempts[0]["node"]
        assert first in held or not (held - {"cpu1"}), (r["key"], held, attempts)
        if first in held:
            repeats += 1
            assert [a["status"] for a in attempts] == ["COMPLETED"], attempts
        held.add(attempts[-1]["node"])
    # Each key misses once on its first node and at most once more after
    # moving to the survivor; everything else is a cache hit.
    assert repeats >= KEYS * ROUNDS - 2 * KEYS

    # The survivor's own counters agree with what the client saw.
    body = request(nodes["cpu2"].port, "GET", "/metrics").body.decode()
    seen = [a for r in records for attempts in r["tries"] for a in attempts if a["node"] == "cpu2"]
    assert _metric(body, "cache_miss") == sum(a["status"] == "CACHE_MISS" for a in seen)
    assert _metric(body, "completed") == sum(a["status"] == "COMPLETED" for a in seen)
