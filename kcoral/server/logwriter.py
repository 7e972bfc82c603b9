# -*- test-case-name: tests.unit.test_logs -*-
"""
L{BackgroundWriter}: log lines written by a thread of their own.

The log observers run on the reactor, once for every event (a dozen for a
small request).  Writing and flushing each line there puts a system call, and
any wait for a slow terminal, pipe or disk, on the reactor.  Behind a
L{BackgroundWriter} the observer only queues the line; one thread writes what
has queued up in a single call and flushes.  Order is kept; L{close} writes
what is left before it returns.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

_STOP = object()


class BackgroundWriter:
    """
    A write-only stream that hands its lines to a writer thread.

    @ivar wrapped: the stream the thread writes to (text or binary, as the
        lines are); only that thread touches it until L{close} returns.
    """

    def __init__(self, wrapped: Any, name: str = "kcoral-log-writer") -> None:
        self.wrapped = wrapped
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def write(self, data: Any) -> None:
        if not self._closed:
            self._queue.put(data)

    def flush(self) -> None:
        """Nothing to do here: the writer thread flushes after each batch."""

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued, then stop the thread (the wrapped stream stays open)."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            batch = []
            while item is not _STOP:
                batch.append(item)
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            if batch:
                try:
                    self.wrapped.write(batch[0][:0].join(batch))
                    self.wrapped.flush()
                except Exception:
                    # Disk full, closed stream...: logging never fails anyone.
                    pass
            if item is _STOP:
                return
