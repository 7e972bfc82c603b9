"""
Where a large upload's (and download's) time goes in the server, with a
client that is never the bottleneck: a raw socket sends a prebuilt request
(the head, then the body with one C{sendall}) and reads the answer with
C{recv_into} one preallocated buffer, so the server sets the pace.

It starts a server (C{--flags}, default a CPU server in reuse mode), uploads
C{--size-mib} of fresh bytes C{--uploads} times (each a new blob, a program
that only uploads it), and reads the server's own figures per upload from
its events: C{request_received.body_ms} (the last byte arrived) and
C{request_accepted.body_ready_ms} (the blob hashed and sealed).  With
C{--download} each program also returns the blob, which comes back
byte for byte, and C{response_streamed.elapsed_ms} is the download as the
server sees it (the part sent with C{sendfile} from the worker's sealed
buffer).  With
C{--py-spy} it samples every thread of the server (idle ones too) and
prints each thread's heaviest leaf frames: the reactor, the blob's write
and hash threads (L{kcoral.ipc.blobsink}), the pool.  Beside it, the bound:
SHA-256 of the same size on one core of this machine.

    python3 bench/transfer_profile.py [--size-mib 64] [--uploads 10] [--download] [--py-spy]

No timing is asserted; the JSON goes to C{bench/results/transfer_profile.json}.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
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
from kcoral.wire.multipart import decode_response  # noqa: E402

DEFAULT_FLAGS = "--device cpu --num-workers 2 --sandbox none --max-requests-per-worker 0"


#: The buffer answers are read into.
_ANSWER = bytearray()


def raw_post(port: int, content_type: str, body: bytes) -> tuple[dict[str, Any], list[bytes]]:
    """
    POST /execute over a plain socket: the answer's JSON and its binary
    parts.  A C{Content-Length} answer is read into one preallocated buffer.
    """
    head = (
        f"POST /execute HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head)
        sock.sendall(body)
        received = bytearray()
        while b"\r\n\r\n" not in received:
            chunk = sock.recv(1 << 16)
            if not chunk:
                raise RuntimeError("the server closed before its answer's head")
            received += chunk
        raw_head, _, start = bytes(received).partition(b"\r\n\r\n")
        headers = dict(
            line.decode("latin-1").lower().split(": ", 1) for line in raw_head.split(b"\r\n")[1:]
        )
        if "content-length" not in headers:
            # A small chunked answer: read to the end (Connection: close).
            rest = bytearray(start)
            while chunk := sock.recv(1 << 16):
                rest += chunk
            return json.loads(_unchunk(bytes(rest))), []
        length = int(headers["content-length"])
        if len(_ANSWER) < length:
            # Grown once and reused, its pages touched before any timing:
            # reading must not fault in fresh memory while the server sends.
            _ANSWER.extend(bytes(length - len(_ANSWER)))
        view = memoryview(_ANSWER)[:length]
        answer = view
        view[: len(start)] = start
        filled = len(start)
        while filled < len(answer):
            got = sock.recv_into(view[filled:])
            if not got:
                raise RuntimeError("the server closed before the end of its answer")
            filled += got
    document, parts = decode_response(headers["content-type"], bytes(answer))
    view.release()
    return document, parts


def _unchunk(data: bytes) -> bytes:
    """The body of a chunked transfer coding (no trailers)."""
    out, position = bytearray(), 0
    while True:
        line_end = data.index(b"\r\n", position)
        size = int(data[position:line_end].split(b";")[0], 16)
        if size == 0:
            return bytes(out)
        out += data[line_end + 2 : line_end + 2 + size]
        position = line_end + 2 + size + 2


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
    parser.add_argument("--download", action="store_true", help="return each blob too")
    parser.add_argument("--rate", type=int, default=1000, help="py-spy samples per second")
    parser.add_argument("--output", default=str(common.RESULTS / "transfer_profile.json"))
    args = parser.parse_args(argv)
    size = args.size_mib << 20
    log_dir = Path(tempfile.mkdtemp(prefix="transfer-profile-"))
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
            back = {"op": "return", "key": "out", "value": {"$ref": "b"}}
            program = [upload, back] if args.download else [upload]
            return multipart_body({"instructions": program}, [data])

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
            answer, parts = raw_post(server.port, content_type, request_body)
            assert answer.get("status") == "COMPLETED", answer
            if args.download:
                returned = parts[answer["results"]["out"]["part"]]
                if returned != i.to_bytes(8, "little") + base[8:]:
                    raise RuntimeError("the returned bytes differ from the uploaded ones")
            del request_body, parts
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
        "benchmark": "transfer_profile",
        "size_mib": args.size_mib,
        "flags": args.flags,
        "sha256_ms": bound,
        "body_ms": arrived,
        "body_ready_ms": ready,
        "p50_body_ms": statistics.median(arrived),
        "p50_ready_ms": statistics.median(ready),
        "ready_vs_sha256": statistics.median(ready) / bound,
    }
    if args.download:
        down = [events[r]["response_streamed"]["elapsed_ms"] for r in ids]
        result["down_ms"] = down
        result["p50_down_ms"] = statistics.median(down)
        result["sent_directly"] = [events[r]["response_streamed"]["sent_directly"] for r in ids]
    print(
        f"{len(ids)} uploads of {args.size_mib} MiB: last byte p50 {result['p50_body_ms']:.1f} ms,"
        f" hashed and sealed p50 {result['p50_ready_ms']:.1f} ms"
        f" ({size / result['p50_ready_ms'] / 1e3:.0f} MB/s, {result['ready_vs_sha256']:.2f}x"
        " the SHA-256 bound)"
    )
    if args.download:
        print(
            f"downloads: streamed p50 {result['p50_down_ms']:.1f} ms"
            f" ({size / result['p50_down_ms'] / 1e3:.0f} MB/s at the server)"
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
