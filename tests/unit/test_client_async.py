# -*- test-case-name: tests.unit.test_client_async -*-
"""
Tests for L{kcoral.client.async_client} and L{kcoral.client.body}: the
treq client against an in-memory server (treq's testing tools).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
from twisted.internet.task import Clock, Cooperator
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyObject

from kcoral.client.async_client import AsyncClient, Attempt, IProgress, NoProgress
from kcoral.client.body import MultipartProducer, Part, encode_body
from kcoral.client.errors import KCoralError, ProtocolError, TransportError
from kcoral.client.files import ReturnedFile
from kcoral.client.program import Program
from kcoral.testing.fakes import FakeServer, cache_miss, completed, json_reply, result_reply
from kcoral.wire.multipart import parse_request_body


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def blob_program(*blobs: bytes) -> Program:
    program = Program()
    module = program.upload(kind="module", source="def f(*a):\n    return len(a)\n", id="m")
    function = program.get_function(module=module, name="f", id="f")
    registers = [program.upload(kind="bytes", value=blob) for blob in blobs]
    program.return_(key="r", value=program.run(fn=function, args=registers, id="run"))
    return program


class ProducerTests(SynchronousTestCase):
    """L{MultipartProducer} streams the 0.1.1 framing with back-pressure."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.cooperator = Cooperator(scheduler=lambda work: self.clock.callLater(0, work))
        self.parts = [
            Part("program", "application/json", b'{"instructions":[]}'),
            Part(f"blob:{_sha(b'x' * 10)}", "application/octet-stream", b"x" * 10),
        ]

    def test_interface_and_length(self) -> None:
        """It provides IBodyProducer and knows its exact length up front."""
        from twisted.web.iweb import IBodyProducer

        producer = MultipartProducer(self.parts, cooperator=self.cooperator, boundary="b" * 32)
        verifyObject(IBodyProducer, producer)
        self.assertEqual(producer.length, len(encode_body(self.parts, "b" * 32)))
        self.assertEqual(producer.content_type, "multipart/form-data; boundary=" + "b" * 32)

    def test_streams_in_chunks_and_pauses(self) -> None:
        """Payloads go out in chunks; a paused producer writes nothing more."""
        progress: list[tuple[int, int]] = []
        producer = MultipartProducer(
            self.parts,
            cooperator=self.cooperator,
            chunk_size=3,
            on_progress=lambda sent, total: progress.append((sent, total)),
        )
        consumer = StringTransport()
        done = producer.startProducing(consumer)
        producer.pauseProducing()
        self.clock.advance(0)
        self.assertEqual(consumer.value(), b"")
        producer.resumeProducing()
        while not done.called:
            self.clock.advance(0)
        self.assertIsNone(self.successResultOf(done))
        body = consumer.value()
        self.assertEqual(len(body), producer.length)
        self.assertEqual(progress[-1], (producer.length, producer.length))
        self.assertGreater(len(progress), 5)
        parsed = parse_request_body(producer.content_type, body)
        self.assertEqual(parsed.program, b'{"instructions":[]}')
        self.assertEqual([b.read() for b in parsed.blobs.values()], [b"x" * 10])

    def test_stop(self) -> None:
        """stopProducing ends the writing; later control calls are harmless."""
        producer = MultipartProducer(self.parts, cooperator=self.cooperator, chunk_size=1)
        done = producer.startProducing(StringTransport())
        producer.stopProducing()
        self.failureResultOf(done)
        producer.pauseProducing()
        producer.stopProducing()

    def test_boundary_avoids_payloads(self) -> None:
        """A fresh 32-hex boundary that no payload contains."""
        producer = MultipartProducer(self.parts, cooperator=self.cooperator)
        boundary = producer.content_type.split("boundary=")[1]
        self.assertRegex(boundary, r"^[0-9a-f]{32}$")


class HealthTests(SynchronousTestCase):
    """L{AsyncClient.health} and L{AsyncClient.target}."""

    def test_ok(self) -> None:
        """A 200 with status ok is returned; the base URL's path prefix is kept."""
        server = FakeServer(json_reply({"status": "ok", "target": {"arch": "sm_90a"}}))
        client = server.client(headers={"Authorization": "Bearer t"})
        d = client.target()
        server.settle()
        self.assertEqual(self.successResultOf(d), {"arch": "sm_90a"})
        self.assertEqual(server.seen[0].path, "prefix/health")
        self.assertEqual(server.seen[0].headers["authorization"], ["Bearer t"])

    def test_cpu_server_has_no_target(self) -> None:
        server = FakeServer(json_reply({"status": "ok", "target": {}}))
        d = server.client().target()
        server.settle()
        self.failureResultOf(d, ProtocolError)

    def test_not_ok(self) -> None:
        server = FakeServer(json_reply({"status": "unavailable"}))
        d = server.client().health()
        server.settle()
        self.failureResultOf(d, ProtocolError)

    def test_http_error(self) -> None:
        """A non-200 becomes KCoralError with the body's kind and message."""
        body = {"status": "ERROR", "request_id": "r", "error": {"kind": "busy", "message": "m"}}
        server = FakeServer(json_reply(body, code=503))
        d = server.client().health()
        server.settle()
        error = self.failureResultOf(d, KCoralError).value
        self.assertEqual((error.status_code, error.kind, error.message), (503, "busy", "m"))
        self.assertEqual(error.request_id, "r")

    def test_plain_text_error(self) -> None:
        server = FakeServer((502, {"Content-Type": "text/plain"}, b"bad gateway"))
        d = server.client().health()
        server.settle()
        error = self.failureResultOf(d, KCoralError).value
        self.assertEqual((error.message, error.kind), ("HTTP 502", None))

    def test_duplicate_keys_rejected(self) -> None:
        server = FakeServer(
            (200, {"Content-Type": "application/json"}, b'{"status":"ok","a":1,"a":2}')
        )
        d = server.client().health()
        server.settle()
        self.failureResultOf(d, ProtocolError)

    def test_transport_error(self) -> None:
        """A failure to get any response is a TransportError."""
        from twisted.internet.defer import fail
        from twisted.internet.error import ConnectionRefusedError

        class Refusing:
            def request(self, *args: Any, **kwargs: Any) -> Any:
                return fail(ConnectionRefusedError())

        client = AsyncClient("http://x", http_client=Refusing(), reactor=Clock())
        self.failureResultOf(client.health(), TransportError)


class ExecuteTests(SynchronousTestCase):
    """L{AsyncClient.execute}: framing, CACHE_MISS retries, decoding."""

    def test_no_blobs_one_attempt(self) -> None:
        """A program without blobs takes one attempt; the body carries options in order."""
        program = Program()
        module = program.upload(kind="module", source="def f():\n    return 'é'\n")
        program.return_(
            key="r", value=program.run(fn=program.get_function(module=module, name="f"))
        )
        server = FakeServer(json_reply(completed({"r": {"type": "string", "value": "é"}})))
        attempts: list[Attempt] = []
        client = server.client()
        client.attempt_observers.append(attempts.append)
        d = client.execute(program, timeout_seconds=30, gpu_count=2, output_limit_bytes=5)
        server.settle()
        result = self.successResultOf(d)
        self.assertEqual(result.results, {"r": "é"})
        self.assertEqual(result.stdout, "out")
        seen = server.seen[0]
        self.assertEqual(seen.path, "prefix/execute")
        self.assertEqual(
            list(seen.program["options"].items()),
            [("gpu_count", 2), ("timeout_seconds", 30), ("output_limit_bytes", 5)],
        )
        compact = json.dumps(
            seen.program, ensure_ascii=False, separators=(",", ":"), allow_nan=False
        ).encode()
        self.assertEqual(seen.program_bytes, compact)
        self.assertIn("é".encode(), seen.program_bytes)
        self.assertEqual(len(attempts), 1)
        self.assertEqual((attempts[0].blobs, attempts[0].status), (0, "COMPLETED"))

    def test_gpu_count_checked_locally(self) -> None:
        client = FakeServer().client()
        for bad in (0, 9, True, 1.5):
            self.assertRaises(ValueError, client.execute, Program(), gpu_count=bad)
        self.assertRaises(TypeError, client.execute, object())

    def test_cache_miss_then_missing_blobs(self) -> None:
        """Attempt 1 sends no blobs; attempt 2 exactly the missing ones, with the route."""
        a, b = b"alpha", b""
        program = blob_program(a, b)
        server = FakeServer(
            json_reply(cache_miss(_sha(b)), **{"X-KCoral-Node": "node-7"}),
            json_reply(completed({"r": {"type": "integer", "value": 2}})),
        )
        d = server.client().execute(program)
        server.settle()
        self.assertEqual(self.successResultOf(d).results, {"r": 2})
        first, second = server.seen
        self.assertEqual(first.blobs, {})
        self.assertEqual(second.blobs, {_sha(b): b""})
        self.assertEqual(second.headers["x-kcoral-node"], ["node-7"])
        self.assertNotIn("x-kcoral-node", first.headers)
        self.assertEqual(first.program_bytes, second.program_bytes)

    def test_second_miss_sends_everything(self) -> None:
        """A second CACHE_MISS is answered with every blob; a third is an error."""
        program = blob_program(b"a", b"b")
        every = {_sha(b"a"): b"a", _sha(b"b"): b"b"}
        server = FakeServer(
            json_reply(cache_miss(_sha(b"a"))),
            json_reply(cache_miss(_sha(b"b"))),
            json_reply(completed()),
        )
        d = server.client().execute(program)
        server.settle()
        self.successResultOf(d)
        self.assertEqual(server.seen[2].blobs, every)
        again = FakeServer(*[json_reply(cache_miss(_sha(b"a")))] * 3)
        d = again.client().execute(program)
        again.settle()
        self.assertIn("complete blob resend", str(self.failureResultOf(d, ProtocolError).value))

    def test_bad_cache_miss(self) -> None:
        """An empty, duplicated, malformed or unknown missing_blobs list is a ProtocolError."""
        program = blob_program(b"a")
        for missing in ([], [_sha(b"a")] * 2, ["XYZ"], [_sha(b"zzz")]):
            server = FakeServer(json_reply(cache_miss(*missing)))
            d = server.client().execute(program)
            server.settle()
            self.failureResultOf(d, ProtocolError)
            self.assertEqual(len(server.seen), 1)

    def test_http_error_stops(self) -> None:
        """A 413 on attempt 2 raises at once."""
        program = blob_program(b"a")
        error = {
            "status": "ERROR",
            "request_id": "q",
            "error": {"kind": "request_too_large", "message": "big"},
        }
        server = FakeServer(json_reply(cache_miss(_sha(b"a"))), json_reply(error, code=413))
        d = server.client().execute(program)
        server.settle()
        failure = self.failureResultOf(d, KCoralError)
        self.assertEqual(failure.value.kind, "request_too_large")
        self.assertEqual(len(server.seen), 2)

    def test_binary_results(self) -> None:
        """Bytes, tensors and files decode, with digests checked."""
        tensor = np.arange(6, dtype=np.float32).reshape(2, 3)
        parts = [b"\x00\r\n", tensor.tobytes(), b"file"]
        results = {
            "b": {"type": "bytes", "part": "return:0", "sha256": _sha(parts[0])},
            "t": {
                "type": "tensor",
                "part": "return:1",
                "sha256": _sha(parts[1]),
                "dtype": "float32",
                "shape": [2, 3],
            },
            "f": {"type": "file", "part": "return:2", "sha256": _sha(parts[2]), "size": 4},
        }
        server = FakeServer(result_reply(completed(results), parts))
        d = server.client().execute(Program())
        server.settle()
        result = self.successResultOf(d)
        self.assertEqual(result["b"], b"\x00\r\n")
        np.testing.assert_array_equal(result["t"], tensor)
        self.assertTrue(result["t"].flags.writeable)
        self.assertEqual(result["f"], ReturnedFile(b"file"))

    def test_bad_digest(self) -> None:
        results = {"b": {"type": "bytes", "part": "return:0", "sha256": _sha(b"other")}}
        server = FakeServer(result_reply(completed(results), [b"data"]))
        d = server.client().execute(Program())
        server.settle()
        self.failureResultOf(d, ProtocolError)

    def test_failed_result_and_check(self) -> None:
        """A FAILED body is a result; check() raises InstructionError with its fields."""
        from kcoral.client.errors import InstructionError

        error = {
            "kind": "engine",
            "message": "ValueError: boom",
            "instruction_index": 3,
            "instruction_op": "run",
            "instruction_id": "run",
            "traceback": "Traceback...",
        }
        body = completed(status="FAILED", error=error)
        server = FakeServer(json_reply(body))
        d = server.client().execute(Program())
        server.settle()
        result = self.successResultOf(d)
        self.assertFalse(result.completed)
        raised = self.assertRaises(InstructionError, result.check)
        self.assertEqual(
            (raised.kind, raised.message, raised.instruction_index, raised.instruction_id),
            ("engine", "ValueError: boom", 3, "run"),
        )

    def test_unsupported_content_type(self) -> None:
        server = FakeServer((200, {"Content-Type": "text/plain"}, b"hi"))
        d = server.client().execute(Program())
        server.settle()
        self.failureResultOf(d, ProtocolError)

    def test_progress(self) -> None:
        """An IProgress sees the upload, the wait and the download of each attempt."""
        events: list[str] = []

        class Recorder(NoProgress):
            def sending(self, sent: int, total: int) -> None:
                events.append("send")

            def waiting(self) -> None:
                events.append("wait")

            def receiving(self, received: int, total: int | None) -> None:
                events.append("recv")

            def done(self) -> None:
                events.append("done")

        verifyObject(IProgress, Recorder())
        server = FakeServer(json_reply(completed()))
        d = server.client(progress=Recorder()).execute(blob_program(b"x" * 100))
        server.settle()
        self.successResultOf(d)
        self.assertEqual(events[0], "send")
        self.assertIn("wait", events)
        self.assertEqual(events[-2:], ["recv", "done"])

    def test_large_blob_not_copied(self) -> None:
        """The producer writes slices of the program's own blob object."""
        data = bytes(3 * (1 << 20) + 5)
        program = blob_program(data)
        self.assertIs(program._blobs[_sha(data)], data)
        server = FakeServer(json_reply(cache_miss(_sha(data))), json_reply(completed()))
        d = server.client().execute(program)
        server.settle()
        self.successResultOf(d)
        self.assertEqual(len(server.seen[1].blobs[_sha(data)]), len(data))


class ContractTests(SynchronousTestCase):
    """The async client works from coroutines."""

    def test_awaitable(self) -> None:
        from twisted.internet.defer import Deferred

        server = FakeServer(json_reply({"status": "ok"}), json_reply(completed()))
        client = server.client()

        async def both() -> tuple[Any, Any]:
            return await client.health(), await client.execute(Program())

        d = Deferred.fromCoroutine(both())
        server.settle()
        health, result = self.successResultOf(d)
        self.assertEqual(health, {"status": "ok"})
        self.assertTrue(result.completed)
        self.assertEqual(json.loads(server.seen[1].program_bytes), {"instructions": []})


class ResponseReaderTests(SynchronousTestCase):
    """ResponseReader decodes a response fed in arbitrary pieces, as decode_response would."""

    def test_bytewise_equals_whole(self) -> None:
        from kcoral.client.download import ResponseReader
        from kcoral.wire.multipart import decode_response, encode_response

        parts = [b"\r\n--x\r\n", b"", bytes(range(256)) * 50]
        body = {"status": "COMPLETED", "results": {}}
        content_type, chunks = encode_response(body, parts)
        data = b"".join(chunks)
        for size in (1, 7, 4096, len(data)):
            reader = ResponseReader(content_type)
            for start in range(0, len(data), size):
                reader.feed(data[start : start + size])
            self.assertEqual(reader.finish(), decode_response(content_type, data))

    def test_json_and_errors(self) -> None:
        from kcoral.client.download import ResponseReader

        reader = ResponseReader("application/json; charset=utf-8")
        reader.feed(b'{"status":')
        reader.feed(b'"ok"}')
        self.assertEqual(reader.finish(), ({"status": "ok"}, {}))
        self.assertRaises(ProtocolError, ResponseReader, "text/plain")
        self.assertRaises(ProtocolError, ResponseReader, "multipart/form-data")
        only_blob = (
            b'--b\r\nContent-Disposition: form-data; name="return:0"\r\n'
            b"Content-Type: application/octet-stream\r\n\r\nx\r\n--b--\r\n"
        )
        reader = ResponseReader("multipart/form-data; boundary=b")
        reader.feed(only_blob)
        self.assertRaises(ProtocolError, reader.finish)
        reader = ResponseReader("multipart/form-data; boundary=b")
        reader.feed(only_blob[:-4])
        self.assertRaises(ProtocolError, reader.finish)
        reader = ResponseReader("application/json")
        reader.feed(b"[1]")
        self.assertRaises(ProtocolError, reader.finish)


class RequestSequenceTests(SynchronousTestCase):
    """The client over treq's StubTreq, checked request by request with RequestSequence."""

    def test_health_requests(self) -> None:
        from treq.testing import HasHeaders, RequestSequence, StringStubbingResource, StubTreq

        ok = (200, {"Content-Type": "application/json"}, b'{"status":"ok","target":{}}')
        expected = (
            b"get",
            "http://kcoral.test/api/health",
            {},
            HasHeaders({"X-Token": ["t"]}),
            b"",
        )
        sequence = RequestSequence([(expected, ok), (expected, ok)])
        stub = StubTreq(StringStubbingResource(sequence))
        client = AsyncClient(
            "http://kcoral.test/api/", headers={"X-Token": "t"}, http_client=stub, reactor=Clock()
        )
        with sequence.consume(self.fail):
            first = client.health()
            second = client.target()
            stub.flush()
            self.assertEqual(self.successResultOf(first)["status"], "ok")
            self.failureResultOf(second, ProtocolError)


class ReactorTests(SynchronousTestCase):
    """
    An L{AsyncClient} builds its connections on the reactor it is given,
    TLS's write clock included (Twisted's default clock is the global
    reactor, which a client on another reactor never runs).
    """

    def _connect(self, url: bytes) -> Any:
        from twisted.internet.protocol import Factory, Protocol
        from twisted.internet.testing import MemoryReactorClock
        from twisted.web.client import URI

        reactor = MemoryReactorClock()
        client = AsyncClient("https://127.0.0.1:8443", reactor=reactor)
        endpoint = client._http._agent._endpointFactory.endpointForURI(URI.fromBytes(url))
        endpoint.connect(Factory.forProtocol(Protocol))
        ((host, port, factory, timeout, _),) = reactor.tcpClients
        return reactor, (host, port, timeout), factory

    def test_https_clock_is_the_clients_reactor(self) -> None:
        """The TLS factory of an https:// connection schedules on the client's reactor."""
        from twisted.protocols.tls import TLSMemoryBIOFactory

        reactor, address, factory = self._connect(b"https://127.0.0.1:8443/health")
        self.assertEqual(address, ("127.0.0.1", 8443, 10.0))
        tls = factory._wrappedFactory  # inside HostnameEndpoint's wrapper
        self.assertIsInstance(tls, TLSMemoryBIOFactory)
        self.assertIs(tls._clock, reactor)

    def test_http_is_plain_tcp(self) -> None:
        """An http:// connection is a plain TCP connection on the client's reactor."""
        from twisted.protocols.tls import TLSMemoryBIOFactory

        _, address, factory = self._connect(b"http://127.0.0.1:8000/health")
        self.assertEqual(address, ("127.0.0.1", 8000, 10.0))
        self.assertNotIsInstance(factory._wrappedFactory, TLSMemoryBIOFactory)

    def test_other_schemes_refused(self) -> None:
        """A scheme other than http or https is refused when connecting."""
        from twisted.internet.testing import MemoryReactorClock
        from twisted.web.client import URI
        from twisted.web.error import SchemeNotSupported

        client = AsyncClient("https://127.0.0.1:8443", reactor=MemoryReactorClock())
        with self.assertRaises(SchemeNotSupported):
            client._http._agent._endpointFactory.endpointForURI(URI.fromBytes(b"ftp://h:21/"))
