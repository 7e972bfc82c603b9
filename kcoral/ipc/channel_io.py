# -*- test-case-name: tests.unit.test_wire_channel,tests.unit.test_wire_shared -*-
"""
Blocking reads and writes of the control channel (L{kcoral.wire.channel}),
and the passing of its shared buffers' descriptors.

The worker has no reactor: it reads the parent's messages with
L{read_message} and writes its own with L{write_message}, each message's
sealed buffers crossing the descriptor socket
(L{kcoral.wire.channel.DESCRIPTOR_FD}) just before the frame that names
them.  The parent reads through the reactor (a
L{kcoral.wire.channel.FrameDecoder}) and takes the descriptors with
L{take_shared}.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from typing import IO, Any

from kcoral.ipc.shared import (
    SharedBuffer,
    SharedMemoryError,
    adopt,
    receive_descriptors,
    send_descriptors,
)
from kcoral.wire.channel import (
    DEFAULT_LIMITS,
    PREFIX,
    ChannelError,
    ChannelMessage,
    Frame,
    FrameLimits,
    decode,
    decode_header,
    encode_frame,
    prefix_and_header,
    prepare,
)


def _read_exactly(stream: IO[bytes], count: int) -> bytes | None:
    chunks = []
    remaining = count
    while remaining:
        chunk = stream.read(remaining)
        if not chunk:
            return None
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def read_frame(stream: IO[bytes], limits: FrameLimits = DEFAULT_LIMITS) -> Frame | None:
    """
    Blocking read of one frame; C{None} at a clean end of stream.

    @raise ChannelError: on a truncated or malformed frame.
    """
    prefix = _read_exactly(stream, PREFIX.size)
    if prefix is None:
        return None
    header_length, payload_length = PREFIX.unpack(prefix)
    limits.check(header_length, payload_length)
    raw_header = _read_exactly(stream, header_length)
    if raw_header is None:
        raise ChannelError("stream ended inside a message")
    header = decode_header(raw_header)
    limits.check_type(str(header.get("type", "")), header_length, payload_length)
    payload = _read_exactly(stream, payload_length) if payload_length else b""
    if payload is None:
        raise ChannelError("stream ended inside a message")
    return Frame(header, payload)


def write_frame(stream: IO[bytes], header: dict[str, Any], payload: bytes = b"") -> None:
    """Blocking write of one frame, flushed; a large payload is not copied."""
    if len(payload) < 1 << 16:
        stream.write(encode_frame(header, payload))
    else:
        stream.write(prefix_and_header(header, len(payload)))
        stream.write(payload)
    stream.flush()


def take_shared(sock: socket.socket | None, sizes: Sequence[int]) -> list[SharedBuffer]:
    """
    The next message's shared buffers from the descriptor socket C{sock},
    one of each of C{sizes}, each checked (L{adopt}: a sealed memfd of
    exactly its declared size); a L{kcoral.wire.channel.TakeShared}.

    @raise ChannelError: no socket, descriptors missing or of another
        count, or one that is not a sealed buffer of its size (every
        descriptor received is closed).
    """
    try:
        if sock is None:
            raise SharedMemoryError("this worker has no descriptor socket")
        fds = receive_descriptors(sock, len(sizes))
    except SharedMemoryError as e:
        raise ChannelError(str(e)) from None
    shared: list[SharedBuffer] = []
    try:
        for index, (fd, size) in enumerate(zip(fds, sizes, strict=True)):
            try:
                shared.append(adopt(fd, size))
            except SharedMemoryError:
                for rest in fds[index + 1 :]:
                    os.close(rest)
                raise
    except SharedMemoryError as e:
        for buffer in shared:
            buffer.close()
        raise ChannelError(str(e)) from None
    return shared


def send_shared(sock: socket.socket | None, message: ChannelMessage) -> None:
    """
    Send the descriptors of C{message}'s shared buffers on C{sock}, before
    its frame (nothing when it has none).

    @raise ValueError: it has shared buffers and there is no socket.
    @raise OSError: the socket is full or closed.
    """
    shared = message.descriptors()
    if shared:
        if sock is None:
            raise ValueError(f"a {message.TYPE!r} message with shared buffers needs a socket")
        send_descriptors(sock, [buffer.fileno() for buffer in shared])


def read_message(
    stream: IO[bytes], limits: FrameLimits = DEFAULT_LIMITS, descriptors: Any = None
) -> ChannelMessage | None:
    """
    Blocking read of one message; C{None} at a clean end of stream.  Its
    shared buffers come from the socket C{descriptors} (blocking).

    @raise ChannelError: on a truncated, malformed or invalid frame.
    """
    frame = read_frame(stream, limits)
    if frame is None:
        return None
    if descriptors is None:
        return decode(frame, None, limits.max_payload_bytes)
    return decode(frame, lambda sizes: take_shared(descriptors, sizes), limits.max_payload_bytes)


def write_message(stream: IO[bytes], message: ChannelMessage, descriptors: Any = None) -> None:
    """
    Blocking write of one message, flushed; a large payload is not copied.
    Its shared buffers' descriptors go first, on the socket C{descriptors}.
    """
    message, head, payload = prepare(message)
    send_shared(descriptors, message)
    stream.write(head)
    if payload:
        stream.write(payload)
    stream.flush()
