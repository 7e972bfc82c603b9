"""
How fast the server's response path can send a large shared part, with a
client that reads as fast as loopback allows (C{recv_into} one reused
buffer): the part, a sealed memfd as a worker returns it, sent by
L{kcoral.server.http.streaming.BodyProducer} through C{sendfile}
(L{DirectSocket}) and through C{pread} slices, alternately, on the real
reactor.  It isolates the server's side of a download: through a Python
HTTP client (C{bench/gpu_tensor_path.py}) the client sets the pace.

    python3 bench/probes/response_path.py [--size-mib 256] [--rounds 4]

Prints the median of each way in MB/s and writes C{--output} (JSON).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/
import common  # noqa: E402
from twisted.internet import reactor  # noqa: E402
from twisted.web.resource import Resource  # noqa: E402
from twisted.web.server import NOT_DONE_YET, Site  # noqa: E402

from kcoral.ipc import shared  # noqa: E402
from kcoral.server.http.streaming import BodyProducer, DirectSocket, body_length  # noqa: E402


class _Part(Resource):
    isLeaf = True

    def __init__(self, part: shared.SharedBuffer, direct: bool, out: list[dict[str, Any]]):
        super().__init__()
        self.part, self.direct, self.out = part, direct, out

    def render_GET(self, request: Any) -> Any:
        chunks: list[bytes | shared.SharedBuffer] = [b"{}", self.part]
        request.setHeader(b"Content-Length", str(body_length(chunks)).encode())
        producer = BodyProducer(
            request, chunks, direct=DirectSocket.of(request) if self.direct else None
        )
        started = time.perf_counter()

        def done(_: None) -> None:
            seconds = time.perf_counter() - started
            self.out.append({"seconds": seconds, "sent_directly": producer.sent_directly})
            request.finish()

        producer.start().addCallback(done)
        return NOT_DONE_YET


def _fetch(port: int) -> int:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
        buffer = memoryview(bytearray(8 << 20))
        received = 0
        while count := sock.recv_into(buffer):
            received += count
        return received


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--output", default=str(common.RESULTS / "response_path.json"))
    args = parser.parse_args(argv)
    if not shared.available():
        print("response_path: no sealed memfds here")
        return 1
    size = args.size_mib << 20
    part = shared.share(os.urandom(1 << 20) * args.size_mib)
    samples: dict[str, list[dict[str, Any]]] = {"sendfile": [], "pread": []}
    ports = {
        way: reactor.listenTCP(
            0, Site(_Part(part, way == "sendfile", samples[way])), interface="127.0.0.1"
        )
        .getHost()
        .port
        for way in samples
    }
    failures: list[BaseException] = []

    def client() -> None:
        try:
            for _ in range(args.rounds + 1):  # the first round warms up
                for way, port in ports.items():
                    if _fetch(port) < size:
                        raise RuntimeError(f"{way}: short response")
        except BaseException as e:  # reported after the reactor stops
            failures.append(e)
        finally:
            reactor.callFromThread(reactor.stop)

    threading.Thread(target=client, daemon=True).start()
    reactor.run()
    if failures:
        raise failures[0]
    result: dict[str, Any] = {"benchmark": "response_path", "size_bytes": size}
    for way, rows in samples.items():
        seconds = statistics.median(row["seconds"] for row in rows[1:])
        result[way] = {
            "median_ms": seconds * 1e3,
            "mb_per_s": size / seconds / 1e6,
            "direct_share": rows[-1]["sent_directly"] / size,
        }
        print(
            f"{way:<9} median {seconds * 1e3:8.1f} ms  {size / seconds / 1e6:7.0f} MB/s  "
            f"(sent with sendfile: {result[way]['direct_share']:.0%})"
        )
    common.write_result(args.output, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
