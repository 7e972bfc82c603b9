# -*- test-case-name: tests.unit.test_logs -*-
"""
L{BackgroundWriter}: log lines written by a thread of their own.

The log observers run on the reactor, once for every event (a dozen for a
small request).  Writing and flushing each line there puts a system call, and
any wait for a slow terminal, pipe or disk, on the reactor.  Behind a
L{BackgroundWriter} the observer only appends the line to a deque; a thread
wakes every L{BackgroundWriter.interval} seconds (not once a line: waking it
per event would cost the reactor a thread switch and a turn of the GIL each
time), writes what has gathered in one call and flushes.  L{sync} writes
what has gathered at once, in the caller's thread: the observers call it
when a request finishes, so a request's lines are written (in one call, not
a dozen) before its answer goes out.  Order is kept; L{close} writes what is
left before it returns.
"""

from __future__ import annotations

import collections
import threading
from typing import Any


class BackgroundWriter:
    """
    A write-only stream whose lines a writer thread writes in batches.

    @ivar wrapped: the stream the thread writes to (text or binary, as the
        lines are); only that thread touches it until L{close} returns.
    @ivar interval: seconds between the thread's batches.
    """

    def __init__(
        self, wrapped: Any, name: str = "kcoral-log-writer", interval: float = 0.05
    ) -> None:
        self.wrapped = wrapped
        self.interval = interval
        # deque.append and popleft are atomic: no lock on the reactor's side.
        self._pending: collections.deque[Any] = collections.deque()
        self._closed = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def write(self, data: Any) -> None:
        if not self._closed:
            self._pending.append(data)

    def flush(self) -> None:
        """Nothing to do here: the writer thread flushes after each batch."""

    def sync(self) -> None:
        """Write what has gathered now, in this thread (one write and a flush)."""
        self._write_pending()

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued, then stop the thread (the wrapped stream stays open)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._write_pending()
        self._write_pending()

    def _write_pending(self) -> None:
        # One writer at a time, so batches reach the stream in order.
        with self._lock:
            batch = []
            while True:
                try:
                    batch.append(self._pending.popleft())
                except IndexError:
                    break
            if not batch:
                return
            try:
                self.wrapped.write(batch[0][:0].join(batch))
                self.wrapped.flush()
            except Exception:
                # Disk full, closed stream...: logging never fails anyone.
                pass
