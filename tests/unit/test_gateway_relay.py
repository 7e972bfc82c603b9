"""
A node's large result relayed to its client as it arrives
(L{kcoral.gateway.relay}), a small one taken over NATS
(L{GatewayAPI.result_message}), and the NATS bridge on the reactor's own
asyncio loop (L{kcoral.gateway.natsbridge}).
"""

from __future__ import annotations

import asyncio
import io
from typing import Any

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.task import Clock
from twisted.logger import globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.test.requesthelper import DummyRequest

from kcoral.gateway.api import GatewayAPI, GatewaySettings
from kcoral.gateway.dispatch import Dispatcher, Outcome, PendingJob
from kcoral.gateway.jobs import (
    NATS_RESULT_BYTES,
    JobMessage,
    ResultHead,
    nats_result_headers,
    parse_result_reply,
    result_headers,
)
from kcoral.gateway.natsbridge import NatsBridge, reactor_loop
from kcoral.gateway.pool import PoolView
from kcoral.gateway.relay import STREAM_RESULT_BYTES, ResultRelay
from kcoral.server.http.request import BACKLOG_PAUSE_BYTES
from kcoral.testing.gateway import FakeJobQueue


class _Transport:
    def __init__(self) -> None:
        self.aborted = False

    def abortConnection(self) -> None:
        self.aborted = True


class _Client:
    """A client's request: what it was written, and its producer."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.producer: Any = None
        self.channel: Any = type("Channel", (), {"transport": _Transport()})()

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def registerProducer(self, producer: Any, streaming: bool) -> None:
        assert streaming
        self.producer = producer

    def unregisterProducer(self) -> None:
        self.producer = None


class RelayTests(SynchronousTestCase):
    def test_bytes_pass_through_in_order(self) -> None:
        """What arrives before the client attaches is written first, the rest as it comes."""
        relay = ResultRelay(10, "j1")
        relay.feed(b"abc")
        client = _Client()
        done = relay.attach(client)
        self.assertEqual(b"".join(client.written), b"abc")
        self.assertIs(client.producer, relay)
        relay.feed(b"defg")
        self.assertNoResult(done)
        relay.feed(b"hij")
        self.assertEqual(b"".join(client.written), b"abcdefghij")
        self.assertTrue(self.successResultOf(done))
        self.assertIsNone(client.producer)

    def test_all_before_attach(self) -> None:
        """A body complete before the client attaches is written whole on attach."""
        relay = ResultRelay(3)
        relay.feed(b"xyz")
        client = _Client()
        self.assertTrue(self.successResultOf(relay.attach(client)))
        self.assertEqual(b"".join(client.written), b"xyz")

    def test_full_client_holds_the_node_back(self) -> None:
        """
        While the client's connection is full the backlog is over the
        request's pause threshold; once it drains, the waiting request is
        told.
        """
        relay = ResultRelay(10)
        relay.attach(_Client())
        self.assertEqual(relay.backlog(), 0)
        relay.pauseProducing()
        self.assertGreater(relay.backlog(), BACKLOG_PAUSE_BYTES)
        woken: list[bool] = []
        relay.when_drained(BACKLOG_PAUSE_BYTES // 2, lambda: woken.append(True))
        self.assertEqual(woken, [])
        relay.resumeProducing()
        self.assertEqual(woken, [True])

    def test_client_leaves(self) -> None:
        """A client that leaves: the rest is read and dropped, and the relay says so."""
        relay = ResultRelay(6)
        client = _Client()
        done = relay.attach(client)
        relay.feed(b"ab")
        done.cancel()
        self.failureResultOf(done, CancelledError)
        relay.feed(b"cdef")
        self.assertEqual(b"".join(client.written), b"ab")
        self.assertFalse(self.successResultOf(relay.done))

    def test_node_breaks_off(self) -> None:
        """A post cut short closes the client's connection (short of its length)."""
        relay = ResultRelay(6)
        client = _Client()
        done = relay.attach(client)
        relay.feed(b"ab")
        relay.abort()
        self.assertTrue(client.channel.transport.aborted)
        self.assertFalse(self.successResultOf(done))
        relay.abort()  # once only

    def test_more_than_announced(self) -> None:
        """Bytes past the announced length break the relay off."""
        relay = ResultRelay(2)
        client = _Client()
        done = relay.attach(client)
        relay.feed(b"abc")
        self.assertTrue(client.channel.transport.aborted)
        self.assertFalse(self.successResultOf(done))


def _api() -> tuple[GatewayAPI, Dispatcher]:
    clock = Clock()
    dispatcher = Dispatcher(FakeJobQueue(), PoolView(presence_timeout=3.0), clock)
    settings = GatewaySettings(
        public_url="http://g",
        queue_size=10,
        queue_timeout=10.0,
        preference_window=0.0,
        max_request_bytes=100,
        default_timeout=10.0,
        max_timeout=10.0,
    )
    api = GatewayAPI(settings, dispatcher, dispatcher.pool, FakeJobQueue(), None, None, clock)  # type: ignore[arg-type]
    message = JobMessage(
        job="j1", request_id="r", program="{}", deadline=10.0, token="t", gateway="http://g"
    )
    dispatcher.jobs["j1"] = PendingJob(message=message, compat="a" * 16, gpus=0, timeout_seconds=1)
    return api, dispatcher


def _post(headers: dict[str, str]) -> DummyRequest:
    request = DummyRequest([b""])
    for name, value in headers.items():
        request.requestHeaders.setRawHeaders(name.encode(), [value.encode()])
    return request


class RelayChoiceTests(SynchronousTestCase):
    def test_large_result_is_relayed_and_settles_its_job(self) -> None:
        """A large result post of a waiting job settles it at once with a relay."""
        api, dispatcher = _api()
        outcome = dispatcher.jobs["j1"].outcome
        request = _post(result_headers(200, "multipart/mixed; boundary=x", node="n1"))
        length = STREAM_RESULT_BYTES + 1
        relay = api.relay_result(request, b"/_pool/jobs/j1/result", length)
        assert relay is not None
        self.assertEqual(relay.length, length)
        settled = self.successResultOf(outcome)
        self.assertIs(settled.body, relay)
        self.assertEqual(settled.node, "n1")
        self.assertEqual(settled.body_length, length)
        self.assertNotIn("j1", dispatcher.jobs)
        self.assertIs(relay.delivered, settled.delivered)

    def test_what_is_read_whole(self) -> None:
        """Small results, blob paths, bad heads and unknown jobs are not relayed."""
        api, dispatcher = _api()
        good = _post(result_headers(200, "application/json"))
        big = STREAM_RESULT_BYTES + 1
        self.assertIsNone(api.relay_result(good, b"/_pool/jobs/j1/result", STREAM_RESULT_BYTES))
        self.assertIsNone(api.relay_result(good, b"/_pool/jobs/j1/result", None))
        self.assertIsNone(api.relay_result(good, b"/_pool/jobs/j1/blobs/" + b"0" * 64, big))
        self.assertIsNone(api.relay_result(good, b"/_pool/jobs/j2/result", big))
        self.assertIsNone(api.relay_result(_post({}), b"/_pool/jobs/j1/result", big))
        self.assertIn("j1", dispatcher.jobs)


def _nats_headers(token: str = "t", **changes: str) -> dict[str, str]:
    message = JobMessage(
        job="j1", request_id="r", program="{}", deadline=10.0, token=token, gateway="http://g"
    )
    headers = nats_result_headers(message, result_headers(200, "application/json", node="n1"))
    headers.update(changes)
    return headers


class NatsResultTests(SynchronousTestCase):
    """A small result sent over NATS is taken as its post would be."""

    def test_result_settles_its_job_and_replies_once_delivered(self) -> None:
        """
        The job is settled with the payload as its body and the subject's
        node (which nats-server authenticated) as the node that ran it,
        whatever the header says; the reply waits for the client.
        """
        api, dispatcher = _api()
        outcome = dispatcher.jobs["j1"].outcome
        reply = api.result_message("n2", _nats_headers(), b'{"status":"COMPLETED"}')
        settled = self.successResultOf(outcome)
        self.assertEqual(settled.head.status, 200)
        self.assertEqual(settled.head.content_type, "application/json")
        self.assertEqual(settled.node, "n2")
        self.assertEqual(settled.body.read(), b'{"status":"COMPLETED"}')
        self.assertEqual(settled.body_length, 22)
        self.assertNoResult(reply)
        settled.delivered.callback(True)
        self.assertEqual(parse_result_reply(self.successResultOf(reply)), (200, True))

    def test_client_gone_is_said(self) -> None:
        """A result whose client left before it was written: 200, not delivered."""
        api, dispatcher = _api()
        outcome = dispatcher.jobs["j1"].outcome
        reply = api.result_message("n1", _nats_headers(), b"x")
        self.successResultOf(outcome).delivered.callback(False)
        self.assertEqual(parse_result_reply(self.successResultOf(reply)), (200, False))

    def test_refusals(self) -> None:
        """
        A wrong or missing token, an unknown job, bad headers and a body over
        the NATS limit are refused with their post's statuses; the job still
        waits.
        """
        api, dispatcher = _api()
        outcome = dispatcher.jobs["j1"].outcome
        no_token = _nats_headers()
        del no_token["X-KCoral-Result-Token"]
        cases = [
            (_nats_headers(token="wrong"), b"x", 401),
            (no_token, b"x", 401),
            (_nats_headers(**{"X-KCoral-Result-Job": "j2"}), b"x", 401),
            (_nats_headers(**{"X-KCoral-Result-Status": "999"}), b"x", 400),
            (_nats_headers(), b"x" * (NATS_RESULT_BYTES + 1), 413),
        ]
        for headers, payload, status in cases:
            reply = self.successResultOf(api.result_message("n1", headers, payload))
            self.assertEqual(parse_result_reply(reply), (status, False), (headers, status))
        self.assertNoResult(outcome)
        self.assertIn("j1", dispatcher.jobs)

    def test_second_result_is_gone(self) -> None:
        """
        The same job's result again (say, after a lost reply): refused, not
        relayed twice; a settled job is forgotten, so its token is unknown.
        """
        api, dispatcher = _api()
        outcome = dispatcher.jobs["j1"].outcome
        api.result_message("n1", _nats_headers(), b"x")
        self.successResultOf(outcome)
        reply = self.successResultOf(api.result_message("n1", _nats_headers(), b"x"))
        self.assertEqual(parse_result_reply(reply)[0], 401)


class _AsyncioReactor:
    """What the bridge looks at in Twisted's asyncio reactor: its loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._asyncioEventloop = loop

    def callFromThread(self, f: Any, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("no thread hop on the reactor's own loop")


class InlineBridgeTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.addCleanup(self.loop.close)

    def test_reactor_loop(self) -> None:
        """Only a reactor that runs on an asyncio loop has one."""
        self.assertIs(reactor_loop(_AsyncioReactor(self.loop)), self.loop)
        self.assertIsNone(reactor_loop(Clock()))

    def _bridge(self) -> NatsBridge:
        bridge = NatsBridge(_AsyncioReactor(self.loop), ["nats://127.0.0.1:1"])
        bridge._loop, bridge.inline = self.loop, True
        return bridge

    def test_call_runs_on_the_reactor_loop(self) -> None:
        """A call's Deferred fires straight from its task, no thread in between."""
        bridge = self._bridge()
        bridge._client, bridge._js = (  # type: ignore[assignment]
            type("C", (), {"is_closed": False, "is_connected": False})(),
            object(),
        )

        async def work(client: Any, js: Any) -> int:
            await asyncio.sleep(0)
            return 7

        d = bridge.call(work)
        self.assertNoResult(d)
        self.loop.run_until_complete(asyncio.sleep(0.01))
        self.assertEqual(self.successResultOf(d), 7)

    def test_cancel_and_errors(self) -> None:
        """Cancelling the Deferred cancels the task; a task's error fails the Deferred."""
        bridge = self._bridge()
        d = bridge.call(lambda client, js: asyncio.sleep(0))
        self.loop.run_until_complete(asyncio.sleep(0.01))
        self.failureResultOf(d)  # not connected
        started: list[bool] = []

        async def forever() -> None:
            started.append(True)
            await asyncio.sleep(3600)

        waiting = bridge._submit(forever)
        self.loop.run_until_complete(asyncio.sleep(0.01))
        waiting.cancel()
        self.failureResultOf(waiting, CancelledError)
        self.loop.run_until_complete(asyncio.sleep(0.01))
        self.assertEqual(started, [True])

    def test_deliver_is_direct(self) -> None:
        """What a watch delivers runs at once (the reactor thread is this one)."""
        bridge = self._bridge()
        seen: list[int] = []
        bridge.deliver(seen.append, 1)
        self.assertEqual(seen, [1])

    def test_begin_fires_with_a_tasks_outcome(self) -> None:
        """
        Work begun on the loop: its result, its error or its cancellation
        (as Twisted's C{CancelledError}) reaches the reactor as its
        Deferred's outcome, fired from the task as the work ends, before
        what that step scheduled for the loop's next turn.
        """
        bridge = self._bridge()
        order: list[str] = []

        async def answer() -> int:
            await asyncio.sleep(0)
            self.loop.call_soon(order.append, "next turn")
            return 7

        async def broken() -> int:
            raise ValueError("no")

        async def forever() -> int:
            await asyncio.sleep(3600)
            return 0

        async def begin_all() -> tuple[Deferred[int], ...]:
            return bridge.begin(answer()), bridge.begin(broken()), bridge.begin(forever())

        answered, failed, stopped = self.loop.run_until_complete(begin_all())
        answered.addCallback(lambda result: order.append("fired") or result)
        self.loop.run_until_complete(asyncio.sleep(0.01))
        self.assertEqual(self.successResultOf(answered), 7)
        self.assertEqual(order, ["fired", "next turn"])
        self.failureResultOf(failed, ValueError)
        self.assertNoResult(stopped)
        self.assertEqual(len(bridge._tasks), 1)
        for task in list(bridge._tasks):
            task.cancel()
        self.loop.run_until_complete(asyncio.sleep(0.01))
        self.failureResultOf(stopped, CancelledError)
        self.assertEqual(bridge._tasks, set())


class AnswerTests(SynchronousTestCase):
    def test_request_finished_is_logged_once_the_response_is_written(self) -> None:
        """
        A small relayed result's C{request_finished} event comes after the
        client's response is written, not in front of it; the node's post
        is answered then too, before the event.
        """
        api, dispatcher = _api()
        pending = dispatcher.jobs["j1"]
        events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        delivered: Deferred[bool] = Deferred()
        outcome = Outcome(
            head=ResultHead(status=200, content_type="application/json"),
            body=io.BytesIO(b'{"ok": true}'),
            body_length=12,
            node="n1",
            delivered=delivered,
        )
        finished_before_answer: list[int] = []
        delivered.addCallback(
            lambda ok: (
                finished_before_answer.append(
                    sum(e.get("kcoral_event") == "request_finished" for e in events)
                )
                or ok
            )
        )
        request = _post({})
        body = self.successResultOf(
            Deferred.fromCoroutine(api._answer(request, "r", pending, outcome, 0.0))
        )
        self.assertEqual(body, b'{"ok": true}')
        self.assertEqual([e for e in events if e.get("kcoral_event") == "request_finished"], [])
        request.write(body)
        request.finish()
        finished = [e for e in events if e.get("kcoral_event") == "request_finished"]
        self.assertEqual(
            [(e["http_status"], e["finish_reason"]) for e in finished], [(200, "relayed")]
        )
        self.assertTrue(self.successResultOf(delivered))
        self.assertEqual(finished_before_answer, [0])
