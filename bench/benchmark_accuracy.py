#!/usr/bin/env python3
"""
Is C{builtin.benchmark} accurate?  The same 1 GiB device-to-device copy timed
through kcoral and directly with CUDA events, in one script run.

kcoral half (one request per C{--rounds}): the program allocates two
C{--size-mib} device buffers with the legacy C{builtin.empty} (float32),
uploads a module whose C{copy(dst, src)} issues one C{cuMemcpyDtoDAsync} of
the whole buffer through PyCUDA, and runs C{builtin.benchmark(copy, dst, src,
{warmup, repeat, flush_l2})} with fixed counts.  Its C{latency_ms_median}
and C{cv} are recorded.

Direct half (in this process, outside kcoral): PyCUDA on the same GPU
(C{--gpu}, primary context), two buffers of the same size, the same copy,
each bracketed by its own pair of CUDA events, C{--warmup} then C{--repeat}
copies; run once before and once after the kcoral rounds.  Skipped with a
message when PyCUDA or a GPU is missing here.

Targets (printed, never asserted): the kcoral median within 0.5 % of the
direct median, and the kcoral CV below 2 %.  On a server without a GPU the
kcoral half is skipped with a message.

Writes C{bench/results/benchmark_accuracy.json} (or C{--output}).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

COPY_SOURCE = """
import pycuda.driver as drv
from kcoral.worker.gpu_builtins import device_pointer


def copy(dst, src):
    drv.memcpy_dtod_async(device_pointer(dst), device_pointer(src), NBYTES)
"""

REL_TARGET = 0.005
CV_TARGET = 0.02


def kcoral_program(nbytes: int, warmup: int, repeat: int, flush_l2: bool) -> dict[str, Any]:
    shape = {"shape": [nbytes // 4], "dtype": "float32"}
    return {
        "instructions": [
            {"op": "run", "id": "src", "fn": "builtin.empty", "args": [shape]},
            {"op": "run", "id": "dst", "fn": "builtin.empty", "args": [shape]},
            {
                "op": "upload",
                "id": "m",
                "kind": "module",
                "source": COPY_SOURCE + f"\nNBYTES = {nbytes}\n",
            },
            {"op": "get_function", "id": "copy", "module": {"$ref": "m"}, "name": "copy"},
            {
                "op": "run",
                "id": "bench",
                "fn": "builtin.benchmark",
                "args": [
                    {"$ref": "copy"},
                    {"$ref": "dst"},
                    {"$ref": "src"},
                    {"warmup": warmup, "repeat": repeat, "flush_l2": flush_l2},
                ],
            },
            {"op": "return", "key": "out", "value": {"$ref": "bench"}},
        ]
    }


def decode(node: dict[str, Any]) -> Any:
    """A protocol §7 value tree to plain Python (no binary parts expected)."""
    kind = node["type"]
    if kind == "object":
        return {k: decode(v) for k, v in node["value"].items()}
    if kind == "array":
        return [decode(v) for v in node["value"]]
    if kind == "null":
        return None
    return node.get("value")


class Direct:
    """The same copy timed with PyCUDA events in this process."""

    def __init__(self, ordinal: int, nbytes: int) -> None:
        import pycuda.driver as drv

        drv.init()
        self.drv = drv
        self.device = drv.Device(ordinal)
        self.context = self.device.retain_primary_context()
        self.context.push()
        self.nbytes = nbytes
        self.src = drv.mem_alloc(nbytes)
        self.dst = drv.mem_alloc(nbytes)
        drv.memset_d32(self.src, 0x3F800000, nbytes // 4)
        self.context.synchronize()

    def time(self, warmup: int, repeat: int) -> list[float]:
        drv = self.drv
        spans: list[float] = []
        for count, keep in ((warmup, False), (repeat, True)):
            events = [(drv.Event(), drv.Event()) for _ in range(count)]
            for start, end in events:
                start.record()
                drv.memcpy_dtod_async(self.dst, self.src, self.nbytes)
                end.record()
            if events:
                events[-1][1].synchronize()
            if keep:
                spans = [end.time_since(start) for start, end in events]
        return spans

    def close(self) -> None:
        self.src.free()
        self.dst.free()
        self.context.pop()
        self.context.detach()


def summary(spans: list[float]) -> dict[str, float]:
    mean = statistics.fmean(spans)
    return {
        "n": len(spans),
        "latency_ms_median": statistics.median(spans),
        "latency_ms_mean": mean,
        "latency_ms_min": min(spans),
        "latency_ms_max": max(spans),
        "cv": statistics.stdev(spans) / mean if len(spans) > 1 else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_server_args(parser, "benchmark_accuracy")
    parser.add_argument("--size-mib", type=int, default=1024, help="size of each buffer")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3, help="kcoral requests")
    parser.add_argument(
        "--flush-l2", action="store_true", help="benchmark with flush_l2 (default off)"
    )
    parser.add_argument("--gpu", type=int, default=0, help="CUDA ordinal for the direct half")
    args = parser.parse_args(argv)
    nbytes = args.size_mib << 20

    with common.server_from_args(args) as (host, port, where):
        info = common.server_info(host, port)
        print(
            f"{args.size_mib} MiB device-to-device copy, {args.repeat} timed copies, against {where}"
        )

        direct = None
        direct_skip = None
        try:
            direct = Direct(args.gpu, nbytes)
        except ImportError as e:
            direct_skip = f"PyCUDA is not importable here ({e}); direct CUDA-event half skipped"
        except Exception as e:  # noqa: BLE001 - no GPU, driver errors: reported
            direct_skip = (
                f"no usable GPU here for the direct half ({type(e).__name__}: {e}); skipped"
            )
        if direct_skip:
            print(direct_skip)

        direct_spans: list[float] = []
        rounds: list[dict[str, Any]] = []
        kcoral_skip = None
        try:
            if direct:
                direct_spans += direct.time(args.warmup, args.repeat)
            if not info["gpu_count"]:
                kcoral_skip = (
                    "server has no GPU (gpu_count 0): kcoral builtin.benchmark half skipped"
                )
                print(kcoral_skip)
            else:
                conn = common.Connection(host, port)
                try:
                    prog = kcoral_program(nbytes, args.warmup, args.repeat, args.flush_l2)
                    for i in range(args.rounds):
                        reply = conn.execute(prog)
                        if reply.outcome != "COMPLETED":
                            raise RuntimeError(
                                f"benchmark program answered {reply.outcome}: {reply.describe_error()}"
                            )
                        result = decode(reply.result["results"]["out"])
                        result["request_wall_ms"] = reply.wall_ms
                        rounds.append(result)
                        print(
                            f"  kcoral round {i + 1}: median {result['latency_ms_median']:.4f} ms, "
                            f"CV {result['cv'] * 100:.3f}%, min {result['latency_ms_min']:.4f}, "
                            f"max {result['latency_ms_max']:.4f} ({result['repeat']} timed, {result.get('timing')})"
                        )
                finally:
                    conn.close()
            if direct:
                direct_spans += direct.time(args.warmup, args.repeat)
        finally:
            if direct:
                direct.close()

        out: dict[str, Any] = {
            "benchmark": "benchmark_accuracy",
            "label": args.label,
            "server": where,
            "server_info": info,
            "size_bytes": nbytes,
            "warmup": args.warmup,
            "repeat": args.repeat,
            "flush_l2": args.flush_l2,
            "targets": {"relative_difference": REL_TARGET, "kcoral_cv": CV_TARGET},
            "kcoral_rounds": rounds,
            "kcoral_skipped": kcoral_skip,
            "direct_skipped": direct_skip,
        }
        if direct_spans:
            d = summary(direct_spans)
            out["direct"] = d
            print(
                f"  direct events: median {d['latency_ms_median']:.4f} ms, CV {d['cv'] * 100:.3f}% "
                f"({d['n']} copies), {2 * nbytes / (d['latency_ms_median'] * 1e-3) / 1e9:.1f} GB/s read+write"
            )
        if rounds:
            k_median = statistics.median(r["latency_ms_median"] for r in rounds)
            k_cv = statistics.median(r["cv"] for r in rounds)
            out["kcoral"] = {
                "latency_ms_median": k_median,
                "cv_median_of_rounds": k_cv,
                "cv_max_of_rounds": max(r["cv"] for r in rounds),
            }
            verdict = "meets" if k_cv < CV_TARGET else "MISSES"
            print(
                f"  kcoral CV (median of rounds) {k_cv * 100:.3f}% ({verdict} the < {CV_TARGET * 100:g}% target)"
            )
            if direct_spans:
                rel = (k_median - out["direct"]["latency_ms_median"]) / out["direct"][
                    "latency_ms_median"
                ]
                out["relative_difference"] = rel
                verdict = "within" if abs(rel) <= REL_TARGET else "OUTSIDE"
                print(
                    f"  kcoral vs direct: {rel * 100:+.3f}% ({verdict} the ±{REL_TARGET * 100:g}% target)"
                )
        common.write_result(args.output, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
