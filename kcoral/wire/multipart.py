# -*- test-case-name: tests.unit.test_wire_multipart -*-
"""
Request and response framing: C{multipart/form-data} (protocol §3, §8.2).

L{RequestBodyParser} takes the request body in chunks as it arrives, so a
256 MiB body is never held twice: each blob payload streams into a
L{BlobWriter} its caller injects, which hashes it once and keeps it (in
memory here; the server's L{kcoral.ipc.uploads.BlobStore} spools it or
streams it into a sealed shared buffer, with threads past a megabyte).  It
accepts and rejects what
the 0.1.1 reference parser does, with its messages, including bare-LF framing,
transport padding after delimiters, preambles and epilogues.

The delimiter scanner is our own: the C{multipart} library's push parser
insists on CRLF framing and a CRLF before the first delimiter, and rejects
padding after a delimiter, all of which §3.3 requires us to accept.  Part
headers are parsed with the standard library's C{email} parser, exactly like
the reference, so header defects are judged identically; as that costs the
reactor milliseconds, the verdict on a short header section is remembered
and a plain-token boundary is read without it.
"""

from __future__ import annotations

import functools
import hashlib
import io
import re
import secrets
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from email.parser import BytesHeaderParser
from email.policy import default as _default_policy
from typing import IO, TYPE_CHECKING, Any, Protocol

import attrs

from kcoral.wire.jsontext import json_dumps
from kcoral.wire.program import (
    Program,
    Upload,
    ValidationError,
    is_digest,
    strict_json_loads,
    tensor_nbytes,
)

if TYPE_CHECKING:
    from kcoral.ipc.shared import SharedBuffer

#: A chunk at least this large, inside a part and with no delimiter in it,
#: reaches the part's handler as a view of itself, not through the
#: scanner's buffer (L{_Scanner._direct}): one copy fewer per byte.
DIRECT_FEED_BYTES = 16 * 1024

#: Largest header section of one part we buffer (the reference has no limit;
#: legitimate headers are a few hundred bytes).
MAX_PART_HEADER_BYTES = 64 * 1024

_SPACES = re.compile(rb"[ \t]*")
_NEED = "need"
_INVALID = "invalid"


class RequestTooLarge(Exception):
    """The request body exceeded C{max_bytes} (HTTP 413, protocol §3.2)."""


def boundary_from_content_type(value: str | None) -> str:
    """
    The boundary of a request's C{Content-Type} header (protocol §3.3).

    @raise ValidationError: "expected a multipart/form-data request" or
        "malformed multipart/form-data boundary".
    """
    if not value or not value.lower().startswith("multipart/form-data"):
        raise ValidationError("expected a multipart/form-data request")
    simple = _SIMPLE_CONTENT_TYPE.fullmatch(value)
    if simple is not None:
        # What httpx (the 0.1.1 client) and our client send: a bare token,
        # which the email parser takes as is, with no defect.  Parsing it
        # there costs the reactor about a millisecond a request.
        return simple.group(1)
    malformed = ValidationError("malformed multipart/form-data boundary")
    try:
        header = BytesHeaderParser(policy=_default_policy).parsebytes(
            f"Content-Type: {value}\r\n\r\n".encode("ascii")
        )
        boundary = header.get_boundary()
        if header.get_content_type() != "multipart/form-data" or not boundary:
            raise malformed
        boundary.encode("ascii")
        defects = header["content-type"].defects
    except (UnicodeError, ValueError, TypeError):
        raise malformed from None
    if "\r" in boundary or "\n" in boundary or defects:
        raise malformed
    return boundary


#: A Content-Type whose boundary is a plain token: no quotes, comments or
#: other parameters for the email parser to judge.
_SIMPLE_CONTENT_TYPE = re.compile(r"multipart/form-data; boundary=([0-9A-Za-z_-]{1,70})")

#: Header sections longer than this are judged every time, never remembered.
_REMEMBERED_HEADERS_MAX = 1024


def _parse_part_headers(raw: bytes) -> tuple[str, str]:
    """
    Judge one part's header section as the reference does; return its name
    and its lowercased media type.

    The email parser costs about a millisecond of the reactor for each part,
    and clients send the same few header sections again and again (every
    C{program} part of the 0.1.1 client is byte for byte the same), so the
    verdict on a short section is remembered: it depends on its bytes alone.

    @raise ValidationError: the reference's verdict on a bad section.
    """
    if len(raw) > _REMEMBERED_HEADERS_MAX:
        return _judge_part_headers(raw)
    verdict = _remembered_verdict(bytes(raw))
    if isinstance(verdict, str):
        raise ValidationError(verdict)
    return verdict


@functools.lru_cache(maxsize=256)
def _remembered_verdict(raw: bytes) -> tuple[str, str] | str:
    """L{_judge_part_headers}'s answer, or the message of its rejection."""
    try:
        return _judge_part_headers(raw)
    except ValidationError as e:
        return e.message


def _judge_part_headers(raw: bytes) -> tuple[str, str]:
    item = BytesHeaderParser(policy=_default_policy).parsebytes(raw)
    if item.defects:
        raise ValidationError("malformed multipart part headers")
    if len(item.get_all("content-disposition", [])) != 1:
        raise ValidationError("each multipart part must have one Content-Disposition")
    if len(item.get_all("content-type", [])) != 1:
        raise ValidationError("each multipart part must have one Content-Type")
    if item["content-disposition"].defects:
        raise ValidationError("multipart part has a malformed Content-Disposition")
    if item["content-type"].defects:
        raise ValidationError("multipart part has a malformed Content-Type")
    if item.get_content_maintype() == "multipart":
        raise ValidationError("nested multipart parts are not supported")
    if item.get_content_disposition() != "form-data":
        raise ValidationError("multipart parts must use form-data disposition")
    params = item.get_params(header="content-disposition", unquote=True) or []
    names = [v for k, v in params[1:] if k.lower() == "name"]
    if len(names) != 1 or not isinstance(names[0], str) or not names[0]:
        raise ValidationError("multipart part is missing its name")
    encoding = item.get("content-transfer-encoding")
    if encoding and str(encoding).lower() not in ("binary", "8bit"):
        raise ValidationError("encoded multipart parts are not supported")
    return names[0], item.get_content_type()


class _PartHandler(Protocol):
    def start_part(self) -> None: ...

    def part_data(self, data: bytes | memoryview) -> None: ...

    def end_part(self) -> None: ...


class _Scanner:
    """
    Find delimiters in a byte stream and hand each part's content (headers
    and payload, framing removed) to a handler.

    A delimiter is C{--boundary} at offset 0 or right after an LF, then an
    optional C{--} (closing), any spaces/tabs, then CRLF or LF; a closing
    delimiter may also end the body.  The payload ends before the LF that
    precedes a delimiter, minus one CR.  Anything else is payload.
    """

    def __init__(self, boundary: bytes, handler: _PartHandler) -> None:
        self._marker = b"--" + boundary
        self._lf_marker = b"\n" + self._marker
        self._handler = handler
        self._buf = bytearray()
        self._state = "start"  # start, preamble, part, done
        self._pos = 0  # where the next search starts in _buf
        self._cand: int | None = None  # index of a candidate marker in _buf
        self._ws = 0  # padding already scanned after the candidate marker
        self.parts = 0

    @property
    def done(self) -> bool:
        return self._state == "done"

    def feed(self, data: bytes) -> None:
        if self._state == "done":
            return
        if (
            self._state == "part"
            and self._cand is None
            and len(data) >= DIRECT_FEED_BYTES
            and type(data) is bytes
            and self._direct(data)
        ):
            return
        self._buf += data
        self._run(final=False)

    def _direct(self, data: bytes) -> bool:
        """
        The common case inside a large payload: no delimiter in C{data} nor
        across its seam with the bytes kept from the last chunk.  The
        payload goes to the handler as a view of C{data} itself (immutable,
        so the handler may keep it) instead of through the buffer, and only
        the last bytes, which could begin a delimiter, are kept; whether it
        was that case.
        """
        marker = self._lf_marker
        keep = len(marker)
        tail = self._buf
        if len(data) <= keep or len(tail) > keep:
            return False
        if tail and (bytes(tail) + data[: keep - 1]).find(marker) >= 0:
            return False
        if data.find(marker) >= 0:
            return False
        if tail:
            self._handler.part_data(bytes(tail))
        self._handler.part_data(memoryview(data)[: len(data) - keep])
        self._buf = bytearray(data[len(data) - keep :])
        self._pos = 0
        return True

    def finish(self) -> None:
        """Signal the end of the body; raise if it had no closing delimiter."""
        if self._state != "done":
            self._run(final=True)
        if self._state != "done":
            raise ValidationError("malformed multipart/form-data body")
        if not self.parts:
            raise ValidationError("multipart body has no parts")

    def _release(self, cut: int) -> None:
        # Drop (or emit as payload) the first cut bytes of the buffer.
        if cut <= 0:
            return
        if self._state == "part":
            # A view, not a copy: handlers consume it before returning
            # (hash, write, or copy), so the buffer can shrink after.
            with memoryview(self._buf) as view, view[:cut] as data:
                self._handler.part_data(data)
        del self._buf[:cut]
        self._pos = max(0, self._pos - cut)
        if self._cand is not None:
            self._cand -= cut

    def _run(self, final: bool) -> None:
        marker = self._marker
        while self._state != "done":
            buf = self._buf
            if self._cand is None:
                if self._state == "start":
                    if len(buf) < len(marker) and not final and marker.startswith(buf):
                        return
                    self._state = "preamble"
                    if buf.startswith(marker):
                        self._cand = 0
                        self._ws = 0
                    continue
                index = buf.find(self._lf_marker, self._pos)
                if index < 0:
                    if not final:
                        # Keep what could be CR + LF + a partial marker.
                        self._release(len(buf) - len(self._lf_marker))
                    return
                self._cand = index + 1
                self._ws = 0
            verdict = self._tail(final)
            if verdict == _NEED:
                # Keep the candidate's LF and the byte before it (a CR?).
                self._release(self._cand - 2)
                return
            if verdict == _INVALID:
                self._pos = self._cand + len(marker)
                self._cand = None
                continue
            assert isinstance(verdict, tuple)
            after, closing = verdict
            if self._state == "part":
                end = self._cand - 1
                if end > 0 and buf[end - 1] == 13:
                    end -= 1
                if end > 0:
                    with memoryview(buf) as view, view[:end] as data:
                        self._handler.part_data(data)
                self._handler.end_part()
            del buf[:after]
            self._pos = 0
            self._cand = None
            if closing:
                self._state = "done"
                buf.clear()
            else:
                self._state = "part"
                self.parts += 1
                self._handler.start_part()

    def _tail(self, final: bool) -> str | tuple[int, bool]:
        buf = self._buf
        assert self._cand is not None
        start = self._cand + len(self._marker)
        n = len(buf)
        if n < start + 2 and not final:
            return _NEED
        closing = buf[start : start + 2] == b"--"
        t = max(start + 2 if closing else start, start + self._ws)
        match = _SPACES.match(buf, t)
        assert match is not None
        t = match.end()
        if t == n:
            if final:
                return (t, True) if closing else _INVALID
            self._ws = t - start
            return _NEED
        if buf[t] == 10:
            return t + 1, closing
        if buf[t] == 13:
            if t + 1 == n:
                if final:
                    return _INVALID
                self._ws = t - start
                return _NEED
            if buf[t + 1] == 10:
                return t + 2, closing
        return _INVALID


class Blob:
    """
    The payload of one C{blob:<sha256>} part: in memory, or in a sealed
    shared buffer (L{shared}); a spooled one is a
    L{kcoral.ipc.uploads.SpooledBlob}.
    """

    def __init__(
        self,
        digest: str,
        size: int,
        data: bytes | None,
        shared: SharedBuffer | None = None,
    ) -> None:
        self.digest = digest
        self.size = size
        self._data = data
        #: The sealed buffer holding the payload, when it streamed into one.
        #: It is shared (the memory cache may keep it): L{close} only lets go.
        self.shared = shared

    @classmethod
    def from_bytes(cls, data: bytes) -> Blob:
        """A blob held in memory (for tests and the client)."""
        return cls(hashlib.sha256(data).hexdigest(), len(data), bytes(data))

    @property
    def path(self) -> str | None:
        """The spool file's path, or C{None} for a blob not spooled."""
        return None

    def read(self) -> bytes:
        """All payload bytes."""
        if self._data is not None:
            return self._data
        if self.shared is not None:
            return self.shared.tobytes()
        raise ValueError("blob is closed")

    def open(self) -> IO[bytes]:
        """A binary file object reading the payload from its start."""
        return io.BytesIO(self.read())

    def close(self) -> None:
        """Let go of the shared buffer; idempotent."""
        self.shared = None

    def __repr__(self) -> str:
        where = "memory" if self._data is not None else self.shared or self.path
        return f"<Blob {self.digest} size={self.size} in {where}>"


class Offload(Protocol):
    """
    The threads writing and hashing a large blob off the parser's thread
    (L{kcoral.ipc.blobsink.BlobSink}), as the parser sees them.
    """

    @property
    def backlog(self) -> int:
        """Bytes handed over and not yet written and hashed."""

    def notify_at(self, level: int, callback: Callable[[], None]) -> None:
        """Call C{callback} (from any thread) once L{backlog} is C{level} or less."""

    def close(self) -> None:
        """No more bytes come: finish the last ones."""


class BlobWriter(Protocol):
    """
    Where one blob part's payload goes as it streams in: the one hash it
    gets, and its bytes held somewhere (L{MemoryBlobWriter}, or
    L{kcoral.ipc.uploads.BlobStore}'s memfds and spool files).
    """

    size: int

    @property
    def offload(self) -> Offload | None:
        """The threads writing and hashing it, once it has them."""

    def write(self, data: bytes | memoryview) -> None:
        """The next bytes of the payload (a view valid only during the call)."""

    def finish(self) -> Blob:
        """Every byte was written: the blob, with the digest of its bytes."""

    def discard(self) -> None:
        """Drop whatever was written (idempotent)."""


#: Makes the writer of a body's next blob, given how many blobs of the
#: body are held already.
NewBlob = Callable[[int], BlobWriter]


class MemoryBlobWriter:
    """
    A L{BlobWriter} that hashes a payload and keeps it in memory (a
    L{NewBlob}: C{held}, the blobs the body holds already, changes nothing
    here; the body's size limit bounds them).
    """

    offload: Offload | None = None

    def __init__(self, held: int = 0) -> None:
        self._hash = hashlib.sha256()
        self._memory: bytearray | None = bytearray()
        self.size = 0

    def write(self, data: bytes | memoryview) -> None:
        if self._memory is None:
            raise ValueError("blob writer is finished")
        self.size += len(data)
        self._hash.update(data)
        self._memory += data

    def finish(self) -> Blob:
        if self._memory is None:
            raise ValueError("blob writer is finished")
        data, self._memory = bytes(self._memory), None
        return Blob(self._hash.hexdigest(), self.size, data)

    def discard(self) -> None:
        self._memory = None


@attrs.frozen
class ParsedRequest:
    """
    A request body that passed every framing and part rule (protocol
    §3.3): the program bytes (not yet validated) and the supplied blobs.
    """

    program: bytes
    blobs: dict[str, Blob]

    def close(self) -> None:
        """Let go of every blob (a spooled one's file is deleted)."""
        for blob in self.blobs.values():
            blob.close()


class _HeaderReader:
    """Collect a part's header section until its blank line."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._scan = 0

    def add(self, data: bytes | memoryview) -> tuple[bytes, bytes] | None:
        """Return (header bytes, payload start) once the blank line is seen."""
        self._buf += data
        buf = self._buf
        while True:
            nl = buf.find(b"\n", self._scan)
            if nl < 0:
                return None
            if nl == self._scan or (nl == self._scan + 1 and buf[self._scan] == 13):
                return bytes(buf[: nl + 1]), bytes(buf[nl + 1 :])
            self._scan = nl + 1

    @property
    def size(self) -> int:
        return len(self._buf)


class RequestBodyParser:
    """
    Parse a C{/execute} request body pushed in chunks (protocol §3).

    Framing and header errors raise from L{feed} once the offending part is
    delimited.  Name, type, duplicate and digest errors are remembered and
    raised by L{close}, because the reference judges framing of every part
    before any part's name, so a later framing error must win.  Any error
    drops every blob (deleting spool files).

    Each blob part's payload goes to a writer that C{new_blob} makes: in
    memory by default (L{MemoryBlobWriter}); the server's
    L{kcoral.ipc.uploads.BlobStore} spools to files or streams into
    sealed shared buffers, with threads for the large ones.
    """

    def __init__(
        self,
        boundary: str,
        *,
        max_bytes: int,
        new_blob: NewBlob = MemoryBlobWriter,
    ) -> None:
        self._scanner = _Scanner(boundary.encode("ascii"), self)
        self._max_bytes = max_bytes
        self._new_blob = new_blob
        self.received = 0
        self._failed: BaseException | None = None
        self._deferred: ValidationError | None = None
        self._deferred_part = 0
        #: Blobs whose threads were still writing and hashing when their
        #: part ended: (part, declared name, writer), collected by close().
        self._pending: list[tuple[int, str, BlobWriter]] = []
        self._program: bytes | None = None
        self._blobs: dict[str, Blob] = {}
        # Per-part state.
        self._headers: _HeaderReader | None = None
        self._part_error: ValidationError | None = None
        self._sink: BlobWriter | bytearray | None = None
        self._blob_name = ""

    # Public API.

    def feed(self, chunk: bytes) -> None:
        """
        Consume the next chunk of the body.

        @raise RequestTooLarge: once more than C{max_bytes} were fed.
        @raise ValidationError: on a framing or part-header violation.
        """
        if self._failed is not None:
            raise self._failed
        self.received += len(chunk)
        try:
            if self.received > self._max_bytes:
                raise RequestTooLarge("request exceeds the configured size limit")
            self._scanner.feed(chunk)
        except BaseException as e:
            self._fail(e)
            raise

    def close(self) -> ParsedRequest:
        """
        The body is complete: check the closing delimiter and part rules.

        @raise ValidationError: with the first applicable §3.3 message.
        """
        if self._failed is not None:
            raise self._failed
        try:
            self._scanner.finish()
            while self._pending:
                part, name, writer = self._pending[0]
                del self._pending[0]
                self._collect(part, name, writer)
            if self._deferred is not None:
                raise self._deferred
            if self._program is None:
                raise ValidationError("missing multipart part: 'program'")
        except BaseException as e:
            self._fail(e)
            raise
        self._failed = ValidationError("parser already closed")
        return ParsedRequest(program=self._program, blobs=dict(self._blobs))

    def abort(self) -> None:
        """Give up (for example on disconnect) and delete spool files."""
        if self._failed is None:
            self._fail(ValidationError("parser aborted"))

    @property
    def settling(self) -> bool:
        """Whether a blob's threads may still be busy: L{close} waits for them."""
        return bool(self._pending)

    def _offload(self) -> Offload | None:
        """The threads of the blob being received, if it has them."""
        sink = self._sink
        return None if sink is None or isinstance(sink, bytearray) else sink.offload

    def backlog(self) -> int:
        """Bytes fed that the part being received has not yet written and hashed."""
        sink = self._offload()
        return 0 if sink is None else sink.backlog

    def when_drained(self, level: int, callback: Callable[[], None]) -> None:
        """
        Call C{callback} once L{backlog} is C{level} bytes or less: at once
        if it is, else from a sink thread.
        """
        sink = self._offload()
        if sink is None:
            callback()
        else:
            sink.notify_at(level, callback)

    # Internals.

    def _fail(self, error: BaseException) -> None:
        self._failed = error
        if self._sink is not None and not isinstance(self._sink, bytearray):
            self._sink.discard()
        self._sink = None
        pending, self._pending = self._pending, []
        for _part, _name, writer in pending:
            writer.discard()
        for blob in self._blobs.values():
            blob.close()
        self._blobs.clear()

    def start_part(self) -> None:
        self._headers = _HeaderReader()
        self._part_error = None
        self._sink = None

    def part_data(self, data: bytes | memoryview) -> None:
        if self._headers is None:
            self._write(data)
            return
        found = self._headers.add(data)
        if found is None:
            if self._headers.size > MAX_PART_HEADER_BYTES and self._part_error is None:
                self._part_error = ValidationError("malformed multipart part headers")
                self._headers = None
            return
        self._headers = None
        raw, rest = found
        self._begin(raw)
        if rest:
            self._write(rest)

    def end_part(self) -> None:
        if self._headers is not None:
            raise ValidationError("malformed multipart part headers")
        if self._part_error is not None:
            raise self._part_error
        sink, self._sink = self._sink, None
        if isinstance(sink, bytearray):
            self._program = bytes(sink)
        elif sink is not None:
            part = self._scanner.parts
            offload = sink.offload
            if offload is None:
                self._collect(part, self._blob_name, sink)
            else:
                # Its threads finish the last bytes while the rest of the
                # body arrives; close() collects it.
                offload.close()
                self._pending.append((part, self._blob_name, sink))

    def _collect(self, part: int, name: str, writer: BlobWriter) -> None:
        """Seal blob C{part}'s buffer and check its digest against its C{name}."""
        try:
            blob = writer.finish()
        except BaseException:
            writer.discard()
            raise
        if blob.digest != name:
            blob.close()
            self._defer(
                part,
                ValidationError(f"blob hash mismatch: declared {name}, computed {blob.digest}"),
            )
        else:
            self._blobs[blob.digest] = blob

    def _defer(self, part: int, error: ValidationError) -> None:
        """Keep the error of the earliest part: the one the reference reports."""
        if self._deferred is None or part < self._deferred_part:
            self._deferred, self._deferred_part = error, part

    def _write(self, data: bytes | memoryview) -> None:
        if self._sink is not None:
            if isinstance(self._sink, bytearray):
                self._sink += data
            else:
                self._sink.write(data)

    def _begin(self, raw: bytes) -> None:
        try:
            name, content_type = _parse_part_headers(raw)
        except ValidationError as e:
            self._part_error = e
            return
        if self._deferred is not None:
            return
        try:
            self._sink = self._check_part(name, content_type)
        except ValidationError as e:
            self._defer(self._scanner.parts, e)

    def _check_part(self, name: str, content_type: str) -> BlobWriter | bytearray:
        if name == "program":
            if self._program is not None:
                raise ValidationError("duplicate multipart part: 'program'")
            if content_type != "application/json":
                raise ValidationError("the 'program' part must use application/json")
            self._program = b""
            return bytearray()
        if not name.startswith("blob:"):
            raise ValidationError(f"unsupported multipart part: {name!r}")
        digest = name[5:]
        if not is_digest(digest):
            raise ValidationError(f"malformed blob part name: {name!r}")
        if digest in self._blobs or any(digest == name for _, name, _ in self._pending):
            raise ValidationError(f"duplicate blob part: {digest}")
        if content_type != "application/octet-stream":
            raise ValidationError(f"blob part {digest} must use application/octet-stream")
        self._blob_name = digest
        return self._new_blob(len(self._blobs) + len(self._pending))


def parse_request_body(
    content_type: str | None, body: bytes, *, max_bytes: int = 1 << 62
) -> ParsedRequest:
    """Parse a whole body at once (tests, small requests): §3.3 in one call."""
    parser = RequestBodyParser(boundary_from_content_type(content_type), max_bytes=max_bytes)
    parser.feed(body)
    return parser.close()


def check_blob_references(program: Program, blobs: Iterable[str]) -> None:
    """
    Every supplied blob part must be referenced by some upload (protocol
    §3.3, decided after program validation).
    """
    referenced = set(program.referenced_blobs())
    unreferenced = sorted(set(blobs) - referenced)
    if unreferenced:
        raise ValidationError(f"unreferenced blob part(s): {', '.join(unreferenced)}")


def check_tensor_lengths(program: Program, sizes: Mapping[str, int]) -> None:
    """
    Every tensor upload whose blob is known (C{sizes}: digest to byte
    length) must have exactly C{product(shape) * itemsize} bytes (§5.1).
    """
    for instruction in program.instructions:
        if not isinstance(instruction, Upload) or instruction.kind != "tensor":
            continue
        blob = instruction.blob
        if blob is None or blob not in sizes:
            continue
        expected = tensor_nbytes(instruction.dtype or "", instruction.shape or ())
        if sizes[blob] != expected:
            raise ValidationError(
                f"tensor upload {instruction.id!r} expects {expected} bytes, got {sizes[blob]}"
            )


def _choose_boundary(payloads: Iterable[bytes | SharedBuffer]) -> str:
    """
    A boundary no payload contains.  Shared buffers (large parts, streamed
    from their memfd) are not scanned: the boundary's 128 random bits are
    drawn after their bytes were sealed, so no program can aim at it, and
    reading hundreds of MiB to rule out a 2**-128 chance would cost what
    streaming saves.
    """
    items = [item for item in payloads if isinstance(item, bytes)]
    while True:
        boundary = f"kcoral-{secrets.token_hex(16)}"
        delimiter = f"\r\n--{boundary}".encode("ascii")
        if all(delimiter not in item for item in items):
            return boundary


def encode_response(
    body: Mapping[str, Any], parts: Sequence[bytes | SharedBuffer]
) -> tuple[str, list[bytes | SharedBuffer]]:
    """
    Frame a COMPLETED/FAILED body (protocol §8.2): plain JSON without binary
    parts, else multipart with C{result} then C{return:0..n-1}.

    @return: the C{Content-Type} value and the body as chunks (the parts
        themselves are not copied).
    """
    result = json_dumps(body)
    if not parts:
        return "application/json", [result]
    boundary = _choose_boundary([result, *parts])
    chunks: list[bytes | SharedBuffer] = []
    named: Iterator[tuple[str, str, bytes | SharedBuffer]] = iter(
        [("result", "application/json", result)]
        + [(f"return:{n}", "application/octet-stream", p) for n, p in enumerate(parts)]
    )
    for name, media, payload in named:
        chunks.append(
            (
                f"--{boundary}\r\n"
                f'Content-Disposition: form-data; name="{name}"\r\n'
                f"Content-Type: {media}\r\n\r\n"
            ).encode("ascii")
        )
        chunks.append(payload)
        chunks.append(b"\r\n")
    chunks.append(f"--{boundary}--\r\n".encode("ascii"))
    return f"multipart/form-data; boundary={boundary}", chunks


class PartCollector:
    """
    A part handler for L{_Scanner} that keeps every part in memory
    (responses are decoded whole): headers judged as they complete, payload
    chunks kept as they come and joined once at the part's end.
    """

    def __init__(self) -> None:
        self.parts: list[tuple[str, str, bytes]] = []
        self._headers: _HeaderReader | None = None
        self._head: tuple[str, str] | None = None
        self._chunks: list[bytes] = []
        self._error: ValidationError | None = None

    def start_part(self) -> None:
        self._headers = _HeaderReader()
        self._head = None
        self._chunks = []
        self._error = None

    def part_data(self, data: bytes | memoryview) -> None:
        if self._headers is None:
            self._chunks.append(bytes(data))
            return
        found = self._headers.add(data)
        if found is None:
            return
        self._headers = None
        raw, rest = found
        try:
            name, media = _parse_part_headers(raw)
            self._head = (name, media)
        except ValidationError as e:
            self._error = e
        if rest:
            self._chunks.append(bytes(rest))

    def end_part(self) -> None:
        if self._headers is not None:
            raise ValidationError("malformed multipart part headers")
        if self._error is not None:
            raise self._error
        assert self._head is not None
        data = b"".join(self._chunks)
        self._chunks = []
        self.parts.append((*self._head, data))


def _media_type(content_type: str | None) -> str:
    return (content_type or "").split(";", 1)[0].strip().lower()


def decode_response(
    content_type: str | None, body: bytes
) -> tuple[dict[str, Any], dict[str, bytes]]:
    """
    Decode a response as the 0.1.1 client does (protocol §2.4, §8.2): the
    JSON object and the binary parts by name.

    @raise ValidationError: on any framing or shape problem.
    """
    media = _media_type(content_type)
    if media == "application/json":
        result = strict_json_loads(body)
        parts: dict[str, bytes] = {}
    elif media == "multipart/form-data":
        collector = PartCollector()
        scanner = _Scanner(boundary_from_content_type(content_type).encode("ascii"), collector)
        scanner.feed(body)
        scanner.finish()
        results = [p for p in collector.parts if p[0] == "result"]
        if len(results) != 1 or results[0][1] != "application/json":
            raise ValidationError("multipart response needs exactly one application/json 'result'")
        result = strict_json_loads(results[0][2])
        parts = {}
        for name, part_media, data in collector.parts:
            if name == "result":
                continue
            if part_media != "application/octet-stream":
                raise ValidationError(f"response part {name!r} must use application/octet-stream")
            if name in parts:
                raise ValidationError(f"duplicate response part: {name!r}")
            parts[name] = data
    else:
        raise ValidationError(f"unsupported response content type {content_type!r}")
    if not isinstance(result, dict):
        raise ValidationError("response body must be a JSON object")
    return result, parts
