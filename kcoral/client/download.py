# -*- test-case-name: tests.unit.test_client_async -*-
"""
Decoding a 200 response as it arrives (protocol §2.4, §8.2), so that a
large binary result is held about twice (its chunks, then the joined part)
rather than once per parsing stage.

The framing rules are the wire package's: its delimiter scanner and its
part-header judge, fed chunk by chunk instead of with the whole body that
L{kcoral.wire.multipart.decode_response} takes.
"""

from __future__ import annotations

from typing import Any

from kcoral.client.errors import ProtocolError
from kcoral.wire.multipart import (
    PartCollector,
    _Scanner,
    boundary_from_content_type,
)
from kcoral.wire.program import ValidationError, strict_json_loads


class ResponseReader:
    """
    Feed a 200 response's body in chunks, then L{finish} for the JSON
    object and the binary parts by name.

    @raise ProtocolError: for an unsupported content type or bad framing.
    """

    def __init__(self, content_type: str | None) -> None:
        self._media = (content_type or "").split(";", 1)[0].strip().lower()
        self._chunks: list[bytes] = []
        self._parts = PartCollector()
        self._scanner: _Scanner | None = None
        try:
            if self._media == "multipart/form-data":
                boundary = boundary_from_content_type(content_type).encode("ascii")
                self._scanner = _Scanner(boundary, self._parts)
            elif self._media != "application/json":
                raise ValidationError(f"unsupported response content type {content_type!r}")
        except ValidationError as e:
            raise ProtocolError(f"malformed response: {e}") from e

    def feed(self, data: bytes) -> None:
        if self._scanner is None:
            self._chunks.append(data)
            return
        try:
            self._scanner.feed(data)
        except ValidationError as e:
            raise ProtocolError(f"malformed response: {e}") from e

    def finish(self) -> tuple[dict[str, Any], dict[str, bytes]]:
        try:
            if self._scanner is None:
                result = strict_json_loads(b"".join(self._chunks))
                parts: dict[str, bytes] = {}
            else:
                self._scanner.finish()
                result, parts = self._split()
        except ValidationError as e:
            raise ProtocolError(f"malformed response: {e}") from e
        if not isinstance(result, dict):
            raise ProtocolError("malformed response: response body must be a JSON object")
        return result, parts

    def _split(self) -> tuple[Any, dict[str, bytes]]:
        results = [p for p in self._parts.parts if p[0] == "result"]
        if len(results) != 1 or results[0][1] != "application/json":
            raise ValidationError("multipart response needs exactly one application/json 'result'")
        parts: dict[str, bytes] = {}
        for name, media, data in self._parts.parts:
            if name == "result":
                continue
            if media != "application/octet-stream":
                raise ValidationError(f"response part {name!r} must use application/octet-stream")
            if name in parts:
                raise ValidationError(f"duplicate response part: {name!r}")
            parts[name] = data
        return strict_json_loads(results[0][2]), parts


__all__ = ["ResponseReader"]
