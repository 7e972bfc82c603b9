# -*- test-case-name: tests.unit.test_worker_engine -*-
"""
Exceptions that uploaded code may raise to choose a failure kind.

When an L{ExecutionError} escapes an instruction, the FAILED response uses its
C{kind} and C{message} (protocol §10.1).  This module is imported by uploaded
code inside workers, so it imports nothing beyond the standard library and the Twisted-free wire package.
"""

from __future__ import annotations

from kcoral.client.errors import KCoralError, ProtocolError, TransportError  # 0.1.1 names
from kcoral.wire.errors import INSTRUCTION_KINDS as KINDS  # protocol §9.1


class ExecutionError(Exception):
    """
    An instruction failed with a chosen error kind.

    @ivar kind: one of L{KINDS} (anything else is reported as C{engine}).
    @ivar message: the text sent as C{error.message}.
    """

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.kind!r}, {self.message!r})"


class GPUAccessViolation(ExecutionError):
    """
    A C{cpu_only} call entered the CUDA API (kind C{gpu_access}).

    @ivar cuda_call: the CUDA API function entered.
    @ivar location: the innermost uploaded-code frame, C{file:line in function}.
    @ivar call_stack: the formatted Python stack at the CUDA call.
    """

    def __init__(
        self,
        message: str,
        *,
        cuda_call: str,
        location: str,
        call_stack: str = "",
    ) -> None:
        super().__init__("gpu_access", message)
        self.cuda_call = cuda_call
        self.location = location
        self.call_stack = call_stack


__all__ = [
    "KINDS",
    "ExecutionError",
    "GPUAccessViolation",
    "KCoralError",
    "ProtocolError",
    "TransportError",
]
