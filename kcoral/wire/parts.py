# -*- test-case-name: tests.unit.test_wire_shared -*-
"""
Binary parts as the protocol sees them: bytes, or a sealed shared buffer
whose descriptor crosses the control channel beside a frame.

The buffers themselves (memfds, seals, descriptor passing) live in
L{kcoral.ipc.shared}, a layer above this one; the wire knows them only
through L{SharedPart}, the few members it reads, so it stays free of
operating-system resources.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol, TypeGuard, Union, runtime_checkable

if TYPE_CHECKING:
    from kcoral.ipc.shared import SharedBuffer

#: Binary parts and blobs smaller than this travel inline in a frame's
#: payload: a descriptor costs a system call or two on each side, more
#: than copying a few KiB.
SHARE_THRESHOLD = 64 * 1024

#: Descriptors one channel message may carry (a frame's parts, at most).
MAX_DESCRIPTORS = 253


@runtime_checkable
class SharedPart(Protocol):
    """
    What the wire reads of a sealed shared buffer
    (L{kcoral.ipc.shared.SharedBuffer}): its size, its descriptor, its bytes.
    """

    size: int

    def __len__(self) -> int: ...

    def fileno(self) -> int: ...

    def close(self) -> None: ...

    def tobytes(self) -> bytes: ...

    def read_chunks(self, chunk: int = ...) -> Iterable[bytes]: ...


#: A binary part: bytes in the frame's payload, or a sealed shared buffer
#: whose descriptor travels beside the frame.
Part = Union[bytes, "SharedBuffer"]


def is_shared(value: object) -> TypeGuard[SharedBuffer]:
    """Whether C{value} is a sealed shared buffer (not bytes)."""
    return not isinstance(value, bytes | bytearray | memoryview) and isinstance(value, SharedPart)
