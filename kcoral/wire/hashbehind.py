# -*- test-case-name: tests.unit.test_hashbehind -*-
"""
SHA-256 of a shared buffer while it is being written, on a thread.

A large blob streams into a memfd on the reactor thread.  Hashing it there
too used to be half of that thread's work for a large upload: SHA-256 runs
at about 1.2 GB/s on one core of the H200's host, slower than the socket,
the multipart scan and the memfd writes together.  L{HashBehind} takes over
a hash object part way through and follows the writer: it reads back what
was written, through a descriptor of its own, and hashes it on another
thread.  C{hashlib} and C{os.pread} let go of the GIL for buffers this
size, so the reactor keeps receiving meanwhile.  L{HashBehind.hexdigest}
waits only for the bytes the thread has not reached yet: about what
arrived in the last milliseconds.
"""

from __future__ import annotations

import os
import threading
from typing import Any

__all__ = ["HashBehind", "READ_BYTES"]

#: How much the thread reads and hashes at a time.
READ_BYTES = 4 << 20


class HashBehind:
    """
    Continue C{hasher} over C{fd}'s bytes from C{offset}, as L{advance}
    says they were written.

    @param hasher: a C{hashlib} object that has seen the first C{offset}
        bytes; from now on only the thread updates it.
    @param fd: the file being written (a memfd); duplicated, so the writer
        may close or seal its own descriptor whenever it likes.
    """

    def __init__(self, hasher: Any, fd: int, offset: int) -> None:
        self._hasher = hasher
        self._fd = os.dup(fd)
        self._hashed = offset
        self._written = offset
        self._closing = False
        self._cancelled = False
        self._error: BaseException | None = None
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="kcoral-hash-behind", daemon=True)
        self._thread.start()

    def advance(self, written: int) -> None:
        """The file now holds C{written} bytes."""
        with self._changed:
            self._written = written
            self._changed.notify()

    def hexdigest(self) -> str:
        """Wait for the thread to hash what was written; the hex digest of it all."""
        with self._changed:
            self._closing = True
            self._changed.notify()
        self._thread.join()
        if self._error is not None:
            raise self._error
        return str(self._hasher.hexdigest())

    def cancel(self) -> None:
        """Stop without a digest (the blob is dropped); does not wait."""
        with self._changed:
            self._cancelled = True
            self._changed.notify()

    def _run(self) -> None:
        try:
            while True:
                with self._changed:
                    while not (self._cancelled or self._closing or self._hashed < self._written):
                        self._changed.wait()
                    if self._cancelled or self._hashed >= self._written:
                        return
                    end = self._written
                while self._hashed < end:
                    data = os.pread(self._fd, min(end - self._hashed, READ_BYTES), self._hashed)
                    if not data:
                        raise OSError("the blob's buffer ended before what was written")
                    self._hasher.update(data)
                    self._hashed += len(data)
        except BaseException as e:  # reported by hexdigest()
            self._error = e
        finally:
            os.close(self._fd)
