# -*- test-case-name: tests.reliability.test_client_response_cap -*-
"""
A hostile server against the client (issue 32, low: "the client has no cap
on response size"): a tiny Twisted server on 127.0.0.1 that declares a
2 GiB body, or streams a chunked body without end.  The client refuses both
with L{ResponseTooLarge}, drops the connection instead of draining it, and
holds a bounded amount of memory meanwhile.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
import tracemalloc
from collections.abc import Iterator

import pytest

from kcoral import Client, Program, ResponseTooLarge
from kcoral.client.async_client import DEFAULT_MAX_RESPONSE_BYTES
from kcoral.testing.live_server import free_port

pytestmark = [pytest.mark.integration]

#: The hostile server: C{/declared/...} declares 2 GiB of JSON and sends 1 MiB
#: a tick; C{/endless/...} sends chunked JSON forever.  It prints how many
#: bytes it had written when a client went away.
HOSTILE = textwrap.dedent(
    """
    import sys
    from twisted.internet import reactor
    from twisted.internet.interfaces import IPullProducer
    from twisted.web.resource import Resource
    from twisted.web.server import NOT_DONE_YET, Site
    from zope.interface import implementer

    CHUNK = b"0" * (1 << 20)

    @implementer(IPullProducer)
    class Flood:
        # One MiB each time the connection drains: only as fast as the client reads.
        def __init__(self, request):
            self.request = request
            self.sent = 0

        def resumeProducing(self):
            self.request.write(CHUNK)
            self.sent += len(CHUNK)

        def stopProducing(self):
            pass

    class Hostile(Resource):
        isLeaf = True

        def render(self, request):
            mode = request.postpath[0].decode() if request.postpath else ""
            request.setHeader(b"content-type", b"application/json")
            if mode == "declared":
                request.setHeader(b"content-length", str(2 << 30).encode())
            flood = Flood(request)
            request.registerProducer(flood, False)

            def gone(reason):
                print(f"gone {mode} {flood.sent}", flush=True)

            request.notifyFinish().addErrback(gone)
            return NOT_DONE_YET

    reactor.listenTCP(int(sys.argv[1]), Site(Hostile()), interface="127.0.0.1")
    print("ready", flush=True)
    reactor.run()
    """
)


@pytest.fixture(scope="module")
def hostile() -> Iterator[tuple[str, subprocess.Popen[str]]]:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", HOSTILE, str(port)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        assert server.stdout.readline().strip() == "ready"
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.kill()
        server.wait()


def _gone(server: subprocess.Popen[str]) -> tuple[str, int]:
    """The server's next report of a client that left: its mode and bytes sent."""
    assert server.stdout is not None
    _, mode, sent = server.stdout.readline().split()
    return mode, int(sent)


def _program() -> Program:
    p = Program()
    m = p.upload(kind="module", source="def f():\n    return 1\n")
    p.return_(key="r", value=p.run(fn=p.get_function(module=m, name="f")))
    return p


def test_declared_length_refused_at_once(hostile: tuple[str, subprocess.Popen[str]]) -> None:
    """
    A body that declares more than the default cap (1 GiB) is refused at
    its first bytes, and the connection dropped.
    """
    url, server = hostile
    with pytest.raises(ResponseTooLarge) as caught:
        Client(f"{url}/declared").health()
    error = caught.value
    assert error.limit == DEFAULT_MAX_RESPONSE_BYTES
    assert error.declared == 2 << 30
    assert error.received < 4 << 20
    assert "max_response_bytes" in str(error)
    mode, sent = _gone(server)
    assert mode == "declared"
    assert sent < 32 << 20


def test_endless_body_dropped_at_the_cap(hostile: tuple[str, subprocess.Popen[str]]) -> None:
    """
    A chunked body that never ends is dropped when it passes the cap: the
    execution fails with L{ResponseTooLarge} and the client's memory stays
    within a small multiple of the cap.
    """
    url, server = hostile
    cap = 16 << 20
    started = time.monotonic()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        with pytest.raises(ResponseTooLarge) as caught:
            Client(f"{url}/endless", max_response_bytes=cap).execute(_program())
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    error = caught.value
    assert (error.limit, error.declared) == (cap, None)
    assert cap < error.received <= cap + (1 << 20)
    assert peak < 3 * cap
    mode, sent = _gone(server)
    assert mode == "endless"
    # It stopped reading: past the cap, only what the sockets buffer left the server.
    assert sent < cap + (32 << 20)
    print(
        f"endless body: dropped after {error.received} bytes, client peak "
        f"{peak / (1 << 20):.1f} MiB for a {cap >> 20} MiB cap, "
        f"{time.monotonic() - started:.2f} s"
    )


def test_cap_must_be_positive() -> None:
    """A cap that is not a positive integer (or None) is refused when the client is made."""
    for bad in (0, -1, 1.5, True, "1"):
        with pytest.raises(ValueError):
            Client("http://127.0.0.1:1", max_response_bytes=bad)  # type: ignore[arg-type]
    Client("http://127.0.0.1:1", max_response_bytes=None)
