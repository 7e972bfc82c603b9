"""
C{bench/gateway.py}'s throughput phase in CI form: one round on two CPU
nodes' worth of nothing (a few hundred null programs), with the CPU meter
and the ballast figure, so that the tooling behind issue 37's throughput
figures keeps working.  No rate or ratio is asserted: this machine may have
two cores.  What is asserted is that every figure the README's reading of a
round rests on is there and sane: each role's CPU, the host's busy share,
the speed probe's samples, the ceiling and the equal-load ratio.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kcoral.testing.nats import nats_server_binary

from .benchscripts import run_bench

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        nats_server_binary() is None, reason="nats-server is not installed (./dev.sh install)"
    ),
]


def test_throughput_round_accounts_cpu(tmp_path: Path) -> None:
    output = tmp_path / "gateway.json"
    run_bench(
        "gateway.py",
        *("--phases", "throughput", "--node-workers", "1", "--concurrency", "4"),
        *("--requests", "120", "--warmup", "2", "--ballast", "1", "--output", str(output)),
        timeout=600,
    )
    throughput = json.loads(output.read_text())["throughput"]
    (round_,) = throughput["rounds"]
    assert set(round_) == {"nodes_1", "nodes_3", "nodes_1_ballast"}
    for figure in round_.values():
        assert figure["requests"] == 120
        cpu = figure["cpu"]
        assert 0.0 < cpu["host_busy"] <= 1.0
        assert 0.0 <= cpu["host_steal"] <= cpu["host_busy"]
        assert cpu["probe_samples"] > 0 and cpu["probe_us"] > 0 and cpu["probe_memory_us"] > 0
        per_job = cpu["ms_per_job"]
        # Every role did work for every job; a node's tree includes its main.
        for role in ("gateway", "nodes", "nats"):
            assert per_job[role] > 0, (role, per_job)
            assert per_job[role] >= per_job[role + "_main"] - 0.05, (role, per_job)
        assert per_job["client"] > 0
        assert set(cpu["main_busy"]) == {"gateway", "nodes", "nats"}
        # The CPU's counters on the nodes' mains, or why this host has none.
        counted = cpu["counters"]["nodes"]
        if "unavailable" in counted:
            assert counted["unavailable"].startswith("no hardware counters here")
        else:
            assert counted["minstructions_per_job"] > 0 and counted["mcycles_per_job"] > 0
            assert 0.0 < counted["ipc"] < 10.0 and 0.1 < counted["ghz"] < 10.0
    (ceiling,) = throughput["ceilings"]
    assert ceiling["ceiling"] == pytest.approx(3 * ceiling["main_ms_1"] / ceiling["main_ms_3"])
    (equal,) = throughput["ratios_equal_load"]
    assert equal == pytest.approx(
        round_["nodes_3"]["per_second"] / round_["nodes_1_ballast"]["per_second"]
    )
    # The ballast ran beside the third figure: the client side (this
    # benchmark's children) spent far more CPU per job there.
    assert (
        round_["nodes_1_ballast"]["cpu"]["ms_per_job"]["client"]
        > round_["nodes_1"]["cpu"]["ms_per_job"]["client"]
    )


def test_counters_follow_a_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """
    C{bench/hwcounters.py} counts a live process's threads through
    perf_event_open.  Hosts without a PMU (most CI machines) still have the
    kernel's software clocks, which take the same path: counted here in
    place of cycles and instructions, both give the CPU nanoseconds a
    busy child spent.
    """
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import hwcounters

    monkeypatch.setattr(hwcounters, "_HARDWARE", 1)  # PERF_TYPE_SOFTWARE
    busy = subprocess.Popen(
        [sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 3: pass"]
    )
    try:
        time.sleep(0.2)
        counters = hwcounters.open_counters([busy.pid])
        assert isinstance(counters, hwcounters.Counters), counters
        before = counters.read()
        time.sleep(0.5)
        after = counters.read()
        counters.close()
    finally:
        busy.kill()
        busy.wait()
    for start, end in zip(before, after, strict=True):
        # Half a second of a spinning process: its CPU clock moved by most of it.
        assert 0.2e9 < end - start < 0.6e9, (before, after)
