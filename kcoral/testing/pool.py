# -*- test-case-name: tests.integration.test_node_join -*-
"""
A stand-in for the gateway, for tests and benchmarks of joined nodes.

L{PoolStandIn} does what C{kcoral gateway} does for its nodes and nothing
more: as the C{gateway} NATS user of a L{kcoral.testing.nats.NatsServer}
it creates the job stream and the buckets, publishes jobs, writes cancel
claims and reads presence; over HTTP on loopback it serves the node routes
(C{GET /_pool/jobs/<job>/blobs/<sha256>}, C{POST /_pool/jobs/<job>/result})
behind each job's token, and keeps the results posted.  It can serve a
blob whose bytes do not match its hash.  Blocking helpers: use them from
tests and scripts, never from a reactor thread.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import secrets
import threading
import time
import uuid
from collections.abc import Coroutine, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar

import attrs

from kcoral.gateway.jobs import (
    CLAIMS_BUCKET,
    JOB_SUBJECTS,
    NODES_BUCKET,
    POOL_PREFIX,
    RESULT_CONTENT_TYPE_HEADER,
    RESULT_NODE_HEADER,
    RESULT_STATUS_HEADER,
    STREAM,
    BlobRef,
    Claim,
    JobMessage,
    Presence,
    job_subject,
)
from kcoral.testing.nats import GATEWAY_USER, NatsServer

__all__ = ["PoolStandIn", "PostedResult"]

_T = TypeVar("_T")

_ROUTE = re.compile(
    r"^" + re.escape(POOL_PREFIX) + r"([A-Za-z0-9_-]+)/(blobs/([0-9a-f]{64})|result)$"
)


@attrs.frozen
class PostedResult:
    """A result a node posted."""

    status: int
    content_type: str
    node: str | None
    body: bytes
    #: How it came: C{http} (posted) or C{nats} (a NATS request).
    via: str = "http"

    def json(self) -> Any:
        return json.loads(self.body)


@attrs.define(eq=False)
class PoolStandIn:
    """
    The gateway's side of a pool, minus the client-facing part.

    @ivar presence_timeout: the nodes bucket's TTL.
    """

    nats: NatsServer
    presence_timeout: float = 3.0
    blobs: dict[str, bytes] = attrs.field(factory=dict)
    #: Bytes served in place of a blob's own (a corrupt gateway, in tests).
    corrupt: dict[str, bytes] = attrs.field(factory=dict)
    results: dict[str, PostedResult] = attrs.field(factory=dict)
    #: Blob fetches by job id, in order.
    fetches: dict[str, list[str]] = attrs.field(factory=dict)
    #: Every result post, as (job, node), in order.
    posts: list[tuple[str, str | None]] = attrs.field(factory=list)
    #: Requests refused for a wrong or missing token.
    refused: int = 0
    _tokens: dict[str, str] = attrs.field(factory=dict)
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _client: Any = None
    _js: Any = None
    _nodes: Any = None
    _claims: Any = None
    _http: ThreadingHTTPServer | None = None
    _http_thread: threading.Thread | None = None
    _changed: threading.Condition = attrs.field(factory=threading.Condition)

    # -- life -----------------------------------------------------------------

    @property
    def url(self) -> str:
        assert self._http is not None
        return f"http://127.0.0.1:{self._http.server_address[1]}"

    def start(self) -> PoolStandIn:
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name="pool-stand-in", daemon=True)
        self._thread.start()
        self._call(self._connect())
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._http.daemon_threads = True
        self._http_thread = threading.Thread(target=self._http.serve_forever, daemon=True)
        self._http_thread.start()
        return self

    def _call(self, coroutine: Coroutine[Any, Any, _T], timeout: float = 30.0) -> _T:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    async def _connect(self) -> None:
        import nats
        from nats.js.api import KeyValueConfig, RetentionPolicy, StorageType, StreamConfig

        credentials = json.loads(self.nats.credentials_file(GATEWAY_USER).read_text())
        self._client = await nats.connect(
            self.nats.url,
            user=credentials["user"],
            password=credentials["password"],
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.2,
            name="pool-stand-in",
        )
        js = self._client.jetstream()
        self._js = js
        await js.add_stream(
            StreamConfig(
                name=STREAM,
                subjects=[JOB_SUBJECTS],
                retention=RetentionPolicy.WORK_QUEUE,
                storage=StorageType.FILE,
            )
        )
        self._nodes = await js.create_key_value(
            KeyValueConfig(bucket=NODES_BUCKET, ttl=self.presence_timeout)
        )
        self._claims = await js.create_key_value(KeyValueConfig(bucket=CLAIMS_BUCKET))

    def reconnect(self) -> None:
        """Reopen the handles after a nats-server restart (the client reconnects itself)."""

        async def reopen() -> None:
            deadline = time.monotonic() + 30
            while not self._client.is_connected:
                if time.monotonic() > deadline:
                    raise TimeoutError("pool stand-in did not reconnect")
                await asyncio.sleep(0.05)
            self._nodes = await self._js.key_value(NODES_BUCKET)
            self._claims = await self._js.key_value(CLAIMS_BUCKET)

        self._call(reopen())

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        if self._loop is not None:
            if self._client is not None:
                try:
                    self._call(self._client.close(), timeout=5)
                except Exception:
                    pass
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._thread is not None:
                self._thread.join(5)

    def __enter__(self) -> PoolStandIn:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- jobs -----------------------------------------------------------------

    def publish(
        self,
        program: dict[str, Any] | str,
        compat: str,
        *,
        gpus: int = 0,
        blobs: Sequence[bytes] = (),
        deadline_in: float = 60.0,
        prefer: str | None = None,
        prefer_for: float = 0.0,
        job: str | None = None,
        request_id: str | None = None,
        results: str | None = None,
    ) -> JobMessage:
        """
        Publish a job (its blobs served from now on); the message sent.

        @param results: the key of the result subjects it names (see
            L{listen_results}); C{None}: its result is posted.
        """
        refs = []
        for blob in blobs:
            digest = hashlib.sha256(blob).hexdigest()
            self.blobs[digest] = blob
            refs.append(BlobRef(sha256=digest, size=len(blob)))
        now = time.time()
        message = JobMessage(
            job=job or uuid.uuid4().hex,
            request_id=request_id or str(uuid.uuid4()),
            program=program if isinstance(program, str) else json.dumps(program),
            blobs=tuple(refs),
            options={},
            deadline=now + deadline_in,
            token=secrets.token_urlsafe(32),
            gateway=self.url,
            prefer=prefer,
            prefer_until=now + prefer_for if prefer is not None else 0.0,
            results=results,
        )
        self._tokens[message.job] = message.token
        self._call(self._js.publish(job_subject(compat, gpus), message.encode()))
        return message

    def listen_results(self, key: str) -> None:
        """
        Take results sent over NATS on C{key}'s subjects, as a gateway
        process does: the token checked, the subject's node recorded, the
        reply sent.
        """
        from kcoral.gateway.jobs import (
            RESULT_JOB_HEADER,
            RESULT_TOKEN_HEADER,
            RESULTS_SUBJECT_PREFIX,
            result_reply,
            results_node,
        )

        async def seen(msg: Any) -> None:
            headers = msg.headers or {}
            job = headers.get(RESULT_JOB_HEADER, "")
            token = self._tokens.get(job)
            if token is None or headers.get(RESULT_TOKEN_HEADER) != token:
                self.refused += 1
                await msg.respond(result_reply(401, error="bad token"))
                return
            self._posted(
                job,
                PostedResult(
                    status=int(headers.get(RESULT_STATUS_HEADER, "0")),
                    content_type=headers.get(RESULT_CONTENT_TYPE_HEADER, ""),
                    node=results_node(msg.subject, key),
                    body=bytes(msg.data),
                    via="nats",
                ),
            )
            await msg.respond(result_reply(200, delivered=True))

        async def subscribe() -> None:
            await self._client.subscribe(f"{RESULTS_SUBJECT_PREFIX}.{key}.*", cb=seen)
            await self._client.flush()

        self._call(subscribe())

    def republish(self, message: JobMessage, compat: str, gpus: int = 0) -> None:
        """Publish C{message} again (a second copy of one job, as after a redelivery)."""
        self._call(self._js.publish(job_subject(compat, gpus), message.encode()))

    def cancel(self, job: str) -> bool:
        """Write the gateway's cancel claim; C{True} when it came first."""
        import nats.js.errors

        async def create() -> bool:
            try:
                await self._claims.create(job, Claim(cancelled=True).encode())
                return True
            except nats.js.errors.KeyWrongLastSequenceError:
                return False

        return self._call(create())

    def claim_of(self, job: str) -> Claim | None:
        import nats.js.errors

        async def get() -> Claim | None:
            try:
                entry = await self._claims.get(job)
            except nats.js.errors.KeyNotFoundError:
                return None
            return Claim.decode(entry.value or b"")

        return self._call(get())

    def presence(self) -> dict[str, Presence]:
        """The nodes' presence keys now."""
        import nats.js.errors

        async def read() -> dict[str, Presence]:
            try:
                keys = await self._nodes.keys()
            except nats.js.errors.NoKeysError:
                return {}
            found = {}
            for key in keys:
                try:
                    entry = await self._nodes.get(key)
                except nats.js.errors.KeyNotFoundError:
                    continue
                if entry.value:
                    found[key] = Presence.decode(entry.value)
            return found

        return self._call(read())

    def wait_presence(self, node: str, timeout: float = 60.0) -> Presence:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.presence().get(node)
            if found is not None:
                return found
            time.sleep(0.1)
        raise AssertionError(f"node {node} never announced itself")

    def queued(self) -> int:
        """Messages in the job stream."""

        async def count() -> int:
            info = await self._js.stream_info(STREAM)
            return int(info.state.messages)

        return self._call(count())

    def wait_result(self, job: str, timeout: float = 60.0) -> PostedResult:
        deadline = time.monotonic() + timeout
        with self._changed:
            while job not in self.results:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no result for job {job}")
                self._changed.wait(left)
            return self.results[job]

    # -- HTTP -------------------------------------------------------------------

    def _authorised(self, job: str, authorization: str | None) -> bool:
        token = self._tokens.get(job)
        return token is not None and authorization == f"Bearer {token}"

    def _posted(self, job: str, result: PostedResult) -> None:
        with self._changed:
            self.posts.append((job, result.node))
            self.results[job] = result
            self._changed.notify_all()


def _handler(pool: PoolStandIn) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _answer(self, status: int, body: bytes = b"") -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _route(self) -> tuple[str, str | None] | None:
            match = _ROUTE.match(self.path)
            if match is None:
                self._answer(404)
                return None
            job = match.group(1)
            if not pool._authorised(job, self.headers.get("Authorization")):
                pool.refused += 1
                self._answer(401)
                return None
            return job, match.group(3)

        def do_GET(self) -> None:
            route = self._route()
            if route is None:
                return
            job, digest = route
            if digest is None or digest not in pool.blobs:
                self._answer(404)
                return
            pool.fetches.setdefault(job, []).append(digest)
            self._answer(200, pool.corrupt.get(digest, pool.blobs[digest]))

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", "0"))
            body = self.rfile.read(length)
            route = self._route()
            if route is None:
                return
            job, digest = route
            if digest is not None:
                self._answer(405)
                return
            pool._posted(
                job,
                PostedResult(
                    status=int(self.headers.get(RESULT_STATUS_HEADER, "0")),
                    content_type=self.headers.get(RESULT_CONTENT_TYPE_HEADER, ""),
                    node=self.headers.get(RESULT_NODE_HEADER),
                    body=body,
                ),
            )
            self._answer(204)

    return Handler
