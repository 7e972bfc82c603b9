"""
Fuzzing a real CPU server with bubblewrap workers (issue 18, item 7):
hypothesis-made multipart bodies and program JSON, and schemathesis against
docs/openapi.yaml; more than 10,000 requests in all.

Every answer must come within the client's timeout (no hang), never be a
500, and be the protocol's JSON ERROR body whenever it is not a 200; after
all of it the server's open descriptors and memory must be flat.  Loopback
only.  The counts are in C{FUZZ_*} below (docs/reliability.md shows the
figures and the command).
"""

from __future__ import annotations

import http.client
import json
import os
import string
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kcoral.testing.live_server import ServerProcess, multipart_body, sha256
from tests.reliability.conftest import requires_bwrap

pytestmark = [pytest.mark.integration, requires_bwrap]

#: Examples per fuzzer (a multipart example is sent twice, with a length and
#: chunked); together with schemathesis' they pass 10,000 requests.
FUZZ_MULTIPART = int(os.environ.get("KCORAL_FUZZ_MULTIPART", "4000"))
FUZZ_PROGRAMS = int(os.environ.get("KCORAL_FUZZ_PROGRAMS", "3000"))
FUZZ_SCHEMA = int(os.environ.get("KCORAL_FUZZ_SCHEMA", "500"))

OPENAPI = Path(__file__).resolve().parents[2] / "docs" / "openapi.yaml"

#: Statuses an answer may have; 500 is never one of them here.
ALLOWED = {200, 400, 401, 404, 405, 408, 413, 414, 431, 503, 504}


def fuzz_settings(examples: int) -> settings:
    """Deterministic, no example database, no deadline, no health checks."""
    return settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
    )


class Client:
    """One keep-alive connection that reconnects when the server closes it."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.connection: http.client.HTTPConnection | None = None
        self.sent = 0
        self.statuses: dict[int, int] = {}

    def send(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, str], bytes]:
        for attempt in range(2):
            if self.connection is None:
                self.connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
            try:
                self.connection.request(method, path, body=body, headers=headers or {})
                response = self.connection.getresponse()
                data = response.read()
            except (ConnectionError, http.client.RemoteDisconnected, BrokenPipeError):
                self.close()
                if attempt:
                    raise
                continue
            result = (response.status, {k.lower(): v for k, v in response.getheaders()}, data)
            if response.will_close:
                self.close()
            self.sent += 1
            self.statuses[result[0]] = self.statuses.get(result[0], 0) + 1
            return result
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.connection is not None:
            self.connection.close()
            self.connection = None


def check_answer(status: int, headers: dict[str, str], body: bytes) -> None:
    """Not a 500, a known status, and a JSON ERROR body when it is not a 200."""
    assert status in ALLOWED, (status, body[:500])
    if status == 200:
        return
    assert headers.get("content-type") == "application/json", (status, headers, body[:300])
    document = json.loads(body)
    assert set(document) == {"status", "request_id", "error"}, document
    assert document["status"] == "ERROR"
    assert set(document["error"]) == {"kind", "message"}
    assert headers.get("x-request-id") == document["request_id"]


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    args = [
        "--device", "cpu", "--sandbox", "bubblewrap", "--num-workers", "2",
        "--max-requests-per-worker", "0", "--log-dir", "",
        "--max-request-bytes", "200000", "--default-timeout-seconds", "10",
    ]  # fmt: skip
    with ServerProcess(args) as server:
        assert server.process is not None
        client = Client(server.port)
        for _ in range(50):  # warm up before the baseline
            check_answer(*client.send("GET", "/health"))
        process = psutil.Process(server.process.pid)
        baseline = {"fds": process.num_fds(), "rss": process.memory_info().rss}
        state = {"server": server, "client": client, "process": process, "baseline": baseline}
        yield state
        client.close()


# -- strategies -------------------------------------------------------------------

_KEYS = [
    "op", "id", "kind", "source", "blob", "dtype", "shape", "path", "module", "name",
    "cpu_only", "fn", "args", "key", "value", "$ref", "instructions", "options",
    "timeout_seconds", "output_limit_bytes", "gpu_count",
]  # fmt: skip
_WORDS = [
    "upload", "run", "get_function", "return", "module", "tensor", "bytes", "library",
    "file", "folder", "float32", "int64", "m", "f", "r", "a.py", "../x", "/abs", "",
]  # fmt: skip

json_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
    st.sampled_from(_WORDS),
)
json_values = st.recursive(
    json_leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.sampled_from(_KEYS), inner, max_size=6),
    ),
    max_leaves=25,
)
instructions = st.one_of(
    st.dictionaries(st.sampled_from(_KEYS), json_values, max_size=7),
    st.fixed_dictionaries(
        {"op": st.sampled_from(["upload", "get_function", "run", "return"])},
        optional={k: json_values for k in _KEYS[1:15]},
    ),
    json_values,
)
programs = st.one_of(
    st.fixed_dictionaries(
        {"instructions": st.lists(instructions, max_size=5)},
        optional={"options": json_values},
    ),
    json_values,
)


def _raw_json_text(value: Any) -> st.SearchStrategy[bytes]:
    text = json.dumps(value)
    return st.sampled_from(
        [
            text.encode(),
            text.encode()[: max(1, len(text) // 2)],
            text.replace(":", "::", 1).encode(),
            b"\xef\xbb\xbf" + text.encode(),
            text.encode() + b"x",
        ]
    )


program_bytes = st.one_of(
    programs.map(lambda p: json.dumps(p).encode()),
    programs.flatmap(_raw_json_text),
    st.sampled_from(
        [
            b'{"instructions":[{"op":' + b"1" * 5000 + b"}]}",
            b'{"instructions":[{"op":{"a":1}}]}',
            b'{"instructions":[{"op":["run"]}]}',
            b"[" * 5000 + b"]" * 5000,
            b'{"a":NaN}',
            b'{"a":1,"a":2}',
        ]
    ),
    st.binary(max_size=200),
)

_token = st.text(alphabet=string.ascii_letters + string.digits + "-_:;=\"' ", max_size=20)


@st.composite
def multipart_bodies(draw: Any) -> tuple[str, bytes]:
    """A multipart body that is right, nearly right or wrong, and its content type."""
    boundary = draw(st.one_of(st.just("b0undary"), _token))
    parts = []
    for _ in range(draw(st.integers(0, 4))):
        name = draw(
            st.one_of(
                st.just("program"),
                st.builds(lambda b: "blob:" + sha256(b), st.binary(max_size=4)),
                _token,
            )
        )
        headers = draw(
            st.one_of(
                st.just(f'Content-Disposition: form-data; name="{name}"\r\n'),
                st.just(f"Content-Disposition: form-data; name={name}\r\n"),
                _token.map(lambda t: t + "\r\n"),
                st.just(""),
            )
        )
        payload = draw(st.one_of(program_bytes, st.binary(max_size=64)))
        parts.append(f"--{boundary}\r\n{headers}\r\n".encode("utf-8", "replace") + payload)
    ending = draw(st.sampled_from(["\r\n", "--\r\n", "", "--", "\r\n--junk"]))
    body = b"\r\n".join(parts) + f"\r\n--{boundary}{ending}".encode("utf-8", "replace")
    body = draw(st.one_of(st.just(body), st.binary(max_size=300), st.just(body[:-7])))
    content_type = draw(
        st.one_of(
            st.just(f"multipart/form-data; boundary={boundary}"),
            st.just(f'multipart/form-data; boundary="{boundary}"'),
            st.just("multipart/form-data"),
            st.just("application/json"),
            _token,
        )
    )
    return content_type, body


# -- the fuzzers --------------------------------------------------------------


def test_multipart_bodies(fuzzed: dict[str, Any]) -> None:
    """Hypothesis-made multipart framing: never a 500, always an ERROR body when refused."""
    client: Client = fuzzed["client"]

    @fuzz_settings(FUZZ_MULTIPART)
    @given(multipart_bodies())
    def fuzz(case: tuple[str, bytes]) -> None:
        content_type, body = case
        # Each body twice: with a Content-Length, and chunked.
        check_answer(*client.send("POST", "/execute", body, {"Content-Type": content_type}))
        chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body) if body else b"0\r\n\r\n"
        headers = {"Content-Type": content_type, "Transfer-Encoding": "chunked"}
        check_answer(*client.send("POST", "/execute", chunked, headers))

    fuzz()


def test_program_json(fuzzed: dict[str, Any]) -> None:
    """Hypothesis-made program JSON in well-formed bodies: never a 500."""
    client: Client = fuzzed["client"]

    @fuzz_settings(FUZZ_PROGRAMS)
    @given(program_bytes)
    def fuzz(program: bytes) -> None:
        content_type, body = multipart_body(program)
        check_answer(*client.send("POST", "/execute", body, {"Content-Type": content_type}))

    fuzz()


def test_openapi_schemathesis(fuzzed: dict[str, Any]) -> None:
    """schemathesis against docs/openapi.yaml, valid and invalid cases: never a 500."""
    import schemathesis

    client: Client = fuzzed["client"]
    schema = schemathesis.openapi.from_path(str(OPENAPI))
    base_url = f"http://127.0.0.1:{fuzzed['server'].port}"
    for result in schema.get_all_operations():
        operation = result.ok()

        @fuzz_settings(FUZZ_SCHEMA)
        @given(operation.as_strategy())
        def fuzz(case: Any) -> None:
            response = case.call(base_url=base_url, timeout=60)
            client.sent += 1
            client.statuses[response.status_code] = client.statuses.get(response.status_code, 0) + 1
            headers = {
                k.lower(): v[0] if isinstance(v, list) else v for k, v in response.headers.items()
            }
            check_answer(response.status_code, headers, response.content)

        fuzz()


def test_flat_and_counted(fuzzed: dict[str, Any]) -> None:
    """
    After the fuzzers: at least 10,000 requests were answered, and the
    server's descriptors and memory are back where they started.
    """
    client: Client = fuzzed["client"]
    client.close()
    process: psutil.Process = fuzzed["process"]
    baseline = fuzzed["baseline"]
    fds = process.num_fds()
    rss = process.memory_info().rss
    print(f"fuzz: {client.sent} requests {sorted(client.statuses.items())}")
    print(f"fds {baseline['fds']} -> {fds}; rss {baseline['rss'] >> 20} -> {rss >> 20} MiB")
    if 2 * FUZZ_MULTIPART + FUZZ_PROGRAMS >= 11_000:
        assert client.sent >= 10_000, client.statuses
    assert 500 not in client.statuses
    assert fds <= baseline["fds"] + 8
    assert rss <= baseline["rss"] + 64 * 1024 * 1024
