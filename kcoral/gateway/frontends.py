# -*- test-case-name: tests.unit.test_gateway_service -*-
"""
Several gateway processes behind one client port (C{--front-ends N}).

One gateway process runs every request's HTTP, its job's NATS traffic and
the node's result post on one reactor thread; past a few hundred null
programs a second that thread is the pool's ceiling, whatever the nodes
could do.  With C{--front-ends N} the gateway runs N processes:

 - All of them listen on the client port with C{SO_REUSEPORT}
   (L{kcoral.server.frontends.listen_reusing_port}): the kernel spreads
   client connections over them, and a keep-alive connection (so a
   C{CACHE_MISS} and its retry) stays with one process.
 - Each has its own NATS connection, dispatcher and blob cache (1/N of
   C{--cache-capacity-bytes}; a C{--disk-cache-dir} is shared), and
   watches the presence and claims buckets itself.
 - A job's answer must reach the process that holds its client, so front
   end I{i} also listens on its own node port, C{--node-port} + I{i}
   (default: the client port + 1 + I{i}), and the jobs it publishes give
   nodes that port in their blob and result URLs (L{node_url}).  Nodes
   must be able to reach those N ports.
 - The first starts the others (C{python -m kcoral.gateway.frontends
   SPEC}), starts one again that dies, and stops them before itself.  A
   front end whose first goes away (its stdin closes) stops.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import attrs
from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure

from kcoral.server.frontends import FrontEndProcesses

if TYPE_CHECKING:
    from kcoral.gateway.service import GatewayConfig

__all__ = ["FrontEndsService", "config_from_json", "config_to_json", "node_port", "node_url"]

#: Seconds the others get to stop after SIGTERM before SIGKILL.
STOP_TIMEOUT = 15.0

_PATHS = ("credentials_file", "nats_ca_file", "auth_token_file", "disk_cache_dir", "log_dir")


def endpoint_port(description: str) -> tuple[str, int]:
    """The interface and port of a C{tcp:} endpoint description."""
    fields = re.split(r"(?<!\\):", description)
    named: dict[str, str] = {}
    positional: list[str] = []
    for item in fields[1:]:
        key, sep, value = item.partition("=")
        if sep:
            named[key] = value.replace("\\:", ":")
        else:
            positional.append(key)
    interface = named.get("interface", "::" if fields[0].lower() == "tcp6" else "0.0.0.0")
    return interface, int(named.get("port") or positional[0])


def node_port(config: GatewayConfig) -> int:
    """The node port of this front end (C{--node-port} + its index)."""
    base = config.node_port
    if base is None:
        base = endpoint_port(config.endpoints[0])[1] + 1
    return base + config.front_end_index


def node_url(public_url: str, port: int) -> str:
    """C{public_url} with its port replaced by C{port}: where nodes reach one front end."""
    parts = urlsplit(public_url)
    host = parts.hostname or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return urlunsplit((parts.scheme, f"{host}:{port}", parts.path, "", "")).rstrip("/")


def config_to_json(config: GatewayConfig) -> str:
    """The whole configuration, for a front end's SPEC file."""
    values = attrs.asdict(config, recurse=False)
    for name in _PATHS:
        if values[name] is not None:
            values[name] = str(values[name])
    for name in ("nats_urls", "endpoints"):
        values[name] = list(values[name])
    return json.dumps(values)


def config_from_json(text: str) -> GatewayConfig:
    """L{config_to_json}'s configuration again."""
    from kcoral.gateway.service import GatewayConfig

    values: dict[str, Any] = json.loads(text)
    for name in _PATHS:
        if values.get(name) is not None:
            values[name] = Path(values[name])
    return GatewayConfig(**values)


class FrontEndsService(Service):
    """
    In the first front end: the others, started, restarted and stopped
    (L{kcoral.server.frontends.FrontEndProcesses}, as the server's are).
    """

    def __init__(self, config: GatewayConfig, reactor: Any) -> None:
        self.config = config
        self.processes = FrontEndProcesses(reactor, "kcoral.gateway.frontends")
        self._directory = Path(tempfile.mkdtemp(prefix="kcoral-gateway-"))

    def startService(self) -> None:
        super().startService()
        for index in range(1, self.config.front_ends):
            spec = self._directory / f"front-end-{index}.json"
            # Each front end logs under its own directory, as the server's do.
            log_dir = self.config.log_dir
            if log_dir is not None:
                log_dir = log_dir / f"front-end-{index}"
            share = attrs.evolve(self.config, front_end_index=index, log_dir=log_dir)
            spec.write_text(config_to_json(share))
            spec.chmod(0o600)
            self.processes.spawn(index, spec)

    def stopService(self) -> Deferred[None]:
        super().stopService()
        return Deferred.fromCoroutine(self._stop())

    async def _stop(self) -> None:
        try:
            await self.processes.stop(STOP_TIMEOUT)
        finally:
            shutil.rmtree(self._directory, ignore_errors=True)


class _ParentWatch(Protocol):
    """Stops the reactor when the first front end's end of stdin closes."""

    def connectionLost(self, reason: Failure = None) -> None:  # type: ignore[assignment]
        from twisted.internet import reactor

        if reactor.running:  # type: ignore[attr-defined]
            reactor.stop()  # type: ignore[attr-defined]


def main(argv: Sequence[str] | None = None) -> int:
    """Run one front end other than the first from its SPEC file; the exit status."""
    from kcoral.gateway.natsbridge import install_asyncio_reactor

    install_asyncio_reactor()
    from twisted.internet import reactor
    from twisted.internet.stdio import StandardIO
    from twisted.logger import globalLogBeginner

    from kcoral.gateway import service
    from kcoral.server.cli.command import stderr_log_observer

    args = list(sys.argv[1:] if argv is None else argv)
    config = config_from_json(Path(args[0]).read_text())
    globalLogBeginner.beginLoggingTo([stderr_log_observer()], redirectStandardIO=False)
    root = service.makeService(config, reactor)
    root.exit_on_failure = True
    StandardIO(_ParentWatch(), stdin=0, stdout=os.open(os.devnull, os.O_WRONLY))  # type: ignore[call-arg]
    reactor.callWhenRunning(root.startService)  # type: ignore[attr-defined]
    reactor.addSystemEventTrigger("before", "shutdown", root.stopService)  # type: ignore[attr-defined]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal's ^C is the first's
    reactor.run()  # type: ignore[attr-defined]
    return 1 if service.START_FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
