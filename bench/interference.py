#!/usr/bin/env python3
"""
Disturbed measurements (issue 34): does a program's child, double-forked
orphan, exec'd binary or lingering thread move another request's
benchmark median, and is every result it moves flagged?  And does an idle
run flag nothing?

Starts a bubblewrap GPU server (4 reused workers on GPU 0), then:

 1. idle: C{--idle} benchmarks in a row (4096 matmul, 50 iterations),
    counting those the monitor flagged;
 2. for each attack (the programs of tests/gpu/test_gpu_monitor.py): a
    baseline median (8192 matmul), then victims in a row while the attack
    runs; per victim its median, how far it moved, and whether it was
    flagged; per attack how long its request took to fail and why.

Prints a summary and writes C{bench/results/interference.json} (or
C{--output}).  Run on the GPU machine::

    python3 bench/interference.py --idle 50
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

from kcoral.testing.live_server import ServerProcess  # noqa: E402
from tests.gpu.test_gpu_monitor import ATTACKS, THREAD, run_attack, run_victim  # noqa: E402
from tests.gpu.test_gpu_trusted_timing import readonly_flags  # noqa: E402


def attack_run(server: ServerProcess, name: str, source: str, seconds: int) -> dict[str, Any]:
    baseline = statistics.median(run_victim(server)["latency_ms_median"] for _ in range(3))
    out: dict[str, Any] = {}
    attacker = threading.Thread(target=run_attack, args=(server, source, seconds, out))
    started = time.monotonic()
    attacker.start()
    victims = []
    # The thread attack's request returns at once: keep measuring while it spins.
    spins = started + seconds if name == "thread" else started
    while (attacker.is_alive() or time.monotonic() < spins) and len(victims) < 30:
        result = run_victim(server)
        victims.append(
            {
                "median_ms": result["latency_ms_median"],
                "moved": result["latency_ms_median"] / baseline - 1,
                "flagged": not result["validity"]["ok"],
                "reasons": result["validity"]["reasons"],
            }
        )
    attacker.join(timeout=120)
    body = out.get("body", {})
    unflagged_moved = [v for v in victims if abs(v["moved"]) > 0.02 and not v["flagged"]]
    return {
        "attack": name,
        "baseline_ms": baseline,
        "attacker_status": body.get("status"),
        "attacker_error": (body.get("error") or {}).get("message"),
        "attacker_seconds": out.get("seconds"),
        "victims": victims,
        "max_moved": max((abs(v["moved"]) for v in victims), default=0.0),
        "flagged": sum(v["flagged"] for v in victims),
        "moved_unflagged": len(unflagged_moved),
        "target_met": not unflagged_moved,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--idle", type=int, default=50, help="benchmarks in the idle run")
    parser.add_argument("--seconds", type=int, default=25, help="how long each attack spins")
    parser.add_argument("--output", default=str(common.RESULTS / "interference.json"))
    parser.add_argument("--log-dir", default="")
    parser.add_argument(
        "--attacks", default="child,double_fork,exec_binary,thread", help="which, comma-separated"
    )
    args = parser.parse_args()
    server = ServerProcess(
        ["--device", "gpu", "--gpus", "0", "--workers-per-gpu", "4"]
        + ["--max-requests-per-worker", "0", "--log-dir", args.log_dir]
        + ["--sandbox", "bubblewrap", "--tensor-api", "torch", *readonly_flags()]
    )
    server.start(timeout=240)
    try:
        idle = [run_victim(server, n=4096) for _ in range(args.idle)]
        flagged = [r["validity"]["reasons"] for r in idle if not r["validity"]["ok"]]
        print(f"idle: {len(flagged)} of {len(idle)} benchmarks flagged {flagged[:3]}")
        runs = []
        chosen = args.attacks.split(",")
        for name, source in [*sorted(ATTACKS.items()), ("thread", THREAD)]:
            if name not in chosen:
                continue
            run = attack_run(server, name, source, args.seconds if name != "thread" else 10)
            runs.append(run)
            print(
                f"{name}: baseline {run['baseline_ms']:.3f} ms, {len(run['victims'])} victims, "
                f"max moved {run['max_moved']:.1%}, flagged {run['flagged']}, "
                f"moved>2% unflagged {run['moved_unflagged']}; attacker "
                f"{run['attacker_status']} after {run['attacker_seconds'] or 0:.1f} s: "
                f"{(run['attacker_error'] or '')[:160]}"
            )
    finally:
        server.stop()
    common.write_result(
        args.output,
        {
            "idle": {"benchmarks": len(idle), "flagged": len(flagged), "reasons": flagged},
            "attacks": runs,
            "targets": {
                "idle_unflagged": not flagged,
                "attacks_flagged_or_within_2pct": all(r["target_met"] for r in runs),
            },
        },
    )
    print(json.dumps({"idle_flagged": len(flagged), "attacks_ok": [r["target_met"] for r in runs]}))


if __name__ == "__main__":
    main()
