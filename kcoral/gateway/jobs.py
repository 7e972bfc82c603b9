# -*- test-case-name: tests.unit.test_gateway_jobs -*-
"""
The pool's schema: NATS names and the JSON messages the gateway and its
nodes exchange (issue 37), as constants, attrs values and codecs.  No
Twisted, no nats-py: both sides and the tests import it.

 - JetStream stream L{STREAM} (work-queue retention, file storage, at most
   the gateway's C{--queue-size} messages, discard new) over
   C{kcoral.jobs.>}; a job goes to L{job_subject} C{(compat, gpus)} and is
   pulled through the durable consumer L{consumer_name} C{(compat, gpus)}.
 - KV bucket L{NODES_BUCKET}: each node's L{Presence}, under its node id,
   put every second; the bucket's TTL is the presence timeout.
 - KV bucket L{CLAIMS_BUCKET}: one create-only key per job id, a
   L{Claim} (a node's, or the gateway's cancel).  The first create wins.
 - Node to gateway over HTTP(S), C{Authorization: Bearer <job token>}:
   C{GET /_pool/jobs/<job>/blobs/<sha256>} and C{POST /_pool/jobs/<job>/result}
   (L{result_headers}).
 - A small result (at most L{NATS_RESULT_BYTES}) goes instead as a NATS
   request to L{results_subject} C{(job.results, node)}, with the same
   headers plus the job and its token (L{nats_result_headers}); the gateway
   process that holds the job's client replies with L{result_reply}.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any, TypeGuard

import attrs

__all__ = [
    "CLAIMS_BUCKET",
    "NODES_BUCKET",
    "STREAM",
    "Claim",
    "JobMessage",
    "Presence",
    "SchemaError",
    "compat_key",
    "consumer_name",
    "job_subject",
    "nats_result_headers",
    "parse_result_reply",
    "result_reply",
    "results_node",
    "results_subject",
]

#: The JetStream work queue of jobs.
STREAM = "KCORAL_JOBS"
#: Subjects of the job stream: C{kcoral.jobs.<compat>.<gpus>}.
JOB_SUBJECTS = "kcoral.jobs.>"
JOB_SUBJECT_PREFIX = "kcoral.jobs"
#: KV bucket of node presence (key: node id).
NODES_BUCKET = "kcoral-nodes"
#: KV bucket of job claims (key: job id; create-only).
CLAIMS_BUCKET = "kcoral-claims"
#: Seconds a node's presence key lives without a refresh (the bucket's TTL).
DEFAULT_PRESENCE_TIMEOUT = 3.0
#: Seconds a claim key lives (the claims bucket's TTL): longer than any job.
CLAIMS_TTL = 24 * 3600.0
#: The most GPUs a program asks for (protocol: C{gpu_count} 1..8).
MAX_GPUS = 8

#: Seconds a node that is not a job's preferred node hands it back for
#: (NAK) at a time, inside the preference window: a NAK's delay keeps the
#: message from every node, the preferred one included, so it is short.
PREFER_RETRY_SECONDS = 0.1

#: Node-facing HTTP routes of the gateway.
POOL_PREFIX = "/_pool/jobs/"

#: Headers of C{POST /_pool/jobs/<job>/result}: the status and content type
#: of the response the node's own server gave; the request body is that
#: response's body, sent as C{application/octet-stream}.
RESULT_STATUS_HEADER = "X-KCoral-Result-Status"
RESULT_CONTENT_TYPE_HEADER = "X-KCoral-Result-Content-Type"
#: Optional: the node server's C{Retry-After}, relayed as it is.
RESULT_RETRY_AFTER_HEADER = "X-KCoral-Result-Retry-After"
#: The node that ran the job (relayed to the client as C{X-KCoral-Node}).
RESULT_NODE_HEADER = "X-KCoral-Result-Node"

#: Results of small jobs, node to gateway over NATS:
#: C{kcoral.results.<gateway process key>.<node id>}.  A node's NATS user
#: may publish on C{kcoral.results.*.<its id>} only, so the subject's last
#: token is the sender's node id, as nats-server authenticated it.
RESULTS_SUBJECT_PREFIX = "kcoral.results"
#: The largest result body sent over NATS (under nats-server's default
#: 1 MiB C{max_payload}); larger ones are posted over HTTP.
NATS_RESULT_BYTES = 256 * 1024
#: Headers of a result sent over NATS beside L{result_headers}' own.
RESULT_JOB_HEADER = "X-KCoral-Result-Job"
RESULT_TOKEN_HEADER = "X-KCoral-Result-Token"

#: The longest client identity a job carries (a token's client name or an address).
MAX_CLIENT = 256

#: Node ids and job ids: NATS KV key and subject-token safe.
_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
_HEX16 = re.compile(r"^[0-9a-f]{16}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class SchemaError(ValueError):
    """A pool message that does not follow the schema."""


def valid_id(value: object) -> TypeGuard[str]:
    """Whether C{value} may be a node id or a job id (a KV key, a subject token)."""
    return isinstance(value, str) and _ID.match(value) is not None


def node_inbox(node_id: str) -> str:
    """
    The reply-subject prefix node C{node_id} connects with (nats-py's
    C{inbox_prefix}): its NATS user may subscribe to C{<prefix>.>} only, so
    it cannot read replies meant for the gateway or another node.
    """
    return f"_INBOX_{node_id}"


def canonical_compat(target: Mapping[str, Any], versions: Mapping[str, Any]) -> bytes:
    """The canonical JSON of a node's C{target} and C{versions} (as /health reports them)."""
    return json.dumps(
        {"target": dict(target), "versions": dict(versions)},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=True,
    ).encode("ascii")


def compat_key(target: Mapping[str, Any], versions: Mapping[str, Any]) -> str:
    """The compatibility class of a node: the first 16 hex digits of the SHA-256 of L{canonical_compat}."""
    return hashlib.sha256(canonical_compat(target, versions)).hexdigest()[:16]


def _check_compat(compat: object) -> None:
    if not isinstance(compat, str) or _HEX16.match(compat) is None:
        raise SchemaError(f"bad compatibility key {compat!r}")


def _check_gpus(gpus: int) -> None:
    if isinstance(gpus, bool) or not isinstance(gpus, int) or not 0 <= gpus <= MAX_GPUS:
        raise SchemaError(f"bad GPU count {gpus!r}")


def job_subject(compat: str, gpus: int) -> str:
    """The subject a job for compatibility class C{compat} needing C{gpus} GPUs is published on."""
    _check_compat(compat)
    _check_gpus(gpus)
    return f"{JOB_SUBJECT_PREFIX}.{compat}.{gpus}"


def results_subject(results: str, node: str) -> str:
    """The subject node C{node} sends a result to the gateway process C{results} on."""
    if not valid_id(results) or not valid_id(node):
        raise SchemaError("bad results key or node id")
    return f"{RESULTS_SUBJECT_PREFIX}.{results}.{node}"


def results_node(subject: str, results: str) -> str | None:
    """The node id of a result's C{subject} on gateway process C{results}'s subjects, or C{None}."""
    prefix = f"{RESULTS_SUBJECT_PREFIX}.{results}."
    if not subject.startswith(prefix):
        return None
    node = subject[len(prefix) :]
    return node if valid_id(node) else None


def consumer_name(compat: str, gpus: int) -> str:
    """The durable pull consumer of L{job_subject} C{(compat, gpus)}."""
    _check_compat(compat)
    _check_gpus(gpus)
    return f"jobs-{compat}-{gpus}"


def program_gpus(gpu_count: int | None) -> int:
    """The C{<gpus>} of a program's subject: its C{gpu_count}, 0 without one."""
    return 0 if gpu_count is None else gpu_count


def _loads(data: bytes | str, what: str) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise SchemaError(f"{what}: not JSON") from None
    if not isinstance(value, dict):
        raise SchemaError(f"{what}: not a JSON object")
    return value


def _dumps(value: Mapping[str, Any]) -> bytes:
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode("utf-8")


def _number(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SchemaError(f"{what} must be a number")
    return float(value)


def _count(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SchemaError(f"{what} must be a non-negative integer")
    return value


def _string_map(value: object, what: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise SchemaError(f"{what} must be an object of strings")
    return dict(value)


@attrs.frozen(kw_only=True)
class BlobRef:
    """A blob a job needs: its SHA-256 and size."""

    sha256: str
    size: int

    def to_json(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "size": self.size}

    @classmethod
    def from_json(cls, value: object) -> BlobRef:
        if not isinstance(value, dict):
            raise SchemaError("blob: not an object")
        digest = value.get("sha256")
        if not isinstance(digest, str) or _SHA256.match(digest) is None:
            raise SchemaError("blob: bad sha256")
        return cls(sha256=digest, size=_count(value.get("size"), "blob size"))


@attrs.frozen(kw_only=True)
class JobMessage:
    """
    One job on the work queue.

    @ivar job: the job id (the claim key; the route of its blobs and result).
    @ivar request_id: the client request's id (the node's server answers with it).
    @ivar program: the program JSON text, as the client sent it.
    @ivar blobs: the blobs it references, fetched from the gateway.
    @ivar options: request headers the node's server needs beyond the program.
    @ivar deadline: unix time; a node that has not claimed it by then skips it.
    @ivar token: the job's capability for the gateway's node routes.
    @ivar gateway: the gateway's base URL for those routes.
    @ivar prefer: the node the client asked for (C{X-KCoral-Node}), or C{None}.
    @ivar prefer_until: unix time until which only C{prefer} takes it.
    @ivar client: who sent it, as the gateway knows the client (its token's
        client name, or its address): a node's reuse scope keeps one
        client's programs from another's worker by it.
    @ivar results: the key of the gateway process's result subjects
        (L{results_subject}): a small result may go there over NATS; with
        none, every result is posted over HTTP.
    """

    job: str
    request_id: str
    program: str
    blobs: tuple[BlobRef, ...] = ()
    options: Mapping[str, str] = attrs.field(factory=dict)
    deadline: float
    token: str
    gateway: str
    prefer: str | None = None
    prefer_until: float = 0.0
    client: str | None = None
    results: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "request_id": self.request_id,
            "program": self.program,
            "blobs": [b.to_json() for b in self.blobs],
            "options": dict(self.options),
            "deadline": self.deadline,
            "token": self.token,
            "gateway": self.gateway,
            "prefer": self.prefer,
            "prefer_until": self.prefer_until,
            "client": self.client,
            "results": self.results,
        }

    def encode(self) -> bytes:
        return _dumps(self.to_json())

    @classmethod
    def decode(cls, data: bytes | str) -> JobMessage:
        value = _loads(data, "job")
        job = value.get("job")
        if not valid_id(job):
            raise SchemaError("job: bad job id")
        for key in ("request_id", "program", "token", "gateway"):
            if not isinstance(value.get(key), str) or not value[key]:
                raise SchemaError(f"job: {key} must be a non-empty string")
        blobs = value.get("blobs", [])
        if not isinstance(blobs, list):
            raise SchemaError("job: blobs must be a list")
        prefer = value.get("prefer")
        if prefer is not None and not valid_id(prefer):
            raise SchemaError("job: bad preferred node")
        client = value.get("client")
        if client is not None and (not isinstance(client, str) or len(client) > MAX_CLIENT):
            raise SchemaError(f"job: client must be a string of at most {MAX_CLIENT} characters")
        results = value.get("results")
        if results is not None and not valid_id(results):
            raise SchemaError("job: bad results key")
        return cls(
            job=job,
            request_id=value["request_id"],
            program=value["program"],
            blobs=tuple(BlobRef.from_json(b) for b in blobs),
            options=_string_map(value.get("options", {}), "job options"),
            deadline=_number(value.get("deadline"), "job deadline"),
            token=value["token"],
            gateway=value["gateway"],
            prefer=prefer,
            prefer_until=_number(value.get("prefer_until", 0.0), "job prefer_until"),
            client=client,
            results=results,
        )

    def blob_url(self, sha256: str) -> str:
        """Where a node fetches one of this job's blobs."""
        return f"{self.gateway.rstrip('/')}{POOL_PREFIX}{self.job}/blobs/{sha256}"

    def result_url(self) -> str:
        """Where a node posts this job's result."""
        return f"{self.gateway.rstrip('/')}{POOL_PREFIX}{self.job}/result"

    def preferred_elsewhere(self, node: str, now: float) -> bool:
        """Whether C{node} should leave this job to the preferred node for now (NAK with a delay)."""
        return self.prefer is not None and self.prefer != node and now < self.prefer_until

    def defer_seconds(self, now: float) -> float:
        """
        The delay of the NAK that leaves this job to its preferred node: a
        moment (L{PREFER_RETRY_SECONDS}) at a time, never past the window.
        """
        return min(PREFER_RETRY_SECONDS, max(0.0, self.prefer_until - now))


@attrs.frozen(kw_only=True)
class Presence:
    """A node's presence record in L{NODES_BUCKET}."""

    node: str
    compat: str
    target: Mapping[str, Any] = attrs.field(factory=dict)
    versions: Mapping[str, Any] = attrs.field(factory=dict)
    gpus: int = 0
    seats: int = 0
    free: int = 0
    at: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "compat": self.compat,
            "target": dict(self.target),
            "versions": dict(self.versions),
            "gpus": self.gpus,
            "seats": self.seats,
            "free": self.free,
            "at": self.at,
        }

    def encode(self) -> bytes:
        return _dumps(self.to_json())

    @classmethod
    def decode(cls, data: bytes | str) -> Presence:
        value = _loads(data, "presence")
        node = value.get("node")
        if not valid_id(node):
            raise SchemaError("presence: bad node id")
        compat = value.get("compat")
        _check_compat(compat)
        assert isinstance(compat, str)
        target, versions = value.get("target", {}), value.get("versions", {})
        if not isinstance(target, dict) or not isinstance(versions, dict):
            raise SchemaError("presence: target and versions must be objects")
        gpus = _count(value.get("gpus", 0), "presence gpus")
        _check_gpus(min(gpus, MAX_GPUS))
        return cls(
            node=node,
            compat=compat,
            target=target,
            versions=versions,
            gpus=gpus,
            seats=_count(value.get("seats", 0), "presence seats"),
            free=_count(value.get("free", 0), "presence free"),
            at=_number(value.get("at", 0.0), "presence at"),
        )

    def can_take(self, gpus: int) -> bool:
        """Whether this node could ever run a job needing C{gpus} GPUs."""
        return self.seats > 0 and gpus <= self.gpus


@attrs.frozen(kw_only=True)
class Claim:
    """
    A job's claim in L{CLAIMS_BUCKET}: a node's (C{node} set) or the
    gateway's cancel (C{cancelled}).  Written with a create-only put.
    """

    node: str | None = None
    cancelled: bool = False

    def __attrs_post_init__(self) -> None:
        if (self.node is None) == (not self.cancelled):
            raise SchemaError("claim: exactly one of node and cancelled")

    def encode(self) -> bytes:
        if self.cancelled:
            return _dumps({"cancelled": True})
        return _dumps({"node": self.node})

    @classmethod
    def decode(cls, data: bytes | str) -> Claim:
        value = _loads(data, "claim")
        if value.get("cancelled") is True:
            return cls(cancelled=True)
        node = value.get("node")
        if not valid_id(node):
            raise SchemaError("claim: bad node id")
        return cls(node=node)


def result_headers(
    status: int, content_type: str, *, retry_after: str | None = None, node: str | None = None
) -> dict[str, str]:
    """The headers of a node's C{POST .../result} (besides C{Authorization})."""
    headers = {
        "Content-Type": "application/octet-stream",
        RESULT_STATUS_HEADER: str(status),
        RESULT_CONTENT_TYPE_HEADER: content_type,
    }
    if retry_after is not None:
        headers[RESULT_RETRY_AFTER_HEADER] = retry_after
    if node is not None:
        headers[RESULT_NODE_HEADER] = node
    return headers


def nats_result_headers(job: JobMessage, headers: Mapping[str, str]) -> dict[str, str]:
    """
    The NATS headers of C{job}'s result sent as a message: the post's
    result headers (C{headers}, L{result_headers}) less its content type,
    plus the job and its token.
    """
    sent = {k: v for k, v in headers.items() if k != "Content-Type"}
    sent[RESULT_JOB_HEADER] = job.job
    sent[RESULT_TOKEN_HEADER] = job.token
    return sent


def result_reply(status: int, *, delivered: bool = False, error: str | None = None) -> bytes:
    """
    The gateway's reply to a result sent over NATS: the HTTP status its
    post would have got (200, 400, 401, 410, 413) and, for a 200, whether
    the client got the answer.
    """
    value: dict[str, Any] = {"status": status, "delivered": delivered}
    if error is not None:
        value["error"] = error
    return _dumps(value)


def parse_result_reply(data: bytes) -> tuple[int, bool]:
    """
    The status and delivery of a L{result_reply}.

    @raise SchemaError: it is not one.
    """
    value = _loads(data, "result reply")
    status = value.get("status")
    if isinstance(status, bool) or not isinstance(status, int) or not 100 <= status <= 599:
        raise SchemaError("result reply: bad status")
    return status, value.get("delivered") is True


@attrs.frozen(kw_only=True)
class ResultHead:
    """What the gateway relays from a posted result besides its body."""

    status: int
    content_type: str
    retry_after: str | None = None
    node: str | None = None


_TOKEN_SAFE = re.compile(r"^[\x20-\x7e]{1,512}$")


def parse_result_headers(get: Any) -> ResultHead:
    """
    Read a posted result's head through C{get(name) -> str | None}.

    @raise SchemaError: a missing or malformed header.
    """
    status_text = get(RESULT_STATUS_HEADER)
    if status_text is None or not status_text.isdigit():
        raise SchemaError("result: missing or bad status")
    status = int(status_text)
    if not 200 <= status <= 599:
        raise SchemaError("result: status out of range")
    content_type = get(RESULT_CONTENT_TYPE_HEADER)
    if content_type is None or _TOKEN_SAFE.match(content_type) is None:
        raise SchemaError("result: missing or bad content type")
    retry_after = get(RESULT_RETRY_AFTER_HEADER)
    if retry_after is not None and (not retry_after.isdigit() or len(retry_after) > 6):
        raise SchemaError("result: bad Retry-After")
    node = get(RESULT_NODE_HEADER)
    if node is not None and not valid_id(node):
        raise SchemaError("result: bad node id")
    return ResultHead(status=status, content_type=content_type, retry_after=retry_after, node=node)
