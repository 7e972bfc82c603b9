"""
The side-by-side tooling in CI form: C{bench/ref_driver.py} (the reference
client 0.1.1, in its own virtualenv) drives the stub floor
(C{bench/stub_server.py}) and a CPU kcoral server in reuse mode for a few
seconds each, and C{bench/side_by_side_table.py} tabulates them.

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

import pytest

from kcoral.testing.live_server import ServerProcess, free_port, request

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
    "1,4",
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


@pytest.fixture(scope="module")
def stub() -> Iterator[int]:
    pytest.importorskip("aiohttp")
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, str(BENCH / "stub_server.py"), "--port", str(port), "--gpus", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if request(port, "GET", "/health", timeout=2).status == 200:
                    break
            except OSError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                out = process.stdout.read().decode() if process.stdout else ""
                pytest.fail(f"stub server did not start: {out}")
            time.sleep(0.1)
        yield port
    finally:
        process.terminate()
        process.wait(10)


def drive(
    refclient: Path, port: int, output: Path, *workloads: str, extra: tuple[str, ...] = ()
) -> dict:
    """Run the driver with the reference virtualenv's interpreter and no PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
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
    "null.rps.c4",
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
    for clients in ("1", "4"):
        level = result["details"]["null_closed_loop"][clients]
        assert len(level["rounds_per_s"]) == 3
        assert level["requests_per_s"] == sorted(level["rounds_per_s"])[1]
        assert result["figures"][f"null.rps.c{clients}"] == level["requests_per_s"]
    # The busiest level over each round's own peak, then the median of rounds.
    levels = result["details"]["null_closed_loop"]
    shares = [
        top / max(one, top)
        for one, top in zip(levels["1"]["rounds_per_s"], levels["4"]["rounds_per_s"], strict=True)
    ]
    assert result["details"]["null_round_peak_shares"] == {"4": pytest.approx(shares)}
    assert result["figures"]["null.round_peak_share.c4"] == pytest.approx(sorted(shares)[1])
    result = drive(refclient, stub, tmp_path / "two.json", "null", extra=("--rounds", "2"))
    level = result["details"]["null_closed_loop"]["4"]
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
    for clients in ("1", "4"):
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


def test_kcoral_cpu_and_table(
    refclient: Path,
    stub: int,
    cpu_server: Callable[..., ServerProcess],
    tmp_path: Path,
) -> None:
    """The same workloads against a CPU kcoral server in reuse mode; then the table."""
    server = cpu_server("--sandbox", "none", "--max-requests-per-worker", "0")
    ours = drive(refclient, server.port, tmp_path / "kcoral.json", "all")
    assert ours["failed"] == []
    assert FIGURES <= set(ours["figures"])
    assert ours["details"]["tensor"]["kind"] == "bytes"
    assert ours["details"]["tensor_roundtrip_attempts"] == [2]
    floor = drive(refclient, stub, tmp_path / "stub.json", "null")
    assert floor["failed"] == []
    table = subprocess.run(
        [
            sys.executable,
            str(BENCH / "side_by_side_table.py"),
            str(tmp_path / "stub.json"),
            str(tmp_path / "kcoral.json"),
            str(tmp_path / "missing.json"),
            "--output",
            str(tmp_path / "table.json"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert table.returncode == 0, table.stderr
    rows = {row["figure"]: row for row in json.loads((tmp_path / "table.json").read_text())["rows"]}
    assert rows["null.sequential.p50"]["floor"] is not None
    assert rows["null.sequential.p50"]["kcoral"] is not None
    assert rows["null.sequential.p50"]["reference"] is None


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
