"""
The raw per-iteration spans behind C{compare}, for designing its interval
(issue 34's coverage).

In one process on GPU 0 (kcoral's in-process backend, CUPTI timing, the
spans captured before the statistics): a 4096 float32 matmul as A, the same
plus a calibrated C{torch.cuda._sleep} worth C{--difference} of A as B.
Rounds of short comparisons (A/A and A/B with warmup 5, A/B with warmup
20; C{--repeat} iterations a side) alternate with long A/B comparisons
(1000 a side) at the start, the middle and the end, so that drift between
runs shows.  Writes every comparison's spans, sides and interval to
C{bench/results/compare_samples.json} (or C{--output}).

    python3 bench/probes/compare_samples.py --rounds 40
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


class Capture:
    """A measurer that keeps every raw measurement and evaluates it here."""

    def __init__(self) -> None:
        self.raws: list[Any] = []
        self._started = 0.0
        self._wall = 0.0

    def start(self) -> None:
        self._started = time.monotonic()

    def stop(self) -> None:
        self._wall = (time.monotonic() - self._started) * 1000.0

    def submit(self, raw: Any) -> dict[str, Any]:
        from kcoral.measurement import evaluate

        self.raws.append(raw)
        return evaluate(raw, self._wall)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--difference", type=float, default=0.05)
    parser.add_argument(
        "--output",
        default=str(Path(__file__).resolve().parents[1] / "results" / "compare_samples.json"),
    )
    args = parser.parse_args()

    import torch

    from kcoral.worker import gpu_builtins, runtime
    from kcoral.worker.gpu import GpuBackend
    from kcoral.worker.gpu_builtins.timing import benchmark, compare

    backend = GpuBackend(0, tensor_api="torch")
    gpu_builtins.use_backend(backend)
    capture = Capture()
    runtime.install_measurer(capture)
    x = torch.randn(4096, 4096, device="cuda")
    out = torch.empty_like(x)
    spin = {"cycles": 0}

    def a() -> None:
        torch.matmul(x, x, out=out)

    def b() -> None:
        torch.matmul(x, x, out=out)
        if spin["cycles"]:
            torch.cuda._sleep(spin["cycles"])

    base = benchmark(a, {"warmup": 20, "repeat": 300})["latency_ms_median"]
    probe = 2_000_000
    spin["cycles"] = probe
    long_spin = benchmark(b, {"warmup": 5, "repeat": 50})["latency_ms_median"]
    per_ms = probe / max(long_spin - base, 1e-6)
    cycles = int(per_ms * base * args.difference)
    print(f"A {base:.4f} ms; {per_ms:.0f} cycles/ms; spin {cycles} cycles")
    runs: list[dict[str, Any]] = []

    def one(label: str, with_spin: bool, warmup: int, repeat: int) -> None:
        spin["cycles"] = cycles if with_spin else 0
        started = time.monotonic()
        if with_spin:
            result = compare(a, b, {"warmup": warmup, "repeat": repeat})
        else:
            result = compare(a, a, {"warmup": warmup, "repeat": repeat})
        raw = capture.raws[-1]
        runs.append(
            {
                "label": label,
                "at": started,
                "warmup": warmup,
                "repeat": repeat,
                "spans_ms": list(raw.spans_ms),
                "sides": list(raw.sides),
                "ratio": result["ratio"],
                "ci95": result["ratio_ci95"],
                "valid": result["validity"]["ok"],
            }
        )

    def long_runs() -> None:
        one("ab_long", True, 20, 1000)
        print(f"  long A/B ratio {runs[-1]['ratio']:.5f}")

    long_runs()
    for i in range(args.rounds):
        one("aa_w5", False, 5, args.repeat)
        one("ab_w5", True, 5, args.repeat)
        one("ab_w20", True, 20, args.repeat)
        if i == args.rounds // 2:
            long_runs()
    long_runs()
    one("aa_long", False, 20, 1000)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"a_ms": base, "spin_cycles": cycles, "runs": runs}))
    for label in ("aa_w5", "ab_w5", "ab_w20"):
        ratios = [r["ratio"] for r in runs if r["label"] == label]
        print(label, f"mean ratio {sum(ratios) / len(ratios):.5f} over {len(ratios)}")
    backend.close()


if __name__ == "__main__":
    main()
