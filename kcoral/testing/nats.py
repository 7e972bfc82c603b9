# -*- test-case-name: tests.integration.test_nats_fixture -*-
"""
A real C{nats-server} on loopback for tests and benchmarks of a kcoral pool
(the gateway, L{kcoral.gateway}, and nodes that join it, L{kcoral.server.join}).

L{NatsServer} writes a configuration (L{nats_config}) with JetStream in a
temporary store directory and one account holding:

  - the C{gateway} user, which publishes jobs and manages the job stream and
    the key-value buckets;
  - one user per node id, whose subject permissions (L{node_permissions})
    let it pull and acknowledge jobs, create claims and write only its own
    presence key: it can neither publish a job nor pose as another node.

Each user's credentials file (L{NatsServer.credentials_file}) is the JSON
C{{"user": ..., "password": ...}} that C{kcoral server --credentials} and
C{kcoral gateway} read.  The server can be stopped, killed and restarted on
the same port and store (JetStream's file storage survives).  These are
blocking helpers: use them from tests and scripts, never from the reactor
thread.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from kcoral.gateway.jobs import (
    CLAIMS_BUCKET,
    NODES_BUCKET,
    RESULTS_SUBJECT_PREFIX,
    STREAM,
    node_inbox,
)
from kcoral.testing.live_server import free_port

__all__ = [
    "CLAIMS_BUCKET",
    "GATEWAY_USER",
    "JOBS_STREAM",
    "NODES_BUCKET",
    "NatsServer",
    "gateway_permissions",
    "nats_config",
    "nats_server_binary",
    "node_inbox",
    "node_permissions",
]

#: The gateway's NATS user name in the generated configuration.
GATEWAY_USER = "gateway"

#: The JetStream stream of jobs (L{kcoral.gateway.jobs.STREAM}).
JOBS_STREAM = STREAM


def nats_server_binary() -> str | None:
    """The C{nats-server} executable on C{PATH} (Debian: C{/usr/sbin}), or C{None}."""
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin" + os.pathsep + "/usr/local/sbin"
    return shutil.which("nats-server", path=path)


def node_permissions(node_id: str) -> dict[str, Any]:
    """
    The subject permissions of node C{node_id}: an allow list, so anything
    not named (publishing on C{kcoral.jobs.>}, another node's presence key,
    creating or deleting streams, purging) is refused by nats-server.

    A node replies on its own inbox prefix (L{node_inbox}), so it cannot
    read the answers meant for the gateway or other nodes.
    """
    api = "$JS.API"
    return {
        "publish": {
            "allow": [
                f"{api}.INFO",
                f"{api}.STREAM.NAMES",
                f"{api}.STREAM.INFO.{JOBS_STREAM}",
                f"{api}.STREAM.INFO.KV_{NODES_BUCKET}",
                f"{api}.STREAM.INFO.KV_{CLAIMS_BUCKET}",
                # Its pull consumers (jobs-<compat>-<gpus>): create, look up, pull.
                f"{api}.CONSUMER.CREATE.{JOBS_STREAM}.>",
                f"{api}.CONSUMER.DURABLE.CREATE.{JOBS_STREAM}.*",
                f"{api}.CONSUMER.INFO.{JOBS_STREAM}.*",
                f"{api}.CONSUMER.MSG.NEXT.{JOBS_STREAM}.*",
                # Acknowledge (or NAK) the jobs it pulled.
                f"$JS.ACK.{JOBS_STREAM}.>",
                # Its own presence key, and nobody else's.
                f"$KV.{NODES_BUCKET}.{node_id}",
                # Claims (create-only) and reading a claim back.
                f"$KV.{CLAIMS_BUCKET}.*",
                f"{api}.DIRECT.GET.KV_{CLAIMS_BUCKET}.>",
                f"{api}.STREAM.MSG.GET.KV_{CLAIMS_BUCKET}",
                # Small results, to any gateway process, as itself only.
                f"{RESULTS_SUBJECT_PREFIX}.*.{node_id}",
            ]
        },
        "subscribe": {"allow": [f"{node_inbox(node_id)}.>"]},
    }


def gateway_permissions() -> dict[str, Any]:
    """The gateway administers the pool: everything in its account."""
    return {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}}


@attrs.frozen
class NatsUser:
    """A user of the generated configuration."""

    name: str
    password: str
    permissions: Mapping[str, Any]

    def credentials(self) -> dict[str, str]:
        """The credentials file's JSON object."""
        return {"user": self.name, "password": self.password}


def _quote(value: str) -> str:
    # nats-server's configuration accepts JSON strings.
    return json.dumps(value)


def nats_config(
    *,
    port: int,
    monitor_port: int,
    store_dir: str,
    users: Iterable[NatsUser],
    host: str = "127.0.0.1",
    account: str = "KCORAL",
) -> str:
    """
    The text of a nats-server configuration: a client port on C{host}, an
    HTTP monitoring port (C{/healthz}), JetStream with file storage in
    C{store_dir}, and one account of C{users} with their permissions.
    """
    user_lines = []
    for user in users:
        name, password = _quote(user.name), _quote(user.password)
        permissions = json.dumps(dict(user.permissions))
        user_lines.append(
            f"      {{user: {name}, password: {password}, permissions: {permissions}}}"
        )
    return "\n".join(
        [
            f"listen: {host}:{port}",
            f"http: {host}:{monitor_port}",
            "jetstream {",
            f"  store_dir: {_quote(store_dir)}",
            "  max_memory_store: 64MB",
            "  max_file_store: 1GB",
            "}",
            "accounts {",
            f"  {account} {{",
            "    jetstream: enabled",
            "    users: [",
            ",\n".join(user_lines),
            "    ]",
            "  }",
            "}",
            "",
        ]
    )


@attrs.define
class NatsServer:
    """
    A C{nats-server} subprocess on free loopback ports, with the gateway
    user and one user per node id (L{node_permissions}).

    Use as a context manager, or C{start()} / C{stop()}; C{kill()} and
    C{restart()} exercise a pool losing its NATS.  Files live in
    C{directory} (a fresh temporary directory by default, removed by
    C{cleanup()} / on exit): the configuration, the JetStream store, the
    log and one credentials file per user.
    """

    node_ids: Sequence[str] = ("node-a", "node-b", "node-c")
    directory: Path | None = None
    port: int = attrs.field(factory=free_port)
    monitor_port: int = attrs.field(factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    users: dict[str, NatsUser] = attrs.field(factory=dict)
    _owns_directory: bool = False

    @property
    def url(self) -> str:
        """The client URL, C{nats://127.0.0.1:PORT}."""
        return f"nats://127.0.0.1:{self.port}"

    @property
    def store_dir(self) -> Path:
        assert self.directory is not None
        return self.directory / "jetstream"

    @property
    def log_path(self) -> Path:
        assert self.directory is not None
        return self.directory / "nats-server.log"

    def _prepare(self) -> None:
        if self.directory is None:
            self.directory = Path(tempfile.mkdtemp(prefix="kcoral-nats-"))
            self._owns_directory = True
        self.directory.mkdir(parents=True, exist_ok=True)
        if not self.users:
            self.users[GATEWAY_USER] = NatsUser(
                GATEWAY_USER, secrets.token_urlsafe(16), gateway_permissions()
            )
            for node_id in self.node_ids:
                if node_id == GATEWAY_USER:
                    raise ValueError(f"node id {node_id!r} is the gateway's user")
                self.users[node_id] = NatsUser(
                    node_id, secrets.token_urlsafe(16), node_permissions(node_id)
                )
        config = nats_config(
            port=self.port,
            monitor_port=self.monitor_port,
            store_dir=str(self.store_dir),
            users=self.users.values(),
        )
        (self.directory / "nats-server.conf").write_text(config)
        for user in self.users.values():
            path = self.credentials_file(user.name)
            path.write_text(json.dumps(user.credentials()))
            path.chmod(0o600)

    def credentials_file(self, user: str) -> Path:
        """The JSON credentials file of C{user} (a node id, or L{GATEWAY_USER})."""
        assert self.directory is not None
        return self.directory / f"{user}.creds.json"

    async def connect(self, user: str, errors: list[str] | None = None) -> Any:
        """
        A nats-py client of C{user} (a node id, or L{GATEWAY_USER}), a
        node's on its own inbox prefix as a joined node has it; no
        reconnects.  Connection errors go to C{errors} when given.
        """
        import nats

        credentials = json.loads(self.credentials_file(user).read_text())

        async def error_cb(e: Exception) -> None:
            if errors is not None:
                errors.append(str(e))

        options: dict[str, Any] = {}
        if user != GATEWAY_USER:
            options["inbox_prefix"] = node_inbox(user)
        return await nats.connect(
            self.url,
            user=credentials["user"],
            password=credentials["password"],
            allow_reconnect=False,
            connect_timeout=5,
            error_cb=error_cb,
            **options,
        )

    def write_credentials(self, path: Path, user: str, password: str) -> Path:
        """A credentials file for any user and password (wrong ones, in tests)."""
        path.write_text(json.dumps({"user": user, "password": password}))
        return path

    def start(self, timeout: float = 30.0) -> NatsServer:
        """Start nats-server and wait until JetStream answers C{/healthz}."""
        binary = nats_server_binary()
        if binary is None:
            raise RuntimeError("nats-server is not installed (Debian: apt-get install nats-server)")
        self._prepare()
        assert self.directory is not None
        log = open(self.log_path, "ab")
        try:
            self.process = subprocess.Popen(
                [binary, "-c", str(self.directory / "nats-server.conf")],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"nats-server exited with {self.process.returncode} during start: "
                    + self.log_path.read_text(errors="replace")[-2000:]
                )
            if self.healthy():
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("nats-server did not become healthy in time")

    def healthy(self) -> bool:
        """Whether the server and its JetStream answer C{/healthz} with 200."""
        url = f"http://127.0.0.1:{self.monitor_port}/healthz?js-enabled-only=true"
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return bool(response.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def monitor(self, endpoint: str) -> Any:
        """A JSON monitoring endpoint (C{varz}, C{connz}, C{jsz}, ...)."""
        url = f"http://127.0.0.1:{self.monitor_port}/{endpoint}"
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.loads(response.read())

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (a clean shutdown) and wait; the exit status."""
        return self._end(signal.SIGTERM, timeout)

    def kill(self) -> int | None:
        """SIGKILL: the server vanishes without a goodbye."""
        return self._end(signal.SIGKILL, 30.0)

    def _end(self, sig: int, timeout: float) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def restart(self, timeout: float = 30.0) -> NatsServer:
        """Stop, then start again on the same ports, users and store."""
        self.stop()
        return self.start(timeout)

    def cleanup(self) -> None:
        """Stop the server and remove the directory this object created."""
        self.kill()
        if self._owns_directory and self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
