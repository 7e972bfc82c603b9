# -*- test-case-name: tests.unit.test_app,tests.unit.test_pool,tests.unit.test_compilers -*-
"""
In-memory fakes of kcoral's collaborators, for every unit test.

Each fake provides the seam it stands in for (the same interface or
protocol the real object provides), so a test wires it where the real one
goes: nothing here starts a process, opens a port or touches a GPU.

  - L{pool_config}: a small L{ServerConfig} for pool tests.
  - L{FakeWorker}, L{FakeSpawner}: a worker process, as the pool sees it,
    and the C{spawn_worker} that makes them.
  - L{FakeSandbox}: an L{ISandbox} that only computes paths.
  - L{RecordingPool}: a L{WorkerPool} handing out one preset seat and
    recording each release.
  - L{FakeTransport}, L{ProcessReactor}: a child process's transport and a
    memory reactor whose C{spawnProcess} records calls (for
    L{kcoral.server.workers.workerproc.WorkerProcess}).
  - L{FakeBlobs}: a blob store that knows a fixed set of blobs.
  - L{EventRecorder}: a cache's C{on_event} callback that remembers calls.
  - L{SyncReactor}, L{SyncThreadPool}: a clock and a thread pool that run
    "threaded" work at once, in the calling thread; L{QueuedThreadReactor}
    delivers C{callFromThread} on the clock's next turn instead.
  - L{RecordingService}: a child service whose start and stop the test fires.
  - L{RecordingLease}, L{FakeFunction}, L{FakeDeviceArray}: a worker's
    GPU lease, a PyCUDA function and a CUDA array, for worker tests.
  - L{FakeClient}: the blocking client, for C{kcoral run}.
  - L{FakeServer} (with L{json_reply}, L{result_reply}, L{completed},
    L{cache_miss}): an in-memory KCoral server for client tests.
  - L{FakeCompilerBackend}: an L{ICompilerBackend} that needs no toolchain.
  - L{FakeGpuSampler}, L{FakeProcessTable}, L{MonitoredWorker}: the GPU
    monitor's NVML, procfs and workers (L{kcoral.server.leases.monitor}).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import attrs
from treq.client import HTTPClient
from treq.testing import RequestTraversalAgent, StringStubbingResource
from twisted.application import service
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.interfaces import IReactorFromThreads, IReactorProcess
from twisted.internet.task import Clock, Cooperator
from twisted.internet.testing import MemoryReactorClock
from twisted.plugin import IPlugin
from twisted.python.failure import Failure
from twisted.python.threadpool import ThreadPool
from zope.interface import implementer

from kcoral.client.async_client import AsyncClient
from kcoral.client.results import ProgramResult
from kcoral.compilers.interfaces import KIND_BINARY, ICompilerBackend
from kcoral.compilers.nvcc import validate_arch, validate_options
from kcoral.config import ServerConfig
from kcoral.errors import ExecutionError
from kcoral.ipc.shared import SharedBuffer
from kcoral.server.cache import Pin, Resolution
from kcoral.server.leases.nvml import GpuSample, IGpuSampler, ProcessUse, SamplerUnavailable
from kcoral.server.sandbox.interface import ISandbox
from kcoral.server.workers.job import Job, JobResult
from kcoral.server.workers.pool import PoolBusy, PoolStopping, Seat, WorkerHandle, WorkerPool
from kcoral.server.workers.workerproc import WorkerSettings
from kcoral.wire.channel import TO_WORKER_FD, ChannelMessage, MessageDecoder, Outcome
from kcoral.wire.multipart import encode_response, parse_request_body

_P = ParamSpec("_P")
_R = TypeVar("_R")

__all__ = [
    "FAKE_MAGIC",
    "EventRecorder",
    "FakeBlobs",
    "FakeClient",
    "FakeCompilerBackend",
    "FakeDeviceArray",
    "FakeFunction",
    "FakeServer",
    "RecordingLease",
    "Seen",
    "cache_miss",
    "completed",
    "json_reply",
    "result_reply",
    "FakeSandbox",
    "FakeSpawner",
    "FakeTransport",
    "FakeWorker",
    "ProcessReactor",
    "QueuedThreadReactor",
    "RecordingPool",
    "RecordingService",
    "SyncReactor",
    "SyncThreadPool",
    "pool_config",
    "seat_with",
]


# -- the pool's collaborators ----------------------------------------------------


class FakeWorker:
    """
    A worker process, as the pool and the API use it: it comes up, runs
    jobs, and exits only when told to.

    @ivar result: what every L{run} answers.
    @ivar jobs: the jobs it was given, in order.
    """

    def __init__(
        self,
        seat: str = "cpu/w0",
        generation: int = 1,
        gpus: tuple[int, ...] = (),
        result: JobResult | None = None,
        env: dict[str, str] | None = None,
        settings: WorkerSettings | None = None,
    ) -> None:
        #: What the pool made it with.
        self.settings = settings or WorkerSettings(grace_seconds=5.0)
        self.seat = seat
        self.generation = generation
        self.gpus = gpus
        self.env = env or {}
        self.ready: Deferred[dict[str, Any]] = Deferred()
        self.ended: Deferred[int | None] = Deferred()
        self.alive = True
        self.pid: int | None = 1000 + generation
        self.info: dict[str, Any] = {}
        self.started_at = 0.0
        self.killed = False
        self.killed_now = False
        self.retired = False
        self.stopped = False
        self.busy = False
        self.result = result or JobResult("outcome", outcome=Outcome(status="COMPLETED"))
        self.jobs: list[Job] = []

    def come_up(self, arch: str = "") -> None:
        """Report ready, with C{arch} as the target when given."""
        self.info = {"target": {"arch": arch} if arch else {}, "versions": {}}
        self.ready.callback(self.info)

    def exit(self, code: int = 0) -> None:
        """The process ends with C{code} (during start: its start fails, as a real one's)."""
        self.alive = False
        if not self.ready.called:
            self.ready.errback(
                RuntimeError(f"worker {self.seat} exited with code {code} during start")
            )
        self.ended.callback(code)

    def run(self, job: Job) -> Deferred[JobResult]:
        self.jobs.append(job)
        return succeed(self.result)

    def kill(self) -> Deferred[int | None]:
        self.killed = True
        if self.alive:
            self.exit(-15)
        return succeed(-15)

    def kill_now(self) -> None:
        self.killed_now = True
        if self.alive:
            self.exit(-9)

    def kill_at_once(self) -> None:
        self.kill_now()

    def retire(self) -> Deferred[int | None]:
        """Asked to go after a retiring outcome: it exits when the test says."""
        self.retired = True
        if not self.alive:
            return succeed(0)
        d: Deferred[int | None] = Deferred()

        def fire(code: int | None) -> int | None:
            d.callback(code)
            return code

        self.ended.addBoth(fire)
        return d

    def stop(self) -> Deferred[int | None]:
        self.stopped = True
        if self.alive:
            self.exit(0)
        return succeed(0)


class FakeSpawner:
    """
    A pool's C{spawn_worker}: makes L{FakeWorker}s, which come up at once
    (reporting C{arch}) unless C{auto_ready} is false.

    @ivar spawned: every worker made, in order.
    """

    def __init__(self, auto_ready: bool = True, arch: str = "") -> None:
        self.auto_ready = auto_ready
        self.arch = arch
        self.spawned: list[FakeWorker] = []

    def __call__(
        self,
        reactor: object,
        *,
        seat: str,
        generation: int,
        gpus: tuple[int, ...],
        env: dict[str, str] | None = None,
        settings: WorkerSettings | None = None,
        **kw: object,
    ) -> FakeWorker:
        worker = FakeWorker(seat, generation, gpus, env=env, settings=settings)
        self.spawned.append(worker)
        if self.auto_ready:
            worker.come_up(self.arch)
        return worker


def pool_config(**changes: Any) -> ServerConfig:
    """
    A L{ServerConfig} for pool tests: two CPU workers, each retired after
    one request, no spares, no logs or disk cache; C{changes} override any
    field.
    """
    defaults: dict[str, Any] = {
        "device": "cpu",
        "num_workers": 2,
        "workers_per_gpu": 1,
        "max_requests_per_worker": 1,
        "spare_workers_per_gpu": 0,
        "worker_termination_grace_seconds": 5.0,
        "worker_wait_timeout_seconds": 10.0,
        "log_dir": None,
        "disk_cache_dir": None,
        "worker_start": "spawn",
    }
    return ServerConfig(**{**defaults, **changes})


@implementer(ISandbox)
class FakeSandbox:
    """
    An L{ISandbox} that isolates nothing and creates nothing: a seat's work
    directory is C{<seat_dir>/work}, as the worker sees it too.

    @ivar cleared: the workspaces L{clear_workspace} was asked to clear.
    @ivar clean: what L{workspace_is_clean} answers (C{False}: every
        workspace is cleared).
    @ivar nodes: the C{gpu_devices} of each L{command}.
    @ivar env: the environment each L{command} returns.
    """

    name = "none"
    reserved = None
    capture_bytes = None
    workspace_bytes = None

    def __init__(self, isolates_devices: bool = False, env: dict[str, str] | None = None) -> None:
        self.isolates_devices = isolates_devices
        self.env = env or {}
        self.cleared: list[Path] = []
        self.clean = False
        self.nodes: list[list[str]] = []

    def prepare_seat(self, seat_dir: Path) -> Path:
        return seat_dir / "work"

    def clear_workspace(self, work_dir: Path) -> None:
        self.cleared.append(work_dir)

    def workspace_is_clean(self, work_dir: Path) -> bool:
        return self.clean

    def command(
        self, *, python: str, worker_args: list[str], work_dir: Path, gpu_devices: list[str]
    ) -> tuple[str, list[str], dict[str, str]]:
        self.nodes.append(list(gpu_devices))
        return python, [python, "-m", "kcoral.worker", *worker_args], dict(self.env)

    def worker_path(self, work_dir: Path) -> str:
        return str(work_dir)

    def run_command(
        self, tail: list[str], work_dir: Path, env: dict[str, str] | None = None
    ) -> tuple[str, list[str], dict[str, str]]:
        """C{tail} as it is (the server's isolated compiles)."""
        return tail[0], list(tail), dict(self.env if env is None else env)

    def prepare_compile_seat(self, seat_dir: Path) -> Path:
        """As L{prepare_seat} (the server's nvcc compiles)."""
        return self.prepare_seat(seat_dir)

    #: No compile filter to map (L{BubblewrapSandbox.compile_filter}).
    compile_filter: str | None = None

    def compile_command(
        self, tail: list[str], work_dir: Path, env: dict[str, str], *, filter_fd: bool = False
    ) -> tuple[str, list[str], dict[str, str]]:
        """C{tail} as it is (the server's nvcc compiles)."""
        return tail[0], list(tail), dict(env)

    def template_command(
        self,
        *,
        python: str,
        template_args: list[str],
        template_dir: Path,
        spaces_dir: Path,
        gpu_devices: list[str],
    ) -> tuple[str, list[str], dict[str, str]]:
        self.nodes.append(list(gpu_devices))
        argv = [python, "-m", "kcoral.worker.template", *template_args, "--isolation", "none"]
        return python, argv, dict(self.env)


@attrs.define(eq=False)
class RecordingPool(WorkerPool):
    """
    A L{WorkerPool} whose one seat is handed out as given: C{preset} (none:
    the pool is saturated).  Every release is recorded in C{released}, and
    nothing is retired or replaced (a seat taken without its worker is
    recorded in C{given_back}).  A multi-GPU program's worker starts
    when the test fires the Deferred recorded in C{starts}; its removal is
    recorded in C{removed}.
    """

    preset: Seat | None = None
    saturated: bool = False
    released: list[tuple[Seat, str | None]] = attrs.field(factory=list)
    #: Seats given back by requests that took no worker (L{give_back}).
    given_back: list[Seat] = attrs.field(factory=list)
    #: The client address of each C{acquire} (the reuse scope's identity).
    clients: list[str | None] = attrs.field(factory=list)
    starts: list[tuple[Seat, tuple[int, ...], Deferred[tuple[WorkerHandle, Path]]]] = attrs.field(
        factory=list
    )
    removed: list[WorkerHandle] = attrs.field(factory=list)

    def acquire(
        self, timeout: float, client: str | None = None, *, seat_only: bool = False
    ) -> Deferred[Seat]:
        self.clients.append(client)
        if self.closing:
            return fail(PoolStopping())
        if self.saturated or self.preset is None:
            return fail(PoolBusy("server saturated"))
        return succeed(self.preset)

    def release(self, seat: Seat, *, retire: str | None = None, clean: bool = False) -> None:
        self.released.append((seat, retire))

    def give_back(self, seat: Seat) -> None:
        self.given_back.append(seat)

    async def start_transient(self, seat: Seat, gpus: tuple[int, ...]) -> tuple[WorkerHandle, Path]:
        started: Deferred[tuple[WorkerHandle, Path]] = Deferred()
        self.starts.append((seat, gpus, started))
        return await started

    def remove_transient(self, worker: WorkerHandle, work_dir: Path) -> Deferred[None]:
        self.removed.append(worker)
        return succeed(None)


def seat_with(worker: FakeWorker, worker_id: str = "cpu/w0", gpu_id: int | None = None) -> Seat:
    """
    A busy seat occupied by C{worker}, which has come up: a worker serves
    requests only after its start, so a later kill ends it as a running
    worker, not as a failed start nobody waits for.
    """
    if not worker.ready.called:
        worker.ready.callback(worker.info)
    return Seat(worker_id, gpu_id, generation=1, worker=worker, work_dir=Path("/w"))


# -- the API's collaborators -------------------------------------------------------


@attrs.define
class FakeBlobs:
    """A blob store that knows the blobs in C{cached}; the rest must be supplied."""

    cached: dict[str, bytes] = attrs.field(factory=dict)

    def resolve(
        self,
        program_blobs: Mapping[str, frozenset[str]],
        supplied: Mapping[str, bytes | SharedBuffer],
    ) -> Deferred[Resolution]:
        found: dict[str, bytes | SharedBuffer] = {}
        missing = []
        for digest in program_blobs:
            if digest in supplied:
                found[digest] = supplied[digest]
            elif digest in self.cached:
                found[digest] = self.cached[digest]
            else:
                missing.append(digest)
        return succeed(Resolution(found, missing, Pin.empty()))


@implementer(IReactorFromThreads)
class SyncReactor(Clock):
    """A clock whose C{callFromThread} runs at once (for L{SyncThreadPool})."""

    def callFromThread(
        self, callable: Callable[..., object], *args: object, **kwargs: object
    ) -> None:
        callable(*args, **kwargs)


class SyncThreadPool(ThreadPool):
    """
    A thread pool that runs every job at once, in the calling thread.

    @ivar jobs: how many jobs it was given.
    """

    jobs = 0

    def callInThread(self, func: Callable[_P, object], *args: _P.args, **kw: _P.kwargs) -> None:
        self.callInThreadWithCallback(None, func, *args, **kw)

    def callInThreadWithCallback(
        self,
        onResult: Callable[[bool, _R], object] | None,
        func: Callable[_P, _R],
        *args: _P.args,
        **kw: _P.kwargs,
    ) -> None:
        self.jobs += 1
        try:
            result = func(*args, **kw)
        except BaseException as e:
            if onResult is not None:
                onResult(False, Failure(e))  # type: ignore[arg-type]
        else:
            if onResult is not None:
                onResult(True, result)


class QueuedThreadReactor(MemoryReactorClock):
    """
    A L{MemoryReactorClock} with C{callFromThread}: calls are queued until
    the clock is advanced, as a real reactor delivers them on its next turn.
    """

    def callFromThread(
        self, callable: Callable[..., object], *args: object, **kwargs: object
    ) -> None:
        self.callLater(0, callable, *args, **kwargs)


class EventRecorder:
    """An C{on_event} callback (of the caches) that remembers every call."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []
        self._lock = threading.Lock()

    def __call__(self, name: str, **fields: Any) -> None:
        with self._lock:
            self.events.append((name, fields))

    def names(self) -> list[str]:
        return [name for name, _ in self.events]


# -- processes -------------------------------------------------------------------


class FakeTransport:
    """The process transport a worker writes to and signals."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.written: dict[int, bytes] = {}
        self.signals: list[str] = []
        self.stdin_closed = False

    def writeToChild(self, fd: int, data: bytes) -> None:
        self.written[fd] = self.written.get(fd, b"") + data

    def closeStdin(self) -> None:
        self.stdin_closed = True

    def signalProcess(self, signal: str) -> None:
        self.signals.append(signal)

    def messages(self) -> list[ChannelMessage]:
        """The messages written to the worker's control channel."""
        return MessageDecoder().feed(self.written.get(TO_WORKER_FD, b""))


@implementer(IReactorProcess)
class ProcessReactor(MemoryReactorClock):
    """A memory reactor that records C{spawnProcess} calls and spawns nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.spawned: list[dict[str, Any]] = []

    def spawnProcess(  # type: ignore[override]
        self,
        processProtocol: Any,
        executable: Any,
        args: Any = (),
        env: Any = None,
        path: Any = None,
        uid: Any = None,
        gid: Any = None,
        usePTY: Any = False,
        childFDs: Any = None,
    ) -> FakeTransport:
        # Above Linux's largest pid_max (2**22): signalling it can never hit
        # a real process or process group.
        transport = FakeTransport(pid=2**22 + 1000 + len(self.spawned))
        self.spawned.append(
            {
                "protocol": processProtocol,
                "executable": executable,
                "args": list(args),
                "env": env,
                "childFDs": childFDs,
                "transport": transport,
            }
        )
        processProtocol.makeConnection(transport)
        return transport


# -- services ----------------------------------------------------------------------


class RecordingService(service.Service):
    """A child service whose start and stop fire when the test says so."""

    def __init__(self, name: str, calls: list[str]) -> None:
        self.setName(name)
        self.calls = calls
        self.started: Deferred[None] = Deferred()
        self.stopped: Deferred[None] = Deferred()

    def startService(self) -> Deferred[None]:  # type: ignore[override]
        super().startService()
        self.calls.append(f"start {self.name}")
        return self.started

    def stopService(self) -> Deferred[None]:
        super().stopService()
        self.calls.append(f"stop {self.name}")
        return self.stopped


# -- the worker's collaborators ---------------------------------------------------


@attrs.define
class RecordingLease:
    """A worker's GPU lease that records the C{acquire}/C{release} calls that changed state."""

    held: bool = False
    events: list[str] = attrs.field(factory=list)

    def acquire(self) -> None:
        if not self.held:
            self.events.append("acquire")
        self.held = True

    def release(self) -> None:
        if self.held:
            self.events.append("release")
        self.held = False


class FakeFunction:
    """Stands in for a PyCUDA C{Function}: records launches."""

    def __init__(self) -> None:
        self.launches: list[tuple[Any, ...]] = []

    def _launch_kernel(self, grid: Any, block: Any, buffer: Any, shared: Any, stream: Any) -> None:
        self.launches.append((grid, block, buffer, shared, stream))


class FakeDeviceArray:
    """An object exporting the CUDA array interface."""

    __cuda_array_interface__ = {
        "shape": (4,),
        "typestr": "<f4",
        "data": (0x7000, False),
        "version": 3,
        "strides": None,
    }


# -- an HTTP server for the client ---------------------------------------------------

Reply = tuple[int, dict[str, str], bytes]


@attrs.define
class Seen:
    """One request as the fake server saw it."""

    method: str
    path: str
    headers: dict[str, list[str]]
    program: dict[str, Any] | None = None
    program_bytes: bytes = b""
    blobs: dict[str, bytes] = attrs.Factory(dict)
    body: bytes = b""


def json_reply(body: dict[str, Any], code: int = 200, **headers: str) -> Reply:
    request_id = body.get("request_id", "00000000-0000-0000-0000-000000000000")
    all_headers = {"Content-Type": "application/json", "X-Request-ID": request_id, **headers}
    return code, all_headers, json.dumps(body).encode()


def result_reply(body: dict[str, Any], parts: list[bytes]) -> Reply:
    content_type, chunks = encode_response(body, parts)
    data = b"".join(c if isinstance(c, bytes) else c.tobytes() for c in chunks)
    return 200, {"Content-Type": content_type, "X-Request-ID": body["request_id"]}, data


def completed(results: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "status": "COMPLETED",
        "request_id": "11111111-1111-4111-8111-111111111111",
        "queue_ms": 1,
        "elapsed_ms": 2.5,
        "lease_wait_ms": 0,
        "lease_held_ms": 0,
        "stdout": "out",
        "stderr": "",
        "stdout_truncated": False,
        "stderr_truncated": False,
        "results": results or {},
    }
    body.update(extra)
    return body


def cache_miss(*digests: str) -> dict[str, Any]:
    return {
        "status": "CACHE_MISS",
        "request_id": "22222222-2222-4222-8222-222222222222",
        "missing_blobs": list(digests),
    }


class FakeServer:
    """
    An in-memory KCoral server for client tests: treq's
    C{StringStubbingResource} behind a C{RequestTraversalAgent}, recording what
    each request carried (parsed with the server's own multipart parser).

    Answers each request with the next scripted reply (or C{handler(seen)}).
    """

    def __init__(self, *replies: Reply | Callable[[Seen], Reply]) -> None:
        self.replies = list(replies)
        self.seen: list[Seen] = []
        self.clock = Clock()
        self.agent = RequestTraversalAgent(StringStubbingResource(self._answer))

    def _answer(
        self, method: bytes, url: str, params: Any, headers: dict[bytes, list[bytes]], data: bytes
    ) -> Reply:
        named = {
            (k.decode() if isinstance(k, bytes) else k).lower(): [
                v.decode() if isinstance(v, bytes) else v for v in vs
            ]
            for k, vs in headers.items()
        }
        seen = Seen(
            method.decode() if isinstance(method, bytes) else method,
            url.split("/", 3)[-1],
            named,
            body=data,
        )
        if seen.method == "POST":
            parsed = parse_request_body(named["content-type"][0], data)
            seen.program_bytes = parsed.program
            seen.program = json.loads(parsed.program)
            seen.blobs = {digest: blob.read() for digest, blob in parsed.blobs.items()}
        self.seen.append(seen)
        reply = self.replies.pop(0)
        return reply(seen) if callable(reply) else reply

    def client(self, **kwargs: Any) -> AsyncClient:
        cooperator = Cooperator(scheduler=lambda work: self.clock.callLater(0, work))
        return AsyncClient(
            "http://kcoral.test/prefix/",
            http_client=HTTPClient(self.agent),
            reactor=self.clock,
            cooperator=cooperator,
            **kwargs,
        )

    def settle(self) -> None:
        """Let body producers and the in-memory connections run to quiescence."""
        for _ in range(50):
            self.clock.advance(0)
            self.agent.flush()


class FakeClient:
    """Stands in for C{kcoral.Client} (for C{kcoral run}): records the call, returns a canned result."""

    def __init__(self, result: ProgramResult | Exception) -> None:
        self.result = result
        self.calls: list[tuple[str, Any, dict[str, Any]]] = []

    def __call__(self, url: str, **kwargs: Any) -> FakeClient:
        self.url = url
        return self

    def __enter__(self) -> FakeClient:
        return self

    def __exit__(self, *args: Any) -> None:
        pass

    def execute(self, program: Any, **kwargs: Any) -> ProgramResult:
        self.calls.append(("execute", program, kwargs))
        if isinstance(self.result, Exception):
            raise self.result
        return self.result

    def health(self) -> dict[str, Any]:
        if isinstance(self.result, Exception):
            raise self.result
        return {"status": "ok"}


# -- compiler backends ---------------------------------------------------------------

#: First bytes of every image L{FakeCompilerBackend} produces.
FAKE_MAGIC = b"FAKECUBIN\0"


@implementer(IPlugin, ICompilerBackend)
@attrs.define(eq=False)
class FakeCompilerBackend:
    """
    A compiler that needs nothing: C{compile} returns a deterministic image
    derived from its inputs, records each call, and can be told to fail.

    @ivar name: the backend's name.
    @ivar usable: what L{available} answers: C{(True, '')} by default.
    @ivar fail: raised by every C{compile} when set.
    @ivar calls: C{(source, arch, options, timeout)} of each C{compile}.
    """

    name: str = "fake"
    kind: str = KIND_BINARY
    usable: tuple[bool, str] = (True, "")
    fail: ExecutionError | None = None
    version: str = "1.0"
    calls: list[tuple[str, str, tuple[str, ...], float]] = attrs.field(factory=list)
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False, repr=False)

    def available(self) -> tuple[bool, str]:
        return self.usable

    def versions(self) -> dict[str, str]:
        return {self.name: self.version} if self.usable[0] else {}

    def compile(self, source: str, arch: str, options: tuple[str, ...], timeout: float) -> bytes:
        with self._lock:
            self.calls.append((source, arch, tuple(options), timeout))
        validate_arch(arch)
        args, _ = validate_options(options)
        if not self.usable[0]:
            raise ExecutionError("unavailable", self.usable[1])
        if self.fail is not None:
            raise self.fail
        digest = hashlib.sha256(repr((source, arch, args)).encode()).digest()
        return FAKE_MAGIC + arch.encode("ascii") + b"\0" + digest


class FakeCudaLibrary:
    """
    The two entry points of C{libcuda} a GPU worker page-locks host memory
    with (C{kcoral.worker.gpu._libcuda}): every call recorded, registration
    answering C{status} (0 is success).
    """

    def __init__(self, status: int = 0) -> None:
        self.status = status
        self.calls: list[tuple[Any, ...]] = []

    def cuMemHostRegister_v2(self, pointer: int, size: int, flags: int) -> int:
        self.calls.append(("register", pointer, size, flags))
        return self.status

    def cuMemHostUnregister(self, pointer: int) -> int:
        self.calls.append(("unregister", pointer))
        return 0


@implementer(IGpuSampler)
@attrs.define
class FakeGpuSampler:
    """
    An L{IGpuSampler} that reads a scripted GPU: the test sets what the
    next readings show (C{processes}, C{usage}, clocks, throttle bits);
    each reading is stamped with C{clock}'s time and returns the usage
    samples newer than asked for, as NVML does.
    """

    clock: Clock
    names: dict[int, str] = attrs.field(factory=lambda: {0: "NVIDIA H200"})
    processes: dict[int, tuple[int, ...]] = attrs.field(factory=dict)
    usage: dict[int, list[ProcessUse]] = attrs.field(factory=dict)
    sm_clock_mhz: int = 1980
    throttle: int = 0
    broken: bool = False
    reads: int = 0

    def name(self, gpu: int) -> str:
        if self.broken or gpu not in self.names:
            raise SamplerUnavailable(f"no GPU {gpu}")
        return self.names[gpu]

    def memory_bandwidth(self, gpu: int) -> float | None:
        self.name(gpu)
        return 6016 / 8 * 3201e6 * 2  # an H200's bus and memory clock

    def use(self, gpu: int, pid: int, sm: int = 50, mem: int = 5, at: float | None = None) -> None:
        """A per-process utilization sample of C{pid} at C{at} (default: now)."""
        stamp = self.clock.seconds() if at is None else at
        self.usage.setdefault(gpu, []).append(ProcessUse(pid, sm, mem, stamp))

    def sample(self, gpu: int, usage_since: float) -> GpuSample:
        self.name(gpu)
        self.reads += 1
        return GpuSample(
            gpu=gpu,
            taken_at=self.clock.seconds(),
            processes=self.processes.get(gpu, ()),
            usage=tuple(u for u in self.usage.get(gpu, ()) if u.at > usage_since),
            sm_clock_mhz=self.sm_clock_mhz,
            mem_clock_mhz=3201,
            sm_clock_max_mhz=1980,
            throttle=self.throttle,
            temperature_c=40,
            power_w=300.0,
        )


@attrs.define
class FakeProcessTable:
    """
    A process table for the GPU monitor: C{pid -> (parent, name, started,
    pid namespace)}; C{kill} removes a process (and records it).
    """

    table: dict[int, tuple[int, str, int, int]] = attrs.field(factory=dict)
    killed: list[int] = attrs.field(factory=list)

    def add(self, pid: int, parent: int, name: str = "python3", ns: int = 1) -> None:
        started = max((entry[2] for entry in self.table.values()), default=0) + 1
        self.table[pid] = (parent, name, started, ns)

    def kill(self, pid: int) -> None:
        self.killed.append(pid)
        self.table.pop(pid, None)

    def parent_of(self, pid: int) -> int | None:
        entry = self.table.get(pid)
        return None if entry is None else entry[0]

    def name_of(self, pid: int) -> str | None:
        entry = self.table.get(pid)
        return None if entry is None else entry[1]

    def started_at(self, pid: int) -> int | None:
        entry = self.table.get(pid)
        return None if entry is None else entry[2]

    def pid_namespace(self, pid: int) -> int | None:
        entry = self.table.get(pid)
        return None if entry is None else entry[3]

    def descendants(self, pid: int) -> list[int]:
        found: list[int] = []
        pending = [pid]
        while pending:
            parent = pending.pop()
            for child, entry in sorted(self.table.items()):
                if entry[0] == parent and child not in found and child != pid:
                    found.append(child)
                    pending.append(child)
        return found


@attrs.define(eq=False)
class MonitoredWorker:
    """A worker as the GPU monitor sees it: its pid, seat, request and violations."""

    pid: int | None
    seat: str = "gpu0/w0"
    alive: bool = True
    request_id: str | None = None
    violations: list[str] = attrs.field(factory=list)

    def gpu_violation(self, reason: str, location: str = "") -> None:
        self.violations.append(reason)
