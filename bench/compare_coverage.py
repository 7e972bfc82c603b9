#!/usr/bin/env python3
"""
Does C{compare}'s 95 % interval cover the true ratio (issue 34)?

Starts a bubblewrap GPU server (one worker, reused), calibrates a
C{torch.cuda._sleep} spin that adds about C{--difference} (5 %) to a 4096
matmul, measures the true ratio with one long comparison (1,000
interleaved iterations a side: the same conditions as the trials) and, for
the record, with two long separate benchmarks, then runs C{--trials}
comparisons of A against itself (true ratio 1) and of A against A plus the
spin, counting the intervals that cover the true ratio (and the separate
benchmarks' ratio) and the verdicts.  Prints a summary and writes
C{bench/results/compare_coverage.json} (or C{--output}).  Run on the GPU
machine::

    python3 bench/compare_coverage.py --trials 40
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

from kcoral.client.results import program_result  # noqa: E402
from kcoral.testing.live_server import ServerProcess  # noqa: E402
from kcoral.wire.multipart import decode_response  # noqa: E402
from tests.gpu.test_gpu_compare import PAIR, run_pair  # noqa: E402
from tests.gpu.test_gpu_trusted_timing import readonly_flags  # noqa: E402

ALONE = """
import torch
from kcoral.builtins import benchmark

def alone(spin, repeat):
    x = torch.randn(4096, 4096, device="cuda")
    out = torch.empty_like(x)
    def f():
        torch.matmul(x, x, out=out)
        if spin:
            torch.cuda._sleep(spin)
    return benchmark(f, {"warmup": 20, "repeat": repeat})["latency_ms_median"]
"""


def alone(server: ServerProcess, spin: int, repeat: int) -> float:
    program = {
        "instructions": [
            {"op": "upload", "kind": "module", "id": "m", "source": ALONE},
            {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "alone"},
            {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": [spin, repeat]},
            {"op": "return", "key": "r", "value": {"$ref": "r"}},
        ],
        "options": {"timeout_seconds": 300},
    }
    response = server.execute(program, timeout=400)
    body, parts = decode_response(response.headers["content-type"], response.body)
    return float(program_result(body, parts).check()["r"])


def trials(
    server: ServerProcess, spin: int, truth: float, count: int, repeat: int
) -> dict[str, Any]:
    rows = []
    for _ in range(count):
        result, _ = run_pair(server, spin, {"warmup": 5, "repeat": repeat})
        low, high = result["ratio_ci95"]
        rows.append(
            {
                "ratio": result["ratio"],
                "ci95": [low, high],
                "verdict": result["verdict"],
                "covers": low <= truth <= high,
                "valid": result["validity"]["ok"],
            }
        )
    covered = sum(r["covers"] for r in rows)
    verdicts = {
        v: sum(r["verdict"] == v for r in rows) for v in ("faster", "slower", "indistinguishable")
    }
    return {
        "true_ratio": truth,
        "trials": rows,
        "covered": covered,
        "coverage": covered / count,
        "verdicts": verdicts,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--repeat", type=int, default=30, help="timed iterations per side")
    parser.add_argument("--difference", type=float, default=0.05)
    parser.add_argument("--output", default=str(common.RESULTS / "compare_coverage.json"))
    args = parser.parse_args()
    server = ServerProcess(
        ["--device", "gpu", "--gpus", "0", "--workers-per-gpu", "1"]
        + ["--max-requests-per-worker", "0", "--log-dir", "", "--sandbox", "bubblewrap"]
        + ["--tensor-api", "torch", *readonly_flags()]
    )
    server.start(timeout=240)
    try:
        base = alone(server, 0, 300)
        # Calibrate: cycles per ms of torch.cuda._sleep, from one long spin.
        probe = 2_000_000
        per_ms = probe / max(alone(server, probe, 50) - base, 1e-6)
        spin = int(per_ms * base * args.difference)
        separate_ab = alone(server, spin, 1000) / alone(server, 0, 1000)
        long_pair, _ = run_pair(server, spin, {"warmup": 20, "repeat": 1000})
        truth_ab = float(long_pair["ratio"])
        print(
            f"A: {base:.4f} ms; spin {spin} cycles; true A/B ratio {truth_ab:.4f} "
            f"(1000 interleaved iterations a side; two separate benchmarks: {separate_ab:.4f})"
        )
        same = trials(server, 0, 1.0, args.trials, args.repeat)
        print(f"A/A: coverage {same['coverage']:.0%}, verdicts {same['verdicts']}")
        differ = trials(server, spin, truth_ab, args.trials, args.repeat)
        differ["separate_ratio"] = separate_ab
        differ["covers_separate_ratio"] = sum(
            low <= separate_ab <= high for low, high in (r["ci95"] for r in differ["trials"])
        ) / len(differ["trials"])
        print(
            f"A/B: coverage {differ['coverage']:.0%} "
            f"(of the separate benchmarks' ratio: {differ['covers_separate_ratio']:.0%}), "
            f"verdicts {differ['verdicts']}"
        )
    finally:
        server.stop()
    common.write_result(
        args.output,
        {"a_ms": base, "spin_cycles": spin, "pair_source": PAIR, "a_a": same, "a_b": differ},
    )
    print(json.dumps({"a_a": same["coverage"], "a_b": differ["coverage"]}))


if __name__ == "__main__":
    main()
