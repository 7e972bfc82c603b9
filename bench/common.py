"""
Shared client-side helpers for the kcoral benchmarks in this folder.

Standard library and numpy only: keep-alive C{http.client} connections, a
minimal multipart encoder/decoder for the KCoral wire format (protocol §3,
§8.2), percentile helpers, a thread-pool load generator and the JSON result
writer.  A benchmark either targets a running server (C{--url}) or starts one
itself (C{--spawn "<server flags>"}) through L{kcoral.testing.live_server.ServerProcess}.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import http.client
import json
import math
import platform
import shlex
import statistics
import sys
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DEFAULT_URL = "http://127.0.0.1:8000"


# --------------------------------------------------------------------------
# arguments and the server under test


def add_server_args(parser: argparse.ArgumentParser, name: str) -> None:
    """C{--url}, C{--spawn}, C{--spawn-timeout}, C{--output}, C{--label}."""
    parser.add_argument("--url", default=DEFAULT_URL, help="base URL of a running server")
    parser.add_argument(
        "--spawn",
        metavar="FLAGS",
        help='start our own server with these flags (e.g. "--device cpu --num-workers 2 '
        "--log-dir '' --sandbox none\"); overrides --url",
    )
    parser.add_argument(
        "--spawn-timeout", type=float, default=180.0, help="seconds to wait for /health"
    )
    parser.add_argument("--label", default="", help="free text recorded in the JSON")
    parser.add_argument(
        "--output", default=str(RESULTS / f"{name}.json"), help="where to write the JSON result"
    )


@contextlib.contextmanager
def server_from_args(args: argparse.Namespace) -> Iterator[tuple[str, int, str]]:
    """Yield C{(host, port, description)}; start and stop a server for C{--spawn}."""
    if args.spawn is not None:
        from kcoral.testing.live_server import ServerProcess

        flags = shlex.split(args.spawn)
        log = RESULTS / f"spawned-server-{uuid.uuid4().hex[:8]}.log"
        RESULTS.mkdir(parents=True, exist_ok=True)
        server = ServerProcess(flags, log_path=log)
        started = time.monotonic()
        try:
            server.start(timeout=args.spawn_timeout)
        except Exception:
            sys.stderr.write(f"server failed to start; its output is in {log.name}\n")
            with contextlib.suppress(OSError):
                sys.stderr.write(log.read_text(errors="replace")[-4000:])
            raise
        print(
            f"spawned server on port {server.port} in {time.monotonic() - started:.1f} s: {args.spawn}"
        )
        try:
            yield "127.0.0.1", server.port, f"spawned: {args.spawn}"
        finally:
            code = server.stop()
            print(f"server stopped (exit code {code})")
            with contextlib.suppress(OSError):
                log.unlink()
    else:
        parsed = urllib.parse.urlsplit(args.url)
        yield parsed.hostname or "127.0.0.1", parsed.port or 80, args.url


# --------------------------------------------------------------------------
# HTTP


class Reply:
    """One decoded C{/execute} (or C{/health}) answer plus client wall time."""

    def __init__(self, status: int, headers: dict[str, str], body: bytes, wall_ms: float) -> None:
        self.status = status
        self.headers = headers
        self.body = body
        self.wall_ms = wall_ms
        self.result: dict[str, Any] = {}
        self.parts: dict[str, bytes] = {}
        content_type = headers.get("content-type", "")
        if content_type.startswith("multipart/"):
            self.parts = parse_multipart(body, content_type)
            self.result = json.loads(self.parts.pop("result"))
        elif body:
            try:
                self.result = json.loads(body)
            except ValueError:
                self.result = {
                    "status": f"HTTP {status}",
                    "raw": body[:500].decode(errors="replace"),
                }

    @property
    def outcome(self) -> str:
        return str(self.result.get("status", f"HTTP {self.status}"))

    def describe_error(self) -> str:
        error = self.result.get("error")
        if isinstance(error, dict):
            return f"{error.get('kind')}: {error.get('message')}"
        return json.dumps(self.result)[:500]


class Connection:
    """A keep-alive HTTP/1.1 connection to the server; reconnects on failure."""

    def __init__(self, host: str, port: int, timeout: float = 300.0) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self._conn: http.client.HTTPConnection | None = None

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            self._conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> Reply:
        for attempt in (0, 1):
            conn = self._connection()
            started = time.perf_counter()
            try:
                conn.request(method, path, body=body, headers=headers or {})
                response = conn.getresponse()
                data = response.read()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                # A keep-alive connection the server closed between requests.
                self.close()
                if attempt:
                    raise
                continue
            wall_ms = (time.perf_counter() - started) * 1e3
            if response.getheader("connection", "").lower() == "close":
                self.close()
            return Reply(
                response.status, {k.lower(): v for k, v in response.getheaders()}, data, wall_ms
            )
        raise AssertionError("unreachable")

    def health(self) -> dict[str, Any]:
        return self.request("GET", "/health").result

    def execute(self, program: dict[str, Any], blobs: list[bytes] = ()) -> Reply:
        content_type, body = multipart_body(program, list(blobs))
        return self.request("POST", "/execute", body, {"Content-Type": content_type})

    def execute_like_client(
        self, program: dict[str, Any], blobs: list[bytes]
    ) -> tuple[Reply, int, float]:
        """
        The 0.1.1 client's flow (protocol §5.5): first attempt without blobs,
        then the missing ones, then all.  Returns the last reply, the number of
        attempts and the total wall time in ms.
        """
        by_digest = {hashlib.sha256(b).hexdigest(): b for b in blobs}
        started = time.perf_counter()
        reply = self.execute(program)
        attempts = 1
        if reply.outcome == "CACHE_MISS":
            missing = [
                by_digest[d] for d in reply.result.get("missing_blobs", []) if d in by_digest
            ]
            reply = self.execute(program, missing)
            attempts += 1
            if reply.outcome == "CACHE_MISS":
                reply = self.execute(program, blobs)
                attempts += 1
        return reply, attempts, (time.perf_counter() - started) * 1e3


def multipart_body(program: dict[str, Any], blobs: list[bytes] = ()) -> tuple[str, bytes]:
    """The request body the reference client sends (program part, then blobs)."""
    from kcoral.testing.live_server import multipart_body as encode

    return encode(program, list(blobs))


def parse_multipart(body: bytes, content_type: str) -> dict[str, bytes]:
    """Parts of a KCoral multipart response by name (protocol §8.2)."""
    params = dict(p.strip().split("=", 1) for p in content_type.split(";")[1:] if "=" in p)
    boundary = params["boundary"].strip('"').encode()
    delimiter = b"\r\n--" + boundary
    data = b"\r\n" + body
    parts: dict[str, bytes] = {}
    position = data.index(delimiter) + len(delimiter)
    while not data.startswith(b"--", position):
        position = data.index(b"\r\n", position) + 2
        header_end = data.index(b"\r\n\r\n", position)
        headers = data[position:header_end].decode("latin-1")
        name = headers.split('name="', 1)[1].split('"', 1)[0]
        end = data.index(delimiter, header_end + 4)
        parts[name] = data[header_end + 4 : end]
        position = end + len(delimiter)
    return parts


def health(host: str, port: int) -> dict[str, Any]:
    conn = Connection(host, port, timeout=30)
    try:
        return conn.health()
    finally:
        conn.close()


# --------------------------------------------------------------------------
# programs


def module_program(
    source: str, calls: list[tuple[str, list[Any], bool]], return_last: bool = True
) -> dict[str, Any]:
    """
    Upload C{source} as a module and run each C{(function name, args,
    cpu_only)} of C{calls} in order; return the last run's value.
    """
    instructions: list[dict[str, Any]] = [
        {"op": "upload", "id": "m", "kind": "module", "source": source}
    ]
    for i, (name, args, cpu_only) in enumerate(calls):
        get = {"op": "get_function", "id": f"f{i}", "module": {"$ref": "m"}, "name": name}
        if cpu_only:
            get["cpu_only"] = True
        instructions += [get, {"op": "run", "id": f"r{i}", "fn": {"$ref": f"f{i}"}, "args": args}]
    if return_last:
        instructions.append({"op": "return", "key": "out", "value": {"$ref": f"r{len(calls) - 1}"}})
    return {"instructions": instructions}


# --------------------------------------------------------------------------
# load generation and statistics


def run_concurrent(
    host: str,
    port: int,
    concurrency: int,
    count: int,
    one: Callable[[Connection, int], Any],
    max_seconds: float | None = None,
) -> tuple[list[Any], float]:
    """
    Call C{one(connection, i)} for C{i} in C{range(count)} from C{concurrency}
    threads, each with its own keep-alive connection.  No request starts
    after C{max_seconds}.  Returns the results of the calls that ran, in
    index order, and the wall time in seconds.
    """
    results: list[Any] = [None] * count
    counter = iter(range(count))
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker() -> None:
        conn = Connection(host, port)
        try:
            while True:
                with lock:
                    i = next(counter, None)
                if i is None or errors:
                    return
                if deadline is not None and time.perf_counter() > deadline:
                    return
                try:
                    results[i] = one(conn, i)
                except BaseException as e:  # noqa: BLE001 - reported by the caller
                    errors.append(e)
                    return
        finally:
            conn.close()

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    started = time.perf_counter()
    deadline = None if max_seconds is None else started + max_seconds
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    if errors:
        raise errors[0]
    return [r for r in results if r is not None], elapsed


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile, C{q} in [0, 100]."""
    if not values:
        return math.nan
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def describe(values: list[float]) -> dict[str, float]:
    """p50/p90/p99/mean/min/max of a list of milliseconds."""
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "mean": statistics.fmean(values),
        "min": min(values),
        "max": max(values),
    }


def fmt(stats: dict[str, float], unit: str = "ms") -> str:
    if not stats.get("n"):
        return "no samples"
    return (
        f"p50 {stats['p50']:.2f} {unit}, p90 {stats['p90']:.2f}, p99 {stats['p99']:.2f}, "
        f"mean {stats['mean']:.2f}, max {stats['max']:.2f} (n={stats['n']})"
    )


def server_info(host: str, port: int) -> dict[str, Any]:
    """The parts of C{/health} worth recording next to a result."""
    h = health(host, port)
    return {
        "gpu_count": h.get("gpu_count"),
        "target": h.get("target"),
        "versions": h.get("versions"),
        "request_capacity": (h.get("load") or {}).get("request_capacity"),
        "sandbox": h.get("sandbox"),
        "workers": len(h.get("workers") or []) or None,
    }


def write_result(path: str, data: dict[str, Any]) -> None:
    data = {
        "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "client_host": platform.node(),
        "python": platform.python_version(),
        **data,
    }
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2, default=str) + "\n")
    try:
        shown = out.resolve().relative_to(ROOT)
    except ValueError:
        shown = out
    print(f"wrote {shown}")
