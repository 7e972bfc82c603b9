# -*- test-case-name: tests.unit.test_app -*-
"""
How a worker's answer becomes an HTTP response (protocol §8, §9).

Pure functions, no Twisted: L{render_result} turns how a job ended into the
status, content type and body of the response plus the fields of its
C{request_finished} event, or raises L{RequestError} for the answers that are
request-level errors (timeout, crash outside an instruction, an invalid
worker reply, a body over the response-size limit).  The server logs and
writes what it gets back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, Union

import attrs

from kcoral.wire.channel import Outcome
from kcoral.wire.errors import (
    RESPONSE_TOO_LARGE_MESSAGE,
    TIMEOUT_MESSAGE,
    error_body,
    http_status,
    instruction_error,
)
from kcoral.wire.jsontext import json_dumps
from kcoral.wire.multipart import encode_response
from kcoral.wire.program import Program

if TYPE_CHECKING:
    from kcoral.ipc.shared import SharedBuffer

#: A response body: bytes, or the chunks of a multipart body.
Body = Union[bytes, list[Union[bytes, "SharedBuffer"]]]

#: Log fields longer than this are cut (error messages, exception text).
FIELD_LIMIT = 2048


class RequestError(Exception):
    """
    A request-level failure answered with an ERROR body (protocol §9.2).

    @ivar kind: the request error kind, which picks the HTTP status.
    @ivar finish_reason: the C{request_finished} event's reason.
    @ivar fields: extra fields of that event.
    """

    def __init__(self, kind: str, message: str, finish_reason: str, **fields: Any) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.finish_reason = finish_reason
        self.fields = fields

    @property
    def status(self) -> int:
        """The HTTP status of this error's kind."""
        return http_status(self.kind)

    def body(self, request_id: str) -> bytes:
        """The ERROR body: exactly three keys."""
        return json_dumps(error_body(request_id, self.kind, self.message))


class Ending(Protocol):
    """How a job ended, as the server saw it (the parent's C{JobResult})."""

    @property
    def ending(self) -> str: ...
    @property
    def outcome(self) -> Outcome | None: ...
    @property
    def instruction_index(self) -> int | None: ...
    @property
    def exit_code(self) -> int | None: ...
    @property
    def output_tail(self) -> str: ...
    @property
    def detail(self) -> str: ...
    @property
    def results(self) -> dict[str, Any]: ...
    @property
    def parts(self) -> tuple[bytes | SharedBuffer, ...]: ...
    @property
    def lease_wait_seconds(self) -> float: ...
    @property
    def lease_held_seconds(self) -> float: ...
    @property
    def measurements(self) -> tuple[dict[str, Any], ...]: ...


@attrs.frozen
class Placement:
    """
    Where a request ran, for the response and its log event (no
    C{worker_id}: a compile-only program the server ran itself).
    """

    worker_id: str | None
    gpu_id: int | None
    gpus: tuple[int, ...]


@attrs.frozen
class Rendered:
    """A response to write, and the C{request_finished} event to log."""

    status: int
    content_type: str
    body: Body
    finish_reason: str
    fields: dict[str, Any]


def render_cache_miss(request_id: str, missing: list[str]) -> Rendered:
    """The 200 CACHE_MISS answer naming the blobs the client must send."""
    body = {"status": "CACHE_MISS", "request_id": request_id, "missing_blobs": list(missing)}
    return Rendered(
        200,
        "application/json",
        json_dumps(body),
        "cache_miss",
        {"status": "CACHE_MISS", "missing": len(missing)},
    )


def render_result(
    request_id: str,
    program: Program,
    result: Ending,
    where: Placement,
    *,
    timeout_seconds: float,
    queue_ms: float,
    elapsed_ms: float,
    max_response_bytes: int,
    interferer: Callable[[dict[str, Any]], str | None] | None = None,
) -> Rendered:
    """
    The response to a job that ran: COMPLETED or FAILED, with binary parts.

    @param interferer: given a C{gpu_access} error, the request that held
        the GPU meanwhile (protocol §9.1).
    @raise RequestError: the answer is an ERROR body instead.
    """
    place = {"worker_id": where.worker_id, "gpu_id": where.gpu_id}
    if result.ending == "timeout":
        raise RequestError(
            "timeout",
            TIMEOUT_MESSAGE,
            "timeout",
            queue_ms=queue_ms,
            elapsed_ms=elapsed_ms,
            timeout_seconds=timeout_seconds,
            output_tail=result.output_tail,
            **place,
        )
    if result.ending == "invalid":
        raise RequestError(
            "engine",
            "invalid worker response" + (f": {result.detail[:512]}" if result.detail else ""),
            "server_error",
            error_kind="invalid_worker_response",
            **place,
        )
    timings = {
        "queue_ms": queue_ms,
        "elapsed_ms": elapsed_ms,
        "lease_wait_ms": result.lease_wait_seconds * 1000.0,
        "lease_held_ms": result.lease_held_seconds * 1000.0,
    }
    if result.ending == "crashed":
        outcome = _crash_outcome(program, result, queue_ms, elapsed_ms, place)
        reason = "crashed"
    else:
        assert result.outcome is not None
        outcome = result.outcome
        reason = "completed" if outcome.status == "COMPLETED" else "program_failed"
    if outcome.oversize is not None:
        # The worker's results were over the limit: it sent their size only.
        raise RequestError(
            "response_too_large",
            RESPONSE_TOO_LARGE_MESSAGE,
            "server_error",
            error_kind="response_too_large",
            response_bytes=outcome.oversize,
            queue_ms=queue_ms,
            elapsed_ms=elapsed_ms,
            lease_held_ms=timings["lease_held_ms"],
            **place,
        )
    parts = list(outcome.parts)
    body: dict[str, Any] = {
        "status": outcome.status,
        "request_id": request_id,
        **timings,
        "stdout": outcome.stdout,
        "stderr": outcome.stderr,
        "stdout_truncated": outcome.stdout_truncated,
        "stderr_truncated": outcome.stderr_truncated,
    }
    if program.options.gpu_count is not None:
        # Only for programs that asked for a GPU count (protocol §6.5).
        body["gpu_ids"] = list(where.gpus)
        body["gpu_count"] = len(where.gpus)
    body["results"] = outcome.results
    if result.measurements:
        # The server's own record of every benchmark measurement, outside
        # the program's results (which uploaded code can forge): clients
        # that do not know the field ignore it (docs/trusted-timing.md).
        body["measurements"] = list(result.measurements)
    error = outcome.error
    if (
        isinstance(error, dict)
        and error.get("kind") == "gpu_access"
        and where.gpu_id is not None
        and interferer is not None
    ):
        error = {**error, "interfered_request_id": interferer(error)}
    if body["status"] != "COMPLETED":
        body["error"] = error
    content_type, chunks = encode_response(body, parts)
    size = sum(len(c) for c in chunks)
    if size > max_response_bytes:
        raise RequestError(
            "response_too_large",
            RESPONSE_TOO_LARGE_MESSAGE,
            "server_error",
            error_kind="response_too_large",
            response_bytes=size,
            queue_ms=queue_ms,
            elapsed_ms=elapsed_ms,
            lease_held_ms=timings["lease_held_ms"],
            **place,
        )
    fields: dict[str, Any] = {
        "status": body["status"],
        "exitcode": result.exit_code if reason == "crashed" else None,
        "output_tail": result.output_tail if reason == "crashed" else None,
        **place,
        **timings,
        "response_bytes": size,
    }
    if error:
        fields.update(
            error_kind=error.get("kind"),
            error_message=str(error.get("message", ""))[:FIELD_LIMIT],
            instruction_index=error.get("instruction_index"),
            instruction_op=error.get("instruction_op"),
            instruction_id=error.get("instruction_id"),
        )
    out: Body = chunks[0] if len(chunks) == 1 and isinstance(chunks[0], bytes) else chunks
    return Rendered(200, content_type, out, reason, fields)


def _crash_outcome(
    program: Program,
    result: Ending,
    queue_ms: float,
    elapsed_ms: float,
    place: dict[str, Any],
) -> Outcome:
    """
    The FAILED outcome of a worker that died inside an instruction; a crash
    anywhere else is a request-level C{engine} error.
    """
    index = result.instruction_index
    if index is None or not 0 <= index < len(program.instructions):
        raise RequestError(
            "engine",
            "worker crashed",
            "crashed",
            exitcode=result.exit_code,
            queue_ms=queue_ms,
            elapsed_ms=elapsed_ms,
            output_tail=result.output_tail,
            **place,
        )
    instruction = program.instructions[index]
    crash_error = instruction_error(
        "runtime",
        "worker exited while executing the instruction",
        index,
        instruction.op,
        instruction.id,
        "",
    )
    # Returns that finished before the crash stay in the results.
    return Outcome(status="FAILED", error=crash_error, results=result.results, parts=result.parts)
