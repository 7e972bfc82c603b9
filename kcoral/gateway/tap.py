# -*- test-case-name: tests.unit.test_gateway_service -*-
"""
The C{kcoral-gateway} twistd plugin's options and service maker:
C{twistd -n kcoral-gateway [options]} and C{kcoral gateway [options]}.

Parsing leaves the validated L{GatewayConfig} on C{options.config};
L{makeService} builds the root service from it.  Nothing here connects,
binds or starts a reactor.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from twisted.python import usage

from kcoral.config import LOG_LEVELS
from kcoral.server.cli.tap import endpoint_description, with_backlog

__all__ = ["Options", "makeService"]

#: The gateway's default HTTP port (the reference router's).
DEFAULT_PORT = 9000


def _number(flag: str) -> Callable[[str], float]:
    def coerce(value: str) -> float:
        try:
            result = float(value)
        except ValueError:
            raise usage.UsageError(f"--{flag} must be a number, got {value!r}") from None
        if not math.isfinite(result):
            raise usage.UsageError(f"--{flag} must be a finite number, got {value!r}")
        return result

    return coerce


def _integer(flag: str) -> Callable[[str], int]:
    def coerce(value: str) -> int:
        try:
            return int(value)
        except ValueError:
            raise usage.UsageError(f"--{flag} must be an integer, got {value!r}") from None

    return coerce


class Options(usage.Options):
    """
    C{kcoral gateway} options.  C{--listen}, C{--host}/C{--port},
    C{--auth-token-file} and C{--public-metrics} are the server's.
    """

    synopsis = "Usage: kcoral gateway --nats URL [options]"

    optFlags = [
        [
            "public-metrics",
            None,
            "Serve /metrics and /status without a token when --auth-token-file is given.",
        ],
        ["no-log-console", None, "Do not mirror log events to standard error."],
    ]

    optParameters: list[list[Any]] = [
        ["nats", None, None, "NATS server URL(s), comma-separated (nats://HOST:PORT, tls://...)."],
        ["nats-credentials", None, None, "The gateway's NATS credentials file (.creds or JSON)."],
        ["nats-ca", None, None, "CA bundle that verifies tls:// NATS servers."],
        ["host", None, "127.0.0.1", "Interface to listen on (without --listen)."],
        ["port", None, DEFAULT_PORT, "TCP port to listen on (without --listen).", _integer("port")],
        [
            "public-url",
            None,
            None,
            "Base URL nodes reach this gateway at for blobs and results "
            "[default: http(s)://HOST:PORT of the first port].",
        ],
        ["auth-token-file", None, None, "File of client bearer tokens (the server's format)."],
        [
            "log-dir",
            None,
            None,
            "Directory of run logs (events.jsonl) [default: none, the console only].",
        ],
        ["log-level", None, "info", f"Least severe event logged, {'|'.join(LOG_LEVELS)}."],
        ["queue-size", None, 1024, "Jobs the work queue holds at most.", _integer("queue-size")],
        [
            "queue-timeout",
            None,
            300.0,
            "Seconds a job waits for a node before 503.",
            _number("queue-timeout"),
        ],
        [
            "presence-timeout",
            None,
            3.0,
            "Seconds a silent node still counts as present (the presence bucket's TTL).",
            _number("presence-timeout"),
        ],
        [
            "preference-window",
            None,
            2.0,
            "Seconds a job waits for the node named by X-KCoral-Node before any node takes it.",
            _number("preference-window"),
        ],
        [
            "result-grace",
            None,
            60.0,
            "Seconds beyond a program's timeout a node may take to post its result.",
            _number("result-grace"),
        ],
        [
            "max-request-bytes",
            None,
            None,
            "Largest client request body.",
            _integer("max-request-bytes"),
        ],
        [
            "max-response-bytes",
            None,
            None,
            "Largest relayed response.",
            _integer("max-response-bytes"),
        ],
        [
            "cache-capacity-bytes",
            None,
            None,
            "The pool-wide memory blob cache's capacity.",
            _integer("cache-capacity-bytes"),
        ],
        [
            "disk-cache-dir",
            None,
            None,
            "The pool-wide disk file cache's directory [default: none].",
        ],
        [
            "front-ends",
            None,
            1,
            "Gateway processes sharing the client port (plain TCP only).",
            _integer("front-ends"),
        ],
        [
            "node-port",
            None,
            None,
            "With --front-ends N: front end i's own port for nodes is this + i "
            "[default: the client port + 1].",
            _integer("node-port"),
        ],
    ]

    def __init__(self) -> None:
        super().__init__()
        self["listen"] = []

    def opt_listen(self, description: str) -> None:
        """
        An endpoint description to listen on (tcp:PORT:interface=ADDR,
        ssl:PORT:privateKey=KEY.pem:certKey=CERT.pem, unix:PATH); repeatable.
        """
        if not description:
            raise usage.UsageError("--listen needs an endpoint description")
        self["listen"].append(description)

    def postOptions(self) -> None:
        from kcoral.gateway.service import GatewayConfig

        urls = tuple(u.strip() for u in (self["nats"] or "").split(",") if u.strip())
        if not urls:
            raise usage.UsageError("--nats URL is required")
        for url in urls:
            if not url.startswith(("nats://", "tls://")):
                raise usage.UsageError(f"--nats: {url!r} is not a nats:// or tls:// URL")
        if not 1 <= self["port"] <= 65535:
            raise usage.UsageError("--port must be between 1 and 65535")
        for name in ("queue-timeout", "presence-timeout", "result-grace"):
            if self[name] <= 0:
                raise usage.UsageError(f"--{name} must be positive")
        if self["preference-window"] < 0:
            raise usage.UsageError("--preference-window must not be negative")
        if self["queue-size"] < 1:
            raise usage.UsageError("--queue-size must be at least 1")
        descriptions = self["listen"] or [endpoint_description(self["host"], self["port"])]
        if self["front-ends"] < 1:
            raise usage.UsageError("--front-ends must be at least 1")
        if self["front-ends"] > 1 and (
            len(descriptions) != 1 or not descriptions[0].lower().startswith(("tcp:", "tcp6:"))
        ):
            raise usage.UsageError("--front-ends needs exactly one plain TCP port (no ssl:, unix:)")
        if self["node-port"] is not None and not 1 <= self["node-port"] <= 65535:
            raise usage.UsageError("--node-port must be between 1 and 65535")
        endpoints = tuple(with_backlog(d, 1024) for d in descriptions)
        public_url = self["public-url"] or _public_url(descriptions[0], self["host"])
        if not public_url.startswith(("http://", "https://")):
            raise usage.UsageError("--public-url must be an http:// or https:// URL")
        credentials = self["nats-credentials"]
        if credentials is not None:
            from kcoral.gateway.natsbridge import load_credentials

            try:
                load_credentials(credentials)
            except (OSError, ValueError) as e:
                raise usage.UsageError(f"--nats-credentials: {e}") from None
        token_file = self["auth-token-file"]
        if token_file is not None:
            from kcoral.server.http.auth import TokenFileError, load_tokens

            try:
                load_tokens(Path(token_file))
            except TokenFileError as e:
                raise usage.UsageError(f"--auth-token-file: {e}") from None
        optional: dict[str, Any] = {}
        for flag, name in (
            ("max-request-bytes", "max_request_bytes"),
            ("max-response-bytes", "max_response_bytes"),
            ("cache-capacity-bytes", "cache_capacity_bytes"),
        ):
            if self[flag] is not None:
                if self[flag] < 0:
                    raise usage.UsageError(f"--{flag} must not be negative")
                optional[name] = self[flag]
        try:
            self.config = GatewayConfig(
                nats_urls=urls,
                credentials_file=None if credentials is None else Path(credentials),
                nats_ca_file=None if self["nats-ca"] is None else Path(self["nats-ca"]),
                endpoints=endpoints,
                public_url=public_url.rstrip("/"),
                auth_token_file=None if token_file is None else Path(token_file),
                public_metrics=bool(self["public-metrics"]),
                queue_size=self["queue-size"],
                queue_timeout=self["queue-timeout"],
                presence_timeout=self["presence-timeout"],
                preference_window=self["preference-window"],
                result_grace=self["result-grace"],
                disk_cache_dir=None
                if self["disk-cache-dir"] is None
                else Path(self["disk-cache-dir"]),
                front_ends=self["front-ends"],
                node_port=self["node-port"],
                log_dir=Path(self["log-dir"]) if self["log-dir"] else None,
                log_console=not self["no-log-console"],
                log_level=self["log-level"],
                **optional,
            )
        except (TypeError, ValueError) as e:
            raise usage.UsageError(str(e)) from None


def _public_url(description: str, host: str) -> str:
    """The URL of a tcp: or ssl: endpoint description (wildcards become loopback)."""
    parts = description.split(":")
    kind = parts[0]
    port = next((p for p in parts[1:] if p.isdigit()), None)
    if port is None:
        for p in parts[1:]:
            if p.startswith("port="):
                port = p.split("=", 1)[1]
    interface = host
    for p in parts[1:]:
        if p.startswith("interface="):
            interface = p.split("=", 1)[1].replace("\\:", ":")
    if interface in ("", "0.0.0.0"):
        interface = "127.0.0.1"
    if interface == "::":
        interface = "::1"
    if ":" in interface:
        interface = f"[{interface}]"
    if port is None:
        raise usage.UsageError("--public-url is required with this --listen endpoint")
    scheme = "https" if kind == "ssl" else "http"
    return f"{scheme}://{interface}:{port}"


def makeService(options: Options) -> Any:
    """The gateway's root service (the plugin's entry point)."""
    from kcoral.gateway.service import makeService as make

    service = make(options.config)
    service.exit_on_failure = True
    return service
