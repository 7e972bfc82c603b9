# -*- test-case-name: tests.unit.test_blobsink -*-
"""
Write a large blob into its memfd and hash it, off the reactor thread.

A blob streams in as chunks on the reactor.  Copying each chunk into fresh
shared-memory pages and hashing it there used to be nearly all of that
thread's work for a large upload (the memfd writes alone were more than
half of it, SHA-256 most of the rest).  L{BlobSink} takes both off: the
reactor hands it each chunk and goes back to the socket; one thread appends
the chunks to the memfd (several at a time, with C{writev}) and another
hashes what was written, reading it back through a read-only mapping in
pieces of one to eight megabytes.  C{os.writev}, C{mmap} and C{hashlib} let go of
the GIL, so the three run side by side and an upload goes at the pace of
its slowest stage, SHA-256 on one core.

The hash takes large pieces because every return to Python costs it the
GIL, which the reactor holds while it scans the body: on the H200's host,
SHA-256 of 64 MiB beside a busy reactor took 65 ms in 256 KiB pieces and
56 ms in 4 MiB ones (52 ms alone).

The bytes not yet hashed are the sink's backlog.  Whoever feeds it reads
L{BlobSink.backlog} and stops reading the socket past a high-water mark;
L{BlobSink.notify_at} says when to read again.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable
from queue import Empty, SimpleQueue
from typing import Any

__all__ = ["BlobSink", "HASH_PIECE", "MAX_LIVE_SINKS"]

#: The least the hash thread waits for before it maps and hashes what was
#: written (less at the end), and the most it takes at once: when it is
#: behind, as it is while a fast client sends, it takes large pieces.
HASH_PIECE = 1 << 20
HASH_PIECE_MAX = 8 << 20

#: Chunks the write thread hands to one C{writev} at most.
WRITE_BATCH = 64

#: Sinks (two threads each) alive at once in this process.  A blob that
#: finds none free is written and hashed on the caller's thread, as
#: small blobs are: slower, but the thread count stays bounded.
MAX_LIVE_SINKS = 32

_live = 0
_live_lock = threading.Lock()


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
    Append chunks to C{fd} on one thread and continue C{hasher} over what
    was appended on another, in the order the chunks were L{put}.

    @param hasher: a C{hashlib} object that has seen every byte of C{fd}
        before its current offset; from now on only the hash thread
        updates it.
    @param fd: the file being filled (a memfd), at the offset where the
        chunks go; duplicated, so the owner may close or seal its own
        descriptor whenever it likes.
    """

    def __init__(self, hasher: Any, fd: int) -> None:
        self._hasher = hasher
        # One descriptor per thread, each closed by its thread at its end.
        self._fd = os.dup(fd)
        self._read_fd = os.dup(fd)
        self._start = os.lseek(self._fd, 0, os.SEEK_CUR)
        #: Bytes L{put} so far.
        self.queued = 0
        self._written = 0
        self._hashed = 0
        self._queue: SimpleQueue[bytes | memoryview | None] = SimpleQueue()
        self._lock = threading.Lock()
        self._progress = threading.Condition(self._lock)
        self._writing = True
        self._hashing = True
        self._waiter: tuple[int, Callable[[], None]] | None = None
        self._cancelled = False
        self._closed = False
        self._error: BaseException | None = None
        self._threads = (
            threading.Thread(target=self._write, name="kcoral-blob-write", daemon=True),
            threading.Thread(target=self._hash, name="kcoral-blob-hash", daemon=True),
        )
        for thread in self._threads:
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
        """Bytes put that are not yet hashed (written ones included)."""
        return self.queued - self._hashed

    def put(self, chunk: bytes | memoryview) -> None:
        """
        Queue C{chunk} (immutable bytes or a view of them: the write thread
        reads it later) for writing and hashing; never waits.
        """
        if self._closed:
            raise ValueError("blob sink is closed")
        if not chunk:
            return
        self.queued += len(chunk)
        self._queue.put(chunk)

    def notify_at(self, level: int, callback: Callable[[], None]) -> None:
        """
        Call C{callback} once the backlog is C{level} bytes or less: now,
        on this thread, if it already is, else on a sink thread (so it
        must be safe to call from any thread).  A later call replaces an
        earlier one that has not been called yet.
        """
        with self._lock:
            if self.backlog > level and self._hashing:
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
        with self._progress:
            self._progress.notify_all()
        self._release_waiter()

    def close(self) -> None:
        """No more chunks: the threads end once they are through the queue."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        _unclaim()

    def _write(self) -> None:
        queue = self._queue
        try:
            while True:
                chunk = queue.get()
                batch = []
                while chunk is not None:
                    batch.append(chunk)
                    if len(batch) == WRITE_BATCH:
                        break
                    try:
                        chunk = queue.get_nowait()
                    except Empty:
                        break
                if batch and not (self._cancelled or self._error is not None):
                    try:
                        self._append(batch)
                    except BaseException as e:  # raised by finish()
                        self._error = e
                if chunk is None:
                    return
                batch.clear()
        finally:
            os.close(self._fd)
            with self._progress:
                self._writing = False
                self._progress.notify_all()

    def _append(self, batch: list[bytes | memoryview]) -> None:
        views = [memoryview(chunk) for chunk in batch]
        total = sum(len(view) for view in views)
        while views:
            sent = os.writev(self._fd, views)
            while views and sent >= len(views[0]):
                sent -= len(views.pop(0))
            if sent:
                views[0] = views[0][sent:]
        with self._progress:
            self._written += total
            if self._written - self._hashed >= HASH_PIECE:
                self._progress.notify_all()

    def _hash(self) -> None:
        try:
            while True:
                with self._progress:
                    self._progress.wait_for(self._piece_ready)
                    end = min(self._written, self._hashed + HASH_PIECE_MAX)
                    if self._cancelled or self._hashed >= end:
                        return
                self._hash_range(self._start + self._hashed, self._start + end)
                with self._lock:
                    self._hashed = end
                    waiter = self._waiter
                    if waiter is None or self.backlog > waiter[0]:
                        continue
                    self._waiter = None
                waiter[1]()
        except BaseException as e:  # raised by finish()
            self._error = self._error or e
        finally:
            os.close(self._read_fd)
            with self._lock:
                self._hashing = False
            self._release_waiter()

    def _piece_ready(self) -> bool:
        return self._cancelled or not self._writing or self._written - self._hashed >= HASH_PIECE

    def _hash_range(self, start: int, end: int) -> None:
        """Hash bytes C{start} to C{end} of the file through a read-only mapping."""
        offset = start - start % mmap.ALLOCATIONGRANULARITY
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mapped = mmap.mmap(self._read_fd, end - offset, flags, mmap.PROT_READ, offset=offset)
        try:
            with memoryview(mapped) as view, view[start - offset :] as piece:
                self._hasher.update(piece)
        finally:
            mapped.close()

    def _release_waiter(self) -> None:
        with self._lock:
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            waiter[1]()
