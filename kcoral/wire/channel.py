# -*- test-case-name: tests.unit.test_wire_channel -*-
"""
The control channel between the reactor process and a worker, defined once.

Both sides import from here: the file descriptors, the framing, and one
frozen attrs class per message type (the idea of Twisted trial's
C{_dist.workercommands}: typed commands instead of string literals).

A frame is a JSON object (the header) and an optional binary payload, so
blob bytes and returned tensors cross the pipe without base64::

    >I header length | >Q payload length | header (UTF-8 JSON) | payload

The header's C{type} names the message class; L{encode} and L{decode} map a
message to a frame and back, refusing any unknown type, missing or extra
field, or field of the wrong JSON type with L{ChannelError}.  The parent
feeds received bytes to a L{FrameDecoder}; the worker, which has no reactor,
uses the blocking C{read_message} and C{write_message} of
L{kcoral.ipc.channel_io}, which also passes the descriptors of shared
buffers.  Nothing here reads or writes a file descriptor: this module is the
channel's values and its framing functions only.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import attrs

from kcoral.wire.jsontext import json_dumps
from kcoral.wire.parts import MAX_DESCRIPTORS, Part, SharedPart, is_shared

if TYPE_CHECKING:
    from kcoral.ipc.shared import SharedBuffer

#: The worker reads the parent's messages on this fd ...
TO_WORKER_FD = 3
#: ... and writes its own on this one.  Fds 1 and 2 never carry channel bytes.
FROM_WORKER_FD = 4
#: Both sides pass descriptors on this one, a C{SOCK_SEQPACKET} unix socket
#: (L{kcoral.ipc.shared}): the sealed memfds of blobs and of large returned
#: parts.  Each message's descriptors are sent just before the frame that
#: names them (a frame's C{shared_parts}, a blob's C{size}), so the reader
#: takes them when it decodes that frame.
DESCRIPTOR_FD = 5
#: The progress board (L{kcoral.ipc.board}): the worker posts the index
#: of the instruction it is about to run there, instead of an
#: L{Instruction} message, unless an L{Execute} asks for announcements.
PROGRESS_FD = 6

#: The channel's fds in a worker, each with who writes it (C{"w"}: the
#: parent writes, C{"r"}: the parent reads, C{"socket"}: both, passing
#: descriptors, C{"board"}: the progress board, shared memory).  Whatever
#: starts a worker hands it exactly these.
WORKER_CHANNEL_FDS: dict[int, str] = {
    TO_WORKER_FD: "w",
    FROM_WORKER_FD: "r",
    DESCRIPTOR_FD: "socket",
    PROGRESS_FD: "board",
}

#: A frame's prefix: its header's length and its payload's.
PREFIX = struct.Struct(">IQ")

#: Largest header accepted by default; headers carry JSON metadata, never bulk data.
MAX_HEADER_BYTES = 64 * 1024 * 1024

#: Largest payload accepted by default (a little above the largest request or response).
MAX_PAYLOAD_BYTES = 1 << 40

#: Retire reasons a worker may put in its L{Outcome}.
RETIRE_REQUEST_LIMIT = "request_limit"
RETIRE_POISONED = "poisoned_context"
WORKER_RETIRE_REASONS = frozenset({RETIRE_REQUEST_LIMIT, RETIRE_POISONED})

#: Program statuses an L{Outcome} reports (protocol §8.1).
OUTCOME_STATUSES = frozenset({"COMPLETED", "FAILED"})


class ChannelError(Exception):
    """The peer sent bytes that are not a valid frame or message."""


# ---------------------------------------------------------------------------
# Frames


@attrs.frozen
class Frame:
    """One framed header and payload, before it is read as a message."""

    header: dict[str, Any]
    payload: bytes = b""
    #: The frame's length on the wire (prefix, header and payload), when read.
    size: int = attrs.field(default=0, eq=False)

    @property
    def type(self) -> str:
        return str(self.header.get("type", ""))


def encode_frame(header: dict[str, Any], payload: bytes = b"") -> bytes:
    """Frame C{header} and C{payload} into one byte string."""
    return prefix_and_header(header, len(payload)) + bytes(payload)


def prefix_and_header(header: dict[str, Any], payload_length: int) -> bytes:
    encoded = json_dumps(header)
    return PREFIX.pack(len(encoded), payload_length) + encoded


def decode_header(raw: bytes) -> dict[str, Any]:
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ChannelError(f"malformed message header: {e}") from None
    if not isinstance(header, dict):
        raise ChannelError("message header must be a JSON object")
    return header


#: Largest frame (header and payload) of every message but an outcome: ready,
#: failed, lease and instruction messages are a few hundred bytes.
CONTROL_FRAME_BYTES = 64 * 1024

#: Room in an outcome's header beyond its results and captured output
#: (the error object with its truncated traceback, field names).
OUTCOME_SLACK_BYTES = 1 << 20


@attrs.frozen
class FrameLimits:
    """
    The largest header and payload a reader accepts.

    With C{max_control_bytes} set, a frame whose type is not one of
    C{bulk_types} must also fit in that many bytes in all; its header is
    read first, so an oversized payload is refused before it is buffered.
    """

    max_header_bytes: int = MAX_HEADER_BYTES
    max_payload_bytes: int = MAX_PAYLOAD_BYTES
    max_control_bytes: int | None = None
    bulk_types: frozenset[str] = frozenset()

    def check(self, header_length: int, payload_length: int) -> None:
        if header_length > self.max_header_bytes:
            raise ChannelError(
                f"message header of {header_length} bytes is over the limit of "
                f"{self.max_header_bytes}"
            )
        if payload_length > self.max_payload_bytes:
            raise ChannelError(
                f"message payload of {payload_length} bytes is over the limit of "
                f"{self.max_payload_bytes}"
            )

    def check_type(self, type_name: str, header_length: int, payload_length: int) -> None:
        """Refuse a frame of a small message type that claims to be large."""
        if self.max_control_bytes is None or type_name in self.bulk_types:
            return
        size = header_length + payload_length
        if size > self.max_control_bytes:
            raise ChannelError(
                f"a {type_name!r} message of {size} bytes is over the limit of "
                f"{self.max_control_bytes}"
            )


DEFAULT_LIMITS = FrameLimits()

#: What a worker may send when it runs no program (start-up, between jobs).
CONTROL_LIMITS = FrameLimits(
    max_header_bytes=CONTROL_FRAME_BYTES,
    max_payload_bytes=0,
    max_control_bytes=CONTROL_FRAME_BYTES,
)


def job_limits(max_response_bytes: int, output_limit: int) -> FrameLimits:
    """
    What a worker may send while it runs one program: small control frames,
    and outcomes and returns no larger than the response they may become (results
    within C{max_response_bytes}, each output stream within C{output_limit}
    bytes, which JSON may escape to six bytes each).
    """
    return FrameLimits(
        max_header_bytes=max(0, max_response_bytes)
        + 12 * max(0, output_limit)
        + OUTCOME_SLACK_BYTES,
        max_payload_bytes=max(0, max_response_bytes),
        max_control_bytes=CONTROL_FRAME_BYTES,
        bulk_types=frozenset({"outcome", "returned", "compile_request", "measurement"}),
    )


#: What decoding a JSON header may take at most, per byte of it, in Python
#: objects (measured: up to 33 for C{[{"":{}},...]}, 25 for C{[[],...]},
#: 3.3 for a list of floats, 1-5 for strings).
HEADER_DECODE_FACTOR = 40


def frame_cost(header_length: int, payload_length: int, decode_limit: int) -> int:
    """
    Server memory that reading and decoding a frame may take, before its
    header is seen: its bytes three times (the buffer, a copy, the decoded
    text or the cut parts) and its header's objects, at most
    C{decode_limit} (L{header_cost} is checked against it once the header
    is in).
    """
    wire = PREFIX.size + header_length + payload_length
    return 3 * wire + min(HEADER_DECODE_FACTOR * header_length, decode_limit)


def header_cost(
    raw: bytes | bytearray, start: int = 0, end: int | None = None, limit: int | None = None
) -> int:
    """
    An upper estimate of the memory C{json.loads} takes for the JSON text
    C{raw[start:end]} (counted in C{count} passes over it, never decoded
    nor copied): per value a pointer and an object, per list an empty one,
    per object a small dict, per string its object, per key a dict entry
    and the decoder's memo (typed results, C{{"type":"integer","value":0}},
    are estimated at about twice what they take), and the text again (four
    times where it is not ASCII: a string of astral characters).
    L{frame_cost} counts the buffer, its copy and the decoded text apart.

    With C{limit}, it may stop counting once the estimate is over it (and
    returns what it has, still over C{limit}).
    """
    end = len(raw) if end is None else end
    total = end - start
    terms = (
        (40, b","),
        (200, b"{"),
        (64, b":"),
        (25, b'"'),
        (64, b"["),
    )
    total += 40
    for weight, token in terms:
        if limit is not None and total > limit:
            return total
        total += weight * raw.count(token, start, end)
    if limit is None or total <= limit:
        with memoryview(raw) as view:
            if not bytes(view[start:end]).isascii():
                total += 3 * (end - start)
    return total


@attrs.define
class FrameDecoder:
    """
    Incremental decoder: C{feed} bytes as they arrive, get whole frames.

    Buffers at most one partial frame.  Its prefix is checked against
    C{limits} as soon as it arrives, and its header's type before its
    payload is buffered, so a frame that claims more than the limits allow
    is refused before its bytes are kept.  After a refusal the decoder keeps
    nothing more: every later C{feed} raises the same error.  C{limits} may
    be replaced between frames (the parent narrows them to what the current
    state allows).

    C{admit}, when set, is asked about each frame once its prefix is in
    (its header and payload lengths, within the limits) and may hold it:
    C{False} stops parsing there until the next C{feed} (which may be
    empty) asks again; C{inspect} sees each raw header before it is
    decoded (the buffer and the header's bounds in it, not a copy).  Both may raise L{ChannelError}.  (The parent reserves server
    memory for a frame with them, L{kcoral.server.workers.channelbudget}.)
    """

    limits: FrameLimits = DEFAULT_LIMITS
    admit: Callable[[int, int], bool] | None = None
    inspect: Callable[[bytearray, int, int], None] | None = None
    _buffer: bytearray = attrs.field(factory=bytearray)
    #: The decoded header and payload length of the frame being read.
    _current: tuple[dict[str, Any], int] | None = None
    _header_end: int = 0
    _admitted: bool = False
    _failed: ChannelError | None = None

    def feed(self, data: bytes) -> list[Frame]:
        """Add C{data} and return every frame it completes."""
        if self._failed is not None:
            raise self._failed
        self._buffer += data
        try:
            return self._frames()
        except ChannelError as e:
            self._failed = e
            self._buffer = bytearray()
            self._current = None
            raise

    def _frames(self) -> list[Frame]:
        frames = []
        buffer = self._buffer
        while True:
            if self._current is None:
                if len(buffer) < PREFIX.size:
                    break
                header_length, payload_length = PREFIX.unpack_from(buffer)
                self.limits.check(header_length, payload_length)
                if not self._admitted:
                    if self.admit is not None and not self.admit(header_length, payload_length):
                        break
                    self._admitted = True
                header_end = PREFIX.size + header_length
                if len(buffer) < header_end:
                    break
                if self.inspect is not None:
                    self.inspect(buffer, PREFIX.size, header_end)
                raw = _copy(buffer, PREFIX.size, header_end)
                header = decode_header(raw)
                del raw
                self.limits.check_type(str(header.get("type", "")), header_length, payload_length)
                del buffer[:header_end]
                self._current = (header, payload_length)
                self._header_end = header_end
            header, payload_length = self._current
            if len(buffer) < payload_length:
                break
            payload = _copy(buffer, 0, payload_length)
            del buffer[:payload_length]
            self._current = None
            self._admitted = False
            frames.append(Frame(header, payload, self._header_end + payload_length))
        return frames

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame still buffered."""
        return len(self._buffer)


def _copy(buffer: bytearray, start: int, end: int) -> bytes:
    """C{bytes(buffer[start:end])} in one copy, not two."""
    with memoryview(buffer) as view:
        return bytes(view[start:end])


# ---------------------------------------------------------------------------
# Field checks: JSON types, strictly (a bool is not an integer here)

_Check = Callable[[Any, "attrs.Attribute[Any]", Any], None]


def _json(*types: type, optional: bool = False) -> _Check:
    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is None and optional:
            return
        if isinstance(value, bool) and bool not in types:
            ok = False
        else:
            ok = isinstance(value, types)
        if not ok:
            raise TypeError(f"field {attribute.name!r} must be {_names(types, optional)}")

    return check


def _names(types: tuple[type, ...], optional: bool) -> str:
    names = {str: "a string", int: "an integer", bool: "a boolean", dict: "an object"}
    text = " or ".join(names.get(t, t.__name__) for t in types)
    return text + " or null" if optional else text


def _one_of(choices: frozenset[str], optional: bool = False) -> _Check:
    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is None and optional:
            return
        if value not in choices:
            raise ValueError(f"field {attribute.name!r} must be one of {sorted(choices)}")

    return check


# ---------------------------------------------------------------------------
# Messages

_REGISTRY: dict[str, type[ChannelMessage]] = {}

_M = TypeVar("_M", bound="type[ChannelMessage]")


def _message(name: str) -> Callable[[_M], _M]:
    """Register a message class under its header C{type}."""

    def register(cls: _M) -> _M:
        if name in _REGISTRY:  # pragma: no cover - a programming error
            raise ValueError(f"message type {name!r} defined twice")
        cls.TYPE = name
        _REGISTRY[name] = cls
        return cls

    return register


@attrs.frozen
class ChannelMessage:
    """
    A message of the control channel.

    Subclasses are frozen attrs classes whose fields are the header's other
    keys; a subclass with a binary payload overrides L{_header_fields},
    L{payload} and L{_from_fields}.
    """

    TYPE: ClassVar[str] = ""

    def _header_fields(self) -> dict[str, Any]:
        return attrs.asdict(self, recurse=False)

    def header(self) -> dict[str, Any]:
        """The frame header: C{type} and every field."""
        return {"type": self.TYPE, **self._header_fields()}

    def payload(self) -> bytes:
        """The frame payload (none by default)."""
        return b""

    def descriptors(self) -> list[SharedBuffer]:
        """The buffers whose descriptors travel with this message (none by default)."""
        return []

    def inline_beyond(self, count: int) -> ChannelMessage:
        """The same message with its shared buffers after the first C{count} inline."""
        return self

    @classmethod
    def _header_keys(cls) -> frozenset[str]:
        return frozenset(a.name for a in attrs.fields(cls))

    @classmethod
    def _optional_keys(cls) -> frozenset[str]:
        """Header keys a frame may leave out."""
        return frozenset()

    @classmethod
    def _shared_sizes(cls, fields: dict[str, Any]) -> list[int]:
        """
        The sizes of the buffers a frame with header C{fields} carries as
        descriptors, in sending order.

        @raise ValueError: the header's description of them is malformed.
        """
        return []

    @classmethod
    def _from_fields(
        cls, fields: dict[str, Any], payload: bytes, shared: list[SharedBuffer]
    ) -> ChannelMessage:
        if payload:
            raise ChannelError(f"a {cls.TYPE!r} message carries no payload")
        return cls(**fields)


# -- parent to worker ---------------------------------------------------------


def _size(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError("a size must be a non-negative integer")
    return value


@_message("blob")
@attrs.frozen
class Blob(ChannelMessage):
    """
    A blob's bytes, sent before the L{Execute} that references it: in the
    payload, or (a L{SharedBuffer}) as a descriptor, the header's C{size}
    giving its length.
    """

    digest: str = attrs.field(validator=_json(str))
    data: bytes | SharedBuffer = attrs.field(
        default=b"", repr=False, validator=attrs.validators.instance_of((bytes, SharedPart))
    )

    def _header_fields(self) -> dict[str, Any]:
        if is_shared(self.data):
            return {"digest": self.digest, "size": len(self.data)}
        return {"digest": self.digest}

    def payload(self) -> bytes:
        return self.data if isinstance(self.data, bytes) else b""

    def descriptors(self) -> list[SharedBuffer]:
        return [self.data] if is_shared(self.data) else []

    @classmethod
    def _header_keys(cls) -> frozenset[str]:
        return frozenset({"digest"})

    @classmethod
    def _optional_keys(cls) -> frozenset[str]:
        return frozenset({"size"})

    @classmethod
    def _shared_sizes(cls, fields: dict[str, Any]) -> list[int]:
        return [] if "size" not in fields else [_size(fields["size"])]

    @classmethod
    def _from_fields(
        cls, fields: dict[str, Any], payload: bytes, shared: list[SharedBuffer]
    ) -> ChannelMessage:
        if shared:
            if payload:
                raise ChannelError("a shared blob carries no payload")
            del fields["size"]
            return cls(data=shared[0], **fields)
        return cls(data=payload, **fields)


@_message("execute")
@attrs.frozen
class Execute(ChannelMessage):
    """Run one program (the program JSON text) in C{workspace}."""

    program: str = attrs.field(validator=_json(str))
    #: The path of the request's workspace as the worker sees it.
    workspace: str = attrs.field(validator=_json(str))
    request_id: str = attrs.field(default="", validator=_json(str))
    output_limit: int = attrs.field(default=1048576, validator=_json(int))
    max_response_bytes: int = attrs.field(default=268435456, validator=_json(int))
    #: The most that decoding the JSON of the results sent (L{header_cost})
    #: may take in the parent (its channel budget's share); results that
    #: would take more are reported C{oversize}.  C{None}: no such bound.
    max_decode_bytes: int | None = attrs.field(default=None, validator=_json(int, optional=True))
    #: The workspace's top-level name kept for the sandbox (C{.kcoral}), or C{None}.
    reserved: str | None = attrs.field(default=None, validator=_json(str, optional=True))
    #: The request's execution budget in seconds (bounds compiles in the
    #: worker); C{None} when the parent gave none.
    timeout_seconds: float | None = attrs.field(
        default=None, validator=_json(float, int, optional=True)
    )
    #: Announce each instruction with an L{Instruction} message (the parent
    #: traces instructions, or gave no progress board) rather than posting
    #: it on the board.
    announce: bool = attrs.field(default=True, validator=_json(bool))
    #: Seconds the worker may watch for its next message awake once it has
    #: answered and settled (0: it sleeps in C{read} at once): the parent
    #: gives some only where a core is spare for every worker.
    watch_next_seconds: float = attrs.field(default=0.0, validator=_json(float, int))
    #: This is the worker's last program: it answers with C{retire}
    #: C{request_limit} and leaves.  The parent decides: it counts each
    #: worker's programs against C{--max-requests-per-worker}.  By default a
    #: worker serves one program, unless told it may serve another.
    last: bool = attrs.field(default=True, validator=_json(bool))


@_message("lease_granted")
@attrs.frozen
class LeaseGranted(ChannelMessage):
    """The answer to L{LeaseAcquire}: this worker now holds its GPUs."""


@_message("lease_next")
@attrs.frozen
class LeaseNext(ChannelMessage):
    """
    Sent while a L{LeaseAcquire} waits: this worker is first in line, so
    its L{LeaseGranted} is the next hand-over of its GPU.  A worker may
    watch for it without sleeping for a while (a sleeping process takes
    tens to hundreds of microseconds to wake, during which the GPU is idle).
    """


@_message("compile_done")
@attrs.frozen
class CompileDone(ChannelMessage):
    """
    The answer to L{CompileRequest}: the shared compile cache now holds the
    image under C{key} (the key the parent computed from the request), or
    the compile failed with C{kind} and C{error}.  C{cached}: the entry was
    there already (no compile ran); C{seconds} is then the original
    compile's time.
    """

    key: str = attrs.field(default="", validator=_json(str))
    seconds: float = attrs.field(default=0.0, validator=_json(int, float))
    kind: str | None = attrs.field(default=None, validator=_json(str, optional=True))
    error: str | None = attrs.field(default=None, validator=_json(str, optional=True))
    cached: bool = attrs.field(default=False, validator=_json(bool))


@_message("measurement_result")
@attrs.frozen
class MeasurementResult(ChannelMessage):
    """
    The answer to L{Measurement}: the C{benchmark} result the parent
    computed (its own record of the measurement), or why there is none.
    """

    result: dict[str, Any] | None = attrs.field(default=None, validator=_json(dict, optional=True))
    error: str | None = attrs.field(default=None, validator=_json(str, optional=True))


@_message("exit")
@attrs.frozen
class Exit(ChannelMessage):
    """Exit in an orderly way."""


@_message("teardown")
@attrs.frozen
class Teardown(ChannelMessage):
    """
    Sent to a GPU worker that answered a retiring L{Outcome}, once the parent
    holds its GPUs' maintenance lease: destroy the CUDA context(s) now,
    answer L{TornDown}, then exit (off the lease).
    """


# -- worker to parent ---------------------------------------------------------


@_message("ready")
@attrs.frozen
class Ready(ChannelMessage):
    """Start-up finished: the worker can take a program."""

    pid: int = attrs.field(validator=_json(int))
    target: dict[str, Any] = attrs.field(validator=_json(dict))
    versions: dict[str, Any] = attrs.field(validator=_json(dict))
    device: str = attrs.field(validator=_json(str))


@_message("failed")
@attrs.frozen
class Failed(ChannelMessage):
    """Start-up failed; the worker exits."""

    error: str = attrs.field(validator=_json(str))


@_message("lease_acquire")
@attrs.frozen
class LeaseAcquire(ChannelMessage):
    """Ask for this worker's GPU lease; the parent answers L{LeaseGranted}."""


@_message("lease_release")
@attrs.frozen
class LeaseRelease(ChannelMessage):
    """Give the lease back (no answer)."""


@_message("torn_down")
@attrs.frozen
class TornDown(ChannelMessage):
    """
    The answer to L{Teardown}.  With C{destroyed} false the context could
    not be destroyed in place, so it goes with the process: the parent
    keeps the lease until the process is gone.
    """

    destroyed: bool = attrs.field(validator=_json(bool))
    #: How long the teardown took in the worker.
    seconds: float = attrs.field(default=0.0, validator=_json(int, float))


@_message("compile_request")
@attrs.frozen
class CompileRequest(ChannelMessage):
    """
    Compile C{source} into the shared compile cache: the parent compiles it
    in a sandbox of its own, where no uploaded code runs, and writes the
    entry; the worker waits for L{CompileDone} and reads it back.
    """

    source: str = attrs.field(validator=_json(str))
    arch: str = attrs.field(validator=_json(str))
    options: list[str] = attrs.field(
        validator=attrs.validators.deep_iterable(
            attrs.validators.instance_of(str), attrs.validators.instance_of(list)
        )
    )
    backend: str = attrs.field(validator=_json(str))
    timeout: float = attrs.field(validator=_json(int, float))


@_message("instruction")
@attrs.frozen
class Instruction(ChannelMessage):
    """About to run instruction C{index}: a crash from now on is attributed to it."""

    index: int = attrs.field(validator=_json(int))


@_message("measure_start")
@attrs.frozen
class MeasureStart(ChannelMessage):
    """
    A C{benchmark}'s timed loop starts now: the parent notes the time on its
    own clock (the wall-clock envelope, L{kcoral.measurement}).
    """


@_message("measure_stop")
@attrs.frozen
class MeasureStop(ChannelMessage):
    """The timed loop announced by L{MeasureStart} ended now."""


@_message("measurement")
@attrs.frozen
class Measurement(ChannelMessage):
    """
    The raw measurement of the timed loop between L{MeasureStart} and
    L{MeasureStop} (L{kcoral.measurement.RawMeasurement} as JSON); the
    parent answers L{MeasurementResult}.
    """

    raw: dict[str, Any] = attrs.field(validator=_json(dict))


def _check_parts(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """attrs validator: binary parts are a tuple of bytes or shared buffers."""
    if not isinstance(value, tuple) or not all(isinstance(p, bytes) or is_shared(p) for p in value):
        raise TypeError("field 'parts' must be a tuple of bytes")


class _CarriesParts:
    """
    Mixin for messages whose C{parts} travel as the frame's payload, their
    sizes in the header's C{part_sizes}; the indices of those carried as
    descriptors (L{SharedBuffer}s) are in C{shared_parts}, and the payload
    holds only the others.
    """

    parts: tuple[Part, ...]

    def _header_fields(self) -> dict[str, Any]:
        fields = attrs.asdict(self, recurse=False)  # type: ignore[arg-type]
        del fields["parts"]
        fields["part_sizes"] = [len(part) for part in self.parts]
        shared = [i for i, part in enumerate(self.parts) if is_shared(part)]
        if shared:
            fields["shared_parts"] = shared
        return fields

    def payload(self) -> bytes:
        return b"".join(part for part in self.parts if isinstance(part, bytes))

    def descriptors(self) -> list[SharedBuffer]:
        return [part for part in self.parts if is_shared(part)]

    def inline_beyond(self, count: int) -> Any:
        parts: list[Part] = []
        for part in self.parts:
            if is_shared(part):
                if count <= 0:
                    part = part.tobytes()
                count -= 1
            parts.append(part)
        return attrs.evolve(self, parts=tuple(parts))  # type: ignore[misc]

    @classmethod
    def _header_keys(cls) -> frozenset[str]:
        return (super()._header_keys() - {"parts"}) | {"part_sizes"}  # type: ignore[misc, no-any-return]

    @classmethod
    def _optional_keys(cls) -> frozenset[str]:
        return frozenset({"shared_parts"})

    @classmethod
    def _shared_sizes(cls, fields: dict[str, Any]) -> list[int]:
        sizes = fields.get("part_sizes")
        if not isinstance(sizes, list):
            raise ValueError("'part_sizes' must be a list of sizes")
        indices = _shared_indices(fields.get("shared_parts", []), len(sizes))
        return [_size(sizes[i]) for i in indices]

    @classmethod
    def _from_fields(
        cls, fields: dict[str, Any], payload: bytes, shared: list[SharedBuffer]
    ) -> Any:
        sizes = fields.pop("part_sizes")
        indices = fields.pop("shared_parts", [])
        parts = _split_parts(sizes, payload, dict(zip(indices, shared, strict=True)))
        return cls(parts=parts, **fields)  # type: ignore[call-arg]


@_message("outcome")
@attrs.frozen
class Outcome(_CarriesParts, ChannelMessage):
    """
    How one program ended.  The header carries C{part_sizes}; the payload is
    the binary parts concatenated in numbering order.
    """

    status: str = attrs.field(validator=_one_of(OUTCOME_STATUSES))
    results: dict[str, Any] = attrs.field(factory=dict, validator=_json(dict))
    error: dict[str, Any] | None = attrs.field(default=None, validator=_json(dict, optional=True))
    stdout: str = attrs.field(default="", validator=_json(str))
    stderr: str = attrs.field(default="", validator=_json(str))
    stdout_truncated: bool = attrs.field(default=False, validator=_json(bool))
    stderr_truncated: bool = attrs.field(default=False, validator=_json(bool))
    retire: str | None = attrs.field(
        default=None, validator=_one_of(WORKER_RETIRE_REASONS, optional=True)
    )
    #: The size results and parts would have had, when over the request's
    #: C{max_response_bytes}: they are left out, so the frame stays within
    #: the limits the parent reads it under.
    oversize: int | None = attrs.field(default=None, validator=_json(int, optional=True))
    parts: tuple[Part, ...] = attrs.field(default=(), repr=False, validator=_check_parts)
    #: How many leading binary parts were already sent with L{Returned}
    #: messages; C{parts} holds only the ones after them.
    streamed_parts: int = attrs.field(default=0, validator=_json(int))


@_message("returned")
@attrs.frozen
class Returned(_CarriesParts, ChannelMessage):
    """
    One C{return} instruction finished: its result and its binary parts,
    sent at once so they survive a later crash of the worker.
    """

    key: str = attrs.field(validator=_json(str))
    value: Any = attrs.field()
    parts: tuple[Part, ...] = attrs.field(default=(), repr=False, validator=_check_parts)


def fit_outcome(outcome: Outcome, limit: int, max_decode: int | None = None) -> Outcome:
    """
    C{outcome}, or the same without its results and parts when either is
    over C{limit} (the parent reads no larger outcome, see L{job_limits},
    and answers C{response_too_large}), or when decoding the results' JSON
    would take the parent more than C{max_decode} (its channel budget's
    share, L{header_cost}).  The worker's engine sends what this leaves;
    the server's compile-only programs (L{kcoral.server.workers.compileonly})
    answer it likewise.
    """
    size = sum(len(part) for part in outcome.parts)
    if size <= limit:
        try:
            text = json_dumps(outcome.results)
        except (TypeError, ValueError):
            return outcome
        results = len(text)
        costly = max_decode is not None and header_cost(text) > max_decode - _OUTPUT_COST * (
            len(outcome.stdout) + len(outcome.stderr)
        )
        if results <= limit + CONTROL_FRAME_BYTES and not costly:
            return outcome
        size += results
    return attrs.evolve(outcome, results={}, parts=(), oversize=size)


#: What decoding a character of captured output may take the parent, at
#: most (its JSON escape, six bytes, each decoded to four).
_OUTPUT_COST = 24


def _shared_indices(value: Any, count: int) -> list[int]:
    """A header's C{shared_parts}: increasing indices of its C{count} parts."""
    if not isinstance(value, list) or len(value) > MAX_DESCRIPTORS:
        raise ValueError(f"'shared_parts' must be a list of at most {MAX_DESCRIPTORS} indices")
    previous = -1
    for index in value:
        if isinstance(index, bool) or not isinstance(index, int) or not previous < index < count:
            raise ValueError("'shared_parts' must be increasing indices of 'part_sizes'")
        previous = index
    return value


def _split_parts(
    sizes: Any, payload: bytes, shared: dict[int, SharedBuffer] | None = None
) -> tuple[Part, ...]:
    """
    Cut C{payload} into parts of C{sizes} (a header's C{part_sizes}); the
    parts at the indices of C{shared} are those buffers instead.
    """
    shared = shared or {}
    if not isinstance(sizes, list) or not all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in sizes
    ):
        raise ChannelError("'part_sizes' must be a list of sizes")
    inline = sum(size for i, size in enumerate(sizes) if i not in shared)
    if inline != len(payload):
        raise ChannelError(f"'part_sizes' add up to {inline} bytes, the payload has {len(payload)}")
    view = memoryview(payload)
    parts: list[Part] = []
    offset = 0
    for index, size in enumerate(sizes):
        buffer = shared.get(index)
        if buffer is not None:
            parts.append(buffer)
            continue
        parts.append(bytes(view[offset : offset + size]))
        offset += size
    return tuple(parts)


#: Every message type, by the name its header carries.
MESSAGE_TYPES: dict[str, type[ChannelMessage]] = dict(_REGISTRY)


def encode(message: ChannelMessage) -> bytes:
    """The frame of C{message}, as bytes."""
    return encode_frame(message.header(), message.payload())


#: Takes the next message's shared buffers from the descriptor socket:
#: C{take(sizes)} returns one sealed buffer of each size, in order (each
#: checked: L{kcoral.ipc.channel_io.take_shared}), or raises L{ChannelError}
#: with every descriptor it received closed.
TakeShared = Callable[[list[int]], "list[SharedBuffer]"]


def decode(
    frame: Frame,
    take: TakeShared | None = None,
    max_shared_bytes: int | None = None,
) -> ChannelMessage:
    """
    The message a frame carries, with the buffers it names taken from the
    descriptor socket through C{take}.

    @raise ChannelError: unknown type, a missing or extra field, a field of
        the wrong type or value, a payload where none belongs, or shared
        buffers that are absent, not sealed buffers, of another size, or
        over C{max_shared_bytes} in all.
    """
    fields = dict(frame.header)
    name = fields.pop("type", None)
    cls = _REGISTRY.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ChannelError(f"unknown message type {name!r}")
    expected = cls._header_keys()
    missing = expected - fields.keys()
    extra = fields.keys() - expected - cls._optional_keys()
    if missing or extra:
        raise ChannelError(
            f"bad {name!r} message: missing fields {sorted(missing)}, unknown fields {sorted(extra)}"
        )
    try:
        sizes = cls._shared_sizes(fields)
    except (TypeError, ValueError) as e:
        raise ChannelError(f"bad {name!r} message: {e}") from None
    shared = _take_shared(name, sizes, take, max_shared_bytes) if sizes else []
    try:
        return cls._from_fields(fields, frame.payload, shared)
    except (TypeError, ValueError, ChannelError) as e:
        for buffer in shared:
            buffer.close()
        raise ChannelError(f"bad {name!r} message: {e}") from None


def _take_shared(
    name: str, sizes: list[int], take: TakeShared | None, max_shared_bytes: int | None
) -> list[SharedBuffer]:
    if take is None:
        raise ChannelError(f"a {name!r} message names descriptors this channel does not pass")
    total = sum(sizes)
    if max_shared_bytes is not None and total > max_shared_bytes:
        raise ChannelError(
            f"a {name!r} message shares {total} bytes, over the limit of {max_shared_bytes}"
        )
    try:
        return take(sizes)
    except ChannelError as e:
        raise ChannelError(f"bad {name!r} message: {e}") from None


def prepare(message: ChannelMessage) -> tuple[ChannelMessage, bytes, bytes]:
    """
    C{message} ready to send: with its shared buffers past
    L{MAX_DESCRIPTORS} inline, its prefix and header, and its payload.
    Encoded before anything is sent, so a header without a JSON form fails
    with nothing written.
    """
    if len(message.descriptors()) > MAX_DESCRIPTORS:
        # One message passes at most MAX_DESCRIPTORS; the other parts go inline.
        message = message.inline_beyond(MAX_DESCRIPTORS)
    payload = message.payload()
    return message, prefix_and_header(message.header(), len(payload)), payload


@attrs.define
class MessageDecoder:
    """L{FrameDecoder} that returns messages: every frame must be a valid one."""

    _frames: FrameDecoder = attrs.field(factory=FrameDecoder)

    def feed(self, data: bytes) -> list[ChannelMessage]:
        return [decode(frame) for frame in self._frames.feed(data)]

    @property
    def pending(self) -> int:
        return self._frames.pending
