"""
The response's C{measurements} field (docs/trusted-timing.md) does not
break the reference client 0.1.1: a COMPLETED body rendered by the server's
own code with a measurement record is parsed by the reference client's
response parser, in its own virtualenv, with the same results as without
the field; our client exposes the record.  The GPU form (a real benchmark
through the reference client against kcoral) is in bench/trusted_timing.py.
"""

from __future__ import annotations

import json
from typing import Any

import attrs
import pytest

from kcoral.client.results import program_result
from kcoral.server.workers.job import JobResult
from kcoral.wire.channel import Outcome
from kcoral.wire.render import Placement, render_result

from .refclient import RefClientUnavailable, run_client

pytestmark = pytest.mark.integration

_MARK = "@@KCORAL-MEASUREMENTS@@"

#: Runs in the reference virtualenv: its parser on the body in argv[1].
_PARSE = f"""
import json, sys
from kcoral.client.result import _parse_program_result
result = _parse_program_result(json.loads(sys.argv[1]), {{}})
print({_MARK!r} + json.dumps({{"status": result.status, "results": result.results}}))
"""

RECORD = {
    "id": 0,
    "instruction_index": 4,
    "wall_ms": 16.3,
    "overhead_ms": 0.08,
    "latency_ms_median": 0.3421,
    "timing": "cupti_activity",
    "iterations_with_activity": 30,
    "validity": {"ok": True, "reasons": []},
}

VALUE = {"latency_ms_median": 0.3421, "measurement_id": 0}


@attrs.frozen
class _Options:
    gpu_count: None = None


@attrs.frozen
class _Program:
    instructions: tuple[Any, ...] = ()
    options: _Options = _Options()


def _body(measurements: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    results = {
        "r": {
            "type": "object",
            "value": {
                "latency_ms_median": {"type": "number", "value": 0.3421},
                "measurement_id": {"type": "integer", "value": 0},
            },
        }
    }
    ending = JobResult(
        "outcome",
        outcome=Outcome(status="COMPLETED", results=results),
        measurements=measurements,
    )
    rendered = render_result(
        "rid",
        _Program(),  # type: ignore[arg-type]
        ending,
        Placement("gpu0/w0", 0, (0,)),
        timeout_seconds=60.0,
        queue_ms=0.0,
        elapsed_ms=20.0,
        max_response_bytes=1 << 20,
    )
    assert isinstance(rendered.body, bytes)
    body: dict[str, Any] = json.loads(rendered.body)
    return body


def _reference_parse(body: dict[str, Any]) -> dict[str, Any]:
    try:
        done = run_client(_PARSE, json.dumps(body))
    except RefClientUnavailable as e:
        pytest.skip(str(e))
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith(_MARK))
    parsed: dict[str, Any] = json.loads(line[len(_MARK) :])
    return parsed


def test_reference_client_ignores_measurements() -> None:
    with_record = _body((RECORD,))
    assert with_record["measurements"] == [RECORD]
    parsed = _reference_parse(with_record)
    assert parsed == _reference_parse(_body(()))
    assert parsed == {"status": "COMPLETED", "results": {"r": VALUE}}


def test_our_client_exposes_measurements() -> None:
    result = program_result(_body((RECORD,)), {})
    assert result.measurements == (RECORD,)
    assert result.verify_measurement(result["r"]) == RECORD
