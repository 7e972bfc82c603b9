"""
The floor: a KCoral server that answers from memory and does no work.

It speaks just enough of the protocol (GET /health, POST /execute with the
0.1.1 client's CACHE_MISS flow, JSON and multipart answers) for
C{bench/ref_driver.py}'s workloads, so the reference client measured against
it shows the least any server can cost that client: what is left is the
client's own cost, HTTP on loopback and the copies no server can avoid.

What it does per request: reads the whole body, splits the multipart parts
with C{bytes.find} (no copy of a part: memoryviews into the body), parses the
C{program} JSON, keeps supplied blobs in a dict (trusting their names: no
hashing), answers C{CACHE_MISS} for referenced blobs it lacks, and
"runs" the program: a function named C{echo} returns its first argument,
every other function returns C{None}; a returned tensor or bytes value goes
back as the blob it came from (its digest is its name). No worker, no GPU,
no validation beyond what the answer needs.

Stack: aiohttp (its C HTTP parser, llhttp) on uvloop when installed. It is
the cheapest well-kept asyncio HTTP/1.1 server with keep-alive on the GPU
machine's image (both are installed there; uvicorn needs a framework on top,
h11 is pure Python), and it lets the body be read in one piece and the
response written as a few buffers with a Content-Length, so a 64 MiB answer
costs one socket write of memory the stub already holds. It runs in one
process, like one reactor.

Standard library, aiohttp and (optionally) uvloop only; it never imports kcoral.

    python3 bench/stub_server.py --port 8200 [--gpus 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import uuid
from collections import OrderedDict
from typing import Any

from aiohttp import web

_ZERO_TIMINGS = {"queue_ms": 0.0, "elapsed_ms": 0.0, "lease_wait_ms": 0.0, "lease_held_ms": 0.0}


class BlobStore:
    """Supplied blobs by digest, least recently used out past C{limit} bytes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.size = 0
        self._blobs: OrderedDict[str, bytes | memoryview] = OrderedDict()

    def get(self, digest: str) -> bytes | memoryview | None:
        data = self._blobs.get(digest)
        if data is not None:
            self._blobs.move_to_end(digest)
        return data

    def put(self, digest: str, data: bytes | memoryview) -> None:
        old = self._blobs.pop(digest, None)
        if old is not None:
            self.size -= len(old)
        self._blobs[digest] = data
        self.size += len(data)
        while self.size > self.limit and len(self._blobs) > 1:
            _, dropped = self._blobs.popitem(last=False)
            self.size -= len(dropped)


def split_multipart(body: bytes, content_type: str) -> list[tuple[str, memoryview]]:
    """
    The (name, payload) pairs of a multipart/form-data body.

    Payloads are memoryviews into C{body}. Only what the 0.1.1 client sends
    is understood (one C{Content-Disposition} with a quoted name per part).
    """
    boundary = None
    for param in content_type.split(";")[1:]:
        key, _, value = param.strip().partition("=")
        if key.lower() == "boundary":
            boundary = value.strip('"')
    if not boundary:
        raise ValueError("no boundary")
    delimiter = b"\r\n--" + boundary.encode("latin-1")
    view = memoryview(body)
    parts = []
    # The first delimiter has no leading CRLF.
    start = body.find(delimiter[2:])
    if start < 0:
        raise ValueError("no first delimiter")
    position = start + len(delimiter) - 2
    while True:
        if body.startswith(b"--", position):
            return parts
        headers_end = body.find(b"\r\n\r\n", position)
        if headers_end < 0:
            raise ValueError("unterminated part headers")
        headers = body[position:headers_end].decode("latin-1")
        name = None
        for line in headers.split("\r\n"):
            key, _, value = line.partition(":")
            if key.strip().lower() == "content-disposition":
                marker = 'name="'
                at = value.find(marker)
                if at >= 0:
                    name = value[at + len(marker) : value.index('"', at + len(marker))]
        end = body.find(delimiter, headers_end + 4)
        if end < 0 or name is None:
            raise ValueError("malformed part")
        parts.append((name, view[headers_end + 4 : end]))
        position = end + len(delimiter)


class Encoder:
    """Encodes the stub's values; binary ones become numbered parts (protocol §7.2)."""

    def __init__(self) -> None:
        self.parts: list[bytes | memoryview] = []

    def encode(self, value: Any) -> dict[str, Any]:
        if value is None:
            return {"type": "null"}
        if isinstance(value, bool):
            return {"type": "boolean", "value": value}
        if isinstance(value, int):
            return {"type": "integer", "value": value}
        if isinstance(value, float):
            return {"type": "number", "value": value}
        if isinstance(value, str):
            return {"type": "string", "value": value}
        if isinstance(value, list):
            return {"type": "array", "value": [self.encode(v) for v in value]}
        if isinstance(value, Blob):
            part = f"return:{len(self.parts)}"
            self.parts.append(value.data)
            if value.dtype is None:
                return {"type": "bytes", "part": part, "sha256": value.digest}
            return {
                "type": "tensor",
                "part": part,
                "sha256": value.digest,
                "dtype": value.dtype,
                "shape": value.shape,
            }
        if isinstance(value, dict):
            return {"type": "object", "value": {k: self.encode(v) for k, v in value.items()}}
        return {"type": "null"}


class Blob:
    """An uploaded tensor or bytes value: its blob and, for a tensor, its metadata."""

    __slots__ = ("digest", "data", "dtype", "shape")

    def __init__(self, digest: str, data: bytes | memoryview, dtype: str | None, shape: Any):
        self.digest = digest
        self.data = data
        self.dtype = dtype
        self.shape = shape


class Function:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


def _json(body: dict[str, Any], request_id: str, status: int = 200) -> web.Response:
    return web.Response(
        status=status,
        body=json.dumps(body, separators=(",", ":")).encode(),
        content_type="application/json",
        headers={"X-Request-ID": request_id},
    )


def _error(request_id: str, status: int, message: str) -> web.Response:
    return _json(
        {
            "status": "ERROR",
            "request_id": request_id,
            "error": {"kind": "request", "message": message},
        },
        request_id,
        status,
    )


class Stub:
    def __init__(self, gpus: int, cache_bytes: int) -> None:
        self.gpus = gpus
        self.blobs = BlobStore(cache_bytes)
        self.instance_id = str(uuid.uuid4())
        self.requests = 0

    async def health(self, request: web.Request) -> web.Response:
        body = {
            "status": "ok",
            "instance_id": self.instance_id,
            "started_at": "1970-01-01T00:00:00Z",
            "gpu_count": self.gpus,
            "load": {"request_capacity": 1, "requests_in_progress": 0, "requests_waiting": 0},
            "target": {"arch": "sm_90a"} if self.gpus else {},
            "versions": {},
            "stub": True,
            "requests": self.requests,
        }
        return web.Response(body=json.dumps(body).encode(), content_type="application/json")

    async def execute(self, request: web.Request) -> web.StreamResponse:
        request_id = str(uuid.uuid4())
        self.requests += 1
        body = await request.read()
        try:
            parts = split_multipart(body, request.headers.get("Content-Type", ""))
        except ValueError as e:
            return _error(request_id, 400, f"malformed multipart body: {e}")
        program = None
        for name, data in parts:
            if name == "program":
                program = json.loads(bytes(data))
            elif name.startswith("blob:"):
                self.blobs.put(name[5:], data)
        if not isinstance(program, dict) or not isinstance(program.get("instructions"), list):
            return _error(request_id, 400, "no program")
        instructions = program["instructions"]
        missing = []
        for ins in instructions:
            digest = ins.get("blob") if ins.get("op") == "upload" else None
            if digest and self.blobs.get(digest) is None and digest not in missing:
                missing.append(digest)
        if missing:
            return _json(
                {"status": "CACHE_MISS", "request_id": request_id, "missing_blobs": missing},
                request_id,
            )
        return self._answer(instructions, request_id)

    def _answer(self, instructions: list[dict[str, Any]], request_id: str) -> web.StreamResponse:
        registers: dict[str, Any] = {}

        def resolve(value: Any) -> Any:
            if isinstance(value, dict) and set(value) == {"$ref"}:
                return registers.get(value["$ref"])
            return value

        encoder = Encoder()
        results: dict[str, Any] = {}
        for ins in instructions:
            op = ins.get("op")
            if op == "upload":
                digest = ins.get("blob")
                if digest:
                    data = self.blobs.get(digest)
                    assert data is not None
                    registers[ins["id"]] = Blob(digest, data, ins.get("dtype"), ins.get("shape"))
                else:
                    registers[ins["id"]] = None
            elif op == "get_function":
                registers[ins["id"]] = Function(ins.get("name", ""))
            elif op == "run":
                fn = resolve(ins.get("fn"))
                args = [resolve(a) for a in ins.get("args") or []]
                echo = isinstance(fn, Function) and fn.name == "echo" and args
                registers[ins["id"]] = args[0] if echo else None
            elif op == "return":
                results[ins["key"]] = encoder.encode(resolve(ins.get("value")))
        answer = {
            "status": "COMPLETED",
            "request_id": request_id,
            **_ZERO_TIMINGS,
            "stdout": "",
            "stderr": "",
            "stdout_truncated": False,
            "stderr_truncated": False,
            "results": results,
        }
        text = json.dumps(answer, separators=(",", ":")).encode()
        if not encoder.parts:
            return web.Response(
                body=text, content_type="application/json", headers={"X-Request-ID": request_id}
            )
        return _Multipart(text, encoder.parts, request_id)


class _Multipart(web.StreamResponse):
    """A multipart answer written as its buffers, with a Content-Length."""

    def __init__(self, result: bytes, parts: list[bytes | memoryview], request_id: str) -> None:
        boundary = "kcoral-" + uuid.uuid4().hex
        self._chunks: list[bytes | memoryview] = [
            f'--{boundary}\r\nContent-Disposition: form-data; name="result"\r\n'
            "Content-Type: application/json\r\n\r\n".encode(),
            result,
        ]
        for i, data in enumerate(parts):
            self._chunks.append(
                f'\r\n--{boundary}\r\nContent-Disposition: form-data; name="return:{i}"\r\n'
                "Content-Type: application/octet-stream\r\n\r\n".encode()
            )
            self._chunks.append(data)
        self._chunks.append(f"\r\n--{boundary}--\r\n".encode())
        super().__init__(
            headers={
                "Content-Type": f"multipart/form-data; boundary={boundary}",
                "X-Request-ID": request_id,
            }
        )
        self.content_length = sum(len(c) for c in self._chunks)

    async def prepare(self, request: web.BaseRequest) -> Any:
        writer = await super().prepare(request)
        for chunk in self._chunks:
            await self.write(chunk)
        await self.write_eof()
        return writer


def make_app(gpus: int, cache_bytes: int) -> web.Application:
    stub = Stub(gpus, cache_bytes)
    # client_max_size: a 64 MiB tensor and more must fit in one body.
    app = web.Application(client_max_size=cache_bytes)
    app.router.add_get("/health", stub.health)
    app.router.add_post("/execute", stub.execute)
    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8200)
    parser.add_argument(
        "--gpus", type=int, default=1, help="gpu_count to report in /health (0: a CPU server)"
    )
    parser.add_argument(
        "--cache-mib", type=int, default=2048, help="blob memory (and largest body) in MiB"
    )
    parser.add_argument("--no-uvloop", action="store_true", help="use asyncio's own loop")
    args = parser.parse_args(argv)
    loop_name = "asyncio"
    if not args.no_uvloop:
        try:
            import uvloop

            asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
            loop_name = "uvloop"
        except ImportError:
            pass
    print(
        f"stub server (aiohttp on {loop_name}, pid {os.getpid()}) on "
        f"http://{args.host}:{args.port}",
        flush=True,
    )
    web.run_app(
        make_app(args.gpus, args.cache_mib << 20),
        host=args.host,
        port=args.port,
        print=None,
        access_log=None,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
