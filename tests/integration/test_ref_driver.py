"""
The side-by-side tooling in CI form: C{bench/ref_driver.py} (the reference
client 0.1.1, in its own virtualenv) drives the stub floor
(C{bench/stub_server.py}), a CPU kcoral server and the reference server 0.1.1
on a CPU, both in reuse mode, for a few seconds each, and
C{bench/side_by_side_table.py} tabulates them with issue 15's targets.

Only correctness is asserted (every workload ran, every answer was right,
the figures exist), never a time: the driver itself checks each answer
(COMPLETED, and the round-tripped bytes equal to what went up).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kcoral.testing.live_server import ServerProcess, free_port, request

from .refclient import RefClientUnavailable, _clean_env, ensure_server_venv

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"

# A few seconds per server: tiny levels, small tensors.
SHORT = [
    "--seconds",
    "0.5",
    "--warmup-seconds",
    "0.1",
    "--warmup",
    "2",
    "--sequential",
    "10",
    "--clients",
    "1,8",
    "--processes",
    "2",
    "--rates",
    "20",
    "--open-loop-threads",
    "4",
    "--tensor-mib",
    "2",
    "--iterations",
    "1",
    "--overlap-clients",
    "2",
    "--cpu-ms",
    "5",
]


def serve(
    argv: list[str], port: int, what: str, capacity: int, log: Path, **popen: Any
) -> Iterator[int]:
    """
    Run C{argv} (a server on C{port}, its output to C{log}: a pipe nobody
    reads would stall a chatty server) until /health offers C{capacity}
    requests, yield the port, then stop it.
    """
    with log.open("wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, **popen)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                answer = request(port, "GET", "/health", timeout=2)
                if answer.status == 200 and answer.json()["load"]["request_capacity"] >= capacity:
                    break
            except (OSError, ValueError, KeyError, TypeError):
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                process.wait(10)
                pytest.fail(f"{what} did not start: {log.read_text(errors='replace')[-4000:]}")
            time.sleep(0.1)
        yield port
    finally:
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


@pytest.fixture(scope="module")
def stub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    pytest.importorskip("aiohttp")
    port = free_port()
    argv = [sys.executable, str(BENCH / "stub_server.py"), "--port", str(port), "--gpus", "1"]
    log = tmp_path_factory.mktemp("stub") / "stub.log"
    yield from serve(argv, port, "the stub server", 1, log)


@pytest.fixture(scope="module")
def reference_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """
    The reference server 0.1.1 on a CPU (2 workers, reuse mode, no sandbox),
    from its own virtualenv, isolated (C{-I}) in a directory of its own so
    our package cannot shadow it.
    """
    try:
        root = ensure_server_venv()
    except RefClientUnavailable as e:  # pragma: no cover - needs PyPI
        pytest.skip(str(e))
    port = free_port()
    # Its CPU workers, kept for many programs, no sandbox: as kcoral is run here.
    flags = "--device cpu --num-workers 2 --max-requests-per-worker 0 --sandbox none"
    argv = [str(root / "bin" / "python"), "-I", "-m", "kcoral", "server", *flags.split()]
    argv += ["--log-dir", "", "--host", "127.0.0.1", "--port", str(port)]
    cwd = tmp_path_factory.mktemp("reference-server")
    log = cwd / "server.log"
    yield from serve(argv, port, "the reference server", 2, log, env=_clean_env(), cwd=cwd)


def drive(
    refclient: Path, port: int, output: Path, *workloads: str, extra: tuple[str, ...] = ()
) -> dict:
    """Run the driver with the reference virtualenv's interpreter and no PYTHONPATH."""
    env = _clean_env()
    completed = subprocess.run(
        [
            str(refclient / "bin" / "python"),
            str(BENCH / "ref_driver.py"),
            *workloads,
            *SHORT,
            *extra,
            "--url",
            f"http://127.0.0.1:{port}",
            "--output",
            str(output),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    return json.loads(output.read_text())


FIGURES = {
    "null.sequential.p50",
    "null.rps.c1",
    "null.rps.c8",
    "open.r20.p99",
    "tensor.roundtrip.p50",
    "tensor.up.rate",
    "tensor.down.rate",
    "overlap.share.c2",
}


def test_stub_floor(refclient: Path, stub: int, tmp_path: Path) -> None:
    """The reference client's whole flow works against the stub, tensors included."""
    result = drive(refclient, stub, tmp_path / "stub.json", "all")
    assert result["failed"] == []
    assert result["health"]["stub"] is True
    assert FIGURES <= set(result["figures"])
    assert result["details"]["tensor"]["kind"] == "tensor"
    # The client's flow: CACHE_MISS then the blob; the held tensor comes back in one.
    assert result["details"]["tensor_roundtrip_attempts"] == [2]
    assert result["details"]["tensor_down_attempts"] == [1]


def test_null_in_interleaved_rounds(refclient: Path, stub: int, tmp_path: Path) -> None:
    """
    With --rounds, the sequential phase and every level run that many
    times, interleaved: the sequential samples are pooled, a level's rate
    is the median of its rounds (the middle two's mean for an even count),
    and each round is kept.
    """
    result = drive(refclient, stub, tmp_path / "rounds.json", "null", extra=("--rounds", "3"))
    assert result["failed"] == []
    assert result["details"]["null_sequential"]["n"] == 30
    for clients in ("1", "8"):
        level = result["details"]["null_closed_loop"][clients]
        assert len(level["rounds_per_s"]) == 3
        assert level["requests_per_s"] == sorted(level["rounds_per_s"])[1]
        assert result["figures"][f"null.rps.c{clients}"] == level["requests_per_s"]
    # The busiest level over each round's own peak, then the median of rounds.
    levels = result["details"]["null_closed_loop"]
    shares = [
        top / max(one, top)
        for one, top in zip(levels["1"]["rounds_per_s"], levels["8"]["rounds_per_s"], strict=True)
    ]
    assert result["details"]["null_round_peak_shares"] == {"8": pytest.approx(shares)}
    assert result["figures"]["null.round_peak_share.c8"] == pytest.approx(sorted(shares)[1])
    result = drive(refclient, stub, tmp_path / "two.json", "null", extra=("--rounds", "2"))
    level = result["details"]["null_closed_loop"]["8"]
    assert level["requests_per_s"] == pytest.approx(sum(level["rounds_per_s"]) / 2)


def test_null_with_the_servers_cpu(
    refclient: Path, cpu_server: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    """
    With --server-pid, each closed-loop round also says what CPU the
    server's main thread, its process tree and the machine spent in it.
    """
    server = cpu_server("--sandbox", "none", "--max-requests-per-worker", "0")
    assert server.process is not None
    result = drive(
        refclient,
        server.port,
        tmp_path / "cpu.json",
        "null",
        extra=("--server-pid", str(server.process.pid), "--seconds", "1"),
    )
    assert result["failed"] == []
    for clients in ("1", "8"):
        level = result["details"]["null_closed_loop"][clients]
        (cpu,) = level["rounds_cpu"]
        # A busy server: its reactor ran, its workers too, and the reactor
        # cannot have been busier than the wall clock allows (one thread).
        assert 0.0 < cpu["reactor_busy"] <= 1.05
        assert cpu["server_cores"] >= cpu["reactor_busy"]
        assert cpu["machine_busy_cores"] > 0.0
        assert cpu["reactor_ms_per_request"] > 0.0
        assert cpu["server_ms_per_request"] >= cpu["reactor_ms_per_request"]
        # The scheduler's counts for the main thread, where /proc has them.
        if Path("/proc/self/schedstat").exists():
            assert 0.0 <= cpu["reactor_runqueue_wait_share"] <= 1.05
        assert cpu["reactor_involuntary_switches_per_request"] >= 0.0


def table(tmp_path: Path, reference: str) -> dict[str, Any]:
    """C{side_by_side_table.py} over the stub's, kcoral's and C{reference}'s JSON."""
    completed = subprocess.run(
        [
            sys.executable,
            str(BENCH / "side_by_side_table.py"),
            str(tmp_path / "stub.json"),
            str(tmp_path / "kcoral.json"),
            str(tmp_path / reference),
            "--output",
            str(tmp_path / "table.json"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert completed.returncode == 0, completed.stderr
    assert "targets (issue 15):" in completed.stdout
    return json.loads((tmp_path / "table.json").read_text())


def test_kcoral_cpu_and_table(
    refclient: Path,
    stub: int,
    cpu_server: Callable[..., ServerProcess],
    reference_server: int,
    tmp_path: Path,
) -> None:
    """
    The same workloads against a CPU kcoral server and the reference server
    on a CPU, both in reuse mode; then the table, whose targets all have a
    value: issue 15's checks in CI-sized form (their verdicts are for the
    benchmark to report, not for a test to assert).
    """
    server = cpu_server("--sandbox", "none", "--max-requests-per-worker", "0")
    ours = drive(refclient, server.port, tmp_path / "kcoral.json", "all")
    assert ours["failed"] == []
    assert FIGURES <= set(ours["figures"])
    assert ours["details"]["tensor"]["kind"] == "bytes"
    assert ours["details"]["tensor_roundtrip_attempts"] == [2]
    floor = drive(refclient, stub, tmp_path / "stub.json", "null", "tensor")
    assert floor["failed"] == []

    # Without a reference run, its column stays empty.
    rows = {row["figure"]: row for row in table(tmp_path, "missing.json")["rows"]}
    assert rows["null.sequential.p50"]["floor"] is not None
    assert rows["null.sequential.p50"]["kcoral"] is not None
    assert rows["null.sequential.p50"]["reference"] is None

    theirs = drive(refclient, reference_server, tmp_path / "reference.json", "all")
    assert theirs["failed"] == []
    assert theirs["health"].get("stub") is not True
    assert FIGURES <= set(theirs["figures"])
    assert theirs["details"]["tensor"]["kind"] == "bytes"
    result = table(tmp_path, "reference.json")
    rows = {row["figure"]: row for row in result["rows"]}
    for figure in FIGURES:
        assert rows[figure]["kcoral"] is not None, figure
        assert rows[figure]["reference"] is not None, figure
        assert rows[figure]["kcoral_over_reference"] is not None, figure
    assert rows["tensor.roundtrip.p50"]["kcoral_over_floor"] is not None
    for target in result["targets"]:
        assert target["value"] is not None, target["what"]
        assert target["met"] in (True, False), target["what"]


def test_driver_refuses_our_package(tmp_path: Path) -> None:
    """With only our package importable, the driver stops rather than drive with it."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    completed = subprocess.run(
        [sys.executable, str(BENCH / "ref_driver.py"), "null", "--url", "http://127.0.0.1:9"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert completed.returncode != 0
    assert "ref_driver:" in completed.stderr
    assert "reference" in completed.stderr
