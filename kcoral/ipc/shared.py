# -*- test-case-name: tests.unit.test_wire_shared -*-
"""
Sealed shared-memory buffers: how a tensor's bytes cross the parent/worker
boundary once.

A L{SharedBuffer} is a Linux C{memfd} sealed against writes, shrinking and
growing (C{F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL}) once it
is filled.  Its descriptor travels on the control channel's descriptor
socket (L{kcoral.wire.channel.DESCRIPTOR_FD}), so the receiver reads the very
pages the sender wrote: the parent fills one with a request body's blob as
it streams in and keeps it in the memory cache; a worker maps it read-only
and copies it to the device from there; a worker fills one with a large
returned tensor and the parent streams the response from it.

The seals are what make sharing safe with a hostile peer: no descriptor of a
sealed memfd (the sender's own included) can write to it, shrink it (so a
mapping never faults past its end) or grow it, and the seals cannot be
removed.  L{adopt} refuses a received descriptor that is not a memfd with
those seals and exactly the declared size.
"""

from __future__ import annotations

import array
import contextlib
import errno
import hashlib
import mmap
import os
import socket
import stat
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kcoral.wire.parts import MAX_DESCRIPTORS, SHARE_THRESHOLD

__all__ = [
    "MAX_DESCRIPTORS",
    "PARALLEL_HASH_BYTES",
    "PARTS",
    "READ_CHUNK",
    "SEALS",
    "SHARE_THRESHOLD",
    "PartSharing",
    "SharedBuffer",
    "SharedMemoryError",
    "SharedWriter",
    "adopt",
    "available",
    "drain_descriptors",
    "fill",
    "receive_descriptors",
    "send_descriptors",
    "share",
    "socket_pair",
]

fcntl: Any
try:
    import fcntl
except ImportError:  # not POSIX: the client still imports the wire package
    fcntl = None

#: The seals every shared buffer carries before its descriptor is sent
#: (Linux's values where the platform has none: nothing is shared there).
REQUIRED_SEALS: int = (
    getattr(fcntl, "F_SEAL_WRITE", 8)
    | getattr(fcntl, "F_SEAL_SHRINK", 2)
    | getattr(fcntl, "F_SEAL_GROW", 4)
)
SEALS: int = REQUIRED_SEALS | getattr(fcntl, "F_SEAL_SEAL", 1)

#: Bytes read from a buffer per L{SharedBuffer.read_chunks} step.
READ_CHUNK = 1 << 20


class SharedMemoryError(Exception):
    """A received descriptor is not a sealed buffer of the declared size."""


def available() -> bool:
    """Whether this platform has sealed memfds (Linux)."""
    return hasattr(os, "memfd_create") and fcntl is not None and hasattr(fcntl, "F_ADD_SEALS")


class SharedBuffer:
    """
    An immutable byte buffer in a sealed memfd, owned through one descriptor.

    The descriptor is closed by L{close} or when the last reference goes,
    so a buffer shared by the memory cache and running requests lives as
    long as any of them holds it.  Reading never maps it: L{pread} copies a
    slice, so a parent streaming a 200 MB result keeps about one chunk of
    it at a time.
    """

    __slots__ = ("size", "_fd", "_finalizer", "__weakref__")

    def __init__(self, fd: int, size: int) -> None:
        self.size = size
        self._fd = fd
        self._finalizer = weakref.finalize(self, _close_quietly, fd)

    def __len__(self) -> int:
        return self.size

    def __repr__(self) -> str:
        return f"<SharedBuffer fd={self._fd} size={self.size}>"

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def fileno(self) -> int:
        if self.closed:
            raise ValueError("shared buffer is closed")
        return self._fd

    def close(self) -> None:
        """Close the descriptor now (idempotent)."""
        self._finalizer()

    def pread(self, offset: int, length: int) -> bytes:
        """Up to C{length} bytes from C{offset}."""
        return os.pread(self.fileno(), min(length, max(0, self.size - offset)), offset)

    def read_chunks(self, chunk: int = READ_CHUNK) -> Iterable[bytes]:
        """Every byte, in chunks of C{chunk} bytes."""
        offset = 0
        while offset < self.size:
            data = self.pread(offset, chunk)
            if not data:
                raise SharedMemoryError("shared buffer ended early")
            offset += len(data)
            yield data

    def tobytes(self) -> bytes:
        """A private copy of every byte (one C{pread}: no mapping, one copy)."""
        data = self.pread(0, self.size)
        if len(data) < self.size:  # a short read (none is expected from a memfd)
            data = b"".join([data, *self._rest(len(data))])
        return data

    def _rest(self, offset: int) -> Iterable[bytes]:
        while offset < self.size:
            data = self.pread(offset, READ_CHUNK)
            if not data:
                raise SharedMemoryError("shared buffer ended early")
            offset += len(data)
            yield data

    def map(self) -> memoryview:
        """
        A read-only view of the pages themselves (no copy): C{mmap} with
        C{PROT_READ}; the seals keep it from shrinking under the mapping.
        """
        if not self.size:
            return memoryview(b"")
        # Populated up front: the copy from it (to a device) then takes no
        # page fault per 4 KiB.
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mapped = mmap.mmap(self.fileno(), self.size, flags, mmap.PROT_READ)
        return memoryview(mapped)

    def path(self) -> str:
        """A path that opens the buffer (for APIs that take a file name)."""
        return f"/proc/self/fd/{self.fileno()}"


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


class SharedWriter:
    """
    Fill a new memfd by appending, then L{seal} it into a L{SharedBuffer}.

    The writer never maps the memfd: a writable shared mapping would make
    C{F_SEAL_WRITE} fail.
    """

    def __init__(self, name: str = "kcoral") -> None:
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        self._fd: int | None = fd
        # A writer dropped unfinished (a request that went away) frees its memfd.
        self._finalizer = weakref.finalize(self, _close_quietly, fd)
        self.size = 0

    def fileno(self) -> int:
        """The memfd being written (for reading back what was written)."""
        if self._fd is None:
            raise ValueError("shared writer is finished")
        return self._fd

    def write(self, data: bytes | bytearray | memoryview) -> None:
        fd = self._fd
        if fd is None:
            raise ValueError("shared writer is finished")
        view = memoryview(data).cast("B")
        while view:
            written = os.write(fd, view)
            self.size += written
            view = view[written:]

    def seal(self) -> SharedBuffer:
        """Seal what was written; the writer is finished."""
        fd, self._fd = self._fd, None
        if fd is None:
            raise ValueError("shared writer is finished")
        self._finalizer.detach()
        try:
            # What is in the file, whoever wrote it (a blob's bytes past its
            # first megabytes are appended through a duplicate descriptor).
            self.size = os.fstat(fd).st_size
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        except BaseException:
            os.close(fd)
            raise
        return SharedBuffer(fd, self.size)

    def discard(self) -> None:
        """Free the memfd without sealing it (idempotent)."""
        self._fd = None
        self._finalizer()


def share(data: bytes | bytearray | memoryview, name: str = "kcoral") -> SharedBuffer:
    """C{data} copied once into a new sealed buffer."""
    writer = SharedWriter(name)
    try:
        writer.write(data)
    except BaseException:
        writer.discard()
        raise
    return writer.seal()


#: Parts at least this large are hashed in a thread beside their copy.
PARALLEL_HASH_BYTES = 4 << 20


class PartSharing:
    """
    How a worker's returned parts become sealed buffers
    (L{kcoral.wire.values.PartSharer}): copied once, and hashed, in a
    thread beside the copy when large (hashlib and the memfd write both
    release the GIL).
    """

    def share(self, view: memoryview) -> tuple[SharedBuffer, str]:
        """C{view} copied into a new sealed buffer, and its SHA-256."""
        hasher = hashlib.sha256()
        if view.nbytes < PARALLEL_HASH_BYTES:
            hasher.update(view)
            return share(view), hasher.hexdigest()
        thread = threading.Thread(target=hasher.update, args=(view,), name="kcoral-hash")
        thread.start()
        try:
            buffer = share(view)
        finally:
            thread.join()
        return buffer, hasher.hexdigest()

    def digest(self, buffer: SharedBuffer) -> str:
        """The SHA-256 of a sealed buffer's bytes, read through a mapping of it."""
        view = buffer.map()
        try:
            return hashlib.sha256(view).hexdigest()
        finally:
            _unmap(view)


#: The one L{PartSharing} (it holds no state).
PARTS = PartSharing()


def _unmap(view: memoryview) -> None:
    """Close a L{SharedBuffer.map} view's mapping now, not when it is collected."""
    mapped = view.obj
    view.release()
    if hasattr(mapped, "close"):
        mapped.close()


def fill(size: int, write: Callable[[memoryview], None], name: str = "kcoral") -> SharedBuffer:
    """
    A new sealed buffer of C{size} bytes that C{write} fills in place through
    a writable mapping: a GPU worker's device-to-host copy of a returned
    tensor lands in it directly (page-locked for the copy), where a host
    array and then a copy of it into a buffer would be two passes.

    C{write} must keep no reference to the view: the mapping is closed
    before the buffer is sealed (a writable shared mapping would make
    C{F_SEAL_WRITE} fail).  Nothing is hashed here: a worker fills buffers
    under its GPU lease and hashes them after it gave the lease back.
    """
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        if size:
            os.ftruncate(fd, size)
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mapped = mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
            try:
                with memoryview(mapped) as view:
                    write(view)
            except BaseException:
                # The error's traceback may still hold a view of the
                # mapping: it is unmapped when that is collected.
                with contextlib.suppress(BufferError):
                    mapped.close()
                raise
            mapped.close()
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return SharedBuffer(fd, size)


def adopt(fd: int, size: int) -> SharedBuffer:
    """
    Take ownership of a received descriptor as a buffer of C{size} bytes.

    @raise SharedMemoryError: (the descriptor closed) it is not a regular
        memfd, lacks a required seal, or is not exactly C{size} bytes.
    """
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise SharedMemoryError("descriptor is not a sealed memory buffer")
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError as e:
            raise SharedMemoryError(
                f"descriptor is not a sealed memory buffer ({errno.errorcode.get(e.errno or 0, e.errno)})"
            ) from None
        if seals & REQUIRED_SEALS != REQUIRED_SEALS:
            raise SharedMemoryError("shared buffer is not sealed against writes")
        if info.st_size != size:
            raise SharedMemoryError(
                f"shared buffer holds {info.st_size} bytes, its message declares {size}"
            )
    except BaseException:
        _close_quietly(fd)
        raise
    return SharedBuffer(fd, size)


# ---------------------------------------------------------------------------
# Passing descriptors (SCM_RIGHTS on a SOCK_SEQPACKET socket)


def socket_pair() -> tuple[socket.socket, socket.socket]:
    """
    A connected pair for descriptors: C{SOCK_SEQPACKET}, so each send is one
    message and descriptors of two messages never merge.
    """
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)


def send_descriptors(sock: socket.socket, fds: Sequence[int]) -> None:
    """Send C{fds} as one message (one byte of data carries them)."""
    if fds:
        sock.sendmsg([b"F"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])


def receive_descriptors(sock: socket.socket, count: int) -> list[int]:
    """
    The next message's descriptors, exactly C{count} of them (close-on-exec).

    On a non-blocking socket a missing message is an error, not a wait: the
    sender sends its descriptors before the frame that names them.

    @raise SharedMemoryError: no message, a message with other than
        C{count} descriptors (every one received is closed; the kernel
        closes those past the buffer), or anything but descriptors.
    """
    if count <= 0:
        return []
    if count > MAX_DESCRIPTORS:
        raise SharedMemoryError(f"{count} descriptors in one message is over {MAX_DESCRIPTORS}")
    space = socket.CMSG_SPACE(count * array.array("i").itemsize)
    try:
        data, ancillary, flags, _ = sock.recvmsg(1, space, socket.MSG_CMSG_CLOEXEC)
    except (BlockingIOError, InterruptedError):
        raise SharedMemoryError("a message names descriptors that were not sent") from None
    except OSError as e:
        raise SharedMemoryError(f"descriptor socket failed: {e}") from None
    fds: list[int] = []
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            received = array.array("i")
            received.frombytes(payload[: len(payload) - len(payload) % received.itemsize])
            fds.extend(received)
    truncated = flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC)
    if len(fds) != count or truncated or data != b"F":
        for fd in fds:
            _close_quietly(fd)
        if not data and not fds:
            raise SharedMemoryError("the descriptor socket was closed")
        raise SharedMemoryError(f"expected {count} descriptors, received {len(fds)}")
    return fds


def drain_descriptors(sock: socket.socket) -> int:
    """
    Read and close whatever is queued on non-blocking C{sock}; return how
    many messages there were (any is a peer that sent what no frame named).
    """
    messages = 0
    space = socket.CMSG_SPACE(MAX_DESCRIPTORS * array.array("i").itemsize)
    while True:
        try:
            data, ancillary, _, _ = sock.recvmsg(1, space, socket.MSG_CMSG_CLOEXEC)
        except (BlockingIOError, InterruptedError):
            return messages
        except OSError:
            return messages
        if not data and not ancillary:
            return messages
        messages += 1
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                received = array.array("i")
                received.frombytes(payload[: len(payload) - len(payload) % received.itemsize])
                for fd in received:
                    _close_quietly(fd)
