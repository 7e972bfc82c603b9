"""
Tests for L{kcoral.server.http.auth}: the token file, the constant-time check,
the guard in front of the API, and what counts as beyond loopback.
"""

from __future__ import annotations

import json

from klein import Klein
from treq.testing import StubTreq
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.iweb import IRequest

from kcoral.server.http.auth import (
    TokenFileError,
    TokenGuard,
    Tokens,
    beyond_loopback,
    parse_tokens,
)
from kcoral.server.http.component import IKcoralRequest

ALICE = "alice-0123456789abcdef"
BOB = "bob-fedcba9876543210xx"


class _Routes:
    app = Klein()

    @app.route("/<path:path>", methods=["GET", "POST"])
    def any_path(self, request: IRequest, path: str) -> bytes:
        request.setHeader(b"Content-Type", b"application/json")
        name = IKcoralRequest(request).client_name
        return json.dumps({"path": path, "client": name}).encode()


def tokens() -> Tokens:
    return parse_tokens(f"# clients\nalice {ALICE}\n\nbob {BOB}\n")


class TokenFileTests(SynchronousTestCase):
    """The token file's format."""

    def test_names_and_tokens(self) -> None:
        """Each line is NAME TOKEN; comments and blank lines are skipped."""
        self.assertEqual(tokens().entries, ((ALICE.encode(), "alice"), (BOB.encode(), "bob")))

    def test_single_bare_token(self) -> None:
        """A file of one bare token names its client 'default'."""
        self.assertEqual(parse_tokens(ALICE + "\n").entries, ((ALICE.encode(), "default"),))

    def test_rejections(self) -> None:
        """Short tokens, repeated names, odd names, bare tokens among several, empty files."""
        for text in (
            "alice short\n",
            f"alice {ALICE}\nalice {BOB}\n",
            f"al:ice {ALICE}\n",
            f"{ALICE}\nbob {BOB}\n",
            "# nothing\n",
            f"alice {ALICE} extra\n",
        ):
            self.assertRaises(TokenFileError, parse_tokens, text)


class ClientForTests(SynchronousTestCase):
    """L{Tokens.client_for} reads C{Authorization: Bearer TOKEN}."""

    def test_match(self) -> None:
        """The right token gives its client name; case of the scheme does not matter."""
        self.assertEqual(tokens().client_for(b"Bearer " + BOB.encode()), "bob")
        self.assertEqual(tokens().client_for(b"bearer " + ALICE.encode()), "alice")

    def test_no_match(self) -> None:
        """Wrong, truncated, extended, other-scheme or missing credentials give None."""
        for header in (
            None,
            b"",
            b"Bearer",
            b"Bearer " + ALICE.encode()[:-1],
            b"Bearer " + ALICE.encode() + b"x",
            b"Basic " + ALICE.encode(),
            ALICE.encode(),
        ):
            self.assertIsNone(tokens().client_for(header), header)


class GuardTests(SynchronousTestCase):
    """L{TokenGuard} in front of a Klein resource."""

    def get(self, path: str, token: str | None = None, public: bool = False) -> tuple[int, dict]:
        guard = TokenGuard(_Routes().app.resource(), tokens(), public_metrics=public)
        treq = StubTreq(guard)
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        response = self.successResultOf(treq.get(f"http://127.0.0.1{path}", headers=headers))
        body = self.successResultOf(response.content())
        if response.code == 401:
            self.assertEqual(
                response.headers.getRawHeaders("www-authenticate"), ['Bearer realm="kcoral"']
            )
            self.assertEqual(response.headers.getRawHeaders("content-type"), ["application/json"])
        return response.code, json.loads(body)

    def test_health_open(self) -> None:
        """/health needs no token (load balancers probe it)."""
        code, body = self.get("/health")
        self.assertEqual((code, body["client"]), (200, None))

    def test_execute_needs_token(self) -> None:
        """Without a valid token, /execute is a 401 ERROR body of kind unauthorized."""
        for token in (None, "nope-nope-nope-nope"):
            code, body = self.get("/execute", token)
            self.assertEqual(code, 401)
            self.assertEqual(set(body), {"status", "request_id", "error"})
            self.assertEqual(body["error"]["kind"], "unauthorized")
        self.flushLoggedErrors()

    def test_client_name_on_request(self) -> None:
        """A valid token's client name is set on the request's component for the app."""
        code, body = self.get("/execute", BOB)
        self.assertEqual((code, body["client"]), (200, "bob"))

    def test_metrics_behind_token(self) -> None:
        """/metrics and /status need the token unless --public-metrics."""
        for path in ("/metrics", "/status", "/status.json"):
            self.assertEqual(self.get(path)[0], 401)
            self.assertEqual(self.get(path, ALICE)[0], 200)
            self.assertEqual(self.get(path, public=True)[0], 200)


class BeyondLoopbackTests(SynchronousTestCase):
    """Which bound addresses other machines can reach."""

    def test_loopback(self) -> None:
        """All of 127.0.0.0/8 and ::1 (also IPv4-mapped) are loopback."""
        self.assertEqual(
            beyond_loopback(["127.0.0.1", "127.0.0.2", "127.255.0.9", "::1", "::ffff:127.0.0.1"]),
            [],
        )

    def test_beyond(self) -> None:
        """Wildcards, other addresses and host names are reachable."""
        hosts = ["0.0.0.0", "::", "10.1.2.3", "192.168.0.1", "example.org"]
        self.assertEqual(beyond_loopback(hosts), hosts)
