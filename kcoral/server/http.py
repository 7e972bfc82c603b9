# -*- test-case-name: tests.unit.test_app -*-
"""
The HTTP site: a request class that enforces the body-size limit while the
body arrives, so a 256 MiB+ upload is refused without being buffered.

Twisted's own form parsing is turned off (the program's multipart body is
parsed by L{kcoral.wire.multipart} in a thread), and error pages are always
the protocol's JSON error body.
"""

from __future__ import annotations

from typing import Any

from twisted.web.server import Request, Site


class LimitedRequest(Request):
    """
    A request that stops buffering its body past C{site.max_request_bytes}.

    When a declared C{Content-Length} is over the limit, or the body grows
    over it, C{too_large} is set and the remaining bytes are discarded; the
    resource answers 413 once the (discarded) body has been received.
    """

    too_large = False
    body_bytes = 0

    def _limit(self) -> int | None:
        site = getattr(self.channel, "site", None)
        return getattr(site, "max_request_bytes", None)

    def gotLength(self, length: int | None) -> None:
        limit = self._limit()
        if length is not None and limit is not None and length > limit:
            self.too_large = True
            length = 0
            channel = self.channel
            if channel is not None:
                # Answer now instead of waiting for a body that is never read:
                # the channel treats the request as complete once its headers
                # end, and closes the connection after the response so the
                # unread body cannot be taken for the next request.
                channel.length = 0
                channel.persistent = False
        super().gotLength(length)

    def handleContentChunk(self, data: bytes) -> None:
        if self.too_large:
            return
        self.body_bytes += len(data)
        limit = self._limit()
        if limit is not None and self.body_bytes > limit:
            self.too_large = True
            self._drop_body()
            return
        super().handleContentChunk(data)

    def _drop_body(self) -> None:
        content = getattr(self, "content", None)
        if content is not None:
            try:
                content.seek(0)
                content.truncate()
            except Exception:
                pass


class KcoralSite(Site):
    """A L{Site} for L{LimitedRequest}s, with form parsing disabled."""

    requestFactory = LimitedRequest

    def __init__(self, resource: Any, *, max_request_bytes: int, **kwargs: Any) -> None:
        try:
            super().__init__(resource, parsePOSTFormSubmission=False, **kwargs)
        except TypeError:  # older Twisted: the request ignores form bodies anyway
            super().__init__(resource, **kwargs)
        self.max_request_bytes = max_request_bytes
        self.displayTracebacks = False
