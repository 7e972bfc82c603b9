"""
Returned values without a JSON text (issue 13, item 3): the return fails as
C{serialization}, the returns before it are kept, the worker lives on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kcoral.testing.live_server import ServerProcess
from tests.reliability.conftest import assert_serves, body_of, requires_bwrap

pytestmark = [pytest.mark.integration, requires_bwrap]

SOURCE = r"""
def ok():
    return "kept"

def surrogate():
    return "\ud800"

def huge():
    return 10**5000
"""


def program(bad: str) -> dict[str, Any]:
    return {
        "instructions": [
            {"op": "upload", "id": "m", "kind": "module", "source": SOURCE},
            {"op": "get_function", "id": "ok", "module": {"$ref": "m"}, "name": "ok"},
            {"op": "get_function", "id": "bad", "module": {"$ref": "m"}, "name": bad},
            {"op": "run", "id": "a", "fn": {"$ref": "ok"}, "args": []},
            {"op": "return", "key": "a", "value": {"$ref": "a"}},
            {"op": "run", "id": "b", "fn": {"$ref": "bad"}, "args": []},
            {"op": "return", "key": "b", "value": {"$ref": "b"}},
        ]
    }


@pytest.fixture(scope="module")
def server(attacked_server: Callable[..., ServerProcess]) -> ServerProcess:
    return attacked_server("--num-workers", "1", "--max-requests-per-worker", "0")


@pytest.mark.parametrize("bad", ["surrogate", "huge"])
def test_unencodable_return(server: ServerProcess, bad: str) -> None:
    response = server.execute(program(bad))
    assert response.status == 200, response.body[:2000]
    body = body_of(response)
    assert body["status"] == "FAILED", body
    assert body["error"]["kind"] == "serialization", body
    assert body["error"]["instruction_index"] == 6
    assert body["results"] == {"a": {"type": "string", "value": "kept"}}
    assert_serves(server)


def test_unencodable_error_message(server: ServerProcess) -> None:
    """An exception whose message has no UTF-8 form still gets its answer."""
    source = "def f():\n    print('\\udc80')\n    raise ValueError('\\ud800')\n"
    response = server.execute(
        {
            "instructions": [
                {"op": "upload", "id": "m", "kind": "module", "source": source},
                {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "f"},
                {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": []},
            ]
        }
    )
    assert response.status == 200, response.body[:2000]
    body = body_of(response)
    assert body["status"] == "FAILED", body
    assert body["error"]["message"] == "ValueError: ?", body
    assert_serves(server)
