# -*- test-case-name: tests.integration.test_haproxy -*-
"""
Two kcoral CPU nodes behind HAProxy with the shipped configuration
(contrib/haproxy/kcoral.cfg), driven at once by the unmodified reference
client (kcoral 0.1.1, in its own virtualenv) and by kcoral's own client.

Each client sends 300 programs; the programs of the reference client upload
one of 20 blobs with C{X-KCoral-Affinity} naming the blob's key.  One node
gets SIGTERM while they run, with C{--lame-duck-seconds} above HAProxy's
time to mark it down, as docs/deployment.md says to run nodes.  The test
shows a rolling restart no client sees: every request is answered with its
result (no 503, no transport error, no retry by the client), no program
runs twice (each carries a tag; every tag is in exactly one accepted
program of the nodes' saved programs), neither node refuses anything, a
CACHE_MISS retry lands on the node that answered it, and a repeated blob
is served from the cache of the node that holds it, in one round trip.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kcoral.testing.live_server import ServerProcess, free_port, request

from .refclient import RefClientUnavailable, _clean_env, _our_env, ensure_venv

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CONFIG = Path(__file__).resolve().parents[2] / "contrib" / "haproxy" / "kcoral.cfg"

KEYS = 20
ROUNDS = 15
THREADS = 4
#: The reference client's progress count at which the first node is stopped.
STOP_AFTER = 60
#: Above the shipped configuration's worst time to mark a node down
#: (inter x fall = 6 s), as docs/deployment.md asks.
LAME_DUCK_SECONDS = 8

_CLIENT = r"""
import hashlib, json, os, sys, threading, time
from kcoral import Client, Program, KCoralError

URL, KEYS, ROUNDS, THREADS, LABEL = sys.argv[1:6]
KEYS, ROUNDS, THREADS = int(KEYS), int(ROUNDS), int(THREADS)
SOURCE = (
    "import hashlib\n"
    "def f(x, tag):\n"
    "    return hashlib.sha256(x + tag.encode()).hexdigest()\n"
)
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


def program(k, tag):
    p = Program()
    m = p.upload(kind="module", source=SOURCE)
    f = p.get_function(module=m, name="f")
    x = p.upload(kind="bytes", value=BLOBS[k])
    p.return_(key="h", value=p.run(fn=f, args=[x, tag]))
    return p


def worker(t):
    clients = {}
    for k in range(t, KEYS, THREADS):
        c = Client(URL, headers={"X-KCoral-Affinity": f"{LABEL}-key-{k}"})
        hooks = getattr(getattr(c, "_http", None), "event_hooks", None)
        if hooks is not None:  # the reference client (httpx): see each answer
            hooks["response"].append(hook)
        clients[k] = c
    for r in range(ROUNDS):
        for k, c in clients.items():
            tag = f"{LABEL}-{k}-{r}"
            local.attempts = []
            try:
                result = c.execute(program(k, tag))
                expected = hashlib.sha256(BLOBS[k] + tag.encode()).hexdigest()
                ok = result.status == "COMPLETED" and result.results["h"] == expected
                error = None if ok else f"{result.status}: {result.error}"
            except Exception as e:
                ok, error = False, f"{type(e).__name__}: {e}"
            with lock:
                records.append({"key": k, "round": r, "tag": tag, "ok": ok,
                                "error": error, "attempts": local.attempts})
                if error is not None:
                    failures.append(error)
                print("PROGRESS", len(records), flush=True)


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
            str(tmp / f"{name}-logs"),
            "--disk-cache-dir",
            str(tmp / f"{name}-files"),
            "--lame-duck-seconds",
            str(LAME_DUCK_SECONDS),
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


class _Client:
    """One client process running L{_CLIENT}; its output read by a thread."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path) -> None:
        self.progress = 0
        self.result: dict[str, Any] | None = None
        self.process = subprocess.Popen(
            argv,
            env=env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("PROGRESS"):
                self.progress = int(line.split()[1])
            elif line.startswith("RESULT "):
                self.result = json.loads(line[len("RESULT ") :])

    def finish(self, timeout: float) -> dict[str, Any]:
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._reader.join(10)
        stderr = self.process.stderr.read() if self.process.stderr else ""
        assert self.result is not None, (
            f"client failed ({self.process.returncode}): {stderr[-3000:]}"
        )
        return self.result


def _events(root: Path) -> list[dict[str, Any]]:
    """Every event a node wrote under its log directory."""
    return [
        json.loads(line)
        for path in root.glob("**/events.jsonl")
        for line in path.read_text().splitlines()
        if line.strip()
    ]


def test_rolling_restart_no_client_sees(cluster: dict[str, Any], refclient_python: Path) -> None:
    """
    300 programs from each client through HAProxy, one node stopped
    (SIGTERM, with its lame duck) mid-run: every one answered with its
    result, none run twice, nothing refused; CACHE_MISS retries pinned to
    the answering node; repeats served from cache.
    """
    nodes, logs = cluster["nodes"], cluster["logs"]
    script = logs / "client.py"
    script.write_text(_CLIENT)
    url = f"http://127.0.0.1:{cluster['port']}"
    args = [str(script), url, str(KEYS), str(ROUNDS), str(THREADS)]
    reference = _Client([str(refclient_python), "-I", *args, "ref"], _clean_env(), logs)
    ours = _Client([sys.executable, "-P", *args, "ours"], _clean_env(_our_env(None)), logs)
    stopping = nodes["cpu1"].process
    deadline = time.monotonic() + 240
    while reference.progress < STOP_AFTER and reference.process.poll() is None:
        assert time.monotonic() < deadline, "the reference client made no progress"
        time.sleep(0.05)
    assert reference.process.poll() is None, "the client finished before the node was stopped"
    # A graceful stop, as systemd sends it: a lame duck, then the drain.
    stopping.send_signal(signal.SIGTERM)
    results = {"ref": reference.finish(240), "ours": ours.finish(240)}
    assert stopping.wait(60) == 0

    for label, result in results.items():
        records = result["records"]
        assert result["failures"] == [], (label, result["failures"][:5])
        assert len(records) == KEYS * ROUNDS, label
        assert all(r["ok"] for r in records), label

    # No program ran twice: each accepted program is saved by the node that
    # ran it, and each tag is in exactly one saved program, on either node.
    saved = Counter(path.read_text() for path in logs.glob("cpu*-logs/**/programs/*.json"))
    tags: Counter[str] = Counter()
    for text, count in saved.items():
        for instruction in json.loads(text)["instructions"]:
            if instruction["op"] == "run":
                tags[instruction["args"][1]] += count
    expected = {r["tag"] for result in results.values() for r in result["records"]}
    assert set(tags) == expected
    assert [tag for tag, count in tags.items() if count != 1] == []

    # The stopped node went through its lame duck, and neither node refused
    # a request (no 503 for HAProxy to retry, none for a client to see).
    events = {name: _events(logs / f"{name}-logs") for name in nodes}
    assert any(e.get("event") == "lame_duck_started" for e in events["cpu1"])
    for name, node_events in events.items():
        refused = [e for e in node_events if e.get("event") == "request_refused"]
        assert refused == [], (name, refused[:3])
    served_by_stopped = sum(e.get("event") == "request_accepted" for e in events["cpu1"])
    assert served_by_stopped > 0

    # The reference client saw every answer (its response hook): no 5xx.
    executes = [r["attempts"] for r in results["ref"]["records"]]
    assert all(a["http"] == 200 for attempts in executes for a in attempts), executes
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
    records = results["ref"]["records"]
    for r in sorted(records, key=lambda r: (r["key"], r["round"])):
        attempts = r["attempts"]
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
