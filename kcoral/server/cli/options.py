# -*- test-case-name: tests.unit.test_options,tests.unit.test_tap -*-
"""
The one table of the server's options: L{OPTIONS}.

Each row is one option of C{twistd kcoral} and C{kcoral server}: its flag,
the L{ServerConfig} field it fills (none for the listening address), its
C{KCORAL_*} environment variable, its command-line default, its help and
the topic C{--help} lists it under.  Everything else reads this table:

  - L{kcoral.server.cli.tap.Options} generates its C{optParameters},
    C{optFlags} and their coercion from it, reads the variables it names,
    and builds the L{ServerConfig} field by field from it;
  - C{--help} groups the options by L{GROUPS};
  - C{docs/_ext/gen_tables.py} writes docs/configuration.md's tables.

Nothing here imports Twisted; a bad value raises L{BadValue}, which the
options turn into a usage error naming the flag or the variable it came
from.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

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
)

__all__ = [
    "DEFAULT_BACKLOG",
    "ENV_VARS",
    "FIELD_FLAGS",
    "GROUPS",
    "HELP_GROUP",
    "OPTIONS",
    "OPTION_GROUPS",
    "BadValue",
    "Option",
    "boolean",
    "by_flag",
    "grouped",
]

#: The listen queue of TCP and SSL ports given without C{backlog=}.
DEFAULT_BACKLOG = 1024


class BadValue(ValueError):
    """
    A value an option cannot take; the message says what it must be
    (C{"must be an integer"}), without naming the flag or the variable.
    """


def integer(text: str) -> int:
    """An integer option's value."""
    try:
        return int(text)
    except ValueError:
        raise BadValue("must be an integer") from None


def number(text: str) -> float:
    """A number option's value: finite."""
    try:
        result = float(text)
    except ValueError:
        raise BadValue("must be a number") from None
    if not math.isfinite(result):
        raise BadValue("must be a finite number")
    return result


def connections(text: str) -> int | None:
    """C{--cuda-connections}: C{auto} (L{None}) or an integer."""
    if text.strip().lower() == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise BadValue("must be an integer or 'auto'") from None


def gpu_ids(text: str) -> tuple[int, ...]:
    """C{--gpus}: comma-separated integers; blank items are skipped."""
    ids = []
    for item in text.split(","):
        if not item.strip():
            continue
        try:
            ids.append(int(item))
        except ValueError:
            raise BadValue("must be a comma-separated list of integers") from None
    return tuple(ids)


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def boolean(text: str) -> bool:
    """A switch's environment variable: C{1}/C{0}, C{true}/C{false}, C{yes}/C{no}, C{on}/C{off}."""
    word = text.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise BadValue("must be 1 or 0 (true/false, yes/no, on/off)")


def _empty_is_none(value: object) -> object:
    """C{''} (the option given empty) turns the feature off: C{None}."""
    return value or None


def _negated(value: object) -> bool:
    return not value


def _as_bool(value: object) -> bool:
    return bool(value)


def _same(value: object) -> object:
    return value


#: The kinds of option.
VALUE, SWITCH, REPEAT = "value", "switch", "repeat"

# Topics, in the order --help and the docs list them.
LISTENING = "Listening and access"
WORKERS = "Workers"
SANDBOX = "Sandbox"
REQUESTS = "Requests: queueing, budgets and sizes"
CACHES = "Caches"
JOIN = "Joining a gateway's pool"
LOGS = "Logs"
#: The topic of C{--help} and C{--version}, which are commands, not options.
HELP_GROUP = "Help"

#: Every topic, in order.
GROUPS = (LISTENING, WORKERS, SANDBOX, REQUESTS, CACHES, JOIN, LOGS)


def _env_name(flag: str) -> str:
    return "KCORAL_" + flag.upper().replace("-", "_")


@attrs.frozen(kw_only=True)
class Option:
    """
    One option of the server's command line.

    @ivar flag: the long option, without its dashes.
    @ivar field: the L{ServerConfig} field it fills; C{None} for the
        options that make the listening endpoints instead.
    @ivar group: its topic, one of L{GROUPS}.
    @ivar help: what it does, for C{--help} and the docs.
    @ivar kind: L{VALUE} (takes a value), L{SWITCH} (takes none) or
        L{REPEAT} (takes a value, may be given again).
    @ivar default: the command-line default of a value option: the text or
        value used when neither the flag nor its variable is given.
    @ivar parse: turns a value's text into the option's value (raising
        L{BadValue}); C{None} keeps the text.
    @ivar to_field: turns the option's value into its field's value.
    @ivar env: its environment variable; by default C{KCORAL_} and the flag
        in capitals with underscores.
    @ivar empty_is_value: an empty variable is a value (C{KCORAL_LOG_DIR=""}
        turns file logging off), not "unset".
    @ivar separator: how a L{REPEAT} option's variable separates its values
        (C{None}: runs of white space).
    """

    flag: str
    field: str | None
    group: str
    help: str
    kind: str = VALUE
    default: Any = None
    parse: Callable[[str], Any] | None = None
    to_field: Callable[[Any], Any] = _same
    env: str = attrs.field(
        default=attrs.Factory(lambda self: _env_name(self.flag), takes_self=True)
    )
    empty_is_value: bool = False
    separator: str | None = None

    def env_value(self, text: str) -> Any:
        """
        The value of this option given as C{text} by its variable.

        @raise BadValue: naming nothing; the caller names the variable.
        """
        if self.kind == SWITCH:
            return boolean(text)
        if self.kind == REPEAT:
            return [item for item in text.split(self.separator) if item]
        return text if self.parse is None else self.parse(text)


_DEFAULTS = ServerConfig(disk_cache_dir=None)


def _choices(values: Sequence[str]) -> str:
    return "|".join(values)


def _int(flag: str, field: str, group: str, help: str, **more: Any) -> Option:
    """An integer option whose command-line default is its field's."""
    more.setdefault("default", getattr(_DEFAULTS, field))
    return Option(flag=flag, field=field, group=group, help=help, parse=integer, **more)


def _float(flag: str, field: str, group: str, help: str, **more: Any) -> Option:
    """A number option whose command-line default is its field's."""
    more.setdefault("default", getattr(_DEFAULTS, field))
    return Option(flag=flag, field=field, group=group, help=help, parse=number, **more)


def _choice(flag: str, field: str, group: str, help: str) -> Option:
    """An option taking one of a few words, checked by the options."""
    return Option(flag=flag, field=field, group=group, help=help, default=getattr(_DEFAULTS, field))


#: Every option of C{twistd kcoral} and C{kcoral server}.
OPTIONS: tuple[Option, ...] = (
    # -- Listening and access -------------------------------------------------
    Option(
        flag="host",
        field=None,
        group=LISTENING,
        env="KCORAL_SERVER_HOST",
        default="127.0.0.1",
        help="Address the HTTP server binds.",
    ),
    Option(
        flag="port",
        field=None,
        group=LISTENING,
        env="KCORAL_SERVER_PORT",
        default=8000,
        parse=integer,
        help="TCP port of the HTTP server, 1-65535.",
    ),
    Option(
        flag="listen",
        field=None,
        group=LISTENING,
        kind=REPEAT,
        help="Listen on a Twisted endpoint instead of --host/--port: tcp:PORT[:interface=ADDR], "
        "ssl:PORT:privateKey=KEY.pem:certKey=CERT.pem, unix:PATH. Repeat to listen on "
        "several; the variable takes several separated by spaces. "
        "[default: tcp on --host/--port]",
    ),
    Option(
        flag="listen-backlog",
        field=None,
        group=LISTENING,
        default=DEFAULT_BACKLOG,
        parse=integer,
        help="Listen queue length of TCP and SSL ports given without backlog=.",
    ),
    Option(
        flag="auth-token-file",
        field="auth_token_file",
        group=LISTENING,
        to_field=_empty_is_none,
        help="File of bearer tokens, one 'CLIENT-NAME TOKEN' per line (or one bare token); "
        "every request but GET /health then needs 'Authorization: Bearer TOKEN'. "
        "[default: no authentication]",
    ),
    Option(
        flag="public-metrics",
        field="public_metrics",
        group=LISTENING,
        kind=SWITCH,
        to_field=_as_bool,
        help="Serve /metrics and /status without a token when --auth-token-file is given "
        "(/health is always open). [default: behind the token]",
    ),
    _int(
        "max-connections",
        "max_connections",
        LISTENING,
        "Open HTTP connections served at once, kept below the open-file limit; at it the "
        "connection waiting longest for a request head is closed to make room, and when "
        "all are in requests a new one gets a 503. 0: only the open-file limit.",
    ),
    _int(
        "max-connections-per-client",
        "max_connections_per_client",
        LISTENING,
        "Open HTTP connections one client address may have; at it that address's "
        "connection waiting longest for a request head is closed to make room. 0: no cap.",
    ),
    _float(
        "first-header-timeout-seconds",
        "first_header_timeout_seconds",
        LISTENING,
        "Seconds a new connection has to send its first request head (408 after); "
        "0: the header timeout.",
    ),
    _float(
        "header-timeout-seconds",
        "header_timeout_seconds",
        LISTENING,
        "Seconds a client has to send a whole request head, however it trickles "
        "(408 after); 0 sets none.",
    ),
    _float(
        "body-timeout-seconds",
        "body_timeout_seconds",
        LISTENING,
        "Seconds a client has to send a request body after its head (408 after); 0 sets none.",
    ),
    _float(
        "body-stall-seconds",
        "body_stall_seconds",
        LISTENING,
        "Seconds a request body may go without a byte arriving before it is cut off "
        "(408) and its bytes released; 0: never.",
    ),
    _int(
        "front-ends",
        "front_ends",
        LISTENING,
        "Server processes sharing the port (SO_REUSEPORT) and the GPUs' leases, each "
        "with its own event loop and an equal share of the seats, spares and caps; "
        "1: one process. Plain TCP endpoints only.",
    ),
    _float(
        "lame-duck-seconds",
        "lame_duck_seconds",
        LISTENING,
        "At a graceful stop, seconds the server keeps serving while /health answers "
        "503 (stopping), before its ports close: set it above a load balancer's "
        "time to mark a node down (HAProxy inter x fall). 0: close them at once.",
    ),
    # -- Workers ----------------------------------------------------------------
    Option(
        flag="device",
        field="device",
        group=WORKERS,
        env="KCORAL_SERVER_DEVICE",
        default=_DEFAULTS.device,
        help=f"Worker kind, {_choices(DEVICES)}.",
    ),
    Option(
        flag="gpus",
        field="gpus",
        group=WORKERS,
        env="KCORAL_SERVER_GPUS",
        default=",".join(str(g) for g in _DEFAULTS.gpus),
        parse=gpu_ids,
        help="Comma-separated physical GPU ids for GPU workers; ignored with --device cpu.",
    ),
    _int("num-workers", "num_workers", WORKERS, "Number of workers in CPU mode."),
    _int("workers-per-gpu", "workers_per_gpu", WORKERS, "Workers per GPU in GPU mode."),
    _int(
        "max-requests-per-worker",
        "max_requests_per_worker",
        WORKERS,
        "Requests a worker serves before it is replaced; 0 reuses workers.",
    ),
    _int(
        "spare-workers-per-gpu",
        "spare_workers_per_gpu",
        WORKERS,
        "Warm workers kept ready per GPU (CPU mode: for the pool) so a retiring "
        "worker's seat is refilled at once; default "
        f"{DEFAULT_SPARE_WORKERS_PER_GPU} in GPU mode (a GPU creates a context in "
        "0.12-0.15 s, one at a time: four cover the refill time at 3-4 requests/s), "
        "0 in CPU mode and with --max-requests-per-worker 0.",
        default=None,
    ),
    _choice(
        "worker-start",
        "worker_start",
        WORKERS,
        f"How new workers are made, {_choices(WORKER_STARTS)}: 'fork' from a template "
        "process that did every import once (falls back to 'spawn' when it cannot "
        "start), 'spawn' a new interpreter each.",
    ),
    Option(
        flag="cuda-connections",
        field="cuda_connections",
        group=WORKERS,
        default="auto",
        parse=connections,
        help="Hardware work queues of each GPU worker's CUDA context "
        "(CUDA_DEVICE_MAX_CONNECTIONS, 1-32, or auto). Fewer make a context "
        f"cheaper to create and destroy: auto is {FRESH_CUDA_CONNECTIONS} when "
        "workers are replaced after every request (an H200 then replaces 10.6 "
        f"workers/s, against 6.1 with 4 and 4.7 with 8), CUDA's own "
        f"{CUDA_DEFAULT_CONNECTIONS} otherwise; a program's streams beyond this "
        "many share queues and may wait on each other.",
    ),
    _choice(
        "tensor-api",
        "tensor_api",
        WORKERS,
        f"Tensor type Python functions receive in GPU workers, {_choices(TENSOR_APIS)}.",
    ),
    _choice(
        "reuse-scope",
        "reuse_scope",
        WORKERS,
        f"Whose requests a reused worker serves, {_choices(REUSE_SCOPES)}: 'address' "
        "only the client it first served (its address, or its token's client name with "
        "--auth-token-file), 'any' every client (a program "
        "can read the next program its worker runs).",
    ),
    _float(
        "worker-termination-grace-seconds",
        "worker_termination_grace_seconds",
        WORKERS,
        "Seconds a stopped worker gets to exit before SIGKILL, spent once.",
    ),
    _float(
        "gpu-monitor-interval",
        "gpu_monitor_interval",
        WORKERS,
        "Seconds between the GPU monitor's NVML readings of every GPU (it kills GPU "
        "processes a program started and flags benchmarks disturbed by other processes "
        "or throttling; docs/trusted-timing.md); 0 turns it off.",
    ),
    # -- Sandbox ----------------------------------------------------------------
    _choice("sandbox", "sandbox", SANDBOX, f"Worker isolation, {_choices(SANDBOXES)}."),
    Option(
        flag="sandbox-readonly-path",
        field="sandbox_readonly_paths",
        group=SANDBOX,
        kind=REPEAT,
        separator=os.pathsep,
        help="Extra path mounted read-only in every worker's sandbox; directories "
        "also join PYTHONPATH. Repeat for several paths (the variable: separated by "
        f"'{os.pathsep}'). Needs --sandbox bubblewrap. [default: none]",
    ),
    _int(
        "output-space-bytes",
        "output_space_bytes",
        SANDBOX,
        "Size of each bubblewrap worker's private tmpfs for captured output "
        "(writes past it fail with ENOSPC).",
    ),
    _int(
        "workspace-bytes",
        "workspace_bytes",
        SANDBOX,
        "Under bubblewrap, the size of the private in-memory workspace (/work) of each "
        "worker that serves one request: a program's files never reach the host's disk "
        "and writes past it fail with ENOSPC. 0, or --max-requests-per-worker other "
        "than 1: the seat's host directory, unbounded.",
    ),
    # -- Requests: queueing, budgets and sizes ----------------------------------
    _float(
        "worker-wait-timeout-seconds",
        "worker_wait_timeout_seconds",
        REQUESTS,
        "Seconds a request waits for an idle worker before a 503.",
    ),
    _int(
        "max-queued-requests",
        "max_queued_requests",
        REQUESTS,
        "Requests that may wait for a worker at once; more get a 503 at once. 0: no cap.",
    ),
    Option(
        flag="finish-abandoned",
        field="finish_abandoned",
        group=REQUESTS,
        kind=SWITCH,
        to_field=_as_bool,
        help="Run a program to its end when its client disconnects. [default: a queued "
        "request is dropped at once, a running one's worker is replaced]",
    ),
    _float(
        "default-timeout-seconds",
        "default_timeout_seconds",
        REQUESTS,
        "Execution budget of a request that names none.",
    ),
    _float(
        "max-timeout-seconds",
        "max_timeout_seconds",
        REQUESTS,
        "Upper bound for any request's execution budget.",
    ),
    _int("max-request-bytes", "max_request_bytes", REQUESTS, "Largest accepted request body."),
    _int(
        "max-bytes-in-flight",
        "max_bytes_in_flight",
        REQUESTS,
        "Request body bytes held at once, from their headers to their answers; a "
        "request over it gets a 503 and its body is discarded. 0: no cap.",
    ),
    _int(
        "max-bytes-per-client",
        "max_bytes_per_client",
        REQUESTS,
        "Request body bytes one client address may hold at once, counted as they "
        "arrive; past it that address's next body gets a 503. 0: no cap.",
    ),
    _int(
        "max-channel-bytes",
        "max_channel_bytes",
        REQUESTS,
        "Server memory that messages from workers may take while they are read, all "
        "workers together, and again what decoded results keep until their answers: a "
        "message over 64 KiB waits until what reading it may cost fits; one that never "
        "could, or results over the budget, fail their request (results whose JSON "
        "would take over half of it are answered response_too_large). 0: no budget.",
    ),
    _int("max-response-bytes", "max_response_bytes", REQUESTS, "Largest response body."),
    _int(
        "output-limit-bytes",
        "output_limit_bytes",
        REQUESTS,
        "Default stdout/stderr capture per stream.",
    ),
    _int(
        "max-output-limit-bytes",
        "max_output_limit_bytes",
        REQUESTS,
        "Largest stdout/stderr capture a request may ask for.",
    ),
    # -- Caches -----------------------------------------------------------------
    _int(
        "cache-capacity-bytes",
        "cache_capacity_bytes",
        CACHES,
        "Capacity of the memory cache for tensors, bytes and libraries.",
    ),
    Option(
        flag="disk-cache-dir",
        field="disk_cache_dir",
        group=CACHES,
        to_field=_empty_is_none,
        help="Directory of the file upload cache; '' disables it. The default is "
        "$XDG_CACHE_HOME/kcoral/files when XDG_CACHE_HOME is absolute, "
        "else ~/.cache/kcoral/files.",
    ),
    _int(
        "disk-cache-capacity-mbytes",
        "disk_cache_capacity_mbytes",
        CACHES,
        "Capacity of the file upload cache in MiB; 0 disables it.",
    ),
    # -- Joining a gateway's pool -------------------------------------------------
    Option(
        flag="join",
        field="join_url",
        group=JOIN,
        to_field=_empty_is_none,
        help="Join a kcoral gateway's pool through this NATS URL (nats://HOST:PORT or "
        "tls://HOST:PORT; several comma-separated): pull its jobs, run them, post the "
        "results to the gateway. Needs --node-id and --credentials; the server then "
        "listens on loopback only. [default: no pool]",
    ),
    Option(
        flag="node-id",
        field="join_node_id",
        group=JOIN,
        to_field=_empty_is_none,
        help="This node's id in the pool (--join): letters, digits, '-' and '_'; its NATS "
        "user may write only this presence key.",
    ),
    Option(
        flag="credentials",
        field="join_credentials",
        group=JOIN,
        to_field=_empty_is_none,
        help="The node's NATS credentials file (--join): a NATS .creds file, or JSON "
        '{"user": ..., "password": ...}.',
    ),
    # -- Logs -------------------------------------------------------------------
    Option(
        flag="log-dir",
        field="log_dir",
        group=LOGS,
        default="logs",
        to_field=_empty_is_none,
        empty_is_value=True,
        help="Directory of run logs and saved programs; '' disables file logging.",
    ),
    _choice(
        "log-level",
        "log_level",
        LOGS,
        f"Least severe event written to events.jsonl and the console, {_choices(LOG_LEVELS)}.",
    ),
    Option(
        flag="no-log-console",
        field="log_console",
        group=LOGS,
        kind=SWITCH,
        to_field=_negated,
        help="Do not mirror log events to the console. [default: mirroring on]",
    ),
    Option(
        flag="no-log-programs",
        field="log_programs",
        group=LOGS,
        kind=SWITCH,
        to_field=_negated,
        help="Do not save accepted programs under the run directory. [default: programs saved]",
    ),
    _float(
        "log-retention-days",
        "log_retention_days",
        LOGS,
        "Delete run directories (events, saved programs) older than this; 0 keeps them.",
    ),
    _int(
        "log-retention-mbytes",
        "log_retention_mbytes",
        LOGS,
        "Delete the oldest run directories while all together exceed this many MiB; "
        "0 sets no bound.",
    ),
)


def by_flag() -> dict[str, Option]:
    """L{OPTIONS} by flag."""
    return {option.flag: option for option in OPTIONS}


#: Each option's environment variable, by flag.
ENV_VARS: Mapping[str, str] = {option.flag: option.env for option in OPTIONS}

#: The flag that sets each L{ServerConfig} field, for error messages.
FIELD_FLAGS: Mapping[str, str] = {
    option.field: option.flag for option in OPTIONS if option.field is not None
}

#: The options of C{--help} (and of docs/configuration.md's tables) by
#: topic, in this order; C{--help} and C{--version} come last.
OPTION_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    *((title, tuple(o.flag for o in OPTIONS if o.group == title)) for title in GROUPS),
    (HELP_GROUP, ("help", "version")),
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
