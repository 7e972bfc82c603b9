# -*- test-case-name: tests.unit.test_measurement -*-
"""
The worker's side of a measurement: where C{benchmark} sends what it saw.

In a worker the L{ChannelMeasurer} tells the parent when the timed loop
starts and stops (L{MeasureStart}, L{MeasureStop}: the parent's wall clock)
and sends the raw measurement (L{Measurement}); the parent computes the
result (L{kcoral.measurement.evaluate}), keeps its own record of it and
answers L{MeasurementResult}.  Outside a worker (kcoral used as a library,
the GPU tests' in-process backend) L{LocalMeasurer} evaluates here, with
this process's own clock.
"""

from __future__ import annotations

import os
import sys
import time
from typing import IO, Any

import attrs

from kcoral.errors import ExecutionError
from kcoral.ipc.channel_io import read_message, write_message
from kcoral.measurement import MeasurementFailed, RawMeasurement, evaluate
from kcoral.wire.channel import Measurement as MeasurementMessage
from kcoral.wire.channel import (
    MeasurementResult,
    MeasureStart,
    MeasureStop,
)

__all__ = ["ChannelMeasurer", "LocalMeasurer"]


@attrs.define
class ChannelMeasurer:
    """Measurements judged by the parent, over the control channel."""

    _inbox: IO[bytes]
    _outbox: IO[bytes]

    def start(self) -> None:
        write_message(self._outbox, MeasureStart())

    def stop(self) -> None:
        write_message(self._outbox, MeasureStop())

    def submit(self, raw: RawMeasurement) -> dict[str, Any]:
        """
        The parent's result for C{raw}.

        @raise ExecutionError: C{runtime}, the parent found nothing to time.
        """
        write_message(self._outbox, MeasurementMessage(raw.to_json()))
        while True:
            message = read_message(self._inbox)
            if message is None:
                sys.stderr.write("kcoral worker: parent closed the channel during a benchmark\n")
                sys.stderr.flush()
                os._exit(1)
            if isinstance(message, MeasurementResult):
                break
        if message.result is None:
            raise ExecutionError("runtime", message.error or "benchmark failed")
        return message.result


@attrs.define
class LocalMeasurer:
    """Measurements judged in this process (no parent to send them to)."""

    _started: float | None = None
    _stopped: float | None = None

    def start(self) -> None:
        self._started = time.monotonic()

    def stop(self) -> None:
        self._stopped = time.monotonic()

    def submit(self, raw: RawMeasurement) -> dict[str, Any]:
        wall = None
        if self._started is not None and self._stopped is not None:
            wall = (self._stopped - self._started) * 1000.0
        self._started = self._stopped = None
        try:
            return evaluate(raw, wall)
        except MeasurementFailed as e:
            raise ExecutionError("runtime", e.message) from None
