"""
The parent's GPU monitor on a bubblewrap GPU server with reused workers
(issue 34): a process a program starts may not use the GPU (a child, a
double-forked orphan, an exec'd binary: each is killed at once and its
request fails naming it), a victim's measurements meanwhile are either
undisturbed or flagged, a process outside the server that uses the GPU
flags the measurement it overlaps without being killed, and an idle run
flags nothing.

Run on the GPU machine (they skip elsewhere):
C{python3 -m pytest -m gpu tests/gpu/test_gpu_monitor.py -q -s}.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kcoral.client.results import program_result
from kcoral.testing.live_server import ServerProcess, request
from kcoral.wire.multipart import decode_response
from tests.gpu.test_gpu_trusted_timing import readonly_flags as _readonly_flags

pytestmark = [pytest.mark.gpu, pytest.mark.integration]

#: A matmul loop on the GPU for C{seconds}: what the attacks run.
SPIN = (
    "import torch, time\n"
    "a = torch.randn(8192, 8192, device='cuda')\n"
    "t = time.time()\n"
    "while time.time() - t < {seconds}:\n"
    "    a @ a\n"
    "    torch.cuda.synchronize()\n"
)

#: cpu_only functions that start GPU work outside the lease, then wait for it.
ATTACKS = {
    "child": """
import subprocess, sys
def attack(seconds):
    child = subprocess.Popen([sys.executable, "-c", SPIN.format(seconds=seconds)])
    return child.wait()
""",
    "double_fork": """
import os, sys, time
def attack(seconds):
    if os.fork() == 0:
        if os.fork() == 0:
            os.execv(sys.executable, [sys.executable, "-c", SPIN.format(seconds=seconds)])
        os._exit(0)
    os.wait()
    time.sleep(seconds)
    return 0
""",
    "exec_binary": """
import subprocess, sys, shlex
def attack(seconds):
    # /bin/sh execs the interpreter: the GPU user is an exec'd binary.
    script = shlex.quote(SPIN.format(seconds=seconds))
    child = subprocess.Popen(["/bin/sh", "-c", f"exec {sys.executable} -c {script}"])
    return child.wait()
""",
}

#: The thread that keeps multiplying after its function returned.
THREAD = """
import threading, time, torch
def attack(seconds):
    def spin():
        a = torch.randn(8192, 8192, device="cuda")
        t = time.time()
        while time.time() - t < seconds:
            a @ a
            torch.cuda.synchronize()
    threading.Thread(target=spin, daemon=True).start()
    return 0
"""

VICTIM = """
import torch
from kcoral.builtins import benchmark
def victim(n, repeat, retry):
    a = torch.randn(n, n, device="cuda")
    out = torch.empty_like(a)
    return benchmark(lambda: torch.matmul(a, a, out=out),
                     {"warmup": 5, "repeat": repeat, "retry_on_interference": retry})
"""


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("monitor-logs")


@pytest.fixture(scope="module")
def server(logs: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(
        ["--device", "gpu", "--gpus", "0", "--workers-per-gpu", "4"]
        + ["--max-requests-per-worker", "0", "--log-dir", str(logs), "--sandbox", "bubblewrap"]
        + ["--tensor-api", "torch", *_readonly_flags()],
        log_path=logs / "server.out",
    )
    server.start(timeout=240)
    yield server
    assert server.stop() == 0


def _body(server: ServerProcess, program: dict[str, Any]) -> dict[str, Any]:
    response = server.execute(program, timeout=300)
    assert response.status == 200, response.body[:2000]
    body, _ = decode_response(response.headers["content-type"], response.body)
    return body


def _call(source: str, name: str, args: list[Any], cpu_only: bool = False) -> dict[str, Any]:
    return {
        "instructions": [
            {"op": "upload", "kind": "module", "id": "m", "source": source},
            {
                "op": "get_function",
                "id": "f",
                "module": {"$ref": "m"},
                "name": name,
                "cpu_only": cpu_only,
            },
            {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": args},
            {"op": "return", "key": "r", "value": {"$ref": "r"}},
        ],
        "options": {"timeout_seconds": 120},
    }


def run_victim(server: ServerProcess, retry: int = 0, n: int = 8192) -> dict[str, Any]:
    response = server.execute(_call(VICTIM, "victim", [n, 50, retry]), timeout=300)
    assert response.status == 200, response.body[:2000]
    body, parts = decode_response(response.headers["content-type"], response.body)
    result: dict[str, Any] = program_result(body, parts).check()["r"]
    return result


def _baseline(server: ServerProcess) -> float:
    medians = sorted(run_victim(server)["latency_ms_median"] for _ in range(3))
    return medians[1]


def run_attack(server: ServerProcess, source: str, seconds: int, out: dict[str, Any]) -> None:
    started = time.monotonic()
    source = f"SPIN = {SPIN!r}\n" + source
    out["body"] = _body(server, _call(source, "attack", [seconds], cpu_only=True))
    out["seconds"] = time.monotonic() - started


def _log_events(logs: Path, name: str) -> list[dict[str, Any]]:
    found = []
    for path in logs.rglob("*"):
        if not path.is_file():
            continue
        for line in path.read_text(errors="replace").splitlines():
            if name in line and line.startswith("{"):
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if event.get("event") == name:
                    found.append(event)
    return found


def _judge_victims(results: list[dict[str, Any]], baseline: float, label: str) -> None:
    for result in results:
        moved = abs(result["latency_ms_median"] / baseline - 1)
        print(
            f"[monitor] {label}: median {result['latency_ms_median']:.3f} ms "
            f"(baseline {baseline:.3f}, moved {moved:.1%}) validity {result['validity']}"
        )
        assert moved <= 0.02 or not result["validity"]["ok"], result


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_descendant_attack_killed(server: ServerProcess, logs: Path, name: str) -> None:
    """
    The attack's GPU process is killed within seconds, not at the end of
    its 25 s; its request fails naming it; the victim's medians meanwhile
    stay within 2 % or are flagged.
    """
    baseline = _baseline(server)
    out: dict[str, Any] = {}
    attacker = threading.Thread(target=run_attack, args=(server, ATTACKS[name], 25, out))
    attacker.start()
    victims = []
    while attacker.is_alive() and len(victims) < 12:
        victims.append(run_victim(server))
    attacker.join(timeout=120)
    body = out["body"]
    print(f"[monitor] {name}: attacker answered in {out['seconds']:.1f} s: {body.get('error')}")
    assert body["status"] == "FAILED", body
    assert body["error"]["kind"] == "gpu_access", body
    assert "started by the program" in body["error"]["message"], body
    assert out["seconds"] < 20, out
    _judge_victims(victims, baseline, name)
    killed = _log_events(logs, "gpu_descendant_killed")
    assert killed, "no gpu_descendant_killed event"
    assert killed[-1]["request_id"], killed[-1]


def test_thread_after_return(server: ServerProcess) -> None:
    """A thread multiplying on after its function returned: victims undisturbed or flagged."""
    baseline = _baseline(server)
    out: dict[str, Any] = {}
    run_attack(server, THREAD, 8, out)
    assert out["body"]["status"] == "COMPLETED", out
    deadline = time.monotonic() + 8
    victims = []
    while time.monotonic() < deadline:
        victims.append(run_victim(server))
    _judge_victims(victims, baseline, "thread")


def test_foreign_process_flags(server: ServerProcess, logs: Path) -> None:
    """
    A process outside the server multiplying on the GPU flags the victim's
    measurement (interference, naming it), is not killed, and is counted.
    """
    spinner = subprocess.Popen([sys.executable, "-c", SPIN.format(seconds=30)])
    try:
        time.sleep(8)  # torch's import and the context
        result = run_victim(server)
        print(f"[monitor] foreign: {result['validity']} gpu={result.get('gpu')}")
        assert not result["validity"]["ok"]
        assert any(r.startswith("interference:") for r in result["validity"]["reasons"])
        assert f"process {spinner.pid}" in json.dumps(result["validity"])
        assert result["gpu"]["other_processes"] == [spinner.pid]
        retried = run_victim(server, retry=2)
        assert retried["attempts"] == 3, retried
        assert spinner.poll() is None, "the monitor killed a process not the server's"
    finally:
        spinner.kill()
        spinner.wait()
    metrics = request(server.port, "GET", "/metrics", b"", {}, 30).body.decode()
    lines = [line for line in metrics.splitlines() if line.startswith("kcoral_gpu_")]
    print("[monitor] " + "\n[monitor] ".join(lines))
    assert 'kcoral_gpu_interference_total{gpu="0"}' in metrics
    assert _log_events(logs, "gpu_interference")


def test_idle_run_unflagged(server: ServerProcess) -> None:
    """Benchmarks on a quiet GPU are never flagged by the monitor, and carry its summary."""
    time.sleep(1.0)
    for _ in range(10):
        result = run_victim(server, n=4096)
        assert result["validity"]["ok"], result
        assert result["gpu"]["samples"] >= 1, result
        assert result["gpu"]["other_processes"] == []
