#!/usr/bin/env python3
"""
Our blocking client (C{kcoral.Client}) moving a large tensor up and back.

Each iteration builds a L{kcoral.Program} that uploads a fresh
C{--size-mib} MiB float32 tensor and returns it, then calls
C{Client.execute}: attempt 1 without the blob (CACHE_MISS), attempt 2 with
it, and the response carries it back.  The returned array is compared with
the one sent.  Recorded: client wall clock per execution (Program building
excluded), MiB/s each way, and, on one extra run under C{tracemalloc}, the
peak of Python memory the execution allocated beyond the Program itself
(the upload is streamed from the Program's bytes and the response decoded
as it arrives; see docs/client.md).

A CPU server cannot hold tensors (C{unavailable}); there the same bytes go
as a C{bytes} upload and come back as C{bytes}, and the script says so.

Writes C{bench/results/client_transfer.json} (or C{--output}).
"""

from __future__ import annotations

import argparse
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/

import common  # noqa: E402

from kcoral import Client, Program  # noqa: E402


def build(data: np.ndarray, tensor: bool) -> Program:
    program = Program()
    if tensor:
        handle = program.upload(kind="tensor", value=data)
    else:
        handle = program.upload(kind="bytes", value=data.tobytes())
    program.return_(key="out", value=handle)
    return program


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_server_args(parser, "client_transfer")
    parser.add_argument("--size-mib", type=int, default=64)
    parser.add_argument("--iterations", type=int, default=5)
    args = parser.parse_args(argv)

    elements = (args.size_mib << 20) // 4
    rng = np.random.default_rng(0)
    with common.server_from_args(args) as (host, port, where):
        info = common.server_info(host, port)
        tensor = bool(info["gpu_count"])
        if not tensor:
            print("server has no GPU (gpu_count 0): the bytes travel as a 'bytes' upload")
        url = f"http://{host}:{port}"
        samples: list[float] = []
        with Client(url) as client:
            client.health()
            for _ in range(args.iterations + 1):  # the first is an unrecorded warm-up
                data = rng.standard_normal(elements, dtype=np.float32)
                program = build(data, tensor)
                started = time.perf_counter()
                result = client.execute(program, timeout_seconds=600).check()
                samples.append((time.perf_counter() - started) * 1e3)
                back = result["out"]
                same = (back if tensor else np.frombuffer(back, np.float32)).tobytes()
                if same != data.tobytes():
                    raise RuntimeError("returned bytes differ from the uploaded bytes")
            program = build(rng.standard_normal(elements, dtype=np.float32), tensor)
            tracemalloc.start()
            base = tracemalloc.get_traced_memory()[0]
            client.execute(program, timeout_seconds=600).check()
            peak_mib = (tracemalloc.get_traced_memory()[1] - base) / 2**20
            tracemalloc.stop()
        wall = common.describe(samples[1:])
        print(
            f"{args.size_mib} MiB up and back through kcoral.Client against {where}: "
            f"p50 {wall['p50']:.1f} ms (min {wall['min']:.1f}, max {wall['max']:.1f}), "
            f"{args.size_mib / (wall['p50'] / 1e3):.1f} MiB/s each way; "
            f"peak extra Python memory {peak_mib:.1f} MiB ({peak_mib / args.size_mib:.2f}x the data)"
        )
        common.write_result(
            args.output,
            {
                "benchmark": "client_transfer",
                "label": args.label,
                "server": where,
                "server_info": info,
                "upload_kind": "tensor" if tensor else "bytes",
                "size_mib": args.size_mib,
                "wall_ms": wall,
                "mib_per_s_each_way": args.size_mib / (wall["p50"] / 1e3),
                "peak_extra_python_mib": peak_mib,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
