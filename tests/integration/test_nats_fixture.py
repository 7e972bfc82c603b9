"""
The NATS fixture (L{kcoral.testing.nats}) against the real nats-server: its
credentials are required, a node's subject permissions hold (it pulls,
acknowledges, claims and announces itself, but neither publishes a job nor
writes another node's presence key), and a restart keeps queued jobs.

These drive nats-py directly on a private asyncio loop; the kcoral code
that uses NATS has its own tests (tests/integration/test_node_join.py).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import nats
import pytest
from nats.errors import NoServersError
from nats.js.api import ConsumerConfig, KeyValueConfig, RetentionPolicy, StreamConfig

from kcoral.testing.nats import (
    CLAIMS_BUCKET,
    GATEWAY_USER,
    JOBS_STREAM,
    NODES_BUCKET,
    NatsServer,
)

_T = TypeVar("_T")

#: How nats-py reports a refused JetStream publish: no acknowledgement
#: comes (the refusal itself arrives as an asynchronous -ERR, checked below).
REFUSED = nats.errors.TimeoutError


@pytest.fixture(scope="module")
def server() -> Iterator[NatsServer]:
    with NatsServer(node_ids=("node-a", "node-b")) as running:
        yield running


def run(coroutine: Callable[[], Awaitable[_T]]) -> _T:
    return asyncio.run(asyncio.wait_for(coroutine(), 60))


async def connect(server: NatsServer, user: str, errors: list[str] | None = None) -> Any:
    return await server.connect(user, errors)


async def prepare(gateway: Any) -> Any:
    """The gateway's side: the job stream and both buckets."""
    js = gateway.jetstream()
    await js.add_stream(
        StreamConfig(
            name=JOBS_STREAM,
            subjects=["kcoral.jobs.>"],
            retention=RetentionPolicy.WORK_QUEUE,
        )
    )
    await js.create_key_value(KeyValueConfig(bucket=NODES_BUCKET, ttl=3))
    await js.create_key_value(KeyValueConfig(bucket=CLAIMS_BUCKET))
    return js


async def _keys(kv: Any) -> list[str]:
    try:
        return list(await kv.keys())
    except nats.js.errors.NoKeysError:
        return []


def test_wrong_password_refused(server: NatsServer, tmp_path: Path) -> None:
    """A node's name with a wrong password does not connect."""
    wrong = server.write_credentials(tmp_path / "wrong.json", "node-a", "not-the-password")
    credentials = json.loads(wrong.read_text())
    errors: list[str] = []

    async def attempt() -> None:
        async def error_cb(e: Exception) -> None:
            errors.append(str(e))

        await nats.connect(
            server.url,
            user=credentials["user"],
            password=credentials["password"],
            allow_reconnect=False,
            max_reconnect_attempts=0,
            connect_timeout=5,
            error_cb=error_cb,
        )

    with pytest.raises((NoServersError, nats.errors.Error, OSError)):
        run(attempt)
    assert any("authorization" in e.lower() for e in errors), errors


def test_node_permissions(server: NatsServer) -> None:
    """
    node-a pulls and acknowledges a job, claims it (create-only: a second
    claim fails) and puts its own presence key; its attempts to publish a
    job and to write node-b's key are refused, and nothing of theirs lands.
    """
    errors: list[str] = []

    async def scenario() -> dict[str, Any]:
        gateway = await connect(server, GATEWAY_USER)
        node = await connect(server, "node-a", errors)
        try:
            gjs = await prepare(gateway)
            await gjs.publish("kcoral.jobs.abc.0", b'{"job": "j1"}')
            js = node.jetstream()
            await js.add_consumer(
                JOBS_STREAM,
                ConsumerConfig(durable_name="jobs-abc-0", filter_subject="kcoral.jobs.abc.0"),
            )
            sub = await js.pull_subscribe_bind("jobs-abc-0", JOBS_STREAM)
            (message,) = await sub.fetch(1, timeout=5)
            claims = await js.key_value(CLAIMS_BUCKET)
            first = await claims.create("j1", b'{"node": "node-a"}')
            with pytest.raises(nats.js.errors.KeyWrongLastSequenceError):
                await claims.create("j1", b'{"cancelled": true}')
            await message.ack()
            nodes = await js.key_value(NODES_BUCKET)
            await nodes.put("node-a", b'{"node": "node-a"}')
            gnodes = await gjs.key_value(NODES_BUCKET)
            # Read back at once: the key expires with the bucket's 3 s TTL.
            own = (await gnodes.get("node-a")).value
            # Refused: a job of its own, and node-b's presence.
            with pytest.raises(REFUSED):
                await js.publish("kcoral.jobs.abc.0", b'{"job": "forged"}', timeout=2)
            with pytest.raises(REFUSED):
                await nodes.put("node-b", b'{"node": "node-b"}')
            await node.flush()
            info = await gjs.stream_info(JOBS_STREAM)
            return {
                "claim": first,
                "own": own,
                "others": sorted(k for k in await _keys(gnodes) if k != "node-a"),
                "queued": info.state.messages,
            }
        finally:
            await node.close()
            await gateway.close()

    seen = run(scenario)
    assert seen["claim"] >= 1
    assert seen["own"] == b'{"node": "node-a"}'
    assert seen["others"] == []
    # The acknowledged job left the work queue, and the forged one never came.
    assert seen["queued"] == 0
    violations = [e for e in errors if "permissions violation" in e.lower()]
    assert any("kcoral.jobs.abc.0" in e for e in violations), errors
    assert any("$kv.kcoral-nodes.node-b" in e.lower() for e in violations), errors


def test_restart_keeps_queued_jobs(tmp_path: Path) -> None:
    """A job queued before a nats-server restart is still there after it."""
    with NatsServer(node_ids=("node-a",), directory=tmp_path / "nats") as server:

        async def publish() -> None:
            gateway = await connect(server, GATEWAY_USER)
            try:
                gjs = await prepare(gateway)
                await gjs.publish("kcoral.jobs.abc.0", b'{"job": "kept"}')
            finally:
                await gateway.close()

        async def count() -> int:
            gateway = await connect(server, GATEWAY_USER)
            try:
                info = await gateway.jetstream().stream_info(JOBS_STREAM)
                return int(info.state.messages)
            finally:
                await gateway.close()

        run(publish)
        server.restart()
        assert run(count) == 1
