# -*- test-case-name: tests.integration.test_gateway -*-
"""
L{IJobQueue} on NATS: the gateway creates the job stream and both KV
buckets (nodes only bind to them), publishes jobs, writes cancel claims,
and watches the presence and claims buckets, handing what it sees to the
reactor (L{PoolView}, L{Dispatcher}).  The watches are started again
whenever the connection comes back (a nats-server restart loses ephemeral
consumers).

The presence watch starts from each node's current key.  The claims watch
sees new claims only, and the claims of the gateway's own queued jobs are
read once each time it starts (L{NatsJobQueue.queued_jobs}): a claim
bucket keeps every job's key for a day, and a watch from the current
values both replays all of them and, on nats-server 2.9, makes every
later claim cost the server in proportion to them (the pending count of a
last-per-subject consumer): measured, the server's CPU per job went from
1 ms to 4-6 ms over 10,000 jobs and the gateway's added latency doubled.

It also takes small results over NATS (L{NatsJobQueue.results_key}): a core
subscription to C{kcoral.results.<key>.*} hands each node's result to
C{on_result} on the reactor, and sends the reply that C{on_result}'s
Deferred fires with.  nats-py renews a core subscription itself after a
reconnect, so it is made once; a node whose result finds no subscriber
(C{no responders}) posts it over HTTP.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
from twisted.internet.defer import CancelledError, Deferred
from twisted.logger import Logger
from zope.interface import implementer

from kcoral.gateway.dispatch import IJobQueue, QueueRefused
from kcoral.gateway.jobs import (
    CLAIMS_BUCKET,
    CLAIMS_TTL,
    JOB_SUBJECTS,
    NODES_BUCKET,
    RESULTS_SUBJECT_PREFIX,
    STREAM,
    Claim,
    Presence,
    SchemaError,
    results_node,
)
from kcoral.gateway.natsbridge import NatsBridge, ensure_consumer

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg
    from nats.js import JetStreamContext

__all__ = ["NatsJobQueue"]

#: Seconds a publish or a KV call may take before it counts as failed.
CALL_TIMEOUT = 5.0
#: Seconds nats-server keeps a watch's consumer once its connection is gone.
WATCH_INACTIVE = 300.0


@implementer(IJobQueue)
@attrs.define(eq=False)
class NatsJobQueue:
    """
    @ivar queue_size: the stream's C{max_msgs} (discard new: a full queue
        refuses the publish).
    @ivar presence_timeout: the nodes bucket's TTL.
    @ivar claims_ttl: the claims bucket's TTL (longer than any queue wait).
    """

    bridge: NatsBridge
    queue_size: int
    presence_timeout: float
    claims_ttl: float = CLAIMS_TTL
    on_presence: Callable[[Presence], None] = lambda p: None
    on_node_removed: Callable[[str], None] = lambda n: None
    #: Called once the presence watch has delivered the bucket's contents.
    on_presence_loaded: Callable[[], None] = lambda: None
    on_claim: Callable[[str, Claim], None] = lambda j, c: None
    #: The gateway's jobs waiting for a claim (called on the reactor):
    #: their claims are read when the claims watch (re)starts.
    queued_jobs: Callable[[], list[str]] = list
    #: The key of this gateway process's result subjects, or C{None}: no
    #: results over NATS.
    results_key: str | None = None
    #: A node's result over NATS: C{(node, headers, payload)}, on the
    #: reactor; fires with the reply to send.
    on_result: Callable[[str, dict[str, str], bytes], Deferred[bytes]] | None = None
    #: Messages waiting in the stream, as last read (L{refresh_depth}).
    depth: int | None = None
    _watches: list[Deferred[None]] = attrs.field(factory=list)
    _results: Deferred[None] | None = None

    log = Logger()

    @property
    def connected(self) -> bool:
        return self.bridge.connected

    # -- set-up ----------------------------------------------------------------

    def setup(self) -> Deferred[None]:
        """Create (or check) the stream and the buckets, then start watching."""
        queue_size, presence_timeout, claims_ttl = (
            self.queue_size,
            self.presence_timeout,
            self.claims_ttl,
        )

        async def create(client: Client, js: JetStreamContext) -> None:
            from nats.js.api import (
                DiscardPolicy,
                RetentionPolicy,
                StorageType,
                StreamConfig,
            )
            from nats.js.errors import BadRequestError

            config = StreamConfig(
                name=STREAM,
                subjects=[JOB_SUBJECTS],
                retention=RetentionPolicy.WORK_QUEUE,
                storage=StorageType.FILE,
                max_msgs=queue_size,
                discard=DiscardPolicy.NEW,
                duplicate_window=120.0,
            )
            try:
                await js.add_stream(config)
            except BadRequestError:
                # It exists with another size (an earlier --queue-size).
                await js.update_stream(config)
            for bucket, ttl in ((NODES_BUCKET, presence_timeout), (CLAIMS_BUCKET, claims_ttl)):
                try:
                    await js.create_key_value(
                        bucket=bucket, ttl=ttl, history=1, storage=StorageType.FILE
                    )
                except BadRequestError:
                    # It exists with another TTL (an earlier --presence-timeout).
                    info = await js.stream_info(f"KV_{bucket}")
                    await js.update_stream(
                        info.config.evolve(max_age=ttl, duplicate_window=min(120.0, ttl))
                    )

        d = self.bridge.call(create, timeout=CALL_TIMEOUT * 2)
        d.addCallback(lambda _: self.watch())
        d.addCallback(lambda _: self._serve_results())
        return d

    def _serve_results(self) -> None:
        """Subscribe to this process's result subjects (once: nats-py renews it)."""
        key, take = self.results_key, self.on_result
        if key is None or take is None or self._results is not None:
            return
        bridge = self.bridge

        async def seen(msg: Msg) -> None:
            node = results_node(msg.subject, key)
            if node is None or not msg.reply:
                return  # no node of ours, or nobody to answer: dropped
            bridge.deliver(self._result, take, node, dict(msg.headers or {}), msg.data, msg.reply)

        async def run(client: Client, js: JetStreamContext) -> None:
            sub = await client.subscribe(f"{RESULTS_SUBJECT_PREFIX}.{key}.*", cb=seen)
            await _kept(sub)

        self._results = self._watching(bridge.spawn(run), "results")

    def _result(
        self,
        take: Callable[[str, dict[str, str], bytes], Deferred[bytes]],
        node: str,
        headers: dict[str, str],
        payload: bytes,
        reply: str,
    ) -> None:
        """On the reactor: a node's result taken, and its reply sent when it is ready."""

        def send(answer: bytes) -> Deferred[None]:
            async def run(client: Client, js: JetStreamContext) -> None:
                await client.publish(reply, answer)

            return self.bridge.call(run, timeout=CALL_TIMEOUT)

        d = take(node, headers, payload)
        d.addCallback(send)
        d.addErrback(
            lambda f: self.log.failure("result of node {node}: reply not sent", f, node=node)
        )

    def watch(self) -> None:
        """(Re)start the presence and claims watches."""
        for running in self._watches:
            running.cancel()
        self._watches = [
            self._spawn_watch(NODES_BUCKET, self._presence_entry, self.on_presence_loaded),
            self._spawn_claims_watch(),
        ]

    def connection_changed(self, connected: bool) -> None:
        """The bridge's connection came back: watch again (from the current values)."""
        if connected and self._watches:
            self.watch()

    def _spawn_watch(
        self,
        bucket: str,
        deliver: Callable[[str, bytes, str | None], None],
        loaded: Callable[[], None] | None = None,
    ) -> Deferred[None]:
        """
        Watch C{bucket}: each entry goes to C{deliver} on the reactor, and
        C{loaded} is called there after the entries the bucket held when the
        watch began (nats-py marks their end with a C{None}).
        """
        bridge = self.bridge

        async def run(client: Client, js: JetStreamContext) -> None:
            kv = await js.key_value(bucket)
            watcher = await kv.watchall()
            try:
                async for entry in watcher:
                    if entry is None:
                        if loaded is not None:
                            bridge.deliver(loaded)
                        continue
                    bridge.deliver(deliver, entry.key, entry.value or b"", entry.operation)
            finally:
                try:
                    await asyncio.wait_for(watcher.stop(), 1.0)
                except Exception:
                    pass

        return self._watching(bridge.spawn(run), bucket)

    def _watching(self, d: Deferred[None], bucket: str) -> Deferred[None]:
        def ended(failure: Any) -> None:
            if failure.check(asyncio.CancelledError, CancelledError):
                return None
            self.log.warn(
                "watch of {bucket} ended: {error}; restarted on reconnect",
                kcoral_event="nats_watch_ended",
                bucket=bucket,
                error=repr(failure.value),
            )
            return None

        d.addErrback(ended)
        return d

    def _spawn_claims_watch(self) -> Deferred[None]:
        """
        Watch the claims created from now on (an ordered consumer that
        delivers new messages only), then read the claims of the jobs
        queued before it started (L{_catch_up}).
        """
        bridge = self.bridge
        prefix = f"$KV.{CLAIMS_BUCKET}."

        async def seen(msg: Msg) -> None:
            headers = msg.headers or {}
            if not msg.subject.startswith(prefix) or "Nats-Marker-Reason" in headers:
                return  # not a key, or a server-placed marker (nats-server 2.11+)
            key = msg.subject[len(prefix) :]
            bridge.deliver(self._claim_entry, key, msg.data or b"", headers.get("KV-Operation"))

        async def run(client: Client, js: JetStreamContext) -> None:
            from nats.js.api import DeliverPolicy

            sub = await js.subscribe(
                f"{prefix}>",
                stream=f"KV_{CLAIMS_BUCKET}",
                cb=seen,
                ordered_consumer=True,
                deliver_policy=DeliverPolicy.NEW,
                inactive_threshold=WATCH_INACTIVE,
            )
            bridge.deliver(self._catch_up)
            await _kept(sub)

        return self._watching(bridge.spawn(run), CLAIMS_BUCKET)

    def _catch_up(self) -> None:
        """Read the claim of every job still queued (the watch sees only later ones)."""
        for job in self.queued_jobs():
            d = self.read_claim(job)

            def seen(claim: Claim | None, job: str = job) -> None:
                if claim is not None:
                    self.on_claim(job, claim)

            d.addCallbacks(seen, lambda f: None)

    def read_claim(self, job: str) -> Deferred[Claim | None]:
        """C{job}'s claim, or C{None} when it has none (or it is not a claim)."""

        async def run(client: Client, js: JetStreamContext) -> Claim | None:
            from nats.js.errors import KeyNotFoundError

            kv = await js.key_value(CLAIMS_BUCKET)
            try:
                entry = await kv.get(job)
            except KeyNotFoundError:
                return None
            try:
                return Claim.decode(entry.value or b"")
            except SchemaError:
                return None

        return self.bridge.call(run, timeout=CALL_TIMEOUT)

    def _presence_entry(self, key: str, value: bytes, operation: str | None) -> None:
        if operation in ("DEL", "PURGE"):
            self.on_node_removed(key)
            return
        try:
            presence = Presence.decode(value)
        except SchemaError as e:
            self.log.warn(
                "bad presence record under {key}: {error}",
                kcoral_event="bad_presence",
                key=key,
                error=str(e),
            )
            return
        if presence.node != key:
            self.log.warn(
                "presence record of {node} under the key {key}: ignored",
                kcoral_event="bad_presence",
                key=key,
                node=presence.node,
            )
            return
        self.on_presence(presence)

    def _claim_entry(self, key: str, value: bytes, operation: str | None) -> None:
        if operation in ("DEL", "PURGE"):
            return
        try:
            claim = Claim.decode(value)
        except SchemaError:
            return
        self.on_claim(key, claim)

    # -- IJobQueue -------------------------------------------------------------

    def prepare(self, compat: str, gpus: int) -> Deferred[None]:
        async def run(client: Client, js: JetStreamContext) -> None:
            await ensure_consumer(js, compat, gpus)

        return self._refusing(self.bridge.call(run, timeout=CALL_TIMEOUT))

    def publish(self, subject: str, data: bytes, job: str) -> Deferred[None]:
        async def run(client: Client, js: JetStreamContext) -> None:
            await js.publish(subject, data, stream=STREAM, headers={"Nats-Msg-Id": job})

        return self._refusing(self.bridge.call(run, timeout=CALL_TIMEOUT))

    def _refusing(self, d: Deferred[None]) -> Deferred[None]:
        def refused(failure: Any) -> None:
            from nats.js.errors import APIError

            error = failure.value
            if isinstance(error, APIError):
                text = f"{error.description or ''}".lower()
                full = "maximum messages" in text or error.err_code in (10077,)
                raise QueueRefused(str(error.description or error), full=full)
            raise QueueRefused(f"{type(error).__name__}: {error}", full=False)

        d.addErrback(refused)
        return d

    def cancel(self, job: str) -> Deferred[Claim | None]:
        async def run(client: Client, js: JetStreamContext) -> Claim | None:
            from nats.js.errors import KeyWrongLastSequenceError

            kv = await js.key_value(CLAIMS_BUCKET)
            try:
                await kv.create(job, Claim(cancelled=True).encode())
            except KeyWrongLastSequenceError:
                entry = await kv.get(job)
                return Claim.decode(entry.value or b"")
            return None

        return self.bridge.call(run, timeout=CALL_TIMEOUT)

    def refresh_depth(self) -> Deferred[None]:
        """Read how many jobs wait in the stream (for /health)."""

        async def run(client: Client, js: JetStreamContext) -> int:
            info = await js.stream_info(STREAM)
            return int(info.state.messages)

        d = self.bridge.call(run, timeout=CALL_TIMEOUT)

        def got(depth: int) -> None:
            self.depth = depth

        def failed(_: Any) -> None:
            self.depth = None

        return d.addCallbacks(got, failed)

    def stop(self) -> None:
        for running in self._watches:
            running.cancel()
        self._watches = []
        results, self._results = self._results, None
        if results is not None:
            results.cancel()


async def _kept(sub: Any) -> None:
    """Keep subscription C{sub} until the task is cancelled (a restart, the stop), then end it."""
    try:
        await asyncio.Event().wait()
    finally:
        try:
            await asyncio.wait_for(sub.unsubscribe(), 1.0)
        except Exception:
            pass
