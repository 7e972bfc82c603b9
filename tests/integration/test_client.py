# -*- test-case-name: tests.integration.test_client -*-
"""
Our blocking L{kcoral.Client} (crochet + treq) against a real CPU server:
repeated and concurrent calls, remote functions, and errors.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import numpy as np
import pytest

# Installed (not running) before any client starts, as in a process that runs
# the global reactor itself: see test_global_reactor_untouched.
from twisted.internet import reactor

from kcoral import Client, KCoralError, Program, RemoteExecutionError, TransportError
from kcoral.testing.live_server import ServerProcess, free_port

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def url(cpu_server: Callable[..., ServerProcess]) -> str:
    return f"http://127.0.0.1:{cpu_server('--sandbox', 'none').port}"


def test_repeated_and_concurrent(url: str) -> None:
    """One client serves many calls, from several threads at once."""
    blob = os.urandom(1 << 20)
    program = Program()
    module = program.upload(kind="module", source="def f(b):\n    return len(b)\n")
    data = program.upload(kind="bytes", value=blob)
    program.return_(
        key="n", value=program.run(fn=program.get_function(module=module, name="f"), args=[data])
    )
    results: list[int] = []
    errors: list[BaseException] = []
    with Client(url) as client:
        assert client.health()["status"] == "ok"
        assert client.execute(program)["n"] == len(blob)

        def work() -> None:
            try:
                for _ in range(3):
                    results.append(client.execute(program, timeout_seconds=60)["n"])
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=work) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert errors == []
    assert results == [len(blob)] * 12


def test_remote_function(url: str) -> None:
    """@client.function() round-trips JSON, bytes and defaults; failures raise."""
    client = Client(url)

    @client.function(timeout=30)
    def describe(x, data=b"", *, scale=2):
        import hashlib

        return {"x": x * scale, "sha": hashlib.sha256(data).hexdigest(), "data": data}

    out = describe.remote(21, data=b"\x00ab")
    assert out["x"] == 42
    assert out["data"] == b"\x00ab"
    assert describe.remote(1)["data"] == b""
    assert describe(1)["x"] == 2  # a plain call runs locally

    @client.function()
    def boom():
        raise ValueError("boom")

    with pytest.raises(RemoteExecutionError) as caught:
        boom.remote()
    assert caught.value.result.error["kind"] == "engine"
    assert "ValueError: boom" in caught.value.result.error["message"]
    client.close()


def test_tensor_upload_unavailable_on_cpu(url: str) -> None:
    """A tensor upload reaches the server and fails with kind unavailable on CPU."""
    program = Program()
    tensor = program.upload(kind="tensor", value=np.ones(4, dtype=np.float32))
    program.return_(key="t", value=tensor)
    result = Client(url).execute(program)
    assert result.status == "FAILED"
    assert result.error["kind"] == "unavailable"


def test_errors(url: str) -> None:
    """A 400 is a KCoralError of kind parse; a closed port is a TransportError."""
    program = Program()
    program.upload(kind="module", source="")
    with pytest.raises(KCoralError) as caught:
        Client(url).execute(program, gpu_count=1)
    assert (caught.value.status_code, caught.value.kind) == (400, "parse")
    with pytest.raises(TransportError):
        Client(f"http://127.0.0.1:{free_port()}").health()


def test_upload_is_streamed(url: str) -> None:
    """
    Sending a 64 MiB blob allocates only a few MiB more: the body is written
    from the program's own bytes, chunk by chunk (tracemalloc sees every
    Python allocation, the reactor thread's included).
    """
    import tracemalloc

    size = 64 << 20
    program = Program()
    module = program.upload(kind="module", source="def f(b):\n    return len(b)\n")
    data = program.upload(kind="bytes", value=os.urandom(size))
    function = program.get_function(module=module, name="f")
    program.return_(key="n", value=program.run(fn=function, args=[data]))
    with Client(url) as client:
        client.health()
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            result = client.execute(program)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert result["n"] == size
    assert peak - base < size // 4


def test_called_from_a_running_event_loop(url: str) -> None:
    """A notebook cell runs inside an asyncio loop; the blocking client still works there."""
    import asyncio

    async def cell() -> str:
        with Client(url) as client:
            return client.health()["status"]

    assert asyncio.run(cell()) == "ok"


def test_download_is_decoded_as_it_arrives(url: str) -> None:
    """
    Receiving a 64 MiB bytes result holds a few copies at most: the response
    is split into parts while it arrives, not after it was collected whole.
    """
    import tracemalloc

    size = 64 << 20
    program = Program()
    module = program.upload(
        kind="module", source=f"import os\ndef f():\n    return os.urandom({size})\n"
    )
    program.return_(key="b", value=program.run(fn=program.get_function(module=module, name="f")))
    with Client(url) as client:
        client.health()
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            result = client.execute(program, output_limit_bytes=0)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert len(result["b"]) == size
    assert peak - base < 4 * size


def test_global_reactor_untouched(url: str) -> None:
    """
    In a process whose global reactor is installed but not running, the
    blocking client runs a reactor of its own: the global one is never
    started, so trial tests and Twisted applications that run it themselves
    can use the client too.
    """
    assert Client(url).health()["status"] == "ok"
    assert not reactor.running
    assert reactor.getDelayedCalls() == []
    running = [t.name for t in threading.enumerate()]
    assert "CrochetReactor" in running


def test_after_the_global_reactor_ran_here(url: str) -> None:
    """
    A thread where the global reactor once ran (C{react()} earlier in a
    script, a trial test before this one) is still marked as Twisted's I/O
    thread after that reactor stopped; the blocking client, on a reactor of
    its own, still waits there instead of failing with crochet's "must not be
    run in the reactor thread".
    """
    from twisted.python import threadable

    client = Client(url)
    assert client.health()["status"] == "ok"  # the client's reactor runs
    saved = threadable.ioThread
    threadable.registerAsIOThread()
    try:
        assert threadable.isInIOThread()
        assert client.health()["status"] == "ok"
    finally:
        threadable.ioThread = saved
