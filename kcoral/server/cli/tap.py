# -*- test-case-name: tests.unit.test_tap -*-
"""
The C{kcoral} twistd plugin's options and service maker.

C{twistd -n kcoral [options]} and C{kcoral server [options]} both parse their
options with L{Options}, so the two accept exactly the same flags.  Parsing
applies the precedence I{command-line flag > environment variable > built-in
default}, runs the checks of the reference command line with its messages,
and leaves two results on the options object:

  - C{options.config}: the validated L{ServerConfig};
  - C{options.endpoint}: a server endpoint description for
    L{twisted.application.strports.service}, such as
    C{tcp:port=8000:interface=127.0.0.1}.

L{makeService} hands both to L{kcoral.server.service.makeService}, which
builds the root service.  Nothing here starts a reactor, binds a port or
spawns a process.
"""

from __future__ import annotations

import math
import os
import re
import textwrap
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from twisted.internet.endpoints import quoteStringArgument
from twisted.python import usage

from kcoral.config import (
    CUDA_DEFAULT_CONNECTIONS,
    DEFAULT_SPARE_WORKERS_PER_GPU,
    DEVICES,
    FRESH_CUDA_CONNECTIONS,
    LOG_LEVELS,
    REUSE_SCOPES,
    SANDBOXES,
    TENSOR_APIS,
    WORKER_STARTS,
    ServerConfig,
    default_disk_cache_dir,
)

if TYPE_CHECKING:
    from twisted.application.service import MultiService

__all__ = [
    "ENV_VARS",
    "OPTION_GROUPS",
    "Options",
    "endpoint_description",
    "grouped",
    "makeService",
    "with_backlog",
    "with_owner_only",
]

#: The listen queue of TCP and SSL ports given without C{backlog=}.
DEFAULT_BACKLOG = 1024

#: Options whose default comes from an environment variable when it is set.
ENV_VARS: Mapping[str, str] = {
    "host": "KCORAL_SERVER_HOST",
    "port": "KCORAL_SERVER_PORT",
    "device": "KCORAL_SERVER_DEVICE",
    "gpus": "KCORAL_SERVER_GPUS",
    "log-dir": "KCORAL_LOG_DIR",
    "spare-workers-per-gpu": "KCORAL_SPARE_WORKERS_PER_GPU",
    "cuda-connections": "KCORAL_CUDA_CONNECTIONS",
    "max-channel-bytes": "KCORAL_MAX_CHANNEL_BYTES",
    "workspace-bytes": "KCORAL_WORKSPACE_BYTES",
    "max-bytes-per-client": "KCORAL_MAX_BYTES_PER_CLIENT",
    "body-stall-seconds": "KCORAL_BODY_STALL_SECONDS",
    "max-connections-per-client": "KCORAL_MAX_CONNECTIONS_PER_CLIENT",
    "first-header-timeout-seconds": "KCORAL_FIRST_HEADER_TIMEOUT_SECONDS",
}

_DEFAULTS = ServerConfig(disk_cache_dir=None)


def _integer(flag: str) -> Callable[[str], int]:
    def coerce(value: str) -> int:
        try:
            return int(value)
        except ValueError:
            raise usage.UsageError(f"--{flag} must be an integer, got {value!r}") from None

    return coerce


def _is_auto(value: str) -> bool:
    """Whether C{--cuda-connections} (or its variable) says C{auto}."""
    return value.strip().lower() == "auto"


def _connections_option(value: str) -> int | None:
    """C{--cuda-connections}: C{auto} (L{None}) or an integer."""
    if _is_auto(value):
        return None
    try:
        return int(value)
    except ValueError:
        raise usage.UsageError(
            f"--cuda-connections must be an integer or 'auto', got {value!r}"
        ) from None


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


def _int_param(flag: str, default: int, doc: str) -> list[Any]:
    return [flag, None, default, doc, _integer(flag)]


def _float_param(flag: str, default: float, doc: str) -> list[Any]:
    return [flag, None, default, doc, _number(flag)]


def _choices(values: Sequence[str]) -> str:
    return "|".join(values)


#: ServerConfig field name -> the flag that sets it, for error messages.
_FIELD_FLAGS: Mapping[str, str] = {
    "gpus": "gpus",
    "log_dir": "log-dir",
    "cache_capacity_bytes": "cache-capacity-bytes",
    "disk_cache_dir": "disk-cache-dir",
    "disk_cache_capacity_mbytes": "disk-cache-capacity-mbytes",
    "default_timeout_seconds": "default-timeout-seconds",
    "max_timeout_seconds": "max-timeout-seconds",
    "worker_wait_timeout_seconds": "worker-wait-timeout-seconds",
    "workers_per_gpu": "workers-per-gpu",
    "max_requests_per_worker": "max-requests-per-worker",
    "spare_workers_per_gpu": "spare-workers-per-gpu",
    "cuda_connections": "cuda-connections",
    "reuse_scope": "reuse-scope",
    "sandbox": "sandbox",
    "sandbox_readonly_paths": "sandbox-readonly-path",
    "worker_termination_grace_seconds": "worker-termination-grace-seconds",
    "gpu_monitor_interval": "gpu-monitor-interval",
    "max_request_bytes": "max-request-bytes",
    "max_response_bytes": "max-response-bytes",
    "output_limit_bytes": "output-limit-bytes",
    "max_output_limit_bytes": "max-output-limit-bytes",
    "output_space_bytes": "output-space-bytes",
    "device": "device",
    "num_workers": "num-workers",
    "tensor_api": "tensor-api",
    "worker_start": "worker-start",
    "log_level": "log-level",
    "log_retention_days": "log-retention-days",
    "log_retention_mbytes": "log-retention-mbytes",
    "auth_token_file": "auth-token-file",
    "public_metrics": "public-metrics",
    "header_timeout_seconds": "header-timeout-seconds",
    "body_timeout_seconds": "body-timeout-seconds",
    "max_connections": "max-connections",
    "finish_abandoned": "finish-abandoned",
    "max_queued_requests": "max-queued-requests",
    "max_bytes_in_flight": "max-bytes-in-flight",
    "max_channel_bytes": "max-channel-bytes",
    "workspace_bytes": "workspace-bytes",
    "max_bytes_per_client": "max-bytes-per-client",
    "body_stall_seconds": "body-stall-seconds",
    "max_connections_per_client": "max-connections-per-client",
    "first_header_timeout_seconds": "first-header-timeout-seconds",
    "front_ends": "front-ends",
    "lame_duck_seconds": "lame-duck-seconds",
    "join_url": "join",
    "join_node_id": "node-id",
    "join_credentials": "credentials",
}

#: The options of C{--help} (and of docs/configuration.md's table) by
#: topic, in this order; an option named in no group is listed last, under
#: L{OTHER_GROUP}.
OPTION_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "Listening and access",
        (
            "host",
            "port",
            "listen",
            "listen-backlog",
            "auth-token-file",
            "public-metrics",
            "max-connections",
            "max-connections-per-client",
            "first-header-timeout-seconds",
            "header-timeout-seconds",
            "body-timeout-seconds",
            "body-stall-seconds",
            "front-ends",
            "lame-duck-seconds",
        ),
    ),
    (
        "Workers",
        (
            "device",
            "gpus",
            "num-workers",
            "workers-per-gpu",
            "max-requests-per-worker",
            "spare-workers-per-gpu",
            "worker-start",
            "cuda-connections",
            "tensor-api",
            "reuse-scope",
            "worker-termination-grace-seconds",
            "gpu-monitor-interval",
        ),
    ),
    ("Sandbox", ("sandbox", "sandbox-readonly-path", "output-space-bytes", "workspace-bytes")),
    (
        "Requests: queueing, budgets and sizes",
        (
            "worker-wait-timeout-seconds",
            "max-queued-requests",
            "finish-abandoned",
            "default-timeout-seconds",
            "max-timeout-seconds",
            "max-request-bytes",
            "max-bytes-in-flight",
            "max-bytes-per-client",
            "max-channel-bytes",
            "max-response-bytes",
            "output-limit-bytes",
            "max-output-limit-bytes",
        ),
    ),
    ("Caches", ("cache-capacity-bytes", "disk-cache-dir", "disk-cache-capacity-mbytes")),
    ("Joining a gateway's pool", ("join", "node-id", "credentials")),
    (
        "Logs",
        (
            "log-dir",
            "log-level",
            "no-log-console",
            "no-log-programs",
            "log-retention-days",
            "log-retention-mbytes",
        ),
    ),
    ("Help", ("help", "version")),
)

#: The group of an option that L{OPTION_GROUPS} does not name.
OTHER_GROUP = "Other"


def grouped(names: Sequence[str]) -> list[tuple[str, list[str]]]:
    """
    C{names} (long options, without dashes) by L{OPTION_GROUPS}, in its
    order of groups, as C{(title, names)} pairs with each group's names
    sorted (as C{--help} lists them); the ones no group names come last,
    under L{OTHER_GROUP}, in their own order.
    """
    present = list(dict.fromkeys(names))
    groups = []
    placed: set[str] = set()
    for title, members in OPTION_GROUPS:
        inside = sorted(name for name in members if name in present)
        placed.update(inside)
        if inside:
            groups.append((title, inside))
    rest = [name for name in present if name not in placed]
    if rest:
        groups.append((OTHER_GROUP, rest))
    return groups


_FIELD_RE = re.compile(r"\b(" + "|".join(_FIELD_FLAGS) + r")\b(?![=_])")


def _flag_message(message: str) -> str:
    """Name flags rather than L{ServerConfig} fields in an error message."""
    return _FIELD_RE.sub(lambda m: "--" + _FIELD_FLAGS[m.group(1)], message)


class Options(usage.Options):
    """
    Options of C{twistd kcoral} and C{kcoral server}.

    @ivar config: the L{ServerConfig} built by L{postOptions}.
    @ivar endpoints: the endpoint descriptions of the HTTP listening ports
        (C{--listen}, or C{tcp:} on C{--host}/C{--port}), built by
        L{postOptions}.
    @ivar endpoint: the first of them.
    """

    longdesc = (
        "Run a KCoral-compatible server: HTTP on --host/--port, GPU workers "
        "(--device gpu) or CUDA C compile workers (--device cpu). A flag given "
        "on the command line beats its environment variable ("
        + ", ".join(f"{v} for --{k}" for k, v in ENV_VARS.items())
        + "), which beats the built-in default."
    )

    optFlags = [
        [
            "no-log-console",
            None,
            "Do not mirror log events to the console. [default: mirroring on]",
        ],
        [
            "no-log-programs",
            None,
            "Do not save accepted programs under the run directory. [default: programs saved]",
        ],
        [
            "public-metrics",
            None,
            "Serve /metrics and /status without a token when --auth-token-file is given "
            "(/health is always open). [default: behind the token]",
        ],
        [
            "finish-abandoned",
            None,
            "Run a program to its end when its client disconnects. [default: a queued "
            "request is dropped at once, a running one's worker is replaced]",
        ],
    ]

    optParameters = [
        ["host", None, "127.0.0.1", "Address the HTTP server binds (env KCORAL_SERVER_HOST)."],
        _int_param("port", 8000, "TCP port of the HTTP server, 1-65535 (env KCORAL_SERVER_PORT)."),
        [
            "device",
            None,
            _DEFAULTS.device,
            f"Worker kind, {_choices(DEVICES)} (env KCORAL_SERVER_DEVICE).",
        ],
        [
            "gpus",
            None,
            ",".join(str(g) for g in _DEFAULTS.gpus),
            "Comma-separated physical GPU ids for GPU workers (env KCORAL_SERVER_GPUS); "
            "ignored with --device cpu.",
        ],
        _int_param("num-workers", _DEFAULTS.num_workers, "Number of workers in CPU mode."),
        _int_param("workers-per-gpu", _DEFAULTS.workers_per_gpu, "Workers per GPU in GPU mode."),
        _int_param(
            "max-requests-per-worker",
            _DEFAULTS.max_requests_per_worker,
            "Requests a worker serves before it is replaced; 0 reuses workers.",
        ),
        [
            "spare-workers-per-gpu",
            None,
            None,
            "Warm workers kept ready per GPU (CPU mode: for the pool) so a retiring "
            "worker's seat is refilled at once; default "
            f"{DEFAULT_SPARE_WORKERS_PER_GPU} in GPU mode (a GPU creates a context in "
            "0.12-0.15 s, one at a time: four cover the refill time at 3-4 requests/s), "
            "0 in CPU mode and with --max-requests-per-worker 0 "
            "(env KCORAL_SPARE_WORKERS_PER_GPU).",
            _integer("spare-workers-per-gpu"),
        ],
        [
            "cuda-connections",
            None,
            "auto",
            "Hardware work queues of each GPU worker's CUDA context "
            "(CUDA_DEVICE_MAX_CONNECTIONS, 1-32, or auto). Fewer make a context "
            f"cheaper to create and destroy: auto is {FRESH_CUDA_CONNECTIONS} when "
            "workers are replaced after every request (an H200 then replaces 10.6 "
            f"workers/s, against 6.1 with 4 and 4.7 with 8), CUDA's own "
            f"{CUDA_DEFAULT_CONNECTIONS} otherwise; a program's streams beyond this "
            "many share queues and may wait on each other (env KCORAL_CUDA_CONNECTIONS).",
            _connections_option,
        ],
        _float_param(
            "worker-termination-grace-seconds",
            _DEFAULTS.worker_termination_grace_seconds,
            "Seconds a stopped worker gets to exit before SIGKILL, spent once.",
        ),
        _float_param(
            "gpu-monitor-interval",
            _DEFAULTS.gpu_monitor_interval,
            "Seconds between the GPU monitor's NVML readings of every GPU (it kills GPU "
            "processes a program started and flags benchmarks disturbed by other processes "
            "or throttling; docs/trusted-timing.md); 0 turns it off.",
        ),
        _float_param(
            "worker-wait-timeout-seconds",
            _DEFAULTS.worker_wait_timeout_seconds,
            "Seconds a request waits for an idle worker before a 503.",
        ),
        _float_param(
            "default-timeout-seconds",
            _DEFAULTS.default_timeout_seconds,
            "Execution budget of a request that names none.",
        ),
        _float_param(
            "max-timeout-seconds",
            _DEFAULTS.max_timeout_seconds,
            "Upper bound for any request's execution budget.",
        ),
        _int_param(
            "max-request-bytes", _DEFAULTS.max_request_bytes, "Largest accepted request body."
        ),
        _int_param("max-response-bytes", _DEFAULTS.max_response_bytes, "Largest response body."),
        _int_param(
            "output-limit-bytes",
            _DEFAULTS.output_limit_bytes,
            "Default stdout/stderr capture per stream.",
        ),
        _int_param(
            "max-output-limit-bytes",
            _DEFAULTS.max_output_limit_bytes,
            "Largest stdout/stderr capture a request may ask for.",
        ),
        _int_param(
            "output-space-bytes",
            _DEFAULTS.output_space_bytes,
            "Size of each bubblewrap worker's private tmpfs for captured output "
            "(writes past it fail with ENOSPC).",
        ),
        _int_param(
            "cache-capacity-bytes",
            _DEFAULTS.cache_capacity_bytes,
            "Capacity of the memory cache for tensors, bytes and libraries.",
        ),
        [
            "disk-cache-dir",
            None,
            None,
            "Directory of the file upload cache; '' disables it. The default is "
            "$XDG_CACHE_HOME/kcoral/files when XDG_CACHE_HOME is absolute, "
            "else ~/.cache/kcoral/files.",
        ],
        _int_param(
            "disk-cache-capacity-mbytes",
            _DEFAULTS.disk_cache_capacity_mbytes,
            "Capacity of the file upload cache in MiB; 0 disables it.",
        ),
        [
            "log-dir",
            None,
            "logs",
            "Directory of run logs and saved programs; '' disables file logging "
            "(env KCORAL_LOG_DIR).",
        ],
        [
            "log-level",
            None,
            _DEFAULTS.log_level,
            f"Least severe event written to events.jsonl and the console, {_choices(LOG_LEVELS)}.",
        ],
        _float_param(
            "log-retention-days",
            _DEFAULTS.log_retention_days,
            "Delete run directories (events, saved programs) older than this; 0 keeps them.",
        ),
        _int_param(
            "log-retention-mbytes",
            _DEFAULTS.log_retention_mbytes,
            "Delete the oldest run directories while all together exceed this many MiB; "
            "0 sets no bound.",
        ),
        [
            "auth-token-file",
            None,
            None,
            "File of bearer tokens, one 'CLIENT-NAME TOKEN' per line (or one bare token); "
            "every request but GET /health then needs 'Authorization: Bearer TOKEN'. "
            "[default: no authentication]",
        ],
        _int_param(
            "listen-backlog",
            DEFAULT_BACKLOG,
            "Listen queue length of TCP and SSL ports given without backlog=.",
        ),
        _float_param(
            "header-timeout-seconds",
            _DEFAULTS.header_timeout_seconds,
            "Seconds a client has to send a whole request head, however it trickles "
            "(408 after); 0 sets none.",
        ),
        _float_param(
            "body-timeout-seconds",
            _DEFAULTS.body_timeout_seconds,
            "Seconds a client has to send a request body after its head (408 after); 0 sets none.",
        ),
        _int_param(
            "max-queued-requests",
            _DEFAULTS.max_queued_requests,
            "Requests that may wait for a worker at once; more get a 503 at once. 0: no cap.",
        ),
        _int_param(
            "front-ends",
            _DEFAULTS.front_ends,
            "Server processes sharing the port (SO_REUSEPORT) and the GPUs' leases, each "
            "with its own event loop and an equal share of the seats, spares and caps; "
            "1: one process. Plain TCP endpoints only.",
        ),
        _int_param(
            "max-bytes-in-flight",
            _DEFAULTS.max_bytes_in_flight,
            "Request body bytes held at once, from their headers to their answers; a "
            "request over it gets a 503 and its body is discarded. 0: no cap.",
        ),
        _int_param(
            "workspace-bytes",
            _DEFAULTS.workspace_bytes,
            "Under bubblewrap, the size of the private in-memory workspace (/work) of each "
            "worker that serves one request: a program's files never reach the host's disk "
            "and writes past it fail with ENOSPC. 0, or --max-requests-per-worker other "
            "than 1: the seat's host directory, unbounded (env KCORAL_WORKSPACE_BYTES).",
        ),
        _int_param(
            "max-channel-bytes",
            _DEFAULTS.max_channel_bytes,
            "Server memory that messages from workers may take while they are read, all "
            "workers together, and again what decoded results keep until their answers: a "
            "message over 64 KiB waits until what reading it may cost fits; one that never "
            "could, or results over the budget, fail their request (results whose JSON "
            "would take over half of it are answered response_too_large). 0: no budget "
            "(env KCORAL_MAX_CHANNEL_BYTES).",
        ),
        _int_param(
            "max-bytes-per-client",
            _DEFAULTS.max_bytes_per_client,
            "Request body bytes one client address may hold at once, counted as they "
            "arrive; past it that address's next body gets a 503. 0: no cap "
            "(env KCORAL_MAX_BYTES_PER_CLIENT).",
        ),
        _float_param(
            "body-stall-seconds",
            _DEFAULTS.body_stall_seconds,
            "Seconds a request body may go without a byte arriving before it is cut off "
            "(408) and its bytes released; 0: never (env KCORAL_BODY_STALL_SECONDS).",
        ),
        _int_param(
            "max-connections",
            _DEFAULTS.max_connections,
            "Open HTTP connections served at once, kept below the open-file limit; at it the "
            "connection waiting longest for a request head is closed to make room, and when "
            "all are in requests a new one gets a 503. 0: only the open-file limit.",
        ),
        _int_param(
            "max-connections-per-client",
            _DEFAULTS.max_connections_per_client,
            "Open HTTP connections one client address may have; at it that address's "
            "connection waiting longest for a request head is closed to make room. 0: no cap "
            "(env KCORAL_MAX_CONNECTIONS_PER_CLIENT).",
        ),
        _float_param(
            "first-header-timeout-seconds",
            _DEFAULTS.first_header_timeout_seconds,
            "Seconds a new connection has to send its first request head (408 after); "
            "0: the header timeout (env KCORAL_FIRST_HEADER_TIMEOUT_SECONDS).",
        ),
        _float_param(
            "lame-duck-seconds",
            _DEFAULTS.lame_duck_seconds,
            "At a graceful stop, seconds the server keeps serving while /health answers "
            "503 (stopping), before its ports close: set it above a load balancer's "
            "time to mark a node down (HAProxy inter x fall). 0: close them at once.",
        ),
        ["sandbox", None, _DEFAULTS.sandbox, f"Worker isolation, {_choices(SANDBOXES)}."],
        [
            "join",
            None,
            None,
            "Join a kcoral gateway's pool through this NATS URL (nats://HOST:PORT or "
            "tls://HOST:PORT; several comma-separated): pull its jobs, run them, post the "
            "results to the gateway. Needs --node-id and --credentials; the server then "
            "listens on loopback only. [default: no pool]",
        ],
        [
            "node-id",
            None,
            None,
            "This node's id in the pool (--join): letters, digits, '-' and '_'; its NATS "
            "user may write only this presence key.",
        ],
        [
            "credentials",
            None,
            None,
            "The node's NATS credentials file (--join): a NATS .creds file, or JSON "
            '{"user": ..., "password": ...}.',
        ],
        [
            "reuse-scope",
            None,
            _DEFAULTS.reuse_scope,
            f"Whose requests a reused worker serves, {_choices(REUSE_SCOPES)}: 'address' "
            "only the client it first served (its address, or its token's client name with "
            "--auth-token-file), 'any' every client (a program "
            "can read the next program its worker runs).",
        ],
        [
            "tensor-api",
            None,
            _DEFAULTS.tensor_api,
            f"Tensor type Python functions receive in GPU workers, {_choices(TENSOR_APIS)}.",
        ],
        [
            "worker-start",
            None,
            _DEFAULTS.worker_start,
            f"How new workers are made, {_choices(WORKER_STARTS)}: 'fork' from a template "
            "process that did every import once (falls back to 'spawn' when it cannot "
            "start), 'spawn' a new interpreter each.",
        ],
    ]

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        """
        @param environ: the environment whose C{KCORAL_*} variables supply
            defaults; L{os.environ} when C{None}.  It is read now, once.
        """
        super().__init__()  # type: ignore[no-untyped-call]
        env = os.environ if environ is None else environ
        self._environ = env
        for key, var in ENV_VARS.items():
            value = env.get(var)
            if value is None:
                continue
            if value == "" and key != "log-dir":
                # An empty variable means "unset", except KCORAL_LOG_DIR=""
                # which disables file logging like --log-dir ''.
                continue
            self[key] = value
            self.defaults[key] = value if value else "''"
        xdg_default = str(default_disk_cache_dir(env))
        self["disk-cache-dir"] = xdg_default
        self.defaults["disk-cache-dir"] = xdg_default
        self["sandbox-readonly-path"] = []
        self["listen"] = []

    def opt_listen(self, description: str) -> None:
        """
        Listen on a Twisted endpoint instead of --host/--port: tcp:PORT[:interface=ADDR],
        ssl:PORT:privateKey=KEY.pem:certKey=CERT.pem, unix:PATH. Repeat to listen on
        several. [default: tcp on --host/--port]
        """
        if not description:
            raise usage.UsageError("--listen needs an endpoint description")
        self["listen"].append(description)

    def opt_sandbox_readonly_path(self, path: str) -> None:
        """
        Extra path mounted read-only in every worker's sandbox; directories
        also join PYTHONPATH. Repeat for several paths. Needs --sandbox
        bubblewrap. [default: none]
        """
        if not path:
            raise usage.UsageError("--sandbox-readonly-path needs a non-empty path")
        self["sandbox-readonly-path"].append(path)

    def opt_help(self) -> None:
        """
        Display this help and exit.
        """
        print(self.__str__())
        raise SystemExit(0)

    opt_h = opt_help

    def getUsage(self, width: int | None = None) -> str:
        """
        Twisted's usage text with the options grouped by topic
        (L{OPTION_GROUPS}) instead of one alphabetical list.
        """
        from twisted.python.usage import docMakeChunks

        if not width:
            width = int(os.environ.get("COLUMNS", "80"))
        short = {long: key for key, long in self.synonyms.items() if len(key) == 1}
        dicts = {}
        for opt in self.longOpt:
            name = opt.rstrip("=")
            dicts[name] = {
                "long": name,
                "short": short.get(name),
                "doc": " ".join(self.docs[name].split()),
                "optType": "parameter" if opt.endswith("=") else "flag",
                "default": self.defaults.get(name),
                "dispatch": self._dispatch.get(name),
            }
        sections = []
        for title, names in grouped(list(dicts)):
            chunks = docMakeChunks([dicts[name] for name in names], width)
            sections.append(f"\n{title}:\n" + "".join(chunks))
        longdesc = "\n".join(textwrap.wrap(self.longdesc, width)).strip()
        return "".join(sections) + "\n" + longdesc + "\n"

    def opt_version(self) -> None:
        """
        Display the kcoral version and exit.
        """
        from importlib import metadata

        try:
            version = metadata.version("kcoral-server")
        except metadata.PackageNotFoundError:
            version = "unknown"
        print(f"kcoral {version}")
        raise SystemExit(0)

    def parseOptions(self, options: Sequence[str] | None = None) -> None:
        """
        Parse C{options}, refusing abbreviated long options.

        getopt accepts any unambiguous prefix of a long option; the reference
        command line does not, so neither do we.
        """
        if options is not None:
            self._reject_abbreviations(options)
        super().parseOptions(options)  # type: ignore[no-untyped-call]

    def _reject_abbreviations(self, options: Sequence[str]) -> None:
        known = {name.rstrip("=") for name in self.longOpt}
        takes_value = {name[:-1] for name in self.longOpt if name.endswith("=")}
        skip = False
        for arg in options:
            if skip:
                skip = False
                continue
            if arg == "--":
                return
            if arg.startswith("--"):
                name, has_value, _ = arg[2:].partition("=")
                if name not in known:
                    raise usage.UsageError(f"option --{name} not recognized")
                skip = name in takes_value and not has_value

    def _integer_from_env(self, flag: str) -> Any:
        """
        The value of C{flag}: flags are coerced while parsing, a default
        taken from its environment variable (L{ENV_VARS}) is coerced here.
        """
        value = self[flag]
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                raise usage.UsageError(
                    f"{ENV_VARS[flag]} must be an integer, got {value!r}"
                ) from None
        return value

    def _float_from_env(self, flag: str) -> Any:
        """L{_integer_from_env} for a number of seconds."""
        value = self[flag]
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise usage.UsageError(
                    f"{ENV_VARS[flag]} must be a number, got {value!r}"
                ) from None
        return value

    def postOptions(self) -> None:
        """
        Check the options and build C{self.config} and C{self.endpoint}.

        @raise usage.UsageError: naming the offending flag.
        """
        spares = self._integer_from_env("spare-workers-per-gpu")
        connections = self["cuda-connections"]
        if isinstance(connections, str):
            # Taken from KCORAL_CUDA_CONNECTIONS (flags are coerced while parsing).
            auto = _is_auto(connections)
            connections = None if auto else self._integer_from_env("cuda-connections")
        port = self._integer_from_env("port")
        device = self["device"]
        if device not in DEVICES:
            raise usage.UsageError(f"--device must be 'cpu' or 'gpu', got {device!r}")
        sandbox = self["sandbox"]
        if sandbox not in SANDBOXES:
            raise usage.UsageError(
                f"--sandbox must be 'none', 'bubblewrap' or 'auto', got {sandbox!r}"
            )
        tensor_api = self["tensor-api"]
        if tensor_api not in TENSOR_APIS:
            raise usage.UsageError(
                f"--tensor-api must be one of {', '.join(TENSOR_APIS)}, got {tensor_api!r}"
            )
        worker_start = self["worker-start"]
        if worker_start not in WORKER_STARTS:
            raise usage.UsageError(
                f"--worker-start must be one of {', '.join(WORKER_STARTS)}, got {worker_start!r}"
            )
        log_level = self["log-level"]
        if log_level not in LOG_LEVELS:
            raise usage.UsageError(
                f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {log_level!r}"
            )
        gpus = self._parse_gpus(self["gpus"])
        host = self["host"]
        if not host:
            raise usage.UsageError("--host must not be empty")

        # The reference command line's checks, in its order and words.
        if device == "gpu" and not gpus:
            raise usage.UsageError("--gpus needs at least one GPU id")
        if self["num-workers"] < 1:
            raise usage.UsageError("--num-workers must be at least 1")
        if self["workers-per-gpu"] < 1:
            raise usage.UsageError("--workers-per-gpu must be at least 1")
        if not 1 <= port <= 65535:
            raise usage.UsageError("--port must be between 1 and 65535")
        if self["max-requests-per-worker"] < 0:
            raise usage.UsageError("--max-requests-per-worker must be non-negative")
        if self["disk-cache-capacity-mbytes"] < 0:
            raise usage.UsageError("--disk-cache-capacity-mbytes must be non-negative")
        if self["sandbox-readonly-path"] and sandbox == "none":
            raise usage.UsageError("--sandbox-readonly-path requires --sandbox bubblewrap")
        if self["listen-backlog"] < 1:
            raise usage.UsageError("--listen-backlog must be at least 1")
        token_file = self["auth-token-file"] or None
        if token_file is not None:
            from kcoral.server.http.auth import TokenFileError, load_tokens

            try:
                load_tokens(token_file)
            except TokenFileError as e:
                raise usage.UsageError(f"--auth-token-file: {e}") from None

        try:
            self.config = ServerConfig(
                gpus=gpus,
                log_dir=self["log-dir"] or None,
                log_console=not self["no-log-console"],
                log_programs=not self["no-log-programs"],
                cache_capacity_bytes=self["cache-capacity-bytes"],
                disk_cache_dir=self["disk-cache-dir"] or None,
                disk_cache_capacity_mbytes=self["disk-cache-capacity-mbytes"],
                default_timeout_seconds=self["default-timeout-seconds"],
                max_timeout_seconds=self["max-timeout-seconds"],
                worker_wait_timeout_seconds=self["worker-wait-timeout-seconds"],
                workers_per_gpu=self["workers-per-gpu"],
                max_requests_per_worker=self["max-requests-per-worker"],
                spare_workers_per_gpu=spares,
                cuda_connections=connections,
                reuse_scope=self["reuse-scope"],
                sandbox=sandbox,
                sandbox_readonly_paths=self["sandbox-readonly-path"],
                worker_termination_grace_seconds=self["worker-termination-grace-seconds"],
                gpu_monitor_interval=self["gpu-monitor-interval"],
                max_request_bytes=self["max-request-bytes"],
                max_response_bytes=self["max-response-bytes"],
                output_limit_bytes=self["output-limit-bytes"],
                max_output_limit_bytes=self["max-output-limit-bytes"],
                output_space_bytes=self["output-space-bytes"],
                device=device,
                num_workers=self["num-workers"],
                tensor_api=tensor_api,
                worker_start=worker_start,
                log_level=log_level,
                log_retention_days=self["log-retention-days"],
                log_retention_mbytes=self["log-retention-mbytes"],
                auth_token_file=token_file,
                public_metrics=bool(self["public-metrics"]),
                header_timeout_seconds=self["header-timeout-seconds"],
                body_timeout_seconds=self["body-timeout-seconds"],
                max_connections=self["max-connections"],
                finish_abandoned=bool(self["finish-abandoned"]),
                max_queued_requests=self["max-queued-requests"],
                max_bytes_in_flight=self["max-bytes-in-flight"],
                max_channel_bytes=self._integer_from_env("max-channel-bytes"),
                workspace_bytes=self._integer_from_env("workspace-bytes"),
                max_bytes_per_client=self._integer_from_env("max-bytes-per-client"),
                max_connections_per_client=self._integer_from_env("max-connections-per-client"),
                first_header_timeout_seconds=self._float_from_env("first-header-timeout-seconds"),
                body_stall_seconds=self._float_from_env("body-stall-seconds"),
                front_ends=self["front-ends"],
                lame_duck_seconds=self["lame-duck-seconds"],
                join_url=self["join"] or None,
                join_node_id=self["node-id"] or None,
                join_credentials=self["credentials"] or None,
            )
        except ValueError as e:
            raise usage.UsageError(_flag_message(str(e))) from None
        self["port"] = port
        descriptions = self["listen"] or [endpoint_description(host, port)]
        self.endpoints = tuple(
            with_owner_only(with_backlog(d, self["listen-backlog"])) for d in descriptions
        )
        if self.config.front_ends > 1:
            other = [d for d in self.endpoints if d.split(":", 1)[0].lower() not in ("tcp", "tcp6")]
            if other:
                raise usage.UsageError(
                    f"--front-ends needs plain TCP endpoints (tcp:...), not {other[0]!r}"
                )
        if self.config.join_url is not None:
            self._check_join()
        self.endpoint = self.endpoints[0]

    def _check_join(self) -> None:
        """
        A node that joins a pool listens on loopback only (its jobs come
        through NATS), and its credentials file must be readable.
        """
        from kcoral.server.join.options import JoinListenError, check_join_endpoints

        try:
            check_join_endpoints(self.endpoints)
        except JoinListenError as e:
            raise usage.UsageError(f"--join: {e}") from None
        from kcoral.gateway.natsbridge import load_credentials

        assert self.config.join_credentials is not None
        try:
            load_credentials(str(self.config.join_credentials))
        except (OSError, ValueError) as e:
            raise usage.UsageError(f"--credentials: {e}") from None

    @staticmethod
    def _parse_gpus(value: str) -> tuple[int, ...]:
        ids = []
        for item in value.split(","):
            if not item.strip():
                continue
            try:
                ids.append(int(item))
            except ValueError:
                raise usage.UsageError(
                    f"--gpus must be a comma-separated list of integers, got {value!r}"
                ) from None
        return tuple(ids)


def endpoint_description(host: str, port: int) -> str:
    """
    Describe a TCP listening port for L{twisted.application.strports}.

    @param host: the interface address; colons (IPv6) are escaped.
    @param port: the TCP port.
    @return: e.g. C{tcp:port=8000:interface=127.0.0.1}.
    """
    interface: str = quoteStringArgument(host)  # type: ignore[no-untyped-call]
    return f"tcp:port={port}:interface={interface}"


def with_backlog(description: str, backlog: int) -> str:
    """
    Add C{backlog=} to a C{tcp:} or C{ssl:} endpoint description that has
    none (Twisted's default of 50 resets connections in a burst).
    """
    kind = description.split(":", 1)[0].lower()
    if kind in ("tcp", "tcp6", "ssl") and "backlog=" not in description:
        return f"{description}:backlog={backlog}"
    return description


#: The mode of a UNIX socket given without C{mode=}: its owner only.
DEFAULT_UNIX_MODE = "600"


def with_owner_only(description: str) -> str:
    """
    Add C{mode=600} to a C{unix:} endpoint description that has no mode
    (Twisted's default, 0666, lets every local user connect).
    """
    kind, _, rest = description.partition(":")
    fields = rest.split(":")
    if kind.lower() == "unix" and not any(f.startswith("mode=") for f in fields[1:]):
        return f"{description}:mode={DEFAULT_UNIX_MODE}"
    return description


def makeService(options: Options, *, console_mirror: bool = False) -> MultiService:
    """
    Build the root service from parsed options (the L{IServiceMaker} hook).

    Under plain twistd, twistd's own log observer already writes every event
    (kcoral's included) to its log file or the terminal, so kcoral's console
    mirror stays off there: each event appears once, where twistd's
    C{--logfile}/C{--syslog} send it.  C{kcoral server} installs a twistd
    logger that leaves kcoral events out and asks for the mirror instead.

    @param options: an L{Options} whose C{postOptions} has run.
    @param console_mirror: keep C{config.log_console} as parsed.
    @return: the service made by L{kcoral.server.service.makeService}.
    """
    # Imported here so that parsing options never loads the service tree.
    import attrs

    from kcoral.server.service import makeService as make_root_service

    config = options.config
    if not console_mirror:
        config = attrs.evolve(config, log_console=False)
    root: MultiService = make_root_service(config, options.endpoints)
    return root
