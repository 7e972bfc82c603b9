"""
The pool's schema (L{kcoral.gateway.jobs}) and the credentials of its NATS
bridge (L{kcoral.gateway.natsbridge}): names, codecs, and refusals of
malformed messages.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kcoral.gateway import jobs
from kcoral.gateway.jobs import (
    BlobRef,
    Claim,
    JobMessage,
    Presence,
    SchemaError,
    compat_key,
    consumer_name,
    job_subject,
    nats_result_headers,
    parse_result_headers,
    parse_result_reply,
    result_headers,
    result_reply,
    results_node,
    results_subject,
)
from kcoral.gateway.natsbridge import NatsCredentials, load_credentials

TARGET = {"device": "cpu", "arch": "x86_64"}
VERSIONS = {"kcoral": "0.1.0", "python": "3.11.2"}


def _job(**changes: object) -> JobMessage:
    fields: dict[str, object] = {
        "job": "a" * 32,
        "request_id": "req-1",
        "program": '{"instructions": []}',
        "blobs": (BlobRef(sha256="0" * 64, size=3),),
        "options": {"X-Extra": "1"},
        "deadline": 100.5,
        "token": "tok",
        "gateway": "https://gw.example:8000/",
        "prefer": "node-1",
        "prefer_until": 50.0,
        "client": "client:alice",
        "results": "f" * 32,
    }
    fields.update(changes)
    return JobMessage(**fields)  # type: ignore[arg-type]


def test_compat_key_is_order_free_and_short() -> None:
    """The compatibility key depends on content, not on key order."""
    key = compat_key(TARGET, VERSIONS)
    assert len(key) == 16 and int(key, 16) >= 0
    assert compat_key(dict(reversed(TARGET.items())), VERSIONS) == key
    assert compat_key(TARGET, {**VERSIONS, "python": "3.12"}) != key


def test_names() -> None:
    """Subjects and consumer names follow the shared design."""
    key = compat_key(TARGET, VERSIONS)
    assert job_subject(key, 0) == f"kcoral.jobs.{key}.0"
    assert consumer_name(key, 2) == f"jobs-{key}-2"
    assert jobs.program_gpus(None) == 0 and jobs.program_gpus(3) == 3
    for bad in (("nothex" * 3, 0), (key, -1), (key, 9), (key, True), ("ABCDEF0123456789", 1)):
        with pytest.raises(SchemaError):
            job_subject(*bad)  # type: ignore[arg-type]


def test_job_round_trip() -> None:
    """A job message decodes to what was encoded."""
    job = _job()
    assert JobMessage.decode(job.encode()) == job
    assert JobMessage.decode(_job(client=None).encode()).client is None
    # A job without a results key (an older gateway's) is posted over HTTP.
    older = _job().to_json()
    del older["results"]
    assert JobMessage.decode(json.dumps(older)).results is None
    assert (
        job.blob_url("f" * 64) == f"https://gw.example:8000/_pool/jobs/{'a' * 32}/blobs/{'f' * 64}"
    )
    assert job.result_url() == f"https://gw.example:8000/_pool/jobs/{'a' * 32}/result"


def test_job_preference() -> None:
    """Another node leaves a preferred job alone until the window closes."""
    job = _job()
    assert job.preferred_elsewhere("node-2", 10.0)
    assert not job.preferred_elsewhere("node-1", 10.0)
    assert not job.preferred_elsewhere("node-2", 50.0)
    assert not _job(prefer=None).preferred_elsewhere("node-2", 10.0)
    # Handed back a moment at a time, never past the window.
    assert job.defer_seconds(10.0) == jobs.PREFER_RETRY_SECONDS
    assert job.defer_seconds(49.95) == pytest.approx(0.05)
    assert job.defer_seconds(60.0) == 0.0


@pytest.mark.parametrize(
    "change",
    [
        {"job": "../x"},
        {"job": "a.b"},
        {"request_id": ""},
        {"program": 3},
        {"blobs": [{"sha256": "x", "size": 1}]},
        {"blobs": [{"sha256": "0" * 64, "size": -1}]},
        {"blobs": {}},
        {"options": {"a": 1}},
        {"deadline": "soon"},
        {"deadline": True},
        {"prefer": "a b"},
        {"token": None},
        {"client": 7},
        {"client": "x" * (jobs.MAX_CLIENT + 1)},
        {"results": "a.b"},
        {"results": ""},
        {"results": 3},
    ],
)
def test_job_refuses_malformed(change: dict[str, object]) -> None:
    """A malformed job message is a L{SchemaError}, never another exception."""
    value = _job().to_json()
    value.update(change)
    with pytest.raises(SchemaError):
        JobMessage.decode(json.dumps(value))


def test_results_over_nats() -> None:
    """
    Result subjects name the gateway process and the sending node; the
    message's headers are the post's plus the job and its token; the
    reply carries the post's status.
    """
    assert results_subject("k1", "node-a") == "kcoral.results.k1.node-a"
    assert results_node("kcoral.results.k1.node-a", "k1") == "node-a"
    assert results_node("kcoral.results.k2.node-a", "k1") is None
    assert results_node("kcoral.results.k1.a.b", "k1") is None
    for bad in (("k.1", "n"), ("k", "n.a"), ("k", ""), ("k", ">")):
        with pytest.raises(SchemaError):
            results_subject(*bad)
    headers = nats_result_headers(_job(), result_headers(200, "application/json", node="n"))
    assert "Content-Type" not in headers
    assert headers["X-KCoral-Result-Job"] == "a" * 32
    assert headers["X-KCoral-Result-Token"] == "tok"
    assert parse_result_headers(headers.get).node == "n"
    assert parse_result_reply(result_reply(200, delivered=True)) == (200, True)
    assert parse_result_reply(result_reply(401, error="no")) == (401, False)
    for garbage in (b"", b"[]", b'{"status": "200"}', b'{"status": 99}', b'{"status": true}'):
        with pytest.raises(SchemaError):
            parse_result_reply(garbage)


@pytest.mark.parametrize("data", [b"", b"[]", b"\xff", b"null", b'{"job": 1}'])
def test_decoders_refuse_garbage(data: bytes) -> None:
    """Every decoder refuses what is not its object."""
    for decoder in (JobMessage.decode, Presence.decode, Claim.decode):
        with pytest.raises(SchemaError):
            decoder(data)


def test_presence_round_trip() -> None:
    """A presence record decodes to what was encoded; C{can_take} reads GPUs and seats."""
    presence = Presence(
        node="n1",
        compat=compat_key(TARGET, VERSIONS),
        target=TARGET,
        versions=VERSIONS,
        gpus=2,
        seats=3,
        free=1,
        at=12.5,
    )
    assert Presence.decode(presence.encode()) == presence
    assert presence.can_take(0) and presence.can_take(2) and not presence.can_take(3)
    assert not Presence(node="n2", compat=presence.compat, seats=0).can_take(0)
    with pytest.raises(SchemaError):
        Presence.decode(json.dumps({**presence.to_json(), "compat": "x"}))
    with pytest.raises(SchemaError):
        Presence.decode(json.dumps({**presence.to_json(), "seats": -1}))


def test_claims() -> None:
    """A claim is a node's or a cancel, never both."""
    assert Claim.decode(Claim(node="n1").encode()) == Claim(node="n1")
    assert Claim.decode(Claim(cancelled=True).encode()) == Claim(cancelled=True)
    assert json.loads(Claim(cancelled=True).encode()) == {"cancelled": True}
    assert json.loads(Claim(node="n1").encode()) == {"node": "n1"}
    with pytest.raises(SchemaError):
        Claim()
    with pytest.raises(SchemaError):
        Claim(node="n1", cancelled=True)
    with pytest.raises(SchemaError):
        Claim.decode(b'{"node": "a/b"}')


def test_result_headers_round_trip() -> None:
    """A node's result head is read back by the gateway."""
    headers = result_headers(503, "application/json", retry_after="1", node="n1")
    head = parse_result_headers(headers.get)
    assert (head.status, head.content_type, head.retry_after, head.node) == (
        503,
        "application/json",
        "1",
        "n1",
    )
    assert headers["Content-Type"] == "application/octet-stream"


@pytest.mark.parametrize(
    "change",
    [
        {jobs.RESULT_STATUS_HEADER: "abc"},
        {jobs.RESULT_STATUS_HEADER: "99"},
        {jobs.RESULT_STATUS_HEADER: None},
        {jobs.RESULT_CONTENT_TYPE_HEADER: None},
        {jobs.RESULT_CONTENT_TYPE_HEADER: "text/\nplain"},
        {jobs.RESULT_RETRY_AFTER_HEADER: "soon"},
        {jobs.RESULT_NODE_HEADER: "a b"},
    ],
)
def test_result_headers_refused(change: dict[str, str | None]) -> None:
    """A malformed result head is a L{SchemaError}."""
    headers: dict[str, str | None] = dict(result_headers(200, "application/json", node="n"))
    headers.update(change)
    with pytest.raises(SchemaError):
        parse_result_headers(headers.get)


def test_credentials(tmp_path: Path) -> None:
    """A JSON user/password file or a .creds file; anything else refused."""
    plain = tmp_path / "node.json"
    plain.write_text(json.dumps({"user": "node-1", "password": "pw"}))
    assert load_credentials(str(plain)) == NatsCredentials(user="node-1", password="pw")
    assert load_credentials(str(plain)).connect_options() == {"user": "node-1", "password": "pw"}
    creds = tmp_path / "node.creds"
    creds.write_text("-----BEGIN NATS USER JWT-----\nx\n------END NATS USER JWT------\n")
    assert load_credentials(str(creds)).connect_options() == {"user_credentials": str(creds)}
    assert NatsCredentials().connect_options() == {}
    for text in ("user:pw", '{"user": "x"}', "[]"):
        bad = tmp_path / "bad"
        bad.write_text(text)
        with pytest.raises(ValueError):
            load_credentials(str(bad))
