"""
C{kcoral gateway}'s options, twistd plugin and .tac
(L{kcoral.gateway.tap}, L{kcoral.gateway.service}), and its guard of the
node-facing routes (L{kcoral.gateway.api.PoolGuard}).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest
from twisted.application.service import IServiceMaker
from twisted.internet.task import Clock
from twisted.plugin import getPlugins
from twisted.python import usage
from zope.interface.verify import verifyObject

from kcoral.gateway import tap
from kcoral.gateway.api import GatewayRequest, PoolGuard, _pool_job
from kcoral.gateway.dispatch import Dispatcher, PendingJob
from kcoral.gateway.jobs import JobMessage
from kcoral.gateway.pool import PoolView
from kcoral.gateway.service import GatewayConfig, GatewayService
from kcoral.testing.gateway import FakeJobQueue

ROOT = Path(__file__).resolve().parents[2]


def parse(*args: str) -> tap.Options:
    options = tap.Options()
    options.parseOptions(list(args))
    return options


def test_options() -> None:
    """The flags become a L{GatewayConfig}; the public URL follows the port."""
    config = parse(
        "--nats",
        "nats://127.0.0.1:4222,nats://127.0.0.1:4223",
        "--port",
        "9100",
        "--queue-size",
        "7",
        "--presence-timeout",
        "2.5",
        "--preference-window",
        "0",
    ).config
    assert config.nats_urls == ("nats://127.0.0.1:4222", "nats://127.0.0.1:4223")
    assert config.public_url == "http://127.0.0.1:9100"
    assert config.endpoints == ("tcp:port=9100:interface=127.0.0.1:backlog=1024",)
    assert (config.queue_size, config.presence_timeout, config.preference_window) == (7, 2.5, 0.0)
    tls = parse(
        "--nats",
        "tls://nats.example:4222",
        "--listen",
        "ssl:9443:privateKey=k.pem:certKey=c.pem",
        "--public-url",
        "https://gw.example:9443/",
    ).config
    assert tls.public_url == "https://gw.example:9443"
    wild = parse("--nats", "nats://x:1", "--host", "0.0.0.0", "--port", "9001").config
    assert wild.public_url == "http://127.0.0.1:9001"


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["--nats", "http://x"],
        ["--nats", "nats://x", "--queue-size", "0"],
        ["--nats", "nats://x", "--queue-size", "many"],
        ["--nats", "nats://x", "--presence-timeout", "0"],
        ["--nats", "nats://x", "--preference-window", "-1"],
        ["--nats", "nats://x", "--port", "70000"],
        ["--nats", "nats://x", "--public-url", "ftp://x"],
        ["--nats", "nats://x", "--queue-timeout", "nan"],
        ["--nats", "nats://x", "--nats-credentials", "/nonexistent/creds"],
        ["--nats", "nats://x", "--auth-token-file", "/nonexistent/tokens"],
    ],
)
def test_options_refused(args: list[str]) -> None:
    """Bad flags are usage errors."""
    with pytest.raises(usage.UsageError):
        parse(*args)


def test_plugin() -> None:
    """twistd finds the C{kcoral-gateway} plugin, and it provides L{IServiceMaker}."""
    import sys

    sys.path.insert(0, str(ROOT))
    try:
        import twisted.plugins

        makers = {p.tapname: p for p in getPlugins(IServiceMaker, twisted.plugins)}
    finally:
        sys.path.remove(str(ROOT))
    maker = makers["kcoral-gateway"]
    assert verifyObject(IServiceMaker, maker)
    assert maker.options is tap.Options or isinstance(maker.options(), tap.Options)


def test_make_service(tmp_path: Path) -> None:
    """The service tree is built without connecting or listening."""
    creds = tmp_path / "gw.json"
    creds.write_text(json.dumps({"user": "gateway", "password": "pw"}))
    options = parse("--nats", "nats://127.0.0.1:4222", "--nats-credentials", str(creds))
    service = tap.makeService(options)
    assert isinstance(service, GatewayService)
    assert service.exit_on_failure
    assert service.config.credentials_file == creds
    assert service.site.guard is service.guard
    assert service.site.max_result_bytes > service.config.max_response_bytes


def test_tac_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """contrib/kcoral-gateway.tac builds an application (nothing starts)."""
    from twisted.application.service import IServiceCollection, loadApplication

    monkeypatch.chdir(tmp_path)
    application = loadApplication(str(ROOT / "contrib" / "kcoral-gateway.tac"), "python")
    services = list(IServiceCollection(application))
    assert len(services) == 1 and isinstance(services[0], GatewayService)


def test_config_validates() -> None:
    """The config refuses impossible values."""
    with pytest.raises((TypeError, ValueError)):
        GatewayConfig(nats_urls=["nats://x"], endpoints=[], public_url="http://x", queue_size=0)


def _dispatcher_with_job(token: str = "secret") -> Dispatcher:
    dispatcher = Dispatcher(FakeJobQueue(), PoolView(presence_timeout=3.0), Clock())
    message = JobMessage(
        job="j1", request_id="r", program="{}", deadline=10.0, token=token, gateway="http://g"
    )
    dispatcher.jobs["j1"] = PendingJob(message=message, compat="a" * 16, gpus=0, timeout_seconds=1)
    return dispatcher


def test_guard_job_token() -> None:
    """Node-facing paths need their own job's token; client paths the client tokens."""
    guard = PoolGuard(None, _dispatcher_with_job())  # type: ignore[arg-type]
    blob = b"/_pool/jobs/j1/blobs/" + b"0" * 64
    assert not guard.refuses(blob, b"Bearer secret")
    assert not guard.refuses(b"/_pool/jobs/j1/result", b"Bearer secret")
    assert guard.refuses(blob, b"Bearer wrong")
    assert guard.refuses(blob, None)
    assert guard.refuses(b"/_pool/jobs/j2/result", b"Bearer secret")
    assert guard.refuses(b"/_pool/jobs/../result", b"Bearer secret")
    assert not guard.refuses(b"/execute", None)
    assert _pool_job(b"/_pool/jobs/j1/result") == "j1"
    assert _pool_job(b"/_pool/jobs/a.b/result") is None

    class Clients:
        def refuses(self, path: bytes, authorization: bytes | None) -> bool:
            return authorization != b"Bearer client"

    guarded = PoolGuard(None, _dispatcher_with_job(), Clients())  # type: ignore[arg-type]
    assert guarded.refuses(b"/execute", None)
    assert not guarded.refuses(b"/execute", b"Bearer client")
    # A client token is no job token, a job token no client token.
    assert guarded.refuses(b"/_pool/jobs/j1/result", b"Bearer client")
    assert guarded.refuses(b"/execute", b"Bearer secret")


def test_result_limit() -> None:
    """Result posts may be as large as a response; other bodies keep the request limit."""

    class Site:
        max_request_bytes = 10
        max_result_bytes = 1000
        _parsePOSTFormSubmission = False

    class Channel:
        site = Site()
        _path = b"/_pool/jobs/j1/result"

    request = GatewayRequest.__new__(GatewayRequest)
    request.channel = Channel()
    assert request._limit() == 1000
    Channel._path = b"/execute"
    assert request._limit() == 10


def test_node_routes_skip_the_per_client_share() -> None:
    """A result post counts against the gateway's bytes in flight only, not its address's share."""
    from twisted.internet.testing import StringTransport

    from kcoral.gateway.api import GatewaySite

    site = GatewaySite(
        None,
        max_result_bytes=1000,
        max_request_bytes=100,
        max_bytes_in_flight=10_000,
        max_bytes_per_client=50,
    )

    def request(path: bytes) -> GatewayRequest:
        channel = site.buildProtocol(None)
        channel.makeConnection(StringTransport())  # peer 192.168.1.1
        channel._path = path
        return GatewayRequest(channel)

    client = request(b"/execute")
    assert client._reserve(40)
    assert site.client_bytes == {"192.168.1.1": 40}
    # Another client body from the same address does not fit its share...
    assert not request(b"/execute")._admits(80)
    # ...a node's result post does, and leaves the share alone.
    result = request(b"/_pool/jobs/j1/result")
    assert result._admits(80)
    assert result._reserve(80)
    assert site.client_bytes == {"192.168.1.1": 40}
    assert site.bytes_in_flight == 120


def test_access_log_leaves_out_node_traffic_that_succeeds() -> None:
    """
    The access log has every client request, and a node's request only
    when it was refused: a result post per job is the gateway's own
    traffic, which its job events record.
    """
    import io
    import types

    from kcoral.gateway.api import GatewaySite

    site = GatewaySite(None, max_result_bytes=1000, max_request_bytes=100)
    lines: list[bytes] = []
    site._logFile = io.StringIO()
    site._logFormatter = lambda when, request: lines.append(getattr(request, "path", b"-")) or ""  # type: ignore[assignment]
    for path, code in (
        (b"/execute", 200),
        (b"/_pool/jobs/j1/result", 200),
        (b"/_pool/jobs/j1/blobs/ab", 200),
        (b"/_pool/jobs/j1/result", 401),
        (b"/health", 503),
    ):
        site.log(types.SimpleNamespace(path=path, code=code))  # type: ignore[arg-type]
    site.log(types.SimpleNamespace(code=400))  # type: ignore[arg-type]  # refused before its path
    assert lines == [b"/execute", b"/_pool/jobs/j1/result", b"/health", b"-"]


def test_spooled_result_reads_like_a_shared_buffer(tmp_path: Path) -> None:
    """A spooled result body offers what the body producer reads: fileno, length, pread."""
    import io

    from kcoral.gateway.api import _SpooledFile

    path = tmp_path / "body"
    path.write_bytes(b"0123456789")
    with open(path, "rb") as f:
        spooled = _SpooledFile.of(f, 8)
        assert spooled is not None
        assert len(spooled) == 8 and spooled.fileno() == f.fileno()
        assert spooled.pread(2, 100) == b"234567"
    assert _SpooledFile.of(io.BytesIO(b"x"), 1) is None


def test_command() -> None:
    """C{kcoral gateway}: a usage error is one line and status 2; good flags reach twistd."""
    import io

    from kcoral.gateway.command import main

    err = io.StringIO()
    assert main(["--queue-size", "0", "--nats", "nats://x:1"], stderr=err) == 2
    assert err.getvalue().startswith("kcoral gateway: error: ")
    seen: list[Any] = []
    status = main(["--nats", "nats://127.0.0.1:4222", "--port", "9123"], run_app=seen.append)
    assert status == 0
    [config] = seen
    assert config["nodaemon"] and config.subCommand == "kcoral-gateway"
    assert config.subOptions.config.public_url == "http://127.0.0.1:9123"


def test_front_ends_config_and_urls(tmp_path: Path) -> None:
    """
    C{--front-ends N}: one plain TCP port; front end I{i}'s node URL is the
    public URL on C{--node-port} + I{i} (default the client port + 1 + I{i});
    the configuration travels to the others whole.
    """
    from kcoral.gateway.frontends import (
        config_from_json,
        config_to_json,
        endpoint_port,
        node_port,
        node_url,
    )

    options = tap.Options()
    options.parseOptions(
        [
            "--nats",
            "nats://n:4222",
            "--port",
            "9000",
            "--front-ends",
            "3",
            "--disk-cache-dir",
            str(tmp_path),
        ]
    )
    config = options.config
    assert config.front_ends == 3 and config.node_port is None
    assert endpoint_port(config.endpoints[0])[1] == 9000
    assert node_port(config) == 9001
    second = attrs.evolve(config, front_end_index=2, node_port=7000)
    assert node_port(second) == 7002
    assert config_from_json(config_to_json(second)) == second
    assert node_url("https://gw.example:9000/", 9002) == "https://gw.example:9002"
    assert node_url("http://[::1]:9000", 9001) == "http://[::1]:9001"
    for refused in (
        ["--front-ends", "0"],
        ["--front-ends", "2", "--listen", "ssl:9443:privateKey=k.pem"],
        ["--front-ends", "2", "--listen", "tcp:9000", "--listen", "tcp:9001"],
        ["--node-port", "70000"],
    ):
        with pytest.raises(usage.UsageError):
            tap.Options().parseOptions(["--nats", "nats://n:4222", *refused])


def test_claims_watch_catches_up_on_queued_jobs() -> None:
    """
    The claims watch sees claims made after it starts; when it (re)starts,
    the claim of each job still queued is read once, and the ones found
    are handed on as a watched claim would be (a failed read is left to
    the job's deadline, as a missed claim always was).
    """
    from twisted.internet.defer import Deferred, fail, succeed

    from kcoral.gateway.jobs import Claim
    from kcoral.gateway.natsqueue import NatsJobQueue

    found = {"j1": Claim(node="node-a"), "j2": None}

    class Queue(NatsJobQueue):
        def read_claim(self, job: str) -> Deferred[Claim | None]:
            if job not in found:
                return fail(TimeoutError("no answer"))
            return succeed(found[job])

    seen: list[tuple[str, Claim]] = []
    queue = Queue(
        bridge=None,  # type: ignore[arg-type]
        queue_size=1,
        presence_timeout=1.0,
        on_claim=lambda job, claim: seen.append((job, claim)),
        queued_jobs=lambda: ["j1", "j2", "j3"],
    )
    queue._catch_up()
    assert seen == [("j1", Claim(node="node-a"))]
