"""
Tests for L{kcoral.wire.channel}: the framing and the typed messages of the
control channel.
"""

from __future__ import annotations

import io
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kcoral.ipc.channel_io import read_frame, read_message, write_frame, write_message
from kcoral.wire.channel import (
    CONTROL_LIMITS,
    FROM_WORKER_FD,
    MESSAGE_TYPES,
    TO_WORKER_FD,
    Blob,
    ChannelError,
    ChannelMessage,
    CompileDone,
    CompileRequest,
    Execute,
    Exit,
    Failed,
    Frame,
    FrameDecoder,
    FrameLimits,
    Instruction,
    LeaseAcquire,
    LeaseGranted,
    LeaseNext,
    LeaseRelease,
    Measurement,
    MeasurementResult,
    MeasureStart,
    MeasureStop,
    MessageDecoder,
    Outcome,
    Ready,
    Returned,
    Teardown,
    TornDown,
    decode,
    encode,
    encode_frame,
    job_limits,
)


def test_round_trip_through_stream() -> None:
    """A header and a binary payload come back as sent; EOF between frames is None."""
    stream = io.BytesIO()
    write_frame(stream, {"type": "blob", "digest": "ab"}, b"\x00\x01\xff")
    write_frame(stream, {"type": "execute", "program": "ünïcode"})
    stream.seek(0)
    assert read_frame(stream) == Frame({"type": "blob", "digest": "ab"}, b"\x00\x01\xff")
    assert read_frame(stream) == Frame({"type": "execute", "program": "ünïcode"})
    assert read_frame(stream) is None


def test_large_payload_written_without_copy_matches_encoding() -> None:
    """A large payload is written in two pieces but frames identically."""
    payload = bytes(range(256)) * 1024
    stream = io.BytesIO()
    write_frame(stream, {"type": "outcome"}, payload)
    assert stream.getvalue() == encode_frame({"type": "outcome"}, payload)


@given(st.binary(max_size=2048), st.integers(min_value=1, max_value=97))
def test_decoder_any_chunking(payload: bytes, chunk: int) -> None:
    """The incremental decoder yields the same frames however bytes arrive."""
    data = encode_frame({"type": "a", "n": 1}, payload) + encode_frame({"type": "b"})
    decoder = FrameDecoder()
    frames = []
    for i in range(0, len(data), chunk):
        frames += decoder.feed(data[i : i + chunk])
    assert frames == [Frame({"type": "a", "n": 1}, payload), Frame({"type": "b"})]
    assert decoder.pending == 0


def test_truncated_frame_is_an_error() -> None:
    """A stream that ends inside a frame is reported, not mistaken for EOF."""
    data = encode_frame({"type": "x"}, b"12345")[:-2]
    with pytest.raises(ChannelError):
        read_frame(io.BytesIO(data))


@pytest.mark.parametrize(
    "header",
    [b"not json", b"[1, 2]", b"\xff\xfe"],
)
def test_malformed_header_is_an_error(header: bytes) -> None:
    """Headers must be UTF-8 JSON objects."""
    frame = struct.pack(">IQ", len(header), 0) + header
    with pytest.raises(ChannelError):
        FrameDecoder().feed(frame)


def test_oversized_header_is_refused_before_buffering() -> None:
    """A peer cannot make the parent buffer a huge header."""
    with pytest.raises(ChannelError):
        FrameDecoder().feed(struct.pack(">IQ", 1 << 31, 0))


def test_frame_limits_are_parameters() -> None:
    """A reader can be given smaller limits than the defaults."""
    limits = FrameLimits(max_header_bytes=16, max_payload_bytes=4)
    with pytest.raises(ChannelError):
        FrameDecoder(limits).feed(encode_frame({"type": "a long header here"}))
    with pytest.raises(ChannelError):
        read_frame(io.BytesIO(encode_frame({}, b"12345")), limits)
    assert read_frame(io.BytesIO(encode_frame({}, b"1234")), limits) == Frame({}, b"1234")


# -- typed messages ------------------------------------------------------------

#: One example of every message type, payloads included.
EXAMPLES: list[ChannelMessage] = [
    Blob("ab" * 32, b"\x00\x01\xff"),
    Execute(
        program='{"instructions":[]}',
        workspace="/w",
        request_id="r",
        output_limit=1024,
        max_response_bytes=1 << 20,
        reserved=".kcoral",
    ),
    LeaseGranted(),
    LeaseNext(),
    Exit(),
    Ready(pid=7, target={"arch": "sm_90a"}, versions={"python": "3.11"}, device="gpu"),
    Failed("RuntimeError: no device"),
    LeaseAcquire(),
    LeaseRelease(),
    Teardown(),
    TornDown(destroyed=True, seconds=0.05),
    Instruction(3),
    Outcome(
        status="FAILED",
        results={"r": {"type": "bytes", "part": "return:0", "sha256": "x"}},
        error={"kind": "runtime", "message": "boom"},
        stdout="out ünï",
        stderr="err",
        stdout_truncated=True,
        stderr_truncated=False,
        retire="poisoned_context",
        parts=(b"abc", b"", b"\xff" * 70000),
        streamed_parts=2,
    ),
    Returned("t", {"type": "bytes", "part": "return:0", "sha256": "x"}, (b"ab", b"")),
    CompileRequest("__global__ void k() {}", "sm_90a", ["-O3"], "nvcc", 30.0),
    CompileDone(key="ab" * 32, seconds=1.25),
    MeasureStart(),
    MeasureStop(),
    Measurement(
        {"timer": "cupti_activity", "repeat": 2, "spans_ms": [0.5, None], "signature_of": [0, -1]}
    ),
    MeasurementResult(result={"latency_ms_median": 0.5, "validity": {"ok": True, "reasons": []}}),
    MeasurementResult(error="benchmark: no timed iteration caused any GPU activity"),
]


def test_fds_are_three_and_four() -> None:
    """The worker reads fd 3 and writes fd 4 (docs/architecture.md)."""
    assert (TO_WORKER_FD, FROM_WORKER_FD) == (3, 4)


def test_every_type_has_an_example() -> None:
    """The examples cover the registry: twenty message types, each named once."""
    assert sorted({m.TYPE for m in EXAMPLES}) == sorted(MESSAGE_TYPES)
    assert len(MESSAGE_TYPES) == 20
    for name, cls in MESSAGE_TYPES.items():
        assert cls.TYPE == name


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: m.TYPE)
def test_message_round_trip(message: ChannelMessage) -> None:
    """encode then decode gives an equal message, through bytes and through a stream."""
    frames = FrameDecoder().feed(encode(message))
    assert len(frames) == 1
    assert frames[0].type == message.TYPE
    assert decode(frames[0]) == message
    stream = io.BytesIO()
    write_message(stream, message)
    stream.seek(0)
    assert read_message(stream) == message
    assert read_message(stream) is None
    assert MessageDecoder().feed(encode(message)) == [message]


def test_outcome_frame_layout() -> None:
    """The outcome header lists part sizes; the payload is the parts, concatenated."""
    outcome = Outcome(status="COMPLETED", parts=(b"ab", b"cde"))
    header = outcome.header()
    assert header == {
        "type": "outcome",
        "status": "COMPLETED",
        "results": {},
        "error": None,
        "stdout": "",
        "stderr": "",
        "stdout_truncated": False,
        "stderr_truncated": False,
        "retire": None,
        "oversize": None,
        "part_sizes": [2, 3],
        "streamed_parts": 0,
    }
    assert outcome.payload() == b"abcde"


def test_blob_payload_is_its_data() -> None:
    """A blob's bytes travel as the payload, not in the header."""
    frame = FrameDecoder().feed(encode(Blob("d", b"xyz")))[0]
    assert frame == Frame({"type": "blob", "digest": "d"}, b"xyz")


@pytest.mark.parametrize(
    "header",
    [
        {},
        {"type": 3},
        {"type": "nonsense"},
        {"type": "Exit"},
    ],
)
def test_unknown_type_is_refused(header: dict[str, object]) -> None:
    """A header without a registered type is not a message."""
    with pytest.raises(ChannelError, match="unknown message type"):
        decode(Frame(header))


def _outcome_header(**changes: object) -> dict[str, object]:
    header = Outcome(status="COMPLETED").header()
    header.update(changes)
    return header


@pytest.mark.parametrize(
    ("header", "payload"),
    [
        # missing and extra fields
        ({"type": "instruction"}, b""),
        ({"type": "instruction", "index": 1, "extra": 2}, b""),
        ({"type": "exit", "now": True}, b""),
        ({"type": "blob"}, b"x"),
        ({"type": "blob", "digest": "d", "data": "x"}, b""),
        ({"type": "ready", "pid": 1, "target": {}, "versions": {}}, b""),
        # wrong JSON types
        ({"type": "instruction", "index": "1"}, b""),
        ({"type": "instruction", "index": True}, b""),
        ({"type": "instruction", "index": 1.5}, b""),
        ({"type": "failed", "error": None}, b""),
        ({"type": "blob", "digest": 5}, b""),
        ({"type": "ready", "pid": 1, "target": [], "versions": {}, "device": "cpu"}, b""),
        (
            {
                "type": "execute",
                "request_id": "r",
                "program": "{}",
                "workspace": "/w",
                "output_limit": "1024",
                "max_response_bytes": 1,
                "reserved": None,
            },
            b"",
        ),
        (
            {
                "type": "execute",
                "request_id": "r",
                "program": "{}",
                "workspace": "/w",
                "output_limit": 1024,
                "max_response_bytes": 1,
                "reserved": 0,
            },
            b"",
        ),
        (_outcome_header(status="DONE"), b""),
        (_outcome_header(retire="tired"), b""),
        (_outcome_header(stdout_truncated=1), b""),
        (_outcome_header(results=[]), b""),
        (_outcome_header(error="boom"), b""),
        # part sizes that do not describe the payload
        (_outcome_header(part_sizes=[2]), b"abc"),
        (_outcome_header(part_sizes=[4]), b"abc"),
        (_outcome_header(part_sizes=[-1, 4]), b"abc"),
        (_outcome_header(part_sizes="3"), b"abc"),
        (_outcome_header(part_sizes=[True, 2]), b"abc"),
        # a payload where none belongs
        ({"type": "lease_granted"}, b"x"),
        ({"type": "instruction", "index": 1}, b"x"),
    ],
)
def test_malformed_message_is_refused(header: dict[str, object], payload: bytes) -> None:
    """Every missing, extra or mistyped field is a ChannelError, never a crash."""
    with pytest.raises(ChannelError, match="bad|carries no payload|part_sizes"):
        decode(Frame(header, payload))
    with pytest.raises(ChannelError):
        MessageDecoder().feed(encode_frame(header, payload))
    with pytest.raises(ChannelError):
        read_message(io.BytesIO(encode_frame(header, payload)))


def test_messages_validate_on_construction() -> None:
    """The sending side cannot build an invalid message either."""
    with pytest.raises(TypeError):
        Instruction("1")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Outcome(status="DONE")
    with pytest.raises(TypeError):
        Outcome(status="COMPLETED", parts=[b"a"])  # type: ignore[arg-type]


def test_messages_are_frozen() -> None:
    """Messages are values."""
    import attrs

    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        Instruction(1).index = 2  # type: ignore[misc]


def test_job_limits_refuse_large_control_frames_from_header() -> None:
    """A small message type claiming a large payload is refused before it is buffered."""
    decoder = FrameDecoder(job_limits(1000, 10))
    frame = encode_frame({"type": "instruction", "index": 0}, b"p" * 70_000)
    with pytest.raises(ChannelError, match="over the limit"):
        decoder.feed(frame[:64])
    assert decoder.pending == 0


def test_job_limits_bound_the_outcome() -> None:
    """An outcome's payload may reach max_response_bytes, not more."""
    limits = job_limits(1000, 10)
    assert FrameDecoder(limits).feed(encode(Outcome(status="COMPLETED", parts=(b"a" * 1000,))))
    with pytest.raises(ChannelError, match="payload"):
        FrameDecoder(limits).feed(encode(Outcome(status="COMPLETED", parts=(b"a" * 1001,)))[:40])


def test_decoder_refuses_everything_after_an_error() -> None:
    """After a refused frame the decoder keeps nothing more."""
    decoder = FrameDecoder(CONTROL_LIMITS)
    with pytest.raises(ChannelError):
        decoder.feed(struct.pack(">IQ", 10, 1 << 39))
    with pytest.raises(ChannelError):
        decoder.feed(encode_frame({"type": "ready"}))
    assert decoder.pending == 0


def test_read_frame_checks_type_limits() -> None:
    """The blocking reader applies the same per-type bound."""
    frame = encode_frame({"type": "instruction"}, b"x" * 70_000)
    with pytest.raises(ChannelError):
        read_frame(io.BytesIO(frame), job_limits(1 << 20, 10))


@pytest.mark.parametrize(
    "header",
    [
        {"type": "torn_down"},
        {"type": "torn_down", "destroyed": 1, "seconds": 0.1},
        {"type": "torn_down", "destroyed": True, "seconds": "0.1"},
        {"type": "torn_down", "destroyed": True, "seconds": 0.1, "extra": 1},
        {"type": "teardown", "now": True},
    ],
)
def test_teardown_pair_is_strict(header: dict[str, object]) -> None:
    """The teardown pair decodes only with exactly its fields, of their types."""
    with pytest.raises(ChannelError):
        decode(Frame(header))


def test_teardown_carries_no_payload() -> None:
    """A payload on a teardown message is refused."""
    with pytest.raises(ChannelError, match="carries no payload"):
        decode(Frame({"type": "teardown"}, b"x"))
