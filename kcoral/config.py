# -*- test-case-name: tests.unit.test_config -*-
"""
The server's configuration: one frozen, validated L{ServerConfig} value.

Field names and Python defaults follow the reference server's
C{ServerConfig} verbatim, because they also appear in the C{server_started}
log record.  Unlike the reference, values are checked when the object is
built, so a bad configuration fails before any service starts.

Nothing here imports Twisted; the command line (L{kcoral.server.cli.tap}) turns
flags and environment variables into a L{ServerConfig}, and the Python API
(C{create_app(ServerConfig(...))}) builds one directly.  Change a value with
C{attrs.evolve(config, field=value)}.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs
from attrs import field
from attrs.validators import instance_of, optional

__all__ = [
    "DEFAULT_SPARE_WORKERS_PER_GPU",
    "DEVICES",
    "LOG_LEVELS",
    "REUSE_SCOPES",
    "SANDBOXES",
    "TENSOR_APIS",
    "WORKER_STARTS",
    "ServerConfig",
    "default_disk_cache_dir",
]

#: Accepted values of L{ServerConfig.device}.
DEVICES = ("cpu", "gpu")

#: Accepted values of L{ServerConfig.sandbox}.
SANDBOXES = ("none", "bubblewrap", "auto")

#: Accepted values of L{ServerConfig.reuse_scope}.
REUSE_SCOPES = ("address", "any")

#: Accepted values of L{ServerConfig.tensor_api}.
TENSOR_APIS = ("auto", "torch", "pycuda")

#: Accepted values of L{ServerConfig.worker_start}.
WORKER_STARTS = ("fork", "spawn")

#: Accepted values of L{ServerConfig.log_level} (L{twisted.logger.LogLevel} names).
LOG_LEVELS = ("debug", "info", "warn", "error", "critical")

#: Warm spares per GPU by default.  One GPU creates CUDA contexts one at a
#: time, 0.12-0.15 s each (shared gpu/README.md), so a spare taken is
#: replaced within about one context creation plus the maintenance lease's
#: patience (1 s) when requests keep the GPU busy: four spares cover that
#: refill time at 3-4 requests/s, and cost four contexts' device memory and
#: four idle processes per GPU.
DEFAULT_SPARE_WORKERS_PER_GPU = 4

_KIB = 1024

#: A pool node id (a NATS KV key and subject token), and a NATS server URL.
_NODE_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
_NATS_URL = re.compile(r"^(nats|tls)://[^\s/]+$")
_MIB = 1024**2
_GIB = 1024**3


def default_disk_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """
    Compute the default directory of the disk file cache (the XDG rule).

    It is C{$XDG_CACHE_HOME/kcoral/files} when C{XDG_CACHE_HOME} is an
    absolute path, and C{~/.cache/kcoral/files} otherwise (unset, empty or
    relative), with C{~} expanded.

    @param environ: the environment to read; L{os.environ} when C{None}.
    @return: an absolute path.
    """
    env = os.environ if environ is None else environ
    xdg = env.get("XDG_CACHE_HOME", "")
    if xdg and os.path.isabs(xdg):
        base = Path(xdg)
    else:
        home = env.get("HOME")
        base = (Path(home) if home else Path.home()) / ".cache"
    return (base / "kcoral" / "files").expanduser().absolute()


def _default_disk_cache_dir() -> Path | None:
    return default_disk_cache_dir()


#: The share of the machine's memory the memory cache may hold by default.
CACHE_MEMORY_SHARE = 8


def default_cache_capacity() -> int:
    """
    The memory cache's default capacity: an eighth of the machine's RAM
    (psutil, else C{sysconf}), or 16 GiB where neither can tell.
    """
    total = 0
    try:
        import psutil

        total = int(psutil.virtual_memory().total)
    except Exception:
        try:
            total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, ValueError, OSError):
            total = 0
    return total // CACHE_MEMORY_SHARE if total > 0 else 16 * _GIB


def _to_gpus(value: Iterable[int]) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,)
    return tuple(value)


def _to_float(value: Any) -> Any:
    # Keep timeouts floats in the log record; bad types are left for the
    # validator to report by field name.
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _to_optional_path(value: str | os.PathLike[str] | None) -> Path | None:
    if value is None:
        return None
    return Path(value)


def _to_paths(value: Iterable[str | os.PathLike[str]]) -> tuple[Path, ...]:
    if isinstance(value, (str, os.PathLike)):
        return (Path(value),)
    return tuple(Path(p) for p in value)


def _strict_int(instance: Any, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{attribute.name} must be an integer, got {value!r}")


def _boolean(instance: Any, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{attribute.name} must be True or False, got {value!r}")


def _number(instance: Any, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{attribute.name} must be a number, got {value!r}")


def _non_negative(instance: Any, attribute: attrs.Attribute[Any], value: int | float) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name} must be non-negative, got {value!r}")


def _positive(instance: Any, attribute: attrs.Attribute[Any], value: int | float) -> None:
    if value <= 0:
        raise ValueError(f"{attribute.name} must be positive, got {value!r}")


def _at_least_one(instance: Any, attribute: attrs.Attribute[Any], value: int) -> None:
    if value < 1:
        raise ValueError(f"{attribute.name} must be at least 1, got {value!r}")


def _choice(*choices: str) -> Any:
    quoted = " or ".join(repr(c) for c in choices) if len(choices) == 2 else None

    def validate(instance: Any, attribute: attrs.Attribute[Any], value: object) -> None:
        if value not in choices:
            allowed = quoted or "one of " + ", ".join(repr(c) for c in choices)
            raise ValueError(f"{attribute.name} must be {allowed}, got {value!r}")

    return validate


def _gpu_ids(instance: Any, attribute: attrs.Attribute[Any], value: tuple[int, ...]) -> None:
    for gpu in value:
        if isinstance(gpu, bool) or not isinstance(gpu, int):
            raise ValueError(f"gpus must contain integers, got {gpu!r}")
        if gpu < 0:
            raise ValueError(f"gpus must not contain negative ids, got {gpu!r}")


_INT = [_strict_int, _non_negative]


def _optional_int(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """C{None}, or a non-negative integer."""
    if value is not None:
        for check in _INT:
            check(instance, attribute, value)


_FLOAT_POSITIVE = [_number, _positive]
_FLOAT_NON_NEGATIVE = [_number, _non_negative]


#: Hardware work queues per GPU worker context (C{CUDA_DEVICE_MAX_CONNECTIONS})
#: when workers are replaced after every request.  Measured on an H200
#: (bench/probes/context_probe.py, 8 contexts at once): a replacement, creation
#: beside teardown and exit, costs 94 ms with 2 queues, 163 ms with 4 and
#: 212 ms with 8, so a GPU replaces 10.6 fresh workers a second instead of
#: 6.1 or 4.7; a program's streams beyond 2 share queues and may wait on each
#: other's work (docs/gpu.md).
FRESH_CUDA_CONNECTIONS = 2

#: CUDA's own number of work queues per context, kept where contexts are
#: made rarely (workers reused for more than one request).
CUDA_DEFAULT_CONNECTIONS = 8


def _connections(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """C{None} (chosen from the worker lifetime) or an integer from 1 to 32, as CUDA accepts."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 32:
        raise ValueError(
            f"{attribute.name} must be an integer from 1 to 32 or None (auto), got {value!r}"
        )


@attrs.frozen(kw_only=True)
class ServerConfig:
    """
    Everything the server needs besides the address it listens on.

    Build it with keywords; every field has the reference server's Python
    default.  Invalid values raise L{ValueError} naming the field.

    @ivar gpus: physical GPU ids (NVML order) that GPU workers are pinned to;
        ignored in CPU mode.  Stored as a tuple.
    @ivar log_dir: directory for run logs and saved programs; C{None}
        disables file logging.
    @ivar log_console: mirror log events to the console.
    @ivar log_programs: save each accepted program under the run directory.
    @ivar cache_capacity_bytes: memory blob cache capacity; by default an
        eighth of the machine's RAM (L{default_cache_capacity}).
    @ivar disk_cache_dir: disk file cache directory; C{None} disables it.
    @ivar disk_cache_capacity_mbytes: disk file cache capacity in MiB;
        C{0} disables it.
    @ivar default_timeout_seconds: execution budget when a request has none.
    @ivar max_timeout_seconds: upper bound for any execution budget.
    @ivar worker_wait_timeout_seconds: how long a request waits for an idle
        worker before a 503; C{0} fails at once when none is idle.
    @ivar workers_per_gpu: workers per GPU in GPU mode.
    @ivar max_requests_per_worker: requests a worker serves before it is
        replaced; C{0} reuses workers without limit.
    @ivar spare_workers_per_gpu: warm workers kept ready beside the seats,
        per GPU (CPU mode: for the pool), so a seat whose worker retires is
        refilled at once and no request waits for a worker to start;
        C{None} means L{DEFAULT_SPARE_WORKERS_PER_GPU} in GPU mode when
        workers are replaced after a number of requests, and none in CPU
        mode or with workers reused without limit (L{spares_per_group}).
    @ivar cuda_connections: hardware work queues of each GPU worker's CUDA
        context (C{CUDA_DEVICE_MAX_CONNECTIONS}, 1-32; CUDA's default is 8):
        fewer make context creation and teardown, so replacing a fresh
        worker, cheaper; streams beyond them share queues.  C{None} (auto)
        means L{FRESH_CUDA_CONNECTIONS} when every worker serves one request
        and CUDA's 8 otherwise (L{work_queues}).
    @ivar reuse_scope: which requests a reused worker may serve (one
        interpreter runs them one after another, so a program can read or
        answer for the next): C{"address"}, only requests from the client
        address its first request came from; C{"any"}, every client's
        (docs/security.md).
    @ivar sandbox: C{"bubblewrap"} (the server does not start when
        bubblewrap cannot run), C{"auto"} (bubblewrap when it runs, else no
        sandbox with a loud warning) or C{"none"}.
    @ivar sandbox_readonly_paths: extra read-only mounts inside the sandbox.
    @ivar worker_termination_grace_seconds: SIGTERM to SIGKILL window.
    @ivar gpu_monitor_interval: seconds between the GPU monitor's readings
        of every GPU (NVML; kcoral.server.leases.monitor); 0 turns it off.
    @ivar max_request_bytes: largest accepted request body.
    @ivar max_response_bytes: largest response body.
    @ivar output_limit_bytes: default per-stream stdout/stderr capture.
    @ivar max_output_limit_bytes: upper bound for a requested capture.
    @ivar output_space_bytes: size of each bubblewrap worker's private
        tmpfs for captured stdout and stderr; a program that writes more
        gets C{ENOSPC} (docs/security.md).
    @ivar device: C{"gpu"} or C{"cpu"}.
    @ivar num_workers: number of workers in CPU mode.
    @ivar tensor_api: what Python functions in GPU workers receive as
        tensors: C{"auto"}, C{"torch"} or C{"pycuda"}.
    @ivar worker_start: how a new worker process is made: C{"fork"}, from
        a template process per device kind that did every import once
        (L{kcoral.server.workers.template}; the server falls back to C{"spawn"},
        loudly, when a template cannot start), or C{"spawn"}, a new
        interpreter per worker.
    @ivar log_level: the least severe level written to C{events.jsonl} and
        the console: one of L{LOG_LEVELS}.
    @ivar log_retention_days: run directories under C{log_dir} (events and
        saved programs) older than this are deleted; C{0} keeps them by age.
    @ivar log_retention_mbytes: the oldest run directories are deleted while
        all of them together exceed this many MiB; C{0} sets no size bound.
    @ivar auth_token_file: the file of bearer tokens and client names
        (L{kcoral.server.http.auth}); C{None} serves everyone.
    @ivar public_metrics: serve C{/metrics} and C{/status} without a token.
    @ivar header_timeout_seconds: time a client has to send a request head,
        not extended by trickled bytes; C{0} sets none.
    @ivar body_timeout_seconds: time a client has to send a request body
        once its head arrived; C{0} sets none.
    @ivar max_connections: open HTTP connections served at once (kept below
        the open-file limit); at it, the connection waiting longest for a
        request head is closed to make room, and when all are in requests a
        new one is answered 503 and closed; C{0} sets no cap but that of
        the open-file limit.
    @ivar max_queued_requests: requests that may wait for a worker at once;
        one more is answered 503 at once; C{0} sets no cap.
    @ivar max_bytes_in_flight: request body bytes the server holds at once
        (counted as they arrive, until the answer is sent); a request whose
        declared length would pass it is answered 503 without its body
        being read, one whose body grows past it has it dropped; C{0}
        sets no cap.
    @ivar max_channel_bytes: server memory that what workers send may take
        at once, all workers of this process together (issue 32): a frame
        over 64 KiB is read only once what reading and decoding it may cost
        fits in it, and what decoded messages keep until their jobs end
        must fit in it too (so both together stay within twice it,
        L{kcoral.server.workers.channelbudget}); C{0} sets no budget.
    @ivar workspace_bytes: under bubblewrap, the size of the private tmpfs
        a one-request worker (C{max_requests_per_worker} 1) gets as its
        workspace, so that what a program writes never reaches the host's
        disk (issue 32); C{0}, or a reused worker: the seat's host
        directory, without a bound.
    @ivar max_connections_per_client: open HTTP connections one client
        address may have at once; at it, that address's connection waiting
        longest for a request head is closed to make room (a 503 when all
        are in requests); C{0} sets no cap.
    @ivar first_header_timeout_seconds: time a new connection has to send
        its first request head (at most C{header_timeout_seconds});
        C{0} leaves it at that.
    @ivar max_bytes_per_client: request body bytes one client address may
        hold at once, counted as they arrive; past it that address's next
        body is answered 503; C{0} sets no cap.
    @ivar body_stall_seconds: a request body that goes this long without a
        byte arriving is cut off (408) and its bytes released; C{0} never.
    @ivar finish_abandoned: run a program to its end when its client
        disconnects; by default a queued request leaves the line at once and
        a running program's worker is replaced.
    @ivar front_ends: server processes sharing the port and the GPUs' leases
        (L{kcoral.server.frontends}): each runs its own event loop and its
        share of the seats; C{1} is one process.  Which of them a process
        is, is not part of the configuration (L{kcoral.server.topology}).
    @ivar lame_duck_seconds: at a graceful stop, how long the server keeps
        serving every request while C{/health} answers 503 C{stopping}, before
        its ports close: longer than a load balancer takes to mark it down
        (HAProxy's C{inter} x C{fall}); C{0} closes them at once.
    @ivar join_url: the NATS URL(s), comma-separated, of a gateway's pool
        this server joins as a node (L{kcoral.server.join}); C{None} joins
        none.  Set with C{join_node_id} and C{join_credentials}.
    @ivar join_node_id: the node's id in the pool (its NATS user's presence
        key): letters, digits, C{-} and C{_}.
    @ivar join_credentials: the node's NATS credentials file (a C{.creds}
        file, or JSON C{{"user": ..., "password": ...}}).
    """

    gpus: tuple[int, ...] = field(default=(0,), converter=_to_gpus, validator=_gpu_ids)
    log_dir: Path | None = field(default=None, converter=_to_optional_path)
    log_console: bool = field(default=True, validator=_boolean)
    log_programs: bool = field(default=True, validator=_boolean)
    cache_capacity_bytes: int = field(factory=default_cache_capacity, validator=_INT)
    disk_cache_dir: Path | None = field(
        factory=_default_disk_cache_dir, converter=_to_optional_path
    )
    disk_cache_capacity_mbytes: int = field(default=16 * _KIB, validator=_INT)
    default_timeout_seconds: float = field(
        default=300.0, converter=_to_float, validator=_FLOAT_POSITIVE
    )
    max_timeout_seconds: float = field(
        default=900.0, converter=_to_float, validator=_FLOAT_POSITIVE
    )
    worker_wait_timeout_seconds: float = field(
        default=1800.0, converter=_to_float, validator=_FLOAT_NON_NEGATIVE
    )
    workers_per_gpu: int = field(default=8, validator=[_strict_int, _at_least_one])
    max_requests_per_worker: int = field(default=1, validator=_INT)
    spare_workers_per_gpu: int | None = field(default=None, validator=_optional_int)
    cuda_connections: int | None = field(default=None, validator=_connections)
    reuse_scope: str = field(default="address", validator=_choice(*REUSE_SCOPES))
    sandbox: str = field(default="bubblewrap", validator=_choice(*SANDBOXES))
    sandbox_readonly_paths: tuple[Path, ...] = field(default=(), converter=_to_paths)
    worker_termination_grace_seconds: float = field(
        default=5.0, converter=_to_float, validator=_FLOAT_NON_NEGATIVE
    )
    gpu_monitor_interval: float = field(
        default=0.2, converter=_to_float, validator=_FLOAT_NON_NEGATIVE
    )
    max_request_bytes: int = field(default=256 * _MIB, validator=_INT)
    max_response_bytes: int = field(default=256 * _MIB, validator=_INT)
    output_limit_bytes: int = field(default=_MIB, validator=_INT)
    max_output_limit_bytes: int = field(default=16 * _MIB, validator=_INT)
    output_space_bytes: int = field(default=64 * _MIB, validator=_INT)
    device: str = field(default="gpu", validator=_choice(*DEVICES))
    num_workers: int = field(default=1, validator=[_strict_int, _at_least_one])
    tensor_api: str = field(default="auto", validator=_choice(*TENSOR_APIS))
    worker_start: str = field(default="fork", validator=_choice(*WORKER_STARTS))
    log_level: str = field(default="info", validator=_choice(*LOG_LEVELS))
    log_retention_days: float = field(
        default=30.0, converter=_to_float, validator=_FLOAT_NON_NEGATIVE
    )
    log_retention_mbytes: int = field(default=10 * _KIB, validator=_INT)
    auth_token_file: Path | None = field(default=None, converter=_to_optional_path)
    public_metrics: bool = field(default=False, validator=_boolean)
    header_timeout_seconds: float = field(
        default=30.0, converter=_to_float, validator=_FLOAT_NON_NEGATIVE
    )
    body_timeout_seconds: float = field(
        default=300.0, converter=_to_float, validator=_FLOAT_NON_NEGATIVE
    )
    max_connections: int = field(default=4096, validator=_INT)
    finish_abandoned: bool = field(default=False, validator=_boolean)
    max_queued_requests: int = field(default=1024, validator=_INT)
    max_bytes_in_flight: int = field(default=2 * _GIB, validator=_INT)
    max_channel_bytes: int = field(default=512 * _MIB, validator=_INT)
    workspace_bytes: int = field(default=_GIB, validator=_INT)
    max_bytes_per_client: int = field(default=512 * _MIB, validator=_INT)
    max_connections_per_client: int = field(default=1024, validator=_INT)
    first_header_timeout_seconds: float = field(
        default=10.0, converter=_to_float, validator=_FLOAT_NON_NEGATIVE
    )
    body_stall_seconds: float = field(
        default=30.0, converter=_to_float, validator=_FLOAT_NON_NEGATIVE
    )
    front_ends: int = field(default=1, validator=[_strict_int, _at_least_one])
    lame_duck_seconds: float = field(
        default=0.0, converter=_to_float, validator=_FLOAT_NON_NEGATIVE
    )
    join_url: str | None = field(default=None, validator=optional(instance_of(str)))
    join_node_id: str | None = field(default=None, validator=optional(instance_of(str)))
    join_credentials: Path | None = field(default=None, converter=_to_optional_path)

    def __attrs_post_init__(self) -> None:
        """Check the rules that involve more than one field."""
        self._check_join()
        if self.device == "gpu" and not self.gpus:
            raise ValueError("gpus must name at least one GPU in GPU mode")
        repeated = sorted({gpu for gpu in self.gpus if self.gpus.count(gpu) > 1})
        if self.device == "gpu" and repeated:
            # One GPU id is one set of seats with one directory each; a repeat
            # would build seats that share them.
            listed = ", ".join(str(gpu) for gpu in repeated)
            raise ValueError(f"gpus must not repeat a GPU id, got {listed} more than once")
        if self.default_timeout_seconds > self.max_timeout_seconds:
            raise ValueError(
                "default_timeout_seconds must not exceed max_timeout_seconds, got "
                f"{self.default_timeout_seconds!r} > {self.max_timeout_seconds!r}"
            )
        needed = 2 * (self.max_output_limit_bytes + 8 * _KIB)
        if self.output_space_bytes < needed:
            raise ValueError(
                f"output_space_bytes must hold both streams up to max_output_limit_bytes, "
                f"at least {needed}, got {self.output_space_bytes}"
            )
        if self.sandbox_readonly_paths and self.sandbox == "none":
            raise ValueError("sandbox_readonly_paths requires sandbox='bubblewrap'")
        seats = self.num_workers if self.cpu_mode else self.workers_per_gpu
        if self.front_ends > seats:
            raise ValueError(
                f"front_ends ({self.front_ends}) must not exceed the workers "
                f"{'of the pool' if self.cpu_mode else 'per GPU'} ({seats}): "
                "each front end needs a seat"
            )

    def _check_join(self) -> None:
        """The join fields come together, with a node id and NATS URLs that fit."""
        given = [self.join_url, self.join_node_id, self.join_credentials]
        if all(value is None for value in given):
            return
        if any(value is None for value in given):
            raise ValueError("join_url, join_node_id and join_credentials go together")
        assert self.join_url is not None and self.join_node_id is not None
        if not _NODE_ID.match(self.join_node_id):
            raise ValueError(
                f"join_node_id must be 1-128 letters, digits, '-' or '_', got {self.join_node_id!r}"
            )
        for url in self.join_url.split(","):
            if not _NATS_URL.match(url.strip()):
                raise ValueError(
                    f"join_url must be nats://HOST:PORT or tls://HOST:PORT, got {url!r}"
                )
        if self.front_ends > 1:
            raise ValueError("join_url needs front_ends 1: one process pulls the pool's jobs")

    def _share(self, count: int, front_end: int) -> int:
        """Of C{count} seats or spares, how many are front end C{front_end}'s (every N-th)."""
        return len(range(front_end, count, self.front_ends))

    @property
    def cpu_mode(self) -> bool:
        """C{True} when workers compile on the CPU and never touch a GPU."""
        return self.device == "cpu"

    @property
    def distinct_gpus(self) -> tuple[int, ...]:
        """
        The GPU ids in C{gpus} order without duplicates; empty in CPU mode.
        """
        if self.cpu_mode:
            return ()
        return tuple(dict.fromkeys(self.gpus))

    @property
    def spares_per_group(self) -> int:
        """The first front end's L{spares_of} (with one front end, all of them)."""
        return self.spares_of(0)

    def spares_of(self, front_end: int) -> int:
        """
        Warm spares kept per GPU (CPU mode: for the pool) by front end
        C{front_end} (every N-th of them): the configured number, or by
        default L{DEFAULT_SPARE_WORKERS_PER_GPU} in GPU mode with
        C{max_requests_per_worker} set (fresh workers: every request retires
        one), and none in CPU mode or when workers are reused without limit
        (a replacement is then rare, and spares would only hold device
        memory).
        """
        if self.spare_workers_per_gpu is not None:
            return self._share(self.spare_workers_per_gpu, front_end)
        if self.cpu_mode or self.max_requests_per_worker == 0:
            return 0
        return self._share(DEFAULT_SPARE_WORKERS_PER_GPU, front_end)

    @property
    def work_queues(self) -> int:
        """
        Hardware work queues per GPU worker context: the configured number,
        or by default L{FRESH_CUDA_CONNECTIONS} when every worker serves one
        request (each request then costs a context creation and teardown,
        and fewer queues make both cheaper) and CUDA's own
        L{CUDA_DEFAULT_CONNECTIONS} when workers serve more (contexts are
        then made rarely, and a program's streams keep all the queues).
        """
        if self.cuda_connections is not None:
            return self.cuda_connections
        if self.max_requests_per_worker == 1:
            return FRESH_CUDA_CONNECTIONS
        return CUDA_DEFAULT_CONNECTIONS

    def seats(self, front_end: int = 0) -> list[tuple[str, int | None]]:
        """
        Every worker seat of front end C{front_end} (C{0}: the first, or the
        only one), in start order: its name and its GPU (C{None} in CPU
        mode).

        GPU mode: C{gpu<id>/w<index>} for each id in C{gpus} order and each
        index below C{workers_per_gpu}.  CPU mode: C{cpu/w<index>} for each
        index below C{num_workers}.  A seat's name survives the replacement
        of the process occupying it.  With several front ends, each has every
        C{front_ends}-th index from its own, so names stay unique.
        """
        first, step = front_end, self.front_ends
        if self.cpu_mode:
            return [(f"cpu/w{i}", None) for i in range(first, self.num_workers, step)]
        return [
            (f"gpu{gpu}/w{i}", gpu)
            for gpu in self.distinct_gpus
            for i in range(first, self.workers_per_gpu, step)
        ]

    def worker_ids(self, front_end: int = 0) -> list[str]:
        """The names of L{seats}."""
        return [name for name, _gpu in self.seats(front_end)]

    def as_log_dict(self) -> dict[str, Any]:
        """
        Every field as a JSON-ready value for the C{server_started} event.

        Paths become strings and tuples become lists.
        """

        def plain(value: Any) -> Any:
            if isinstance(value, Path):
                return str(value)
            if isinstance(value, tuple):
                return [plain(v) for v in value]
            return value

        return {a.name: plain(getattr(self, a.name)) for a in attrs.fields(ServerConfig)}
