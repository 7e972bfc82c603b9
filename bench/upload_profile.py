"""
Where a large upload's time goes in the server, with a client that is never
the bottleneck: a raw socket sends a prebuilt request (the head, then the
body with one C{sendall}), so the server sets the pace.

It starts a server (C{--flags}, default a CPU server in reuse mode), uploads
C{--size-mib} of fresh bytes C{--uploads} times (each a new blob, a program
that only uploads it), and reads the server's own figures per upload from
its events: C{request_received.body_ms} (the last byte arrived) and
C{request_accepted.body_ready_ms} (the blob hashed and sealed).  With
C{--py-spy} it samples every thread of the server (idle ones too) and
prints each thread's heaviest leaf frames: the reactor, the blob's write
and hash threads (L{kcoral.wire.blobsink}), the pool.  Beside it, the bound:
SHA-256 of the same size on one core of this machine.

    python3 bench/upload_profile.py [--size-mib 64] [--uploads 10] [--py-spy]

No timing is asserted; the JSON goes to C{bench/results/upload_profile.json}.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import http.client
import json
import os
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from kcoral.testing.live_server import ServerProcess, multipart_body  # noqa: E402

DEFAULT_FLAGS = "--device cpu --num-workers 2 --sandbox none --max-requests-per-worker 0"


def raw_post(port: int, content_type: str, body: bytes) -> dict[str, Any]:
    """POST /execute over a plain socket; the answer's JSON (small here)."""
    head = (
        f"POST /execute HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head)
        sock.sendall(body)
        response = http.client.HTTPResponse(sock)
        response.begin()
        return json.loads(response.read())


def sha256_ms(data: bytes, piece: int = 256 << 10) -> float:
    view = memoryview(data)
    started = time.perf_counter()
    hasher = hashlib.sha256()
    for offset in range(0, len(data), piece):
        hasher.update(view[offset : offset + piece])
    return (time.perf_counter() - started) * 1e3


def thread_table(raw: str, top: int = 6) -> dict[str, list[tuple[str, int]]]:
    """Per thread (py-spy's first frame names it), the heaviest leaf frames."""
    threads: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if len(frames) < 2:
            continue
        # "thread (tid): name" with --threads; a blob's threads are new for
        # every upload, so they are grouped by name.
        name = frames[0].partition("): ")[2] or frames[0]
        if name == "MainThread":
            name = "reactor (MainThread)"
        threads[name][frames[-1]] += int(count)
    return {name: leaves.most_common(top) for name, leaves in threads.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flags", default=DEFAULT_FLAGS, help="the server's flags")
    parser.add_argument("--size-mib", type=int, default=64)
    parser.add_argument("--uploads", type=int, default=10)
    parser.add_argument("--py-spy", action="store_true", help="sample the server's threads")
    parser.add_argument("--rate", type=int, default=1000, help="py-spy samples per second")
    parser.add_argument("--output", default=str(common.RESULTS / "upload_profile.json"))
    args = parser.parse_args(argv)
    size = args.size_mib << 20
    log_dir = Path(tempfile.mkdtemp(prefix="upload-profile-"))
    base = os.urandom(size)
    bound = statistics.median(sha256_ms(base) for _ in range(5))
    print(
        f"sha256 of {args.size_mib} MiB on one core: {bound:.1f} ms ({size / bound / 1e3:.0f} MB/s)"
    )
    server = ServerProcess(
        [*shlex.split(args.flags), "--log-dir", str(log_dir)], log_path=log_dir / "server.out"
    )
    server.start(timeout=240)
    spy = None
    raw_path = log_dir / "spy.raw"
    ids = []
    try:

        def body(i: int) -> tuple[str, bytes]:
            data = i.to_bytes(8, "little") + base[8:]
            digest = hashlib.sha256(data).hexdigest()
            upload = {"op": "upload", "kind": "bytes", "id": "b", "blob": digest}
            return multipart_body({"instructions": [upload]}, [data])

        raw_post(server.port, *body(0))  # warm-up
        if args.py_spy:
            binary = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
            assert server.process is not None
            spy = subprocess.Popen(
                [binary, "record", "-p", str(server.process.pid), "-f", "raw", "-o",
                 str(raw_path), "-r", str(args.rate), "--idle", "--threads", "--nonblocking"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            time.sleep(1.0)
        for i in range(1, args.uploads + 1):
            content_type, request_body = body(i)
            time.sleep(0.2)  # the server's previous blob is released
            answer = raw_post(server.port, content_type, request_body)
            del request_body
            assert answer.get("status") == "COMPLETED", answer
            ids.append(answer["request_id"])
        if spy is not None:
            spy.send_signal(2)
            spy.wait(30)
        time.sleep(0.5)
    finally:
        server.stop()
    events: dict[str, dict[str, Any]] = collections.defaultdict(dict)
    for path in log_dir.rglob("events.jsonl*"):
        for line in path.read_text().splitlines():
            event = json.loads(line)
            if event.get("request_id") in ids:
                events[event["request_id"]][event["event"]] = event
    arrived = [events[r]["request_received"]["body_ms"] for r in ids]
    ready = [events[r]["request_accepted"]["body_ready_ms"] for r in ids]
    result: dict[str, Any] = {
        "benchmark": "upload_profile",
        "size_mib": args.size_mib,
        "flags": args.flags,
        "sha256_ms": bound,
        "body_ms": arrived,
        "body_ready_ms": ready,
        "p50_body_ms": statistics.median(arrived),
        "p50_ready_ms": statistics.median(ready),
        "ready_vs_sha256": statistics.median(ready) / bound,
    }
    print(
        f"{len(ids)} uploads of {args.size_mib} MiB: last byte p50 {result['p50_body_ms']:.1f} ms,"
        f" hashed and sealed p50 {result['p50_ready_ms']:.1f} ms"
        f" ({size / result['p50_ready_ms'] / 1e3:.0f} MB/s, {result['ready_vs_sha256']:.2f}x"
        " the SHA-256 bound)"
    )
    if spy is not None and raw_path.exists():
        table = thread_table(raw_path.read_text())
        result["threads"] = table
        for name, leaves in table.items():
            print(f"-- {name[:70]}")
            for frame, count in leaves:
                print(f"   {count:6d}  {frame[:110]}")
    common.write_result(args.output, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
