# -*- test-case-name: tests.integration.test_interop -*-
"""
Interoperability tests: the unmodified reference client (PyPI C{kcoral==0.1.1})
and our own client (L{kcoral.Client}, L{kcoral.client.cli}) against our
server in CPU mode, or, with C{KCORAL_INTEROP_DEVICE=gpu} on the GPU
machine, against GPU servers (fresh workers, two per GPU), where the few
cases that differ by device expect what a GPU server answers.

Each test that drives a client runs twice (the C{client_impl} fixture): the
reference client runs in its own virtualenv (see L{refclient}), ours in this
interpreter's environment; each test sends the same short script to it and
reads back one JSON line. Where the client
cannot express a request (malformed bodies, duplicate keys, unreferenced
blobs...) the tests speak raw HTTP through L{kcoral.testing.live_server}. The checklist
of protocol.md section 15 maps onto these tests in docs/interop.md.
"""

from __future__ import annotations

import json
import math
import os
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kcoral.testing.live_server import (
    ServerProcess,
    multipart_body,
    post_program,
    request,
    servers_by_flags,
    sha256,
)

from .refclient import (
    kcoral_cli,
    our_kcoral_cli,
    run_client,
    run_our_client,
)

pytestmark = pytest.mark.integration

_MARK = "@@KCORAL-INTEROP@@"

# Runs in the reference virtualenv before each test's body. The body fills
# C{out}; the epilogue prints it as one JSON line.
_PRELUDE = """
import hashlib, json, os, sys, tempfile, pathlib, textwrap
import kcoral
from kcoral import (Client, Program, KCoralError, ProtocolError, ReturnedFile,
                    ReturnedFolder, RemoteExecutionError)

def J(v):
    if isinstance(v, (bytes, bytearray)):
        return {"$bytes": bytes(v).hex()}
    if isinstance(v, ReturnedFile):
        return {"$file": v.read_bytes().hex()}
    if isinstance(v, ReturnedFolder):
        return {"$folder": {k: f.read_bytes().hex() for k, f in v.files.items()},
                "directories": list(v.directories)}
    if isinstance(v, dict):
        return {k: J(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [J(x) for x in v]
    return v

def R(r):
    return {"status": r.status, "request_id": r.request_id, "results": J(r.results),
            "stdout": r.stdout, "stderr": r.stderr,
            "stdout_truncated": r.stdout_truncated, "stderr_truncated": r.stderr_truncated,
            "error": r.error, "timings": [r.queue_ms, r.elapsed_ms, r.lease_wait_ms, r.lease_held_ms],
            "gpu_ids": list(r.gpu_ids)}

def E(e):
    return {"type": type(e).__name__, "status_code": getattr(e, "status_code", None),
            "kind": getattr(e, "kind", None), "message": str(getattr(e, "message", e)),
            "request_id": getattr(e, "request_id", None)}

ATTEMPTS = []

def _hook(response):
    response.read()
    response.request.read()
    status = None
    if response.headers.get("content-type", "").startswith("application/json"):
        status = json.loads(response.content).get("status")
    elif response.headers.get("content-type", "").startswith("multipart/form-data"):
        status = "multipart"
    missing = 0
    if status == "CACHE_MISS":
        missing = len(json.loads(response.content).get("missing_blobs") or [])
    ATTEMPTS.append({"blobs": response.request.content.count(b'name="blob:'),
                     "http": response.status_code, "status": status, "missing": missing,
                     "request_id": response.headers.get("x-request-id")})

URL = sys.argv[1]
client = Client(URL, headers=json.loads(sys.argv[2]) or None)
#@@HOOK@@

def module_program(source, name="f", args=(), key="r", cpu_only=False):
    p = Program()
    m = p.upload(kind="module", source=textwrap.dedent(source), id="m")
    f = p.get_function(module=m, name=name, id="f", cpu_only=cpu_only)
    r = p.run(fn=f, args=list(args), id="run")
    p.return_(key=key, value=r)
    return p

out = {}
"""

# How each client lets the script see its HTTP attempts.
_HOOKS = {
    "reference": 'client._http.event_hooks["response"].append(_hook)\n',
    "ours": (
        "client.attempt_observers.append(lambda a: ATTEMPTS.append({"
        '"blobs": a.blobs, "http": a.code, "request_id": a.request_id, '
        '"missing": len(a.missing_blobs), '
        '"status": "multipart" if a.media_type == "multipart/form-data" else a.status}))\n'
    ),
}

#: Which client the current test drives (set by the C{client_impl} fixture).
_IMPL = {"kind": "reference"}

_EPILOGUE = f"""
out.setdefault("attempts", ATTEMPTS)
print({_MARK!r} + json.dumps(out))
"""


@pytest.fixture(params=["reference", "ours"])
def client_impl(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the test with the reference client, then with ours."""
    if request.param == "reference":
        request.getfixturevalue("refclient")
    _IMPL["kind"] = request.param
    try:
        yield request.param
    finally:
        _IMPL["kind"] = "reference"


def cli(args: list[str], **kwargs: Any) -> Any:
    """Run the current client's C{kcoral} command."""
    if _IMPL["kind"] == "ours":
        return our_kcoral_cli(args, **kwargs)
    return kcoral_cli(args, **kwargs)


#: The servers' device: C{cpu} (the default) or C{gpu} (L{interop_server}).
DEVICE = os.environ.get("KCORAL_INTEROP_DEVICE", "cpu")
ON_GPU = DEVICE == "gpu"


@pytest.fixture(scope="module")
def interop_server(
    cpu_server: Callable[..., ServerProcess],
) -> Iterator[Callable[..., ServerProcess]]:
    """
    The module's server factory: L{cpu_server}'s, or on a GPU run GPU
    servers with two fresh workers per GPU (C{--num-workers N} becomes
    C{--workers-per-gpu N}).
    """
    if not ON_GPU:
        yield cpu_server
        return
    gpus = os.environ.get("KCORAL_INTEROP_GPUS", "0")
    base = ["--device", "gpu", "--gpus", gpus, "--workers-per-gpu", "2", "--log-dir", ""]
    factory = servers_by_flags(base)
    start = next(factory)

    def gpu_server(*args: str) -> ServerProcess:
        return start(*("--workers-per-gpu" if a == "--num-workers" else a for a in args))

    try:
        yield gpu_server
    finally:
        factory.close()


@pytest.fixture(scope="module")
def disk_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("disk-cache")


@pytest.fixture(scope="module")
def server(interop_server: Callable[..., ServerProcess], disk_cache: Path) -> ServerProcess:
    """The default server: bubblewrap sandbox, 2 workers."""
    return interop_server("--disk-cache-dir", str(disk_cache))


@pytest.fixture(scope="module", params=["bubblewrap", "none"])
def any_server(
    request: pytest.FixtureRequest,
    interop_server: Callable[..., ServerProcess],
    disk_cache: Path,
) -> ServerProcess:
    """The default server, and one without a sandbox."""
    return interop_server("--disk-cache-dir", str(disk_cache), "--sandbox", request.param)


@pytest.fixture(scope="module")
def limits_server(interop_server: Callable[..., ServerProcess]) -> ServerProcess:
    """One worker and small limits, for 413/500/503."""
    return interop_server(
        "--disk-cache-dir",
        "",
        "--num-workers",
        "1",
        "--max-request-bytes",
        "200000",
        "--max-response-bytes",
        "100000",
        "--worker-wait-timeout-seconds",
        "1",
    )


def client(
    server: ServerProcess,
    body: str,
    *,
    headers: dict[str, str] | None = None,
    timeout: float = 120,
) -> dict[str, Any]:
    """Run C{body} with the current client bound to C{server}; return its C{out}."""
    prelude = _PRELUDE.replace("#@@HOOK@@\n", _HOOKS[_IMPL["kind"]])
    script = prelude + textwrap.dedent(body) + _EPILOGUE
    run = run_our_client if _IMPL["kind"] == "ours" else run_client
    proc = run(
        script, f"http://127.0.0.1:{server.port}", json.dumps(headers or {}), timeout=timeout
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_MARK)]
    assert proc.returncode == 0 and lines, f"client script failed:\n{proc.stdout}\n{proc.stderr}"
    result: dict[str, Any] = json.loads(lines[-1][len(_MARK) :])
    return result


def b(data: bytes) -> dict[str, str]:
    """How the client scripts' C{J} spells bytes."""
    return {"$bytes": data.hex()}


# --- health ------------------------------------------------------------------


def test_health(client_impl: str, any_server: ServerProcess) -> None:
    out = client(
        any_server,
        """
        out["health"] = client.health()
        try:
            client.target()
        except ProtocolError as e:
            out["target"] = str(e)
        """,
    )
    health = out["health"]
    assert health["status"] == "ok"
    assert str(uuid.UUID(health["instance_id"])) == health["instance_id"]
    assert health["started_at"].endswith("Z")
    if ON_GPU:
        assert health["gpu_count"] >= 1
        assert health["target"]["arch"].startswith("sm_"), health["target"]
    else:
        assert health["gpu_count"] == 0
        assert health["target"] == {}
    assert isinstance(health["versions"], dict)
    load = health["load"]
    assert set(load) >= {"request_capacity", "requests_in_progress", "requests_waiting"}
    assert all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in load.values())
    if not ON_GPU:
        assert out["target"] == "the server reported no compilation target"
    raw = request(any_server.port, "GET", "/health")
    assert raw.status == 200
    assert raw.headers["content-type"].split(";")[0] == "application/json"


# --- values --------------------------------------------------------------------


def test_value_types(client_impl: str, any_server: ServerProcess) -> None:
    out = client(
        any_server,
        r'''
        p = module_program(r"""
            def f():
                return {
                    "null": None, "true": True, "false": False, "int": 42, "neg": -7,
                    "big": 2**100, "float": 2.5, "whole_float": 3.0, "str": "h\u00e9llo \u2603",
                    "empty_str": "", "bytes": b"\x00\r\n--x\xff", "empty_bytes": b"",
                    "bytearray": bytearray(b"ba"), "list": [1, "a", None], "tuple": (1, 2),
                    "dict": {"k": {"nested": [b"n", {"deep": True}]}}, "empty": {}, "empty_list": [],
                }
        """)
        r = client.execute(p)
        out["r"] = R(r)
        out["types"] = {k: type(v).__name__ for k, v in r.results.get("r", {}).items()}
        ''',
    )
    r = out["r"]
    assert r["status"] == "COMPLETED", r["error"]
    assert r["error"] is None
    if ON_GPU:
        # A GPU worker holds the lease while it runs (protocol 6.7).
        assert all(t >= 0.0 and math.isfinite(t) for t in r["timings"][2:])
    else:
        assert r["timings"][2:] == [0.0, 0.0]
    assert r["gpu_ids"] == []
    value = r["results"]["r"]
    assert value == {
        "null": None,
        "true": True,
        "false": False,
        "int": 42,
        "neg": -7,
        "big": 2**100,
        "float": 2.5,
        "whole_float": 3.0,
        "str": "h\u00e9llo \u2603",
        "empty_str": "",
        "bytes": b(b"\x00\r\n--x\xff"),
        "empty_bytes": b(b""),
        "bytearray": b(b"ba"),
        "list": [1, "a", None],
        "tuple": [1, 2],
        "dict": {"k": {"nested": [b(b"n"), {"deep": True}]}},
        "empty": {},
        "empty_list": [],
    }
    assert out["types"]["true"] == "bool"
    assert out["types"]["int"] == "int"
    assert out["types"]["whole_float"] == "float"
    assert list(value) == list(out["types"])  # insertion order kept


def test_value_types_raw_framing(server: ServerProcess) -> None:
    """Multipart response framing, part numbering and digests, seen raw."""
    source = "def f():\n    return [b'a', {'x': b'\\r\\n'}, b'']\ndef g():\n    return 1\n"
    program = {
        "instructions": [
            {"op": "upload", "kind": "module", "source": source, "id": "m"},
            {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "f"},
            {"op": "get_function", "id": "g", "module": {"$ref": "m"}, "name": "g"},
            {"op": "run", "id": "rf", "fn": {"$ref": "f"}, "args": []},
            {"op": "run", "id": "rg", "fn": {"$ref": "g"}, "args": []},
            {"op": "return", "key": "z", "value": {"$ref": "rf"}},
            {"op": "return", "key": "a", "value": {"$ref": "rf"}},
            {"op": "return", "key": "n", "value": {"$ref": "rg"}},
        ]
    }
    response = server.execute(program)
    assert response.status == 200
    content_type = response.headers["content-type"]
    assert content_type.startswith("multipart/form-data; boundary=")
    boundary = content_type.split("boundary=", 1)[1].strip('"').encode()
    parts = _split_multipart(response.body, boundary)
    names = [name for name, _, _ in parts]
    assert names == ["result"] + [f"return:{i}" for i in range(6)]
    assert parts[0][1] == "application/json"
    assert all(ctype == "application/octet-stream" for _, ctype, _ in parts[1:])
    body = json.loads(parts[0][2])
    assert body["request_id"] == response.headers["x-request-id"]
    assert list(body["results"]) == ["z", "a", "n"]
    assert "error" not in body
    assert "gpu_ids" not in body and "gpu_count" not in body
    payloads = {name: data for name, _, data in parts}
    z = body["results"]["z"]["value"]
    assert [z[0]["part"], z[1]["value"]["x"]["part"], z[2]["part"]] == [
        "return:0",
        "return:1",
        "return:2",
    ]
    for node, data in [(z[0], b"a"), (z[1]["value"]["x"], b"\r\n"), (z[2], b"")]:
        assert payloads[node["part"]] == data
        assert node["sha256"] == sha256(data)
    for _, _, data in parts:
        assert b"--" + boundary not in data


def _split_multipart(body: bytes, boundary: bytes) -> list[tuple[str, str, bytes]]:
    """A strict splitter for well-formed CRLF multipart bodies."""
    delimiter = b"--" + boundary
    assert body.startswith(delimiter + b"\r\n")
    assert body.endswith(delimiter + b"--\r\n") or body.endswith(delimiter + b"--")
    chunks = body.split(b"\r\n" + delimiter)
    first = chunks[0][len(delimiter) + 2 :]
    parts = []
    for chunk in [first] + [c[2:] for c in chunks[1:-1]]:
        head, _, data = chunk.partition(b"\r\n\r\n")
        headers = dict(
            (k.strip().lower(), v.strip())
            for k, _, v in (line.decode().partition(":") for line in head.split(b"\r\n"))
        )
        name = headers["content-disposition"].split('name="', 1)[1].rstrip('"')
        parts.append((name, headers["content-type"], data))
    return parts


def test_handles_and_ordering(client_impl: str, server: ServerProcess) -> None:
    """Handles, callables as arguments and callees, snapshots, interleaved returns."""
    out = client(
        server,
        r'''
        p = Program()
        m = p.upload(kind="module", source=textwrap.dedent("""
            state = []
            def noargs():
                return "called"
            def apply(fn, x):
                return fn(x)
            def double(x):
                return 2 * x
            def maker():
                return lambda: "from closure"
            def push(x):
                state.append(x)
                return state
            def echo(*args):
                return list(args)
            def me():
                return globals()["double"](21)
        """))
        noargs = p.get_function(module=m, name="noargs")
        apply = p.get_function(module=m, name="apply")
        double = p.get_function(module=m, name="double")
        maker = p.get_function(module=m, name="maker")
        push = p.get_function(module=m, name="push")
        echo = p.get_function(module=m, name="echo")
        me = p.get_function(module=m, name="me")
        r0 = p.run(fn=noargs, args=[])
        p.return_(key="noargs", value=r0)
        r1 = p.run(fn=apply, args=[double, 4])
        p.return_(key="apply", value=r1)
        blob = p.upload(kind="bytes", value=b"late")
        made = p.run(fn=maker)
        r2 = p.run(fn=made)
        p.return_(key="closure", value=r2)
        s1 = p.run(fn=push, args=[1])
        p.return_(key="snapshot", value=s1)
        p.run(fn=push, args=[2])
        r3 = p.run(fn=echo, args=[[{"$ref": "upload_0"}], {"$ref": "nope", "k": 1}, {"$ref": ""}, blob])
        p.return_(key="echo", value=r3)
        p.return_(key="globals", value=p.run(fn=me))
        r = client.execute(p)
        out["r"] = R(r)
        ''',
    )
    r = out["r"]
    assert r["status"] == "COMPLETED", r["error"]
    results = r["results"]
    assert results["noargs"] == "called"
    assert results["apply"] == 8
    assert results["closure"] == "from closure"
    assert results["snapshot"] == [1]
    assert results["echo"] == [
        [{"$ref": "upload_0"}],
        {"$ref": "nope", "k": 1},
        {"$ref": ""},
        b(b"late"),
    ]
    assert results["globals"] == 42


# --- blobs, CACHE_MISS --------------------------------------------------------


def test_bytes_uploads_cache_miss_and_retry(client_impl: str, any_server: ServerProcess) -> None:
    out = client(
        any_server,
        r"""
        nonce = os.urandom(16)
        blobs = [b"", b"\r\n\x00\xff" + nonce, os.urandom(70000)]
        p = Program()
        m = p.upload(kind="module", source="import hashlib\ndef f(*xs):\n    return [[len(x), hashlib.sha256(x).hexdigest(), type(x).__name__] for x in xs]\n")
        f = p.get_function(module=m, name="f")
        regs = [p.upload(kind="bytes", value=x) for x in blobs]
        p.return_(key="r", value=p.run(fn=f, args=regs))
        first = client.execute(p)
        out["first_attempts"] = list(ATTEMPTS)
        ATTEMPTS.clear()
        second = client.execute(p)
        out["second_attempts"] = list(ATTEMPTS)
        out["first"] = R(first)
        out["second"] = R(second)
        out["expected"] = [[len(x), hashlib.sha256(x).hexdigest(), "bytes"] for x in blobs]
        """,
    )
    assert out["first"]["status"] == "COMPLETED", out["first"]["error"]
    assert out["first"]["results"]["r"] == out["expected"]
    assert out["second"]["results"]["r"] == out["expected"]
    first = out["first_attempts"]
    # Attempt 1 carries no blobs and misses; attempt 2 sends the missing blobs:
    # all three, or two when the empty blob is cached already (the other
    # client's run of this test may have sent it).
    missing = first[0]["missing"]
    assert missing in (2, 3)
    assert [(a["blobs"], a["status"]) for a in first] == [(0, "CACHE_MISS"), (missing, "COMPLETED")]
    assert all(a["request_id"] for a in first)
    assert first[0]["request_id"] != first[1]["request_id"]
    # Seen before: served from the memory cache, no miss.
    assert [(a["blobs"], a["status"]) for a in out["second_attempts"]] == [(0, "COMPLETED")]


def test_cache_miss_raw(server: ServerProcess) -> None:
    digest_a = sha256(os.urandom(32))
    data = os.urandom(40)
    digest_b = sha256(data)
    program = {
        "instructions": [
            {"op": "upload", "kind": "bytes", "blob": digest_a, "id": "a"},
            {"op": "upload", "kind": "file", "blob": digest_b, "path": "x/y", "id": "b"},
            {"op": "upload", "kind": "bytes", "blob": digest_a, "id": "c"},
            {"op": "return", "key": "k", "value": {"$ref": "a"}},
        ],
        "options": {"gpu_count": 1},
    }
    response = server.execute(program, headers={"X-KCoral-Node": "node-7"})
    assert response.status == 200
    assert response.headers["content-type"].split(";")[0] == "application/json"
    body = response.json()
    assert set(body) == {"status", "request_id", "missing_blobs"}
    assert body["status"] == "CACHE_MISS"
    assert body["missing_blobs"] == [digest_a, digest_b]
    assert body["request_id"] == response.headers["x-request-id"]
    assert "x-kcoral-node" not in response.headers
    # Supplying b is retained; a still missing.
    response = server.execute(program, [data])
    assert response.json()["missing_blobs"] == [digest_a]


def test_gpu_count_after_cache_miss(server: ServerProcess) -> None:
    data = os.urandom(24)
    program = {
        "instructions": [
            {"op": "upload", "kind": "bytes", "blob": sha256(data), "id": "a"},
            {"op": "return", "key": "k", "value": {"$ref": "a"}},
        ],
        "options": {"gpu_count": 1},
    }
    assert server.execute(program).json()["status"] == "CACHE_MISS"
    response = server.execute(program, [data])
    if ON_GPU:
        # The returned bytes make the answer multipart: its first part is the result.
        boundary = response.headers["content-type"].split("boundary=", 1)[1].strip('"').encode()
        parts = _split_multipart(response.body, boundary)
        body = json.loads(parts[0][2])
        assert (body["status"], body["gpu_count"], len(body["gpu_ids"])) == ("COMPLETED", 1, 1)
        assert parts[1][2] == data
    else:
        _assert_error(response, 400, "parse")


def test_file_cache_second_execute(client_impl: str, server: ServerProcess) -> None:
    out = client(
        server,
        r"""
        p = Program()
        p.upload_file(blob=os.urandom(100), path="./data//in.bin")
        p.return_file(key="f", path="data/in.bin")
        a = client.execute(p)
        out["a"] = [x["status"] for x in ATTEMPTS]
        ATTEMPTS.clear()
        b = client.execute(p)
        out["b"] = [x["status"] for x in ATTEMPTS]
        out["same"] = a["f"].read_bytes() == b["f"].read_bytes()
        """,
    )
    assert out["a"] == ["CACHE_MISS", "multipart"]
    assert out["b"] == ["multipart"]
    assert out["same"]


# --- files and folders ----------------------------------------------------------


def test_file_and_folder_uploads_and_returns(client_impl: str, any_server: ServerProcess) -> None:
    out = client(
        any_server,
        r'''
        src = pathlib.Path(tempfile.mkdtemp())
        (src / "sub" / "deeper").mkdir(parents=True)
        (src / "sub" / "deeper" / "d.txt").write_bytes(b"deep")
        (src / ".hidden").write_bytes(b"secret")
        (src / "sub" / ".h2").write_bytes(b"")
        (src / "a.bin").write_bytes(bytes(range(256)))
        (src / "emptydir").mkdir()
        p = Program()
        p.upload_folder(src, path="in")
        single = p.upload_file(blob=b"one\r\n", path="single.txt")
        m = p.upload(kind="module", source=textwrap.dedent("""
            import os, stat
            def f(path):
                os.makedirs("out/empty/nested")
                os.makedirs("out/.hid")
                with open("out/.hid/x", "w") as fh:
                    fh.write("x")
                with open("out/z.txt", "w") as fh:
                    fh.write("z")
                return {"path": path,
                        "file_mode": stat.S_IMODE(os.stat("in/sub/deeper/d.txt").st_mode),
                        "dir_mode": stat.S_IMODE(os.stat("in/sub/deeper").st_mode),
                        "uploaded_empty_dir": os.path.exists("in/emptydir")}
        """))
        f = p.get_function(module=m, name="f")
        r = p.run(fn=f, args=[single])
        p.return_(key="info", value=r)
        p.return_folder(key="in", path="in")
        p.return_folder(key="out", path="out")
        p.return_file(key="single", path=single)
        p.return_folder(key="empty", path="out/empty/nested")
        res = client.execute(p)
        out["r"] = R(res)
        ''',
    )
    r = out["r"]
    assert r["status"] == "COMPLETED", r["error"]
    results = r["results"]
    assert results["info"] == {
        "path": "single.txt",
        "file_mode": 0o600,
        "dir_mode": 0o700,
        "uploaded_empty_dir": False,
    }
    assert results["in"] == {
        "$folder": {
            ".hidden": b"secret".hex(),
            "a.bin": bytes(range(256)).hex(),
            "sub/.h2": "",
            "sub/deeper/d.txt": b"deep".hex(),
        },
        "directories": ["sub", "sub/deeper"],
    }
    assert results["out"] == {
        "$folder": {".hid/x": b"x".hex(), "z.txt": b"z".hex()},
        "directories": [".hid", "empty", "empty/nested"],
    }
    assert results["single"] == {"$file": b"one\r\n".hex()}
    assert results["empty"] == {"$folder": {}, "directories": []}


def test_file_return_failures(client_impl: str, server: ServerProcess) -> None:
    out = client(
        server,
        r"""
        def attempt(setup, kind, path):
            p = Program()
            m = p.upload(kind="module", source=textwrap.dedent(setup))
            p.run(fn=p.get_function(module=m, name="f"))
            (p.return_file if kind == "file" else p.return_folder)(key="x", path=path)
            return R(client.execute(p))
        out["missing"] = attempt("def f(): pass", "file", "nope")
        out["symlink"] = attempt("import os\ndef f():\n    open('t', 'w').close()\n    os.symlink('t', 'l')", "file", "l")
        out["folder_symlink"] = attempt("import os\ndef f():\n    os.mkdir('d')\n    os.symlink('/etc', 'd/l')", "folder", "d")
        out["fifo"] = attempt("import os\ndef f():\n    os.mkfifo('p')", "file", "p")
        out["dir_as_file"] = attempt("import os\ndef f():\n    os.mkdir('d')", "file", "d")
        """,
    )
    for name in ["missing", "symlink", "folder_symlink", "fifo", "dir_as_file"]:
        r = out[name]
        assert r["status"] == "FAILED", name
        assert r["error"]["kind"] == "serialization", (name, r["error"])
        assert r["error"]["instruction_op"] == "return"
        assert r["error"]["instruction_id"] is None
        assert r["error"]["instruction_index"] == 3
        assert r["results"] == {}


# --- remote functions ------------------------------------------------------------


def test_remote_functions(client_impl: str, any_server: ServerProcess) -> None:
    out = client(
        any_server,
        r"""
        @client.function(timeout=60, output_limit_bytes=4096)
        def scale(x, factor=2, *, data=b"", note="d\u00e9faut", extra=None):
            print("remote print")
            return {"x": x * factor, "data": data, "len": len(data), "note": note, "extra": extra}

        @client.function(cpu_only=True)
        def ident(value):
            return value

        @client.function()
        def boom(x):
            raise ValueError(f"bad {x}")

        out["a"] = J(scale.remote(5, data=b"ab"))
        out["b"] = J(scale.remote("s", 3, data=b"", note="\u2603", extra=[1, {"$ref": "module"}]))
        out["c"] = J(ident.remote({"$ref": "output", "nested": [None, True, 1.5]}))
        out["d"] = J(ident.remote(b"\x00" * 1000))
        res = scale.execute(1)
        out["stdout"] = res.stdout
        try:
            boom.remote(7)
        except RemoteExecutionError as e:
            out["boom"] = R(e.result)
        """,
    )
    assert out["a"] == {"x": 10, "data": b(b"ab"), "len": 2, "note": "d\u00e9faut", "extra": None}
    assert out["b"] == {
        "x": "sss",
        "data": b(b""),
        "len": 0,
        "note": "\u2603",
        "extra": [1, {"$ref": "module"}],
    }
    assert out["c"] == {"$ref": "output", "nested": [None, True, 1.5]}
    assert out["d"] == b(b"\x00" * 1000)
    assert out["stdout"] == "remote print\n"
    error = out["boom"]["error"]
    assert out["boom"]["status"] == "FAILED"
    assert error["kind"] == "engine"
    assert error["message"] == "ValueError: bad 7"
    assert error["instruction_op"] == "run"
    assert error["instruction_id"] == "output"
    assert "Traceback" in error["traceback"]


# --- failures ---------------------------------------------------------------------


_ERROR_KEYS = {
    "kind",
    "message",
    "instruction_index",
    "instruction_op",
    "instruction_id",
    "traceback",
}


def test_failed_kinds(client_impl: str, any_server: ServerProcess) -> None:
    out = client(
        any_server,
        r'''
        def run_one(source, name="f", args=()):
            return R(client.execute(module_program(source, name=name, args=args)))
        out["engine"] = run_one("def f():\n    raise KeyError('boom')\n")
        out["assert"] = run_one("def f():\n    assert 1 == 2, 'nope'\n")
        out["syntax"] = run_one("def f(:\n")
        out["import_error"] = run_one("raise RuntimeError('at import')\n")
        out["missing_name"] = run_one("x = 1\n", name="g")
        out["not_callable"] = run_one("f = 3\n")
        out["nan"] = run_one("def f():\n    return float('nan')\n")
        out["object"] = run_one("def f():\n    return object()\n")
        out["int_key"] = run_one("def f():\n    return {1: 2}\n")
        p = Program()
        p.return_(key="m", value=p.upload(kind="module", source=""))
        out["module_value"] = R(client.execute(p))
        out["correctness"] = run_one("from kcoral.errors import ExecutionError\ndef f():\n    raise ExecutionError('correctness', 'outputs differ')\n")
        out["compile_kind"] = run_one("from kcoral.errors import ExecutionError\ndef f():\n    raise ExecutionError('compile', 'nvcc said no')\n")
        out["crash"] = run_one("import os\ndef f():\n    print('lost')\n    os._exit(3)\n")

        p = Program()
        p.upload_file(blob=b"x", path="already")
        m = p.upload(kind="module", source="def f():\n    open('taken', 'w').close()\n")
        p.run(fn=p.get_function(module=m, name="f"))
        p.upload_file(blob=b"y", path="taken")
        out["exists"] = R(client.execute(p))

        import numpy as np
        p = Program()
        p.upload(kind="tensor", value=np.zeros(4, dtype=np.float32))
        out["tensor"] = R(client.execute(p))
        p = Program()
        p.upload(kind="library", value=b"\x7fELF not really")
        out["library"] = R(client.execute(p))

        # Partial results: two returns (one binary) survive a later failure; the
        # failing return contributes nothing.
        p = Program()
        m = p.upload(kind="module", source=textwrap.dedent("""
            def ok():
                return [b"part0", {"b": b"part1"}]
            def bad():
                return [b"x", float("inf")]
            def fail():
                raise RuntimeError("late")
        """))
        okr = p.run(fn=p.get_function(module=m, name="ok"))
        p.return_(key="first", value=okr)
        p.return_(key="bad", value=p.run(fn=p.get_function(module=m, name="bad")))
        out["partial_return"] = R(client.execute(p))
        p = Program()
        m = p.upload(kind="module", source="def ok():\n    print('before')\n    return b'kept'\ndef fail():\n    raise RuntimeError('late')\n")
        p.return_(key="first", value=p.run(fn=p.get_function(module=m, name="ok")))
        p.run(fn=p.get_function(module=m, name="fail"), id="failing")
        p.return_(key="never", value=p.run(fn=p.get_function(module=m, name="ok")))
        out["partial"] = R(client.execute(p))
        ''',
    )
    expectations = {
        "engine": ("engine", "run", 2),
        "assert": ("engine", "run", 2),
        "syntax": ("parse", "upload", 0),
        "import_error": ("parse", "upload", 0),
        "missing_name": ("parse", "get_function", 1),
        "not_callable": ("runtime", "run", 2),
        "nan": ("serialization", "return", 3),
        "object": ("serialization", "return", 3),
        "int_key": ("serialization", "return", 3),
        "module_value": ("serialization", "return", 1),
        "correctness": ("correctness", "run", 2),
        "compile_kind": ("compile", "run", 2),
        "crash": ("runtime", "run", 2),
        "exists": ("runtime", "upload", 4),
        "tensor": ("unavailable", "upload", 0),
        "library": ("unavailable", "upload", 0),
        "partial_return": ("serialization", "return", 6),
        "partial": ("engine", "run", 5),
    }
    if ON_GPU:
        # A GPU takes the tensor, and refuses the library as a bad image.
        del expectations["tensor"], expectations["library"]
        assert out["tensor"]["status"] == "COMPLETED", out["tensor"]
        assert out["library"]["status"] == "FAILED", out["library"]
        assert out["library"]["error"]["instruction_op"] == "upload"
    for name, (kind, op, index) in expectations.items():
        r = out[name]
        assert r["status"] == "FAILED", (name, r)
        error = r["error"]
        assert set(error) == _ERROR_KEYS, name
        assert (error["kind"], error["instruction_op"], error["instruction_index"]) == (
            kind,
            op,
            index,
        ), (
            name,
            error,
        )
        assert isinstance(error["traceback"], str)
        if op == "return":
            assert error["instruction_id"] is None
        else:
            assert isinstance(error["instruction_id"], str)
    assert out["engine"]["error"]["message"] == "KeyError: 'boom'"
    assert out["engine"]["error"]["instruction_id"] == "run"
    assert "Traceback" in out["engine"]["error"]["traceback"]
    assert out["correctness"]["error"]["message"] == "outputs differ"
    assert out["compile_kind"]["error"]["message"] == "nvcc said no"
    assert out["syntax"]["error"]["message"].startswith("syntax error")
    assert out["import_error"]["error"]["message"] == "RuntimeError: at import"
    assert out["crash"]["error"]["message"] == "worker exited while executing the instruction"
    assert out["crash"]["error"]["traceback"] == ""
    assert out["crash"]["results"] == {}
    assert out["crash"]["stdout"] == ""
    assert out["partial_return"]["results"] == {"first": [b(b"part0"), {"b": b(b"part1")}]}
    assert out["partial"]["results"] == {"first": b(b"kept")}
    assert out["partial"]["stdout"] == "before\n"
    assert out["partial"]["error"]["instruction_id"] == "failing"
    assert out["partial"]["error"]["message"] == "RuntimeError: late"


def test_builtins_importable(client_impl: str, server: ServerProcess) -> None:
    """The 0.1.1 helper names import inside uploaded code (GPU use is another matter)."""
    out = client(
        server,
        r'''
        r = client.execute(module_program("""
            def f():
                from kcoral.errors import ExecutionError
                from kcoral.builtins import benchmark, compile_tirx
                e = ExecutionError("parse", "m")
                return [e.kind, e.message, callable(benchmark), callable(compile_tirx)]
        """))
        out["r"] = R(r)
        ''',
    )
    assert out["r"]["status"] == "COMPLETED", out["r"]["error"]
    assert out["r"]["results"]["r"] == ["parse", "m", True, True]


# --- output capture ------------------------------------------------------------------


def test_output_capture_and_truncation(client_impl: str, any_server: ServerProcess) -> None:
    out = client(
        any_server,
        r'''
        src = """
            import os, subprocess, sys
            def f():
                print("py-out")
                print("py-err", file=sys.stderr)
                sys.stdout.flush()
                sys.stderr.flush()
                os.write(1, b"fd-out\\n")
                subprocess.run(["sh", "-c", "echo sub-out; echo sub-err >&2"], check=True)
                return 1
        """
        out["default"] = R(client.execute(module_program(src)))
        out["limited"] = R(client.execute(module_program(src), output_limit_bytes=10))
        out["off"] = R(client.execute(module_program(src), output_limit_bytes=0))
        out["exact"] = R(client.execute(module_program("def f():\n    print('0123456789', end='')\n"), output_limit_bytes=10))
        out["huge"] = R(client.execute(module_program(src), output_limit_bytes=268435456, timeout_seconds=1e9))
        ''',
    )
    default = out["default"]
    assert default["stdout"] == "py-out\nfd-out\nsub-out\n"
    assert default["stderr"] == "py-err\nsub-err\n"
    assert (default["stdout_truncated"], default["stderr_truncated"]) == (False, False)
    limited = out["limited"]
    assert limited["stdout"] == "py-out\nfd-"
    assert limited["stderr"] == "py-err\nsub"
    assert (limited["stdout_truncated"], limited["stderr_truncated"]) == (True, True)
    off = out["off"]
    assert (off["stdout"], off["stderr"], off["stdout_truncated"], off["stderr_truncated"]) == (
        "",
        "",
        False,
        False,
    )
    assert (out["exact"]["stdout"], out["exact"]["stdout_truncated"]) == ("0123456789", False)
    assert out["huge"]["status"] == "COMPLETED"
    assert out["huge"]["stdout"] == default["stdout"]


def test_workspace_is_fresh(client_impl: str, server: ServerProcess) -> None:
    out = client(
        server,
        r'''
        src = """
            import os
            def f():
                before = sorted(os.listdir("."))
                open("left-behind", "w").close()
                return [before, os.getcwd() == os.path.realpath(".")]
        """
        out["a"] = R(client.execute(module_program(src)))
        out["b"] = R(client.execute(module_program(src)))
        ''',
    )
    for name in "ab":
        assert out[name]["status"] == "COMPLETED", out[name]["error"]
        listing, cwd_ok = out[name]["results"]["r"]
        assert [entry for entry in listing if entry != ".kcoral"] == []
        assert cwd_ok


# --- request-level errors ---------------------------------------------------------------


def test_timeout_kills_worker_and_subprocesses(client_impl: str, any_server: ServerProcess) -> None:
    marker = f"{time.time() % 1000:.6f}"
    out = client(
        any_server,
        f'''
        src = """
            import subprocess, time
            def f():
                subprocess.Popen(["sleep", "{marker}"])
                time.sleep(60)
        """
        try:
            client.execute(module_program(src), timeout_seconds=1)
        except KCoralError as e:
            out["e"] = E(e)
        ''',
    )
    assert out["e"]["type"] == "KCoralError"
    assert (out["e"]["status_code"], out["e"]["kind"]) == (504, "timeout")
    assert out["e"]["message"] == "execution timed out"
    assert out["e"]["request_id"]
    deadline = time.monotonic() + 10
    while _processes_with_arg(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _processes_with_arg(marker)


def _processes_with_arg(arg: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path("/proc", entry, "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if arg.encode() in cmdline:
                found.append(int(entry))
    return found


def test_request_id_echo(client_impl: str, server: ServerProcess) -> None:
    request_id = str(uuid.uuid4())
    out = client(
        server,
        r"""
        out["ok"] = R(client.execute(module_program("def f():\n    return 1\n")))
        try:
            client.execute(module_program("def f():\n    pass\n"), timeout_seconds=-1)
        except (KCoralError, ValueError) as e:
            out["validation"] = E(e)
        p = Program()
        p.upload(kind="bytes", value=os.urandom(8))
        try:
            client.execute(p, gpu_count=1)
        except KCoralError as e:
            out["error"] = E(e)
        """,
        headers={"X-Request-ID": request_id},
    )
    assert out["ok"]["request_id"] == request_id
    if ON_GPU:
        assert "error" not in out, out  # a GPU server takes gpu_count=1
    else:
        assert out["error"]["request_id"] == request_id
        assert (out["error"]["status_code"], out["error"]["kind"]) == (400, "parse")
    assert all(a["request_id"] == request_id for a in out["attempts"])


@pytest.mark.parametrize(
    "header",
    [
        lambda: [str(uuid.uuid4()).upper()],
        lambda: ["{" + str(uuid.uuid4()) + "}"],
        lambda: ["urn:uuid:" + str(uuid.uuid4())],
        lambda: [uuid.uuid4().hex],
        lambda: ["garbage"],
        lambda: [str(uuid.uuid4()), str(uuid.uuid4())],
    ],
    ids=["upper", "braces", "urn", "nohyphens", "garbage", "repeated"],
)
def test_bad_request_id_replaced(server: ServerProcess, header: Callable[[], list[str]]) -> None:
    import http.client

    values = header()
    content_type, body = multipart_body(_simple_program())
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        connection.putrequest("POST", "/execute")
        connection.putheader("Content-Type", content_type)
        connection.putheader("Content-Length", str(len(body)))
        for value in values:
            connection.putheader("X-Request-ID", value)
        connection.endheaders(body)
        response = connection.getresponse()
        data = json.loads(response.read())
        assert response.status == 200
        returned = response.getheader("X-Request-ID")
    finally:
        connection.close()
    assert data["request_id"] == returned
    assert returned not in values
    assert str(uuid.UUID(returned)) == returned


def test_nil_uuid_request_id_accepted(server: ServerProcess) -> None:
    nil = "00000000-0000-0000-0000-000000000000"
    response = post_program(server.port, _simple_program(), headers={"X-Request-ID": nil})
    assert response.headers["x-request-id"] == nil
    assert response.json()["request_id"] == nil


def test_request_too_large(client_impl: str, limits_server: ServerProcess) -> None:
    out = client(
        limits_server,
        r"""
        p = Program()
        p.upload(kind="bytes", value=os.urandom(300000))
        try:
            client.execute(p)
        except KCoralError as e:
            out["e"] = E(e)
        """,
    )
    assert (out["e"]["status_code"], out["e"]["kind"]) == (413, "request_too_large")
    assert [a["http"] for a in out["attempts"]] == [200, 413]
    # A declared Content-Length over the limit is refused before the body is read.
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", limits_server.port, timeout=30)
    try:
        connection.putrequest("POST", "/execute")
        connection.putheader("Content-Type", "multipart/form-data; boundary=b")
        connection.putheader("Content-Length", "999999999")
        connection.endheaders()
        response = connection.getresponse()
        _assert_error_parts(
            response.status, dict(response.getheaders()), response.read(), 413, "request_too_large"
        )
    finally:
        connection.close()


def test_response_too_large(client_impl: str, limits_server: ServerProcess) -> None:
    out = client(
        limits_server,
        r"""
        try:
            client.execute(module_program("def f():\n    return b'x' * 150000\n"))
        except KCoralError as e:
            out["e"] = E(e)
        """,
    )
    assert (out["e"]["status_code"], out["e"]["kind"]) == (500, "response_too_large")


def test_busy(client_impl: str, limits_server: ServerProcess) -> None:
    # Long enough for a client that takes seconds to start (the reference
    # client imports ml_dtypes: 1.3 s on a small machine) and its 1 s wait.
    slow = _simple_program("import time\ndef f():\n    time.sleep(10)\n    return 1\n")
    results: list[Any] = []
    thread = threading.Thread(target=lambda: results.append(limits_server.execute(slow)))
    thread.start()
    try:
        time.sleep(0.8)
        out = client(
            limits_server,
            r"""
            try:
                client.execute(module_program("def f():\n    return 1\n"))
            except KCoralError as e:
                out["e"] = E(e)
            """,
        )
        response = limits_server.execute(_simple_program())
    finally:
        thread.join()
    assert (out["e"]["status_code"], out["e"]["kind"]) == (503, "busy")
    _assert_error(response, 503, "busy")
    assert response.headers["retry-after"] == "1"
    assert results[0].json()["status"] == "COMPLETED"


# --- kcoral run ----------------------------------------------------------------------


def test_kcoral_run_python(client_impl: str, server: ServerProcess, tmp_path: Path) -> None:
    experiment = tmp_path / "exp"
    (experiment / "lib").mkdir(parents=True)
    (experiment / "lib" / "helper.py").write_text("VALUE = 'helper-value'\n")
    (experiment / "script.py").write_text(
        textwrap.dedent(
            """
            import os, sys
            sys.path.insert(0, os.path.join(os.path.dirname(__file__), "lib"))
            import helper
            print("args", sys.argv[1:], helper.VALUE)
            print("to-stderr", file=sys.stderr)
            with open("out.txt", "w") as fh:
                fh.write("fetched " + os.environ.get("GREETING", "?"))
            sys.exit(int(sys.argv[1]))
            """
        )
    )
    url = f"http://127.0.0.1:{server.port}"
    proc = cli(
        [
            "run",
            "python",
            "--url",
            url,
            "--send",
            "exp",
            "-e",
            "GREETING=hello",
            "--",
            "exp/script.py",
            "3",
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 3, proc.stderr
    assert "args ['3'] helper-value" in proc.stdout
    assert "to-stderr" in proc.stderr
    proc = cli(
        [
            "run",
            "python",
            "--url",
            url,
            "--send",
            "exp",
            "-e",
            "GREETING=hello",
            "--fetch",
            "out.txt",
            "--out",
            "results",
            "--",
            "exp/script.py",
            "0",
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "results" / "out.txt").read_text() == "fetched hello"
    # A --fetch of something never written forces a non-zero status.
    proc = cli(
        ["run", "python", "--url", url, "--fetch", "absent", "--out", "r2", "--", "-c", "print(1)"],
        cwd=tmp_path,
    )
    assert proc.returncode != 0
    assert "missing artifacts: absent" in proc.stderr


def test_kcoral_run_shell(client_impl: str, server: ServerProcess, tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{server.port}"
    proc = cli(["run", "shell", "--url", url, "--", "echo", "hi"], cwd=tmp_path)
    assert (proc.returncode, proc.stdout) == (0, "hi\n"), proc.stderr
    proc = cli(
        ["run", "shell", "--url", url, "--", "sh", "-c", "echo err >&2; exit 7"], cwd=tmp_path
    )
    assert proc.returncode == 7
    assert "err" in proc.stderr
    proc = cli(["run", "shell", "--url", url, "--", "sh", "-c", "kill -TERM $$"], cwd=tmp_path)
    assert proc.returncode == 128 + 15


# --- raw HTTP: validation ---------------------------------------------------------------


def _simple_program(source: str = "def f():\n    return 1\n") -> dict[str, Any]:
    return {
        "instructions": [
            {"op": "upload", "kind": "module", "source": source, "id": "m"},
            {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "f"},
            {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": []},
            {"op": "return", "key": "k", "value": {"$ref": "r"}},
        ]
    }


def _assert_error_parts(
    status: int, headers: dict[str, str], body: bytes, code: int, kind: str
) -> None:
    headers = {k.lower(): v for k, v in headers.items()}
    assert status == code, body
    assert headers["content-type"].split(";")[0] == "application/json"
    data = json.loads(body)
    assert set(data) == {"status", "request_id", "error"}
    assert data["status"] == "ERROR"
    assert set(data["error"]) == {"kind", "message"}
    assert data["error"]["kind"] == kind, data
    assert data["request_id"] == headers["x-request-id"]


def _assert_error(response: Any, code: int, kind: str) -> None:
    _assert_error_parts(response.status, response.headers, response.body, code, kind)


def _strip_options(p: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    return {**p, "options": options}


def _with(index: int, **changes: Any) -> dict[str, Any]:
    p = _simple_program()
    p["instructions"][index] = {**p["instructions"][index], **changes}
    return p


def _upload_files(*paths: str) -> dict[str, Any]:
    return {
        "instructions": [
            {"op": "upload", "kind": "file", "blob": sha256(b""), "path": path, "id": f"u{i}"}
            for i, path in enumerate(paths)
        ]
    }


_SIMPLE = json.dumps(_simple_program(), separators=(",", ":"))

_BAD_PROGRAMS: dict[str, Any] = {
    "duplicate-key-top": _SIMPLE[:-1] + ',"instructions":[]}',
    "duplicate-key-nested": _SIMPLE.replace('"args":[]', '"args":[{"a":1,"a":2}]'),
    "nan": _SIMPLE.replace('"args":[]', '"args":[NaN]'),
    "infinity": _SIMPLE.replace('"args":[]', '"args":[-Infinity]'),
    "overflow-literal": _SIMPLE.replace('"args":[]', '"args":[1e400]'),
    "not-object": [],
    "unknown-top": {**_simple_program(), "extra": 1},
    "missing-instructions": {"options": {}},
    "empty-instructions": {"instructions": []},
    "options-null": _strip_options(_simple_program(), None),  # type: ignore[arg-type]
    "options-unknown": _strip_options(_simple_program(), {"gpus": 1}),
    "timeout-bool": _strip_options(_simple_program(), {"timeout_seconds": True}),
    "timeout-zero": _strip_options(_simple_program(), {"timeout_seconds": 0}),
    "timeout-overflow": _SIMPLE[:-1] + ',"options":{"timeout_seconds":1e400}}',
    "output-bool": _strip_options(_simple_program(), {"output_limit_bytes": False}),
    "output-negative": _strip_options(_simple_program(), {"output_limit_bytes": -1}),
    "gpu-count-bool": _strip_options(_simple_program(), {"gpu_count": True}),
    "gpu-count-9": _strip_options(_simple_program(), {"gpu_count": 9}),
    "gpu-count-on-cpu": _strip_options(_simple_program(), {"gpu_count": 1}),
    "unknown-field": _with(2, extra=1),
    "missing-field": {"instructions": [{"op": "upload", "kind": "module", "id": "m"}]},
    "unknown-op": _with(2, op="call"),
    "unknown-kind": {
        "instructions": [{"op": "upload", "kind": "image", "blob": sha256(b""), "id": "x"}]
    },
    "unknown-ref": _with(2, fn={"$ref": "nope"}),
    "forward-ref": _with(1, module={"$ref": "r"}),
    "self-ref": _with(2, fn={"$ref": "r"}),
    "duplicate-id": _with(2, id="f"),
    "empty-id": _with(2, id=""),
    "duplicate-return-key": {
        "instructions": _simple_program()["instructions"]
        + [{"op": "return", "key": "k", "value": {"$ref": "m"}}]
    },
    "return-value-and-kind": _with(3, kind="file", path="a"),
    "upper-blob-digest": {
        "instructions": [{"op": "upload", "kind": "bytes", "blob": sha256(b"").upper(), "id": "x"}]
    },
    "bad-dtype": {
        "instructions": [
            {
                "op": "upload",
                "kind": "tensor",
                "blob": sha256(b""),
                "dtype": "uint16",
                "shape": [0],
                "id": "x",
            }
        ]
    },
    "bool-shape": {
        "instructions": [
            {
                "op": "upload",
                "kind": "tensor",
                "blob": sha256(b""),
                "dtype": "uint8",
                "shape": [True],
                "id": "x",
            }
        ]
    },
    "cpu-only-not-bool": _with(1, cpu_only=1),
    "path-dotdot": _upload_files("a/../b"),
    "path-absolute": _upload_files("/etc/passwd"),
    "path-backslash": _upload_files("a\\b"),
    "path-nul": _upload_files("a\0b"),
    "path-empty": _upload_files(""),
    "path-dot-only": _upload_files("./."),
    "path-long-component": _upload_files("x" * 256),
    "path-too-long": _upload_files("/".join(["y" * 200] * 21)),
    "path-duplicate": _upload_files("a", "./a"),
    "path-conflict": _upload_files("a", "a-b", "a/b"),
}
_BAD_PROGRAMS["return-dot"] = {
    "instructions": _simple_program()["instructions"][:3]
    + [{"op": "return", "key": "k", "kind": "folder", "path": "."}]
}


@pytest.mark.parametrize("name", sorted(_BAD_PROGRAMS))
def test_invalid_programs_rejected(server: ServerProcess, name: str) -> None:
    if ON_GPU and name == "gpu-count-on-cpu":
        pytest.skip("a GPU server takes gpu_count 1")
    program = _BAD_PROGRAMS[name]
    payload = program.encode() if isinstance(program, str) else json.dumps(program).encode()
    response = server.execute(payload)
    _assert_error(response, 400, "parse")


def test_valid_edge_programs_accepted(server: ServerProcess) -> None:
    """Return keys may equal ids; paths normalize; nested refs are literals; charset is ok."""
    instructions = _simple_program()["instructions"]
    instructions[2]["args"] = [{"$ref": "m", "x": 1}, [{"$ref": "m"}], {"$ref": ""}]
    instructions[0]["source"] = "def f(*a):\n    return ['\u00e9\u2603', *a]\n"
    program = {
        "instructions": instructions
        + [
            {
                "op": "upload",
                "kind": "file",
                "blob": sha256(b"z"),
                "path": "./d//e/./f",
                "id": "file",
            },
            {"op": "return", "key": "m", "value": {"$ref": "file"}},
            {"op": "return", "key": "folder", "kind": "folder", "path": "d/"},
        ],
        "options": {"timeout_seconds": 1e9, "output_limit_bytes": 268435456},
    }
    content_type, body = multipart_body(program, [b"z"])
    body = body.replace(
        b"Content-Type: application/json\r\n",
        b"Content-Type: application/json; charset=utf-8\r\n",
        1,
    )
    response = request(
        server.port, "POST", "/execute", body, {"Content-Type": content_type, "X-KCoral-Node": "n1"}
    )
    assert response.status == 200, response.body
    assert response.headers["content-type"].startswith("multipart/form-data")
    boundary = response.headers["content-type"].split("boundary=", 1)[1].strip('"').encode()
    parts = _split_multipart(response.body, boundary)
    result = json.loads(parts[0][2])
    assert result["status"] == "COMPLETED", result
    assert result["results"]["k"]["value"][0] == {"type": "string", "value": "\u00e9\u2603"}
    assert [v["value"] for v in result["results"]["k"]["value"][1:]] == [
        {"$ref": {"type": "string", "value": "m"}, "x": {"type": "integer", "value": 1}},
        [{"type": "object", "value": {"$ref": {"type": "string", "value": "m"}}}],
        {"$ref": {"type": "string", "value": ""}},
    ]
    assert result["results"]["m"] == {"type": "string", "value": "d/e/f"}
    assert result["results"]["folder"]["directories"] == ["e"]
    assert list(result["results"]["folder"]["files"]) == ["e/f"]


def _raw(server: ServerProcess, content_type: str | None, body: bytes) -> Any:
    headers = {"Content-Type": content_type} if content_type else {}
    return request(server.port, "POST", "/execute", body, headers)


def test_multipart_rejections(server: ServerProcess) -> None:
    program = json.dumps(_simple_program()).encode()
    blob = b"data"
    ct, good = multipart_body(program, [])
    boundary = ct.split("=", 1)[1]

    def part(name: str, data: bytes, ctype: str = "application/octet-stream") -> bytes:
        return (
            f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\nContent-Type: {ctype}\r\n\r\n'.encode()
            + data
            + b"\r\n"
        )

    program_part = part("program", program, "application/json")
    close = f"--{boundary}--\r\n".encode()
    cases = {
        "no-content-type": (None, good),
        "wrong-content-type": ("application/json", program),
        "no-boundary": ("multipart/form-data", good),
        "no-closing": (ct, program_part),
        "no-parts": (ct, close),
        "missing-program": (ct, part("blob:" + sha256(blob), blob) + close),
        "duplicate-program": (ct, program_part + program_part + close),
        "program-wrong-type": (ct, part("program", program, "text/plain") + close),
        "blob-upper": (ct, program_part + part("blob:" + sha256(blob).upper(), blob) + close),
        "blob-mismatch": (ct, program_part + part("blob:" + sha256(b"other"), blob) + close),
        "blob-wrong-type": (
            ct,
            program_part + part("blob:" + sha256(blob), blob, "text/plain") + close,
        ),
        "blob-unreferenced": (ct, program_part + part("blob:" + sha256(blob), blob) + close),
        "unknown-part": (ct, program_part + part("other", blob) + close),
        "encoded-part": (
            ct,
            program_part.replace(
                b"Content-Type: application/json",
                b"Content-Type: application/json\r\nContent-Transfer-Encoding: base64",
            )
            + close,
        ),
        "bad-json": (ct, part("program", b"{", "application/json") + close),
        "bom": (ct, part("program", b"\xef\xbb\xbf" + program, "application/json") + close),
    }
    failures = {}
    for name, (content_type, body) in cases.items():
        response = _raw(server, content_type, body)
        try:
            _assert_error(response, 400, "parse")
        except AssertionError as e:
            failures[name] = str(e)[:300]
    assert failures == {}


def test_multipart_accepted_variants(server: ServerProcess) -> None:
    """Quoted boundaries, bare LF framing, preamble/epilogue and filename parameters."""
    program = json.dumps(_simple_program()).encode()
    boundary = "XyZ"
    body = (
        b'preamble\r\n--XyZ\nContent-Disposition: form-data; name="program"; filename="p.json"\n'
        b"Content-Type: application/json\n\n" + program + b"\n--XyZ--\nepilogue"
    )
    response = _raw(server, f'multipart/form-data; boundary="{boundary}"', body)
    assert response.status == 200, response.body
    assert response.json()["status"] == "COMPLETED"


def test_tensor_length_mismatch(server: ServerProcess) -> None:
    data = b"\0" * 6
    program = {
        "instructions": [
            {
                "op": "upload",
                "kind": "tensor",
                "blob": sha256(data),
                "dtype": "float32",
                "shape": [2],
                "id": "t",
            }
        ]
    }
    _assert_error(server.execute(program, [data]), 400, "parse")


def test_keep_alive_sequence(server: ServerProcess) -> None:
    """Three requests on one connection, as a CACHE_MISS retry sequence makes them."""
    import http.client

    data = os.urandom(64)
    program = {
        "instructions": [
            {"op": "upload", "kind": "bytes", "blob": sha256(data), "id": "a"},
            {"op": "return", "key": "k", "value": {"$ref": "a"}},
        ]
    }
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    statuses = []
    try:
        for blobs in ([], [data], [data]):
            content_type, body = multipart_body(program, blobs)
            connection.request("POST", "/execute", body, {"Content-Type": content_type})
            response = connection.getresponse()
            payload = response.read()
            assert response.status == 200
            ctype = response.getheader("Content-Type")
            if ctype.startswith("application/json"):
                statuses.append(json.loads(payload)["status"])
            else:
                boundary = ctype.split("boundary=", 1)[1].encode()
                statuses.append(json.loads(_split_multipart(payload, boundary)[0][2])["status"])
    finally:
        connection.close()
    assert statuses == ["CACHE_MISS", "COMPLETED", "COMPLETED"]


def test_unknown_path_and_method(server: ServerProcess) -> None:
    assert request(server.port, "GET", "/nope").status == 404
    assert request(server.port, "GET", "/execute").status == 405


@pytest.fixture(autouse=True)
def _no_leaked_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The reference client must never see our package through the environment."""
    monkeypatch.delenv("KCORAL_URL", raising=False)
    yield


@pytest.mark.parametrize(
    "sandbox",
    ["bubblewrap", "none"],
)
def test_background_processes_terminated(
    sandbox: str, refclient: Path, interop_server: Callable[..., ServerProcess], disk_cache: Path
) -> None:
    server = interop_server("--disk-cache-dir", str(disk_cache), "--sandbox", sandbox)
    marker = f"{time.time() % 1000:.6f}"
    response = server.execute(
        _simple_program(
            f"import subprocess\ndef f():\n    subprocess.Popen(['sleep', '{marker}'])\n    return 1\n"
        )
    )
    assert response.status == 200
    deadline = time.monotonic() + 10
    while _processes_with_arg(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    leftover = _processes_with_arg(marker)
    for pid in leftover:  # do not leak the sleeper past the test
        os.kill(pid, 9)
    assert not leftover


@pytest.mark.parametrize("sandbox", ["bubblewrap", "none"])
def test_background_processes_reported(
    sandbox: str, refclient: Path, interop_server: Callable[..., ServerProcess], disk_cache: Path
) -> None:
    server = interop_server("--disk-cache-dir", str(disk_cache), "--sandbox", sandbox)
    marker = f"{time.time() % 1000:.6f}"
    try:
        body = server.execute(
            _simple_program(
                f"import subprocess\ndef f():\n    subprocess.Popen(['sleep', '{marker}'])\n    return 1\n"
            )
        ).json()
    finally:
        time.sleep(1)
        for pid in _processes_with_arg(marker):
            os.kill(pid, 9)
    assert body["status"] == "FAILED"
    assert body["error"]["kind"] == "runtime"
    assert (
        body["error"]["message"]
        == "program left background processes running; they were terminated"
    )
    assert body["error"]["traceback"] == ""
    assert body["results"] == {"k": {"type": "integer", "value": 1}}


def test_unknown_execution_error_kind_is_engine(server: ServerProcess) -> None:
    response = server.execute(
        _simple_program(
            "from kcoral.errors import ExecutionError\ndef f():\n    raise ExecutionError('weird', 'x')\n"
        )
    )
    assert response.json()["error"]["kind"] == "engine"


def test_traceback_tail_limit(server: ServerProcess) -> None:
    source = "def f():\n    raise ValueError('\\u00e9' * 20000)\n"
    error = server.execute(_simple_program(source)).json()["error"]
    assert error["message"] == "ValueError: " + "\u00e9" * 20000
    assert 0 < len(error["traceback"]) <= 8192
    assert len(error["traceback"].encode()) <= 8192
    assert error["traceback"].endswith("\u00e9\n")


def test_file_return_relative_to_workspace_after_chdir(server: ServerProcess) -> None:
    program = _simple_program(
        "import os\ndef f():\n    open('a.txt', 'w').write('hi')\n    os.mkdir('sub')\n    os.chdir('sub')\n"
    )
    program["instructions"].append({"op": "return", "key": "file", "kind": "file", "path": "a.txt"})
    response = server.execute(program)
    boundary = response.headers["content-type"].split("boundary=", 1)[1].encode()
    parts = _split_multipart(response.body, boundary)
    assert json.loads(parts[0][2])["status"] == "COMPLETED"
    assert parts[1][2] == b"hi"
