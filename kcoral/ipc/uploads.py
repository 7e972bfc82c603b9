# -*- test-case-name: tests.unit.test_wire_multipart,tests.unit.test_blobsink -*-
"""
Where a request body's blobs go on the server: spool files, sealed shared
buffers and the threads that fill them.

The multipart parser (L{kcoral.wire.multipart.RequestBodyParser}) is pure:
it frames the body and hands each blob part's payload to a
L{kcoral.wire.multipart.BlobWriter} that its C{new_blob} makes.  A
L{BlobStore} makes this room's writers: a blob stays in memory up to a
threshold, then goes to a spool file or (C{shared}) to a memfd that is
sealed into a L{SharedBuffer} once complete, and past L{OFFLOAD_BYTES} a
L{BlobSink}'s threads write and hash it off the reactor.
L{StreamedBody} is a body parsed while it arrives on the reactor, every
blob streaming into shared memory.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from collections.abc import Callable
from typing import IO

import attrs

from kcoral.ipc.blobsink import BlobSink
from kcoral.ipc.shared import SharedWriter
from kcoral.ipc.shared import available as shared_memory_available
from kcoral.wire.multipart import (
    Blob,
    ParsedRequest,
    RequestBodyParser,
    RequestTooLarge,
    boundary_from_content_type,
)
from kcoral.wire.program import ValidationError

#: Blobs of one request body that may land in sealed shared buffers.
MAX_SHARED_BLOBS = 64

#: A blob streaming into shared memory is written and hashed on the
#: reactor up to this size, then by the threads of a L{BlobSink}: for a
#: large upload those two were nearly all of the reactor's work.
OFFLOAD_BYTES = 1 << 20


class SpooledBlob(Blob):
    """A blob spooled to a temporary file, which L{close} deletes."""

    def __init__(self, digest: str, size: int, path: str) -> None:
        super().__init__(digest, size, None)
        self._path: str | None = path

    @property
    def path(self) -> str | None:
        return self._path

    def read(self) -> bytes:
        if self._path is None:
            raise ValueError("blob is closed")
        with open(self._path, "rb") as f:
            return f.read()

    def open(self) -> IO[bytes]:
        if self._path is None:
            raise ValueError("blob is closed")
        return open(self._path, "rb")

    def close(self) -> None:
        path, self._path = self._path, None
        if path is not None:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


class StreamingBlobWriter:
    """
    Hash a streamed payload (the one hash it gets) and keep it in memory up
    to C{threshold} bytes, past that in a sealed shared buffer when
    C{shared} (never on disk: the server's bytes in flight bound it), else
    in a spool file (a L{kcoral.wire.multipart.BlobWriter}).
    """

    def __init__(self, threshold: int, spool_dir: str | None, shared: bool = False) -> None:
        self._hash = hashlib.sha256()
        self._memory: bytearray | None = bytearray()
        self._file: IO[bytes] | None = None
        self._shared: SharedWriter | None = None
        self._path: str | None = None
        self._threshold = threshold
        self._dir = spool_dir
        self._share = shared
        self._offload: BlobSink | None = None
        self.size = 0

    @property
    def offload(self) -> BlobSink | None:
        """The threads writing and hashing this blob, past L{OFFLOAD_BYTES}."""
        return self._offload

    def write(self, data: bytes | memoryview) -> None:
        self.size += len(data)
        if self._offload is not None:
            # The threads read it later: a view of a received chunk as it
            # is (immutable), else a copy (a view of the scanner's buffer,
            # reused once this returns).
            kept = data if isinstance(data, memoryview) and type(data.obj) is bytes else None
            self._offload.put(bytes(data) if kept is None else kept)
            return
        self._hash.update(data)
        if self._memory is not None:
            self._memory += data
            if len(self._memory) <= self._threshold:
                return
            data, self._memory = bytes(self._memory), None
            if self._share:
                self._shared = SharedWriter("kcoral-blob")
            else:
                fd, self._path = tempfile.mkstemp(prefix="kcoral-blob-", dir=self._dir)
                self._file = os.fdopen(fd, "wb")
        if self._shared is not None:
            self._shared.write(data)
            if self.size >= OFFLOAD_BYTES:
                # The hash has seen every byte so far, the memfd holds them.
                self._offload = BlobSink.start(self._hash, self._shared.fileno())
            return
        assert self._file is not None
        self._file.write(data)

    def finish(self) -> Blob:
        offload, self._offload = self._offload, None
        digest = self._hash.hexdigest() if offload is None else offload.finish()
        if self._shared is not None:
            writer, self._shared = self._shared, None
            return Blob(digest, self.size, None, shared=writer.seal())
        if self._file is not None:
            self._file.close()
            self._file = None
            assert self._path is not None
            path, self._path = self._path, None
            return SpooledBlob(digest, self.size, path)
        assert self._memory is not None
        return Blob(digest, self.size, bytes(self._memory))

    def discard(self) -> None:
        offload, self._offload = self._offload, None
        if offload is not None:
            offload.cancel()
        if self._shared is not None:
            self._shared.discard()
            self._shared = None
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._path is not None:
            try:
                os.unlink(self._path)
            except FileNotFoundError:
                pass
            self._path = None
        self._memory = None


@attrs.frozen
class BlobStore:
    """
    Makes the server's blob writers (a L{kcoral.wire.multipart.NewBlob}):
    in memory up to C{threshold} bytes, then spooled into C{spool_dir},
    or with C{shared} streamed into a sealed shared buffer.  A body of many
    blobs gets memfds for its first L{MAX_SHARED_BLOBS} only (each is a
    descriptor of the server's); the rest stay in memory, bounded like
    every body by the bytes in flight.
    """

    threshold: int = 1 << 20
    spool_dir: str | None = None
    shared: bool = False

    def __call__(self, held: int) -> StreamingBlobWriter:
        shared = self.shared and held < MAX_SHARED_BLOBS
        return StreamingBlobWriter(self.threshold, self.spool_dir, shared)


class StreamedBody:
    """
    A request body parsed while it arrives (C{feed} from the HTTP
    request's C{handleContentChunk}): blobs are hashed once and land in
    sealed shared buffers, nothing is spooled.  A parse error is kept, not
    raised, so the rest of the body is read and discarded; L{result}
    raises it.
    """

    def __init__(self, content_type: str | None, max_bytes: int, threshold: int) -> None:
        self.received = 0
        self._error: BaseException | None = None
        self._parser: RequestBodyParser | None = None
        # result() may run on a pool thread (L{settling}) while the reactor
        # aborts the body (its client left): whichever comes second sees
        # what the first did.
        self._closing = threading.Lock()
        self._aborted = False
        try:
            boundary = boundary_from_content_type(content_type)
        except ValidationError as e:
            self._error = e
            return
        self._parser = RequestBodyParser(
            boundary, max_bytes=max_bytes, new_blob=BlobStore(threshold, shared=True)
        )

    @classmethod
    def for_content_type(
        cls, content_type: str | None, max_bytes: int, threshold: int = 64 * 1024
    ) -> StreamedBody | None:
        """A streamed body for a multipart request; C{None} for anything else."""
        if not shared_memory_available() or not (content_type or "").lower().startswith(
            "multipart/form-data"
        ):
            return None
        return cls(content_type, max_bytes, threshold)

    def feed(self, data: bytes) -> None:
        self.received += len(data)
        if self._error is not None or self._parser is None:
            return
        try:
            self._parser.feed(data)
        except (ValidationError, RequestTooLarge, OSError) as e:
            # OSError: no memfd could be made (descriptors or memory are
            # short); the API answers it as the server being busy.
            self._error = e
            self._parser.abort()

    @property
    def settling(self) -> bool:
        """
        Whether L{result} may wait for a large blob's threads to finish its
        last bytes: then it belongs on a pool thread, not the reactor.
        """
        return self._error is None and self._parser is not None and self._parser.settling

    def result(self) -> ParsedRequest:
        """
        The parsed body, once all of it arrived (any thread).

        @raise ValidationError: the body broke a rule of protocol §3.
        @raise RequestTooLarge: it was over the size limit.
        @raise OSError: the server could not hold it (no memfd could be made).
        """
        with self._closing:
            if self._error is not None:
                raise self._error
            assert self._parser is not None
            try:
                parsed = self._parser.close()
            except (ValidationError, RequestTooLarge) as e:
                self._error = e
                raise
            if self._aborted:
                parsed.close()
                self._error = ValidationError("parser aborted")
                raise self._error
            return parsed

    def abort(self) -> None:
        """
        Drop whatever was parsed (the request ended without it).  Never
        waits: while L{result} runs on another thread, it drops its result.
        """
        self._aborted = True
        if self._parser is not None and self._closing.acquire(blocking=False):
            try:
                self._parser.abort()
            finally:
                self._closing.release()

    def backlog(self) -> int:
        """
        Bytes fed that are not yet in their blob's memfd and hash: the
        reader stops reading past a high-water mark (L{when_drained}).
        """
        if self._error is not None or self._parser is None:
            return 0
        return self._parser.backlog()

    def when_drained(self, level: int, callback: Callable[[], None]) -> None:
        """
        Call C{callback}, from any thread, once L{backlog} is C{level} bytes
        or less (at once if it already is, or if the body failed).
        """
        if self._error is not None or self._parser is None:
            callback()
        else:
            self._parser.when_drained(level, callback)
