"""
Tests for L{kcoral.wire.channel}: the framing of parent/worker messages.
"""

from __future__ import annotations

import io
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kcoral.wire.channel import (
    ChannelError,
    Message,
    MessageDecoder,
    encode_message,
    read_message,
    write_message,
)


def test_round_trip_through_stream() -> None:
    """A header and a binary payload come back as sent; EOF between frames is None."""
    stream = io.BytesIO()
    write_message(stream, {"type": "blob", "digest": "ab"}, b"\x00\x01\xff")
    write_message(stream, {"type": "execute", "program": "ünïcode"})
    stream.seek(0)
    assert read_message(stream) == Message({"type": "blob", "digest": "ab"}, b"\x00\x01\xff")
    assert read_message(stream) == Message({"type": "execute", "program": "ünïcode"})
    assert read_message(stream) is None


def test_large_payload_written_without_copy_matches_encoding() -> None:
    """A large payload is written in two pieces but frames identically."""
    payload = bytes(range(256)) * 1024
    stream = io.BytesIO()
    write_message(stream, {"type": "outcome"}, payload)
    assert stream.getvalue() == encode_message({"type": "outcome"}, payload)


@given(st.binary(max_size=2048), st.integers(min_value=1, max_value=97))
def test_decoder_any_chunking(payload: bytes, chunk: int) -> None:
    """The incremental decoder yields the same messages however bytes arrive."""
    data = encode_message({"type": "a", "n": 1}, payload) + encode_message({"type": "b"})
    decoder = MessageDecoder()
    messages = []
    for i in range(0, len(data), chunk):
        messages += decoder.feed(data[i : i + chunk])
    assert messages == [Message({"type": "a", "n": 1}, payload), Message({"type": "b"})]
    assert decoder.pending == 0


def test_truncated_frame_is_an_error() -> None:
    """A stream that ends inside a frame is reported, not mistaken for EOF."""
    data = encode_message({"type": "x"}, b"12345")[:-2]
    with pytest.raises(ChannelError):
        read_message(io.BytesIO(data))


@pytest.mark.parametrize(
    "header",
    [b"not json", b"[1, 2]", b"\xff\xfe"],
)
def test_malformed_header_is_an_error(header: bytes) -> None:
    """Headers must be UTF-8 JSON objects."""
    frame = struct.pack(">IQ", len(header), 0) + header
    with pytest.raises(ChannelError):
        MessageDecoder().feed(frame)


def test_oversized_header_is_refused_before_buffering() -> None:
    """A peer cannot make the parent buffer a huge header."""
    with pytest.raises(ChannelError):
        MessageDecoder().feed(struct.pack(">IQ", 1 << 31, 0))
