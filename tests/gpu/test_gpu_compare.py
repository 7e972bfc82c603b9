"""
C{compare} on a bubblewrap GPU server (issue 34): A and B interleaved in a
random order under one lease, the parent's ratio, interval and verdict.
A/A pairs give a ratio near 1; B with a spin added is slower; the
parent's record carries the comparison.

Run on the GPU machine (they skip elsewhere):
C{python3 -m pytest -m gpu tests/gpu/test_gpu_compare.py -q -s}.
"""

from __future__ import annotations

from typing import Any

import pytest

from kcoral.client.results import program_result
from kcoral.testing.live_server import ServerProcess
from kcoral.wire.multipart import decode_response
from tests.gpu.test_gpu_monitor import logs, server  # noqa: F401  (the fixtures)

pytestmark = [pytest.mark.gpu, pytest.mark.integration]

#: A is a 4096 matmul; B the same plus C{spin} GPU cycles of
#: C{torch.cuda._sleep} (0: B is A).
PAIR = """
import torch
from kcoral.builtins import compare

def pair(spin, cfg):
    x = torch.randn(4096, 4096, device="cuda")
    out = torch.empty_like(x)
    def a():
        torch.matmul(x, x, out=out)
    def b():
        torch.matmul(x, x, out=out)
        if spin:
            torch.cuda._sleep(spin)
    return compare(a, b, cfg)
"""


def run_pair(where: ServerProcess, spin: int, cfg: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    program = {
        "instructions": [
            {"op": "upload", "kind": "module", "id": "m", "source": PAIR},
            {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "pair"},
            {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": [spin, cfg]},
            {"op": "return", "key": "r", "value": {"$ref": "r"}},
        ],
        "options": {"timeout_seconds": 120},
    }
    response = where.execute(program, timeout=300)
    assert response.status == 200, response.body[:2000]
    body, parts = decode_response(response.headers["content-type"], response.body)
    return program_result(body, parts).check()["r"], body


def test_a_against_itself(server: ServerProcess) -> None:  # noqa: F811
    """Two copies of one kernel: ratio near 1, both sides measured, valid."""
    result, body = run_pair(server, 0, {"warmup": 5, "repeat": 40})
    print(f"[compare] A/A: {result['ratio']:.4f} {result['ratio_ci95']} {result['verdict']}")
    assert result["validity"]["ok"], result
    assert 0.97 < result["ratio"] < 1.03, result
    assert result["a"]["repeat"] == result["b"]["repeat"] == 40
    assert result["a"]["iterations_with_activity"] == 40
    record = body["measurements"][-1]
    assert record["ratio"] == result["ratio"] and record["verdict"] == result["verdict"]


def test_spin_is_slower(server: ServerProcess) -> None:  # noqa: F811
    """B with a spin of about half A's time: slower, the interval above 1."""
    result, _ = run_pair(server, 500_000, {"warmup": 5, "repeat": 30})
    print(f"[compare] A/B: {result['ratio']:.4f} {result['ratio_ci95']} {result['verdict']}")
    assert result["validity"]["ok"], result
    assert result["verdict"] == "slower", result
    assert result["ratio_ci95"][0] > 1.0
