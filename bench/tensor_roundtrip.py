#!/usr/bin/env python3
"""
End-to-end cost of moving a large tensor through the server and back.

The program uploads one C{--size-mib} MiB float32 tensor (a blob) and
returns it unchanged, so the bytes cross the wire twice and, on a GPU
server, are copied to the device and back.  Three flows, each
C{--iterations} times, every one with a fresh tensor unless stated:

 - C{direct}: the blob is supplied in the first attempt (one HTTP request);
 - C{client_flow}: what the 0.1.1 reference client does (protocol §5.5): a
   first attempt without blobs answers C{CACHE_MISS}, the second attempt
   carries the missing blob;
 - C{cached}: the same tensor again, first attempt without blobs; the
   server's memory cache holds it, so only the response carries the bytes.

Every returned part is compared byte for byte with what was sent (and its
SHA-256 with the result's C{sha256}).  Times are client wall clock:
C{end_to_end_ms} includes encoding the request and decoding the response on
the client, C{http_ms} the HTTP exchanges only; C{ms_per_mib} is
C{end_to_end_ms / size_mib}.

A CPU server (C{gpu_count} 0) cannot hold tensors (C{unavailable}); there the
script uploads the same bytes as a C{bytes} upload and says so, which still
measures the wire, cache and worker transfer path.

Writes C{bench/results/tensor_roundtrip.json} (or C{--output}).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402


def program(digest: str, shape: list[int], tensor: bool) -> dict:
    upload = {"op": "upload", "id": "t", "kind": "tensor" if tensor else "bytes", "blob": digest}
    if tensor:
        upload.update(dtype="float32", shape=shape)
    return {"instructions": [upload, {"op": "return", "key": "out", "value": {"$ref": "t"}}]}


def check(reply: common.Reply, data: bytes, tensor: bool, shape: list[int]) -> None:
    if reply.outcome != "COMPLETED":
        raise RuntimeError(f"round trip answered {reply.outcome}: {reply.describe_error()}")
    node = reply.result["results"]["out"]
    expected_type = "tensor" if tensor else "bytes"
    if node.get("type") != expected_type:
        raise RuntimeError(f"returned {node.get('type')}, expected {expected_type}")
    if tensor and (node.get("dtype") != "float32" or node.get("shape") != shape):
        raise RuntimeError(
            f"returned {node.get('dtype')} {node.get('shape')}, expected float32 {shape}"
        )
    part = reply.parts.get(node["part"])
    if part is None or hashlib.sha256(part).hexdigest() != node["sha256"]:
        raise RuntimeError("returned part missing or its SHA-256 does not match the result")
    if part != data:
        raise RuntimeError("returned bytes differ from the uploaded bytes")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_server_args(parser, "tensor_roundtrip")
    parser.add_argument("--size-mib", type=int, default=64)
    parser.add_argument("--iterations", type=int, default=5, help="round trips per flow")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    elements = (args.size_mib << 20) // 4
    shape = [elements // 1024, 1024] if elements % 1024 == 0 else [elements]
    base = np.random.default_rng(args.seed).standard_normal(elements, dtype=np.float32)
    counter = [0]

    def fresh() -> bytes:
        """A tensor no earlier request used, so no cache holds it."""
        counter[0] += 1
        array = base.copy()
        array[:2] = np.frombuffer(np.int64(counter[0] + time.time_ns()).tobytes(), dtype=np.float32)
        return array.tobytes()

    with common.server_from_args(args) as (host, port, where):
        info = common.server_info(host, port)
        tensor = bool(info["gpu_count"])
        kind = "tensor" if tensor else "bytes"
        if not tensor:
            print(
                "server has no GPU (gpu_count 0): tensors need a GPU worker, so the same "
                f"{args.size_mib} MiB travel as a 'bytes' upload instead"
            )
        print(f"{args.size_mib} MiB float32 round trip against {where} ({kind} upload)")
        conn = common.Connection(host, port)
        flows: dict[str, dict] = {}
        try:
            # Unrecorded warm-up: the first request may pay for imports.
            data = fresh()
            check(
                conn.execute(program(hashlib.sha256(data).hexdigest(), shape, tensor), [data]),
                data,
                tensor,
                shape,
            )

            for flow in ("direct", "client_flow", "cached"):
                samples = []
                cached = fresh()
                if flow == "cached":
                    digest = hashlib.sha256(cached).hexdigest()
                    check(
                        conn.execute(program(digest, shape, tensor), [cached]),
                        cached,
                        tensor,
                        shape,
                    )
                for _ in range(args.iterations):
                    data = cached if flow == "cached" else fresh()
                    started = time.perf_counter()
                    digest = hashlib.sha256(data).hexdigest()
                    prog = program(digest, shape, tensor)
                    if flow == "direct":
                        reply = conn.execute(prog, [data])
                        attempts, http_ms = 1, reply.wall_ms
                    elif flow == "client_flow":
                        first = conn.execute(prog)
                        if first.outcome != "CACHE_MISS":
                            raise RuntimeError(
                                f"fresh tensor: first attempt answered {first.outcome}, not CACHE_MISS"
                            )
                        reply = conn.execute(prog, [data])
                        attempts, http_ms = 2, first.wall_ms + reply.wall_ms
                    else:
                        reply = conn.execute(prog)
                        attempts, http_ms = 1, reply.wall_ms
                    end_to_end = (time.perf_counter() - started) * 1e3
                    check(reply, data, tensor, shape)
                    samples.append(
                        {
                            "end_to_end_ms": end_to_end,
                            "http_ms": http_ms,
                            "attempts": attempts,
                            "elapsed_ms": float(reply.result["elapsed_ms"]),
                            "queue_ms": float(reply.result["queue_ms"]),
                        }
                    )
                e2e = common.describe([s["end_to_end_ms"] for s in samples])
                flows[flow] = {
                    "iterations": len(samples),
                    "attempts": samples[0]["attempts"],
                    "end_to_end_ms": e2e,
                    "http_ms": common.describe([s["http_ms"] for s in samples]),
                    "server_elapsed_ms": common.describe([s["elapsed_ms"] for s in samples]),
                    "ms_per_mib": e2e["p50"] / args.size_mib,
                    "mib_per_s_each_way": args.size_mib / (e2e["p50"] / 1e3),
                    "bytes_verified": True,
                }
                f = flows[flow]
                print(
                    f"  {flow:<12} {f['attempts']} attempt(s): end-to-end p50 {e2e['p50']:.1f} ms "
                    f"(min {e2e['min']:.1f}, max {e2e['max']:.1f}), {f['ms_per_mib']:.2f} ms/MiB, "
                    f"HTTP p50 {f['http_ms']['p50']:.1f} ms, server elapsed p50 "
                    f"{f['server_elapsed_ms']['p50']:.1f} ms; bytes identical"
                )
        finally:
            conn.close()

        common.write_result(
            args.output,
            {
                "benchmark": "tensor_roundtrip",
                "label": args.label,
                "server": where,
                "server_info": info,
                "upload_kind": kind,
                "size_mib": args.size_mib,
                "dtype": "float32",
                "shape": shape,
                "flows": flows,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
