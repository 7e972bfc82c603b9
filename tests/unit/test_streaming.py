"""The response body producer (kcoral.server.http.streaming)."""

from __future__ import annotations

from typing import Any

import pytest

from kcoral.ipc import shared
from kcoral.server.http.streaming import BodyProducer, body_length, shared_bytes

pytestmark = pytest.mark.skipif(not shared.available(), reason="no sealed memfds here")


class PullingRequest:
    """A request whose transport pulls from a registered producer."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.producer: Any = None

    def registerProducer(self, producer: Any, streaming: bool) -> None:
        assert not streaming
        self.producer = producer

    def unregisterProducer(self) -> None:
        self.producer = None

    def write(self, data: bytes) -> None:
        assert isinstance(data, bytes)
        self.written.append(data)

    def pull_all(self) -> None:
        while self.producer is not None:
            self.producer.resumeProducing()


def test_streams_bytes_and_buffers_in_slices() -> None:
    big = shared.share(bytes(range(256)) * 40)
    chunks: list[bytes | shared.SharedBuffer] = [b"head", b"", big, b"tail"]
    request = PullingRequest()
    producer = BodyProducer(request, chunks, slice_bytes=4096)
    done = producer.start()
    request.pull_all()
    assert done.called
    assert b"".join(request.written) == b"head" + big.tobytes() + b"tail"
    # The buffer went out a slice at a time.
    assert max(len(piece) for piece in request.written) == 4096
    assert body_length(chunks) == 8 + 10240
    assert shared_bytes(chunks) == 10240


def test_stop_writes_nothing_more() -> None:
    request = PullingRequest()
    producer = BodyProducer(request, [b"a", shared.share(b"b" * 10000)], slice_bytes=100)
    done = producer.start()
    producer.resumeProducing()
    producer.stopProducing()
    assert done.called and request.producer is None
    producer.resumeProducing()
    assert request.written == [b"a"]


def test_a_closed_buffer_fails_the_body() -> None:
    buffer = shared.share(b"x" * 100)
    request = PullingRequest()
    producer = BodyProducer(request, [buffer])
    done = producer.start()
    buffer.close()
    request.pull_all()
    failures: list[Any] = []
    done.addErrback(failures.append)
    assert failures and failures[0].check(ValueError)
