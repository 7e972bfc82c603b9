# -*- test-case-name: tests.unit.test_blobsink -*-
"""
Write a large blob into its memfd and hash it, off the reactor thread.

A blob streams in as chunks on the reactor.  Copying each chunk into fresh
shared-memory pages and hashing it there used to be nearly all of that
thread's work for a large upload (the memfd writes alone were more than
half of it, SHA-256 most of the rest).  L{BlobSink} takes both off: the
reactor hands it each chunk and goes back to the socket, one thread appends
the chunks to the memfd and another hashes the same chunk objects.  Both
C{os.write} and C{hashlib} let go of the GIL for buffers this size, so the
three run side by side; an upload then goes at the pace of its slowest
stage, SHA-256 on one core.

The chunks not yet written and hashed are the sink's backlog.  Whoever
feeds it reads L{BlobSink.backlog} and stops reading the socket past a
high-water mark; L{BlobSink.notify_at} says when to read again.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from queue import SimpleQueue
from typing import Any

__all__ = ["BlobSink", "MAX_LIVE_SINKS"]

#: Sinks (two threads each) alive at once in this process.  A blob that
#: finds none free is written and hashed on the caller's thread, as
#: small blobs are: slower, but the thread count stays bounded.
MAX_LIVE_SINKS = 32

_live = 0
_live_lock = threading.Lock()

_WRITE, _HASH = 0, 1


def _claim() -> bool:
    global _live
    with _live_lock:
        if _live >= MAX_LIVE_SINKS:
            return False
        _live += 1
        return True


def _unclaim() -> None:
    global _live
    with _live_lock:
        _live -= 1


class BlobSink:
    """
    Append chunks to C{fd} and continue C{hasher} over them, each on a
    thread of its own, in the order they were L{put}.

    @param hasher: a C{hashlib} object that has seen every byte before the
        first chunk; from now on only the hash thread updates it.
    @param fd: the file being filled (a memfd), at the offset where the
        chunks go; duplicated, so the owner may close or seal its own
        descriptor whenever it likes.
    """

    def __init__(self, hasher: Any, fd: int) -> None:
        self._hasher = hasher
        self._fd = os.dup(fd)
        #: Bytes L{put} so far.
        self.queued = 0
        self._done = [0, 0]  # bytes written, bytes hashed
        self._queues: tuple[
            SimpleQueue[bytes | memoryview | None], SimpleQueue[bytes | memoryview | None]
        ] = (
            SimpleQueue(),
            SimpleQueue(),
        )
        self._lock = threading.Lock()
        self._waiter: tuple[int, Callable[[], None]] | None = None
        self._cancelled = False
        self._closed = False
        self._error: BaseException | None = None
        self._threads = (
            threading.Thread(target=self._run, args=(_WRITE,), name="kcoral-blob-write"),
            threading.Thread(target=self._run, args=(_HASH,), name="kcoral-blob-hash"),
        )
        for thread in self._threads:
            thread.daemon = True
            thread.start()

    @classmethod
    def start(cls, hasher: Any, fd: int) -> BlobSink | None:
        """A new sink, or C{None} when L{MAX_LIVE_SINKS} are alive."""
        if not _claim():
            return None
        try:
            return cls(hasher, fd)
        except BaseException:
            _unclaim()
            raise

    @property
    def backlog(self) -> int:
        """Bytes put that are not yet both written and hashed."""
        return self.queued - min(self._done)

    def put(self, chunk: bytes | memoryview) -> None:
        """
        Queue C{chunk} (immutable bytes or a view of them: the threads read
        it later) for writing and hashing; never waits.
        """
        if self._closed:
            raise ValueError("blob sink is closed")
        if not chunk:
            return
        self.queued += len(chunk)
        for queue in self._queues:
            queue.put(chunk)

    def notify_at(self, level: int, callback: Callable[[], None]) -> None:
        """
        Call C{callback} once the backlog is C{level} bytes or less: now,
        on this thread, if it already is, else on a sink thread (so it
        must be safe to call from any thread).  A later call replaces an
        earlier one that has not been called yet.
        """
        with self._lock:
            if self.backlog > level:
                self._waiter = (level, callback)
                return
        callback()

    def finish(self) -> str:
        """
        No more chunks: wait until the threads have written and hashed the
        ones queued, and return the hex digest of every byte.

        @raise OSError: a write failed (the memory ran out, say).
        """
        self.close()
        for thread in self._threads:
            thread.join()
        if self._error is not None:
            raise self._error
        return str(self._hasher.hexdigest())

    def cancel(self) -> None:
        """
        Drop what is queued and stop both threads, without waiting.  A
        waiting L{notify_at} callback is called now: nothing is held back
        for this sink any more.
        """
        self._cancelled = True
        self.close()
        with self._lock:
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            waiter[1]()

    def close(self) -> None:
        """No more chunks: the threads end once they are through the queue."""
        if self._closed:
            return
        self._closed = True
        for queue in self._queues:
            queue.put(None)
        _unclaim()

    def _run(self, stage: int) -> None:
        queue = self._queues[stage]
        try:
            while (chunk := queue.get()) is not None:
                if not (self._cancelled or self._error is not None):
                    try:
                        self._consume(stage, chunk)
                    except BaseException as e:  # raised by finish()
                        self._error = e
                self._advance(stage, len(chunk))
        finally:
            if stage == _WRITE:
                os.close(self._fd)

    def _consume(self, stage: int, chunk: bytes | memoryview) -> None:
        if stage == _HASH:
            self._hasher.update(chunk)
            return
        view = memoryview(chunk)
        while view:
            view = view[os.write(self._fd, view) :]

    def _advance(self, stage: int, size: int) -> None:
        with self._lock:
            self._done[stage] += size
            waiter = self._waiter
            if waiter is None or self.backlog > waiter[0]:
                return
            self._waiter = None
        waiter[1]()
