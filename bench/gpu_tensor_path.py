#!/usr/bin/env python3
"""
The tensor data path on a GPU, in one batch (issue 15): what each copy costs
and how fast a 64 MiB float32 round trip moves through our server.

Part 1, in this process (PyCUDA, no server), the copies a worker can make
with a sealed shared buffer (L{kcoral.ipc.shared}):

 - C{h2d_mapped}: host to device straight from the read-only mapping of
   the memfd (pageable memory; what workers do today);
 - C{h2d_registered}: the same after C{cuMemHostRegister} of the mapping
   (read-only flag), registration and unregistration timed with the copy;
 - C{h2d_staged}: memfd to a pinned staging buffer, then to the device;
 - C{d2h_then_share}: device to a fresh host array, then into a new memfd
   (what workers do for a returned tensor);
 - C{d2h_into_memfd}: device straight into a writable mapping of a new
   memfd, unmapped and sealed afterwards (pageable: slower on the H200);
 - C{d2h_registered_memfd}: the same with the mapping page-locked for the
   copy (C{cuMemHostRegister}, then unregistered), through the worker's own
   code (L{kcoral.worker.gpu.copy_dtoh_shared}: C{KCORAL_DTOH_COPY=registered},
   and returns over 64 MiB);
 - C{d2h_registered_unpopulated}: the same without C{MAP_POPULATE} (the
   registration faults the pages in);
 - C{register_memfd}: only the page-locking of that path (a new memfd,
   mapped, registered, unregistered, sealed; no copy): its fixed cost;
 - C{d2h_pinned_staging}: device to the worker's page-locked staging
   buffer, kept across returns (L{kcoral.worker.gpu.Staging}: what workers
   do under the lease for a returned device tensor from 4 MiB to 64 MiB;
   the part collector writes the memfd from it after the lease);
 - C{hash_memfd}: SHA-256 of a result buffer's mapping (the part
   collector's pass, made after the lease is released);
 - C{return_staging}, C{return_registered}, C{return_pageable}: the whole
   of a return each way (C{KCORAL_DTOH_COPY}), the copy and the part
   collector's memfd and hash; the fastest is printed.

Part 2, through our server (C{--device gpu}, workers reused, C{--sandbox
none}, its logs beside the JSON output): the reference client's flow for a
fresh tensor each time (C{CACHE_MISS}, then the request with the blob), the
tensor returned unchanged and checked byte for byte.  "At the server": up =
size / C{body_ready_ms} of the blob request's C{request_accepted} event
(end of head until the blob was hashed and sealed; C{body_ms} of
C{request_received}, until its last byte arrived, is printed too), down = size / C{elapsed_ms} of its
C{response_streamed} event; end-to-end and the server's own C{elapsed_ms}
are the client's figures.

Writes bench/results/gpu_tensor_path.json (or C{--output}).

    python bench/gpu_tensor_path.py [--size-mib 64] [--iterations 5] [--workers 8]
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import common  # noqa: E402

from kcoral.ipc import shared  # noqa: E402
from kcoral.testing.live_server import ServerProcess  # noqa: E402
from kcoral.wire.multipart import decode_response  # noqa: E402
from kcoral.wire.values import PartCollector  # noqa: E402

#: cuMemHostRegister flags.
CU_MEMHOSTREGISTER_READ_ONLY = 0x08


def timed(fn: Any, repeat: int) -> dict[str, float]:
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - started) * 1e3)
    return {"p50_ms": statistics.median(samples), "min_ms": min(samples), "max_ms": max(samples)}


def copy_paths(size: int, repeat: int) -> dict[str, Any]:
    import pycuda.autoinit  # noqa: F401
    import pycuda.driver as drv

    libcuda = ctypes.CDLL("libcuda.so.1")
    data = np.random.default_rng(0).standard_normal(size // 4, dtype=np.float32)
    buffer = shared.share(memoryview(data).cast("B"))
    device = drv.mem_alloc(size)
    out: dict[str, Any] = {}

    def h2d_mapped() -> None:
        view = buffer.map()
        drv.memcpy_htod(device, view)
        drv.Context.synchronize()

    def h2d_registered() -> None:
        view = buffer.map()
        pointer = np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0]
        status = libcuda.cuMemHostRegister_v2(
            ctypes.c_void_p(pointer), ctypes.c_size_t(size), CU_MEMHOSTREGISTER_READ_ONLY
        )
        if status != 0:
            raise RuntimeError(f"cuMemHostRegister failed: {status}")
        try:
            drv.memcpy_htod(device, view)
            drv.Context.synchronize()
        finally:
            libcuda.cuMemHostUnregister(ctypes.c_void_p(pointer))

    pinned = drv.pagelocked_empty(size, np.uint8)

    def h2d_staged() -> None:
        pinned[:] = np.frombuffer(buffer.map(), dtype=np.uint8)
        drv.memcpy_htod(device, pinned)
        drv.Context.synchronize()

    def d2h_then_share() -> None:
        host = np.empty(size, np.uint8)
        drv.memcpy_dtoh(host, device)
        shared.share(memoryview(host))

    def d2h_into_memfd() -> None:
        fd = os.memfd_create("kcoral-result", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, size)
        mapped = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        host = np.frombuffer(mapped, dtype=np.uint8)
        drv.memcpy_dtoh(host, device)
        del host
        mapped.close()
        import fcntl

        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, shared.SEALS)
        shared.SharedBuffer(fd, size).close()

    from kcoral.worker import gpu

    def d2h_registered_memfd() -> None:
        result = gpu.copy_dtoh_shared(drv, int(device), size)
        if result is None:
            raise RuntimeError(f"page-locking refused: {gpu.dtoh_refused()}")
        result.close()

    def register_memfd() -> None:
        def register(view: memoryview) -> None:
            host = np.frombuffer(view, dtype=np.uint8)
            pointer = host.__array_interface__["data"][0]
            status = libcuda.cuMemHostRegister_v2(
                ctypes.c_void_p(pointer), ctypes.c_size_t(size), 0
            )
            if status != 0:
                raise RuntimeError(f"cuMemHostRegister failed: {status}")
            libcuda.cuMemHostUnregister(ctypes.c_void_p(pointer))
            del host

        shared.fill(size, register).close()

    def d2h_registered_unpopulated() -> None:
        # As d2h_registered_memfd without MAP_POPULATE: the registration
        # faults the pages in (one walk over them instead of two).
        import fcntl

        fd = os.memfd_create("kcoral-result", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, size)
        mapped = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        host = np.frombuffer(mapped, dtype=np.uint8)
        pointer = host.__array_interface__["data"][0]
        status = libcuda.cuMemHostRegister_v2(ctypes.c_void_p(pointer), ctypes.c_size_t(size), 0)
        if status != 0:
            raise RuntimeError(f"cuMemHostRegister failed: {status}")
        try:
            drv.memcpy_dtoh(host, device)
        finally:
            libcuda.cuMemHostUnregister(ctypes.c_void_p(pointer))
        del host
        mapped.close()
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, shared.SEALS)
        shared.SharedBuffer(fd, size).close()

    staging = gpu.Staging()

    def staged() -> memoryview:
        view = staging.copy(drv, int(device), size)
        if view is None:
            raise RuntimeError(f"page-locked staging refused: {gpu.dtoh_refused()}")
        return view

    def d2h_pinned_staging() -> None:
        # Under the lease: only the copy into the staging buffer.
        staged()
        staging.release()

    # The whole of a return, the worker's own code: under the lease the copy,
    # after it the part (the memfd written and hashed by the part collector).
    def return_staging() -> None:
        PartCollector(shared.PARTS).add(staged())
        staging.release()

    def return_registered() -> None:
        buffer = gpu.copy_dtoh_shared(drv, int(device), size)
        if buffer is None:
            raise RuntimeError(f"page-locking refused: {gpu.dtoh_refused()}")
        PartCollector(shared.PARTS).add(buffer)
        buffer.close()

    def return_pageable() -> None:
        host = np.empty(size, np.uint8)
        drv.memcpy_dtoh(host, device)
        PartCollector(shared.PARTS).add(memoryview(host))

    result_buffer = shared.share(memoryview(data).cast("B"))

    def hash_memfd() -> None:
        view = result_buffer.map()
        hashlib.sha256(view).hexdigest()
        view.release()

    def check_bytes(name: str, copy: Any) -> None:
        drv.memcpy_htod(device, data)
        try:
            result = copy(drv, int(device), size)
            if result is None or result.tobytes() != data.tobytes():
                raise RuntimeError("bytes differ (or refused)")
            result.close()
            out[f"{name}_bytes_exact"] = True
        except Exception as e:
            out[f"{name}_bytes_exact"] = f"{type(e).__name__}: {e}"
        print(f"  {name} byte-exact: {out[f'{name}_bytes_exact']}")

    def staged_part(drv: Any, source: int, nbytes: int) -> shared.SharedBuffer | None:
        view = staging.copy(drv, source, nbytes)
        if view is None:
            return None
        parts = PartCollector(shared.PARTS)
        parts.add(view)
        staging.release()
        part = parts.parts[0]
        return part if isinstance(part, shared.SharedBuffer) else None

    check_bytes("d2h_registered_memfd", gpu.copy_dtoh_shared)
    check_bytes("d2h_pinned_staging", staged_part)
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            out["shmem_hugepages"] = f.read().strip()
    except OSError:
        out["shmem_hugepages"] = None
    print(f"  shmem transparent huge pages: {out['shmem_hugepages']}")

    for name, fn in [
        ("h2d_mapped", h2d_mapped),
        ("h2d_registered", h2d_registered),
        ("h2d_staged", h2d_staged),
        ("d2h_then_share", d2h_then_share),
        ("d2h_into_memfd", d2h_into_memfd),
        ("d2h_registered_memfd", d2h_registered_memfd),
        ("d2h_registered_unpopulated", d2h_registered_unpopulated),
        ("register_memfd", register_memfd),
        ("d2h_pinned_staging", d2h_pinned_staging),
        ("hash_memfd", hash_memfd),
        ("return_staging", return_staging),
        ("return_registered", return_registered),
        ("return_pageable", return_pageable),
    ]:
        try:
            fn()  # warm-up
            result = timed(fn, repeat)
            result["gb_per_s"] = size / (result["p50_ms"] / 1e3) / 1e9
        except Exception as e:  # report, keep going
            result = {"error": f"{type(e).__name__}: {e}"}
        out[name] = result
        shown = (
            f"p50 {result['p50_ms']:.2f} ms ({result['gb_per_s']:.1f} GB/s)"
            if "p50_ms" in result
            else result["error"]
        )
        print(f"  {name:<26} {shown}")
    ways = {
        "staging": "return_staging",
        "registered": "return_registered",
        "pageable": "return_pageable",
    }
    timed_ways = {how: out[row]["p50_ms"] for how, row in ways.items() if "p50_ms" in out[row]}
    if timed_ways:
        best = min(timed_ways, key=timed_ways.__getitem__)
        out["dtoh_copy_fastest"] = best
        print(
            f"  returned tensors: fastest way {best} (KCORAL_DTOH_COPY; workers default to"
            f" {gpu.DTOH_COPIES[0]}): "
            + ", ".join(f"{how} {ms:.1f} ms" for how, ms in timed_ways.items())
        )
    return out


def sha256_bound(size: int, repeat: int) -> dict[str, float]:
    """
    SHA-256 of C{size} bytes in 256 KiB pieces on one core: the upload's
    bound, since the server must name every blob by its digest and the
    hash is one sequential pass.
    """
    data = os.urandom(size)
    view = memoryview(data)
    piece = 256 << 10

    def digest() -> None:
        hasher = hashlib.sha256()
        for offset in range(0, size, piece):
            hasher.update(view[offset : offset + piece])

    result = timed(digest, repeat)
    result["mb_per_s"] = size / result["p50_ms"] / 1e3
    print(
        f"  sha256 of {size >> 20} MiB on one core: {result['p50_ms']:.1f} ms"
        f" ({result['mb_per_s']:.0f} MB/s): the upload's bound"
    )
    return result


def events(log_dir: Path) -> list[dict[str, Any]]:
    found = []
    for path in log_dir.rglob("events.jsonl*"):
        for line in path.read_text(errors="replace").splitlines():
            try:
                found.append(json.loads(line))
            except ValueError:
                pass
    return found


def server_round_trips(
    size_mib: int, iterations: int, workers: int, cpu: bool, results: Path
) -> dict[str, Any]:
    results.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="gpu-tensor-path-", dir=results))
    device = ["--device", "cpu", "--num-workers", "2"] if cpu else [
        "--device", "gpu", "--gpus", "0", "--workers-per-gpu", str(workers),
    ]  # fmt: skip
    flags = [
        *device,
        "--sandbox", "none", "--max-requests-per-worker", "0", "--log-dir", str(log_dir),
    ]  # fmt: skip
    # A CPU server holds no tensors: the same bytes travel as a bytes upload.
    upload: dict[str, Any] = {"kind": "bytes"} if cpu else {"kind": "tensor", "dtype": "float32"}
    elements = (size_mib << 20) // 4
    shape = [elements // 1024, 1024]
    base = np.random.default_rng(1).standard_normal(elements, dtype=np.float32)
    samples = []
    server = ServerProcess(flags, log_path=log_dir / "server.log")
    server.start(timeout=180)
    try:
        for i in range(iterations + 1):
            array = base.copy()
            array[:2] = np.frombuffer(np.int64(i + time.time_ns()).tobytes(), dtype=np.float32)
            data = array.tobytes()
            digest = hashlib.sha256(data).hexdigest()
            program = {
                "instructions": [
                    {"op": "upload", "id": "t", "blob": digest, **upload,
                     **({} if cpu else {"shape": shape})},
                    {"op": "return", "key": "out", "value": {"$ref": "t"}},
                ]
            }  # fmt: skip
            started = time.perf_counter()
            miss = server.execute(program)
            missed = time.perf_counter()
            reply = server.execute(program, [data])
            ended = time.perf_counter()
            assert json.loads(miss.body)["status"] == "CACHE_MISS", miss.body[:300]
            result, parts = decode_response(reply.headers["content-type"], reply.body)
            assert result["status"] == "COMPLETED", result
            if parts[result["results"]["out"]["part"]] != data:
                raise RuntimeError("returned bytes differ from the uploaded bytes")
            if i == 0:
                continue  # warm-up
            samples.append(
                {
                    "request_id": reply.headers.get("x-request-id"),
                    "end_to_end_ms": (ended - started) * 1e3,
                    "cache_miss_ms": (missed - started) * 1e3,
                    "blob_request_ms": (ended - missed) * 1e3,
                    "server_elapsed_ms": float(result["elapsed_ms"]),
                }
            )
        time.sleep(1.0)  # let the event log flush
    finally:
        server.stop()
    by_request: dict[str, dict[str, Any]] = {}
    for event in events(log_dir):
        rid = event.get("request_id")
        if rid:
            by_request.setdefault(rid, {})[event.get("event")] = event
    size = size_mib << 20
    for sample in samples:
        seen = by_request.get(sample["request_id"] or "", {})
        body_ms = (seen.get("request_received") or {}).get("body_ms")
        ready_ms = (seen.get("request_accepted") or {}).get("body_ready_ms")
        streamed = (seen.get("response_streamed") or {}).get("elapsed_ms")
        # Up: until the blob was hashed and sealed, not only received.
        sample["server_body_ms"] = body_ms
        sample["server_up_ms"] = ready_ms
        sample["server_down_ms"] = streamed
        sample["up_mb_per_s"] = size / ready_ms / 1e3 if ready_ms else None
        sample["down_mb_per_s"] = size / streamed / 1e3 if streamed else None

    def p50(key: str) -> float | None:
        values = [s[key] for s in samples if s.get(key) is not None]
        return statistics.median(values) if values else None

    summary = {
        key: p50(key)
        for key in (
            "end_to_end_ms",
            "cache_miss_ms",
            "blob_request_ms",
            "server_elapsed_ms",
            "server_body_ms",
            "server_up_ms",
            "server_down_ms",
            "up_mb_per_s",
            "down_mb_per_s",
        )
    }
    for key, value in summary.items():
        print(f"  {key:<18} p50 {value:.1f}" if value is not None else f"  {key:<18} n/a")
    return {"log_dir": str(log_dir), "samples": samples, "p50": summary}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=64)
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--skip-server", action="store_true")
    parser.add_argument(
        "--server-only", action="store_true", help="skip part 1 (the copies in this process)"
    )
    parser.add_argument(
        "--cpu", action="store_true", help="dry run on a CPU machine: no copy paths, a CPU server"
    )
    parser.add_argument("--output", default=str(common.RESULTS / "gpu_tensor_path.json"))
    args = parser.parse_args(argv)
    size = args.size_mib << 20
    if not args.cpu:
        print(f"== copy paths, {args.size_mib} MiB, in this process")
    result: dict[str, Any] = {"benchmark": "gpu_tensor_path", "size_mib": args.size_mib}
    if not (args.cpu or args.server_only):
        result["copy_paths"] = copy_paths(size, args.iterations)
    result["sha256_bound"] = sha256_bound(size, args.iterations)
    if not args.skip_server:
        print(
            f"== our server, {args.size_mib} MiB float32, client flow (CACHE_MISS, then the blob)"
        )
        result["server"] = server_round_trips(
            args.size_mib, args.iterations, args.workers, args.cpu, Path(args.output).parent
        )
    common.write_result(args.output, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
