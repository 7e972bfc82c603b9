"""
Shared pieces of the attack tests: a bubblewrap CPU server factory and
programs that run one function of an uploaded module.

Attack programs only ever run against a server whose workers are in the
bubblewrap sandbox (docs/security.md).
"""

from __future__ import annotations

import http.client
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kcoral.testing.live_server import Response, ServerProcess, multipart_body, servers_by_flags

#: Every test here attacks a real server; bubblewrap must be there.
requires_bwrap = pytest.mark.skipif(
    shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed"
)


@pytest.fixture(scope="module")
def attacked_server() -> Iterator[Callable[..., ServerProcess]]:
    """
    A factory of bubblewrap CPU servers living as long as the module:
    C{attacked_server(*flags)} starts one per distinct flag list.
    """
    yield from servers_by_flags(["--device", "cpu", "--sandbox", "bubblewrap", "--log-dir", ""])


def run_program(source: str, fn: str, *args: Any, **extra: Any) -> dict[str, Any]:
    """A program uploading C{source} and returning C{fn(*args)} as C{out}."""
    program: dict[str, Any] = {
        "instructions": [
            {"op": "upload", "id": "m", "kind": "module", "source": source},
            {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": fn},
            {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": list(args)},
            {"op": "return", "key": "out", "value": {"$ref": "r"}},
        ]
    }
    program.update(extra)
    return program


def body_of(response: Response) -> dict[str, Any]:
    """The JSON body of a response, whatever its status."""
    body: dict[str, Any] = response.json()
    return body


def assert_serves(server: ServerProcess) -> None:
    """The server is healthy and an ordinary program completes."""
    assert server.health()["status"] == "ok"
    response = server.execute(run_program("def f(a, b):\n    return a + b\n", "f", 2, 3))
    assert response.status == 200, response.body[:2000]
    body = body_of(response)
    assert body["status"] == "COMPLETED", body
    assert body["results"]["out"]["value"] == 5


def post_from(
    server: ServerProcess, source: str, program: dict[str, Any], timeout: float = 120.0
) -> Response:
    """
    POST C{program} from loopback address C{source} (127.0.0.x): another
    client address, as the reuse scope sees it.
    """
    content_type, body = multipart_body(program)
    connection = http.client.HTTPConnection(
        "127.0.0.1", server.port, timeout=timeout, source_address=(source, 0)
    )
    try:
        connection.request("POST", "/execute", body=body, headers={"Content-Type": content_type})
        response = connection.getresponse()
        data = response.read()
        return Response(response.status, {k.lower(): v for k, v in response.getheaders()}, data)
    finally:
        connection.close()
