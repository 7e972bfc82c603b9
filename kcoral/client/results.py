# -*- test-case-name: tests.unit.test_client_results -*-
"""
Turning a response into a L{ProgramResult} or a typed error, as the 0.1.1
client does (protocol §5.4, §7.4, §8.1, §9): pure functions over the body
and its binary parts, shared by the async and blocking clients.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kcoral.client.errors import InstructionError, KCoralError, ProtocolError
from kcoral.client.files import ReturnedFile, ReturnedFolder
from kcoral.wire.errors import INSTRUCTION_KINDS, OPS
from kcoral.wire.multipart import decode_response
from kcoral.wire.program import ValidationError, is_digest, strict_json_loads
from kcoral.wire.values import DecodedFile, DecodedFolder, decode_results


@dataclass
class ProgramResult:
    """
    A program's outcome: C{COMPLETED} or C{FAILED}, with every value
    returned before a failure (CACHE_MISS never reaches the caller).

    Binary values decode to C{bytes}, tensors to writable NumPy arrays,
    file and folder returns to L{ReturnedFile} / L{ReturnedFolder}.
    C{error} is the server's error object (protocol §9.1) or C{None}.
    """

    status: str
    request_id: str
    queue_ms: float
    elapsed_ms: float
    lease_wait_ms: float
    lease_held_ms: float
    results: dict[str, Any]
    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    error: dict[str, Any] | None = None
    gpu_ids: tuple[int, ...] = ()
    #: The server's own record of every C{benchmark} measurement the
    #: program made, in order (docs/trusted-timing.md): computed out of the
    #: uploaded code's reach, unlike the values in C{results}.
    measurements: tuple[dict[str, Any], ...] = ()

    @property
    def completed(self) -> bool:
        """Whether every instruction completed."""
        return self.status == "COMPLETED"

    def __getitem__(self, key: str) -> Any:
        """A returned value by key (C{KeyError} when absent)."""
        return self.results[key]

    def verify_measurement(self, value: Mapping[str, Any]) -> dict[str, Any]:
        """
        The server's record of the C{benchmark} result C{value} (a dict the
        program returned, or part of one with its C{measurement_id}), once
        every number C{value} holds matches it.

        @raise ValueError: C{value} names no record of this response, or
            differs from it (forged by the uploaded code), or the record
            says the measurement is not valid.
        """
        ident = value.get("measurement_id") if isinstance(value, Mapping) else None
        record = next((r for r in self.measurements if r.get("id") == ident), None)
        if ident is None or record is None:
            raise ValueError("the value names no measurement the server recorded")
        for key in MEASURED_KEYS:
            # What the value claims must be what the server recorded.
            if key in record and key in value and value[key] != record[key]:
                raise ValueError(
                    f"{key} is {value.get(key)!r} in the value, {record[key]!r} in the record"
                )
        validity = record.get("validity", {})
        if not validity.get("ok", False):
            raise ValueError(f"the measurement is not valid: {validity.get('reasons')}")
        return record

    def check(self) -> ProgramResult:
        """
        Return this result when it completed, else raise L{InstructionError}
        carrying the failure's kind, message and instruction.
        """
        if not self.completed:
            raise InstructionError(self)
        return self


#: The keys of a benchmark result that L{ProgramResult.verify_measurement}
#: compares with the server's record.
MEASURED_KEYS = (
    "latency_ms_median",
    "latency_ms_mean",
    "latency_ms_min",
    "latency_ms_max",
    "latency_ms_stdev",
    "cv",
    "repeat",
    "warmup",
    "timing",
    "iterations_with_activity",
    "validity",
)


def _measurements(body: Mapping[str, Any]) -> tuple[dict[str, Any], ...]:
    records = body.get("measurements", [])
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise ValidationError("measurements must be a list of objects")
    return tuple(records)


def _is_number(value: object) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    )


_ERROR_FIELDS = frozenset(
    {"kind", "message", "instruction_index", "instruction_op", "instruction_id", "traceback"}
)
_GPU_ACCESS_FIELDS = _ERROR_FIELDS | {"cuda_call", "location", "interfered_request_id"}


def _check_error(error: object) -> dict[str, Any]:
    if not isinstance(error, dict):
        raise ValidationError("error must be an object")
    kind = error.get("kind")
    expected = _GPU_ACCESS_FIELDS if kind == "gpu_access" else _ERROR_FIELDS
    if set(error) != expected:
        raise ValidationError("error details have unexpected fields")
    if kind not in INSTRUCTION_KINDS:
        raise ValidationError(f"error kind {kind!r} is invalid")
    if not isinstance(error["message"], str) or not isinstance(error["traceback"], str):
        raise ValidationError("error message and traceback must be strings")
    index = error["instruction_index"]
    if isinstance(index, bool) or not isinstance(index, int):
        raise ValidationError("error instruction_index must be an integer")
    if error["instruction_op"] not in OPS:
        raise ValidationError("error instruction_op is invalid")
    if error["instruction_id"] is not None and not isinstance(error["instruction_id"], str):
        raise ValidationError("error instruction_id must be a string or null")
    if kind == "gpu_access":
        interfered = error["interfered_request_id"]
        if not (
            isinstance(error["cuda_call"], str)
            and isinstance(error["location"], str)
            and (interfered is None or isinstance(interfered, str))
        ):
            raise ValidationError("gpu_access error details have the wrong types")
    return error


def _check_gpus(body: Mapping[str, Any]) -> tuple[int, ...]:
    if ("gpu_ids" in body) != ("gpu_count" in body):
        raise ValidationError("gpu_ids and gpu_count must be reported together")
    if "gpu_ids" not in body:
        return ()
    ids, count = body["gpu_ids"], body["gpu_count"]
    if (
        not isinstance(ids, list)
        or not ids
        or len(ids) > 8
        or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids)
        or len(set(ids)) != len(ids)
    ):
        raise ValidationError("gpu_ids must list one to eight distinct device indices")
    if isinstance(count, bool) or count != len(ids):
        raise ValidationError("gpu_count must match gpu_ids")
    return tuple(ids)


def _public(value: Any) -> Any:
    if isinstance(value, DecodedFile):
        return ReturnedFile(value.data)
    if isinstance(value, DecodedFolder):
        return ReturnedFolder(
            {path: ReturnedFile(data) for path, data in value.files.items()}, value.directories
        )
    return value


def program_result(body: Mapping[str, Any], parts: Mapping[str, bytes]) -> ProgramResult:
    """
    Validate a COMPLETED/FAILED body and decode its results.

    @raise ProtocolError: when anything does not follow protocol §8.1.
    """
    try:
        status = body["status"]
        if status not in ("COMPLETED", "FAILED"):
            raise ValidationError(f"unexpected program status {status!r}")
        request_id = body["request_id"]
        if not isinstance(request_id, str) or not request_id:
            raise ValidationError("request_id must be a non-empty string")
        timings = [body[k] for k in ("queue_ms", "elapsed_ms", "lease_wait_ms", "lease_held_ms")]
        if not all(_is_number(t) for t in timings):
            raise ValidationError("the reported timings must be finite numbers")
        stdout, stderr = body["stdout"], body["stderr"]
        if not isinstance(stdout, str) or not isinstance(stderr, str):
            raise ValidationError("stdout and stderr must be strings")
        truncated = (body.get("stdout_truncated", False), body.get("stderr_truncated", False))
        if not all(isinstance(flag, bool) for flag in truncated):
            raise ValidationError("output truncation flags must be booleans")
        gpu_ids = _check_gpus(body)
        measurements = _measurements(body)
        encoded = body["results"]
        if not isinstance(encoded, dict):
            raise ValidationError("results must be an object")
        results = {key: _public(v) for key, v in decode_results(encoded, parts).items()}
        if status == "COMPLETED":
            if "error" in body:
                raise ValidationError("COMPLETED response must not contain error details")
            error = None
        else:
            error = _check_error(body["error"])
    except (KeyError, TypeError, ValueError) as e:
        raise ProtocolError(f"malformed execution response: {e}") from e
    return ProgramResult(
        status=status,
        request_id=request_id,
        queue_ms=float(timings[0]),
        elapsed_ms=float(timings[1]),
        lease_wait_ms=float(timings[2]),
        lease_held_ms=float(timings[3]),
        results=results,
        stdout=stdout,
        stderr=stderr,
        stdout_truncated=truncated[0],
        stderr_truncated=truncated[1],
        error=error,
        gpu_ids=gpu_ids,
        measurements=measurements,
    )


def response_body(content_type: str | None, data: bytes) -> tuple[dict[str, Any], dict[str, bytes]]:
    """
    Split a 200 response into its JSON object and binary parts.

    @raise ProtocolError: on an unsupported type or malformed framing.
    """
    try:
        return decode_response(content_type, data)
    except ValidationError as e:
        raise ProtocolError(f"malformed response: {e}") from e


def json_object(data: bytes) -> dict[str, Any]:
    """A strict JSON object (protocol §4.1 rules apply to responses too)."""
    try:
        body = strict_json_loads(data)
    except ValidationError as e:
        raise ProtocolError(f"response is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise ProtocolError("JSON response must be an object")
    return body


def missing_blobs(body: Mapping[str, Any], known: Mapping[str, object]) -> list[str]:
    """
    The digests a first CACHE_MISS asks for (protocol §5.4): a non-empty,
    duplicate-free list of digests that the program holds.
    """
    missing = body.get("missing_blobs")
    if not isinstance(missing, list) or not missing:
        raise ProtocolError("CACHE_MISS response needs a non-empty 'missing_blobs' array")
    if not all(is_digest(d) for d in missing):
        raise ProtocolError("CACHE_MISS response contains an invalid blob hash")
    if len(set(missing)) != len(missing):
        raise ProtocolError("CACHE_MISS response contains duplicate blob hashes")
    unknown = sorted(set(missing) - set(known))
    if unknown:
        raise ProtocolError(f"server misses blobs with no local bytes to send: {unknown}")
    return missing


def server_error(code: int, data: bytes) -> KCoralError:
    """The L{KCoralError} for a non-200 answer (protocol §9.2)."""
    try:
        body: object = strict_json_loads(data)
    except ValidationError:
        body = {}
    if not isinstance(body, dict):
        body = {}
    error = body.get("error")
    kind = None
    if isinstance(error, dict):
        message = str(error.get("message", "server error"))
        kind = error.get("kind")
    else:
        message = str(error) if error else f"HTTP {code}"
    request_id = body.get("request_id")
    return KCoralError(
        code,
        message,
        kind=kind if isinstance(kind, str) else None,
        request_id=request_id if isinstance(request_id, str) else None,
    )


__all__ = [
    "ProgramResult",
    "json_object",
    "missing_blobs",
    "program_result",
    "response_body",
    "server_error",
]
