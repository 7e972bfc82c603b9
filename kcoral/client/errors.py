# -*- test-case-name: tests.unit.test_client_results -*-
"""
The client's exceptions, with the 0.1.1 client's names and arguments.

Pure Python: C{kcoral.errors} re-exports them, and importing this module
loads neither Twisted nor treq.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kcoral.client.results import ProgramResult


class KCoralError(Exception):
    """
    The server answered with an HTTP status other than 200.

    @ivar status_code: the HTTP status (503 for a busy server, say).
    @ivar message: the server's error message.
    @ivar kind: the error kind of the body (C{busy}, C{parse}...), or C{None}.
    @ivar request_id: the server's request id, when the body had one.
    """

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        kind: str | None = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(f"HTTP {status_code}: {message}")
        self.status_code = status_code
        self.message = message
        self.kind = kind
        self.request_id = request_id


class TransportError(Exception):
    """No HTTP response came back (connection refused, reset, DNS...)."""


class ProtocolError(Exception):
    """The server's response does not follow the KCoral protocol."""


class ResponseTooLarge(ProtocolError):
    """
    A response body exceeded the client's C{max_response_bytes} cap; the
    connection was dropped as soon as the cap was passed (or at once, when
    the declared C{Content-Length} was over it).

    @ivar limit: the cap, in bytes.
    @ivar received: body bytes received when the client gave up.
    @ivar declared: the declared C{Content-Length}, or C{None}.
    """

    def __init__(self, limit: int, received: int, declared: int | None) -> None:
        size = f"declares {declared} bytes" if declared is not None else "went past it"
        super().__init__(
            f"response body is larger than max_response_bytes={limit} ({size}); "
            f"pass a larger max_response_bytes to the client to accept it"
        )
        self.limit = limit
        self.received = received
        self.declared = declared


class InstructionError(Exception):
    """
    A program ended C{FAILED}: one instruction failed (protocol §9.1).

    Raised by L{ProgramResult.check}; the result keeps everything else.

    @ivar kind: one of the eight instruction error kinds.
    @ivar message: the server's message.
    @ivar instruction_index: zero-based index of the failing instruction.
    @ivar instruction_op: its op (C{upload}, C{get_function}, C{run}, C{return}).
    @ivar instruction_id: its id, or C{None} for a return.
    @ivar traceback: the remote traceback text (may be empty).
    @ivar result: the whole L{ProgramResult}.
    """

    def __init__(self, result: ProgramResult) -> None:
        error: dict[str, Any] = result.error or {}
        self.result = result
        self.kind: str = error.get("kind", "engine")
        self.message: str = error.get("message", "")
        self.instruction_index: int | None = error.get("instruction_index")
        self.instruction_op: str | None = error.get("instruction_op")
        self.instruction_id: str | None = error.get("instruction_id")
        self.traceback: str = error.get("traceback", "")
        super().__init__(
            f"instruction {self.instruction_index} ({self.instruction_op} "
            f"{self.instruction_id!r}) failed: {self.kind}: {self.message}"
        )


class RemoteExecutionError(RuntimeError):
    """
    A remote function's program ended C{FAILED}.

    @ivar result: the failed L{ProgramResult} (error, traceback, output).
    """

    def __init__(self, result: ProgramResult) -> None:
        self.result = result
        error = result.error or {}
        super().__init__(
            f"Remote execution {result.request_id} failed: "
            f"{error.get('kind', 'unknown')}: {error.get('message', 'no error details')}"
        )


__all__ = [
    "InstructionError",
    "KCoralError",
    "ProtocolError",
    "RemoteExecutionError",
    "ResponseTooLarge",
    "TransportError",
]
