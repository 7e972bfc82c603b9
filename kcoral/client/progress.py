# -*- test-case-name: tests.unit.test_client_cli -*-
"""
A one-line progress display on a terminal for C{kcoral run}: upload and
download bytes, and the time spent waiting for the server; shown only once
a phase has lasted a second.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import IO, Any

from twisted.internet.task import LoopingCall
from zope.interface import implementer

from kcoral.client.async_client import IProgress

_MIB = 1 << 20


@implementer(IProgress)
class TerminalProgress:
    """
    Draws C{kcoral: upload [#####     ] 12.0/64.0 MiB} on C{stream} (a
    terminal), rewriting the line in place; C{clock} drives the waiting
    counter.
    """

    def __init__(
        self,
        stream: IO[str],
        *,
        clock: Any = None,
        delay: float = 1.0,
        now: Callable[[], float] = time.monotonic,
        width: int = 30,
    ) -> None:
        self._stream = stream
        self._clock = clock
        self._delay = delay
        self._now = now
        self._width = width
        self._phase: str | None = None
        self._started = 0.0
        self._shown = False
        self._ticker: LoopingCall | None = None

    def _enter(self, phase: str) -> bool:
        if self._phase != phase:
            self._stop_ticker()
            self._phase = phase
            self._started = self._now()
        return self._now() - self._started >= self._delay

    def _draw(self, text: str) -> None:
        self._stream.write("\r\x1b[K" + text)
        self._stream.flush()
        self._shown = True

    def _bar(self, label: str, done: int, total: int | None) -> str:
        if not total:
            return f"kcoral: {label} {done / _MIB:.1f} MiB"
        filled = min(self._width, self._width * done // total)
        bar = "#" * filled + " " * (self._width - filled)
        return f"kcoral: {label} [{bar}] {done / _MIB:.1f}/{total / _MIB:.1f} MiB"

    def sending(self, sent: int, total: int) -> None:
        if self._enter("upload"):
            self._draw(self._bar("upload", sent, total))

    def receiving(self, received: int, total: int | None) -> None:
        if self._enter("download"):
            self._draw(self._bar("download", received, total))

    def waiting(self) -> None:
        self._enter("wait")
        if self._clock is None:
            return
        self._ticker = LoopingCall(self._tick)
        self._ticker.clock = self._clock
        self._ticker.start(0.5, now=False).addErrback(lambda _: None)

    def _tick(self) -> None:
        elapsed = self._now() - self._started
        if elapsed >= self._delay:
            self._draw(f"kcoral: waiting for the server {elapsed:.0f} s")

    def _stop_ticker(self) -> None:
        if self._ticker is not None and self._ticker.running:
            self._ticker.stop()
        self._ticker = None

    def done(self) -> None:
        self._stop_ticker()
        self._phase = None
        if self._shown:
            self._stream.write("\r\x1b[K")
            self._stream.flush()
            self._shown = False


__all__ = ["TerminalProgress"]
