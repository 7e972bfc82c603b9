# -*- test-case-name: tests.unit.test_wire_channel -*-
"""
Framing of the control channel between the reactor process and a worker.

Each message is a JSON object (the header) and an optional binary payload, so
blob bytes and returned tensors cross the pipe without base64.  A frame is::

    >I header length | >Q payload length | header (UTF-8 JSON) | payload

The parent feeds received bytes to a L{MessageDecoder}; the worker, which has
no reactor, uses the blocking L{read_message} and L{write_message}.
"""

from __future__ import annotations

import json
import struct
from typing import IO, Any

import attrs

_PREFIX = struct.Struct(">IQ")

#: Largest header accepted; headers carry JSON metadata, never bulk data.
MAX_HEADER_BYTES = 64 * 1024 * 1024

#: Largest payload accepted (a little above the largest request or response).
MAX_PAYLOAD_BYTES = 1 << 40


class ChannelError(Exception):
    """The peer sent bytes that are not a valid frame."""


@attrs.frozen
class Message:
    """One decoded frame."""

    header: dict[str, Any]
    payload: bytes = b""

    @property
    def type(self) -> str:
        return str(self.header.get("type", ""))


def encode_message(header: dict[str, Any], payload: bytes = b"") -> bytes:
    """Frame C{header} and C{payload} into one byte string."""
    return _prefix_and_header(header, len(payload)) + bytes(payload)


def _decode_header(raw: bytes) -> dict[str, Any]:
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ChannelError(f"malformed message header: {e}") from None
    if not isinstance(header, dict):
        raise ChannelError("message header must be a JSON object")
    return header


def _check_sizes(header_length: int, payload_length: int) -> None:
    if header_length > MAX_HEADER_BYTES:
        raise ChannelError(f"message header of {header_length} bytes is too large")
    if payload_length > MAX_PAYLOAD_BYTES:
        raise ChannelError(f"message payload of {payload_length} bytes is too large")


@attrs.define
class MessageDecoder:
    """
    Incremental decoder: C{feed} bytes as they arrive, get whole messages.

    Buffers at most one partial frame.
    """

    _buffer: bytearray = attrs.field(factory=bytearray)

    def feed(self, data: bytes) -> list[Message]:
        """Add C{data} and return every message it completes."""
        self._buffer += data
        messages = []
        while len(self._buffer) >= _PREFIX.size:
            header_length, payload_length = _PREFIX.unpack_from(self._buffer)
            _check_sizes(header_length, payload_length)
            end = _PREFIX.size + header_length + payload_length
            if len(self._buffer) < end:
                break
            header_end = _PREFIX.size + header_length
            header = _decode_header(bytes(self._buffer[_PREFIX.size : header_end]))
            payload = bytes(self._buffer[header_end:end])
            del self._buffer[:end]
            messages.append(Message(header, payload))
        return messages

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame still buffered."""
        return len(self._buffer)


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


def read_message(stream: IO[bytes]) -> Message | None:
    """
    Blocking read of one message; C{None} at a clean end of stream.

    @raise ChannelError: on a truncated or malformed frame.
    """
    prefix = _read_exactly(stream, _PREFIX.size)
    if prefix is None:
        return None
    header_length, payload_length = _PREFIX.unpack(prefix)
    _check_sizes(header_length, payload_length)
    raw_header = _read_exactly(stream, header_length)
    payload = _read_exactly(stream, payload_length) if payload_length else b""
    if raw_header is None or payload is None:
        raise ChannelError("stream ended inside a message")
    return Message(_decode_header(raw_header), payload)


def write_message(stream: IO[bytes], header: dict[str, Any], payload: bytes = b"") -> None:
    """Blocking write of one message, flushed; a large payload is not copied."""
    if len(payload) < 1 << 16:
        stream.write(encode_message(header, payload))
    else:
        stream.write(_prefix_and_header(header, len(payload)))
        stream.write(payload)
    stream.flush()


def _prefix_and_header(header: dict[str, Any], payload_length: int) -> bytes:
    encoded = json.dumps(header, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode(
        "utf-8"
    )
    return _PREFIX.pack(len(encoded), payload_length) + encoded
