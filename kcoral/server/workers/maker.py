# -*- test-case-name: tests.unit.test_pool,tests.unit.test_gpus -*-
"""
How the pool's worker processes are made.

L{WorkerMaker} builds a worker's command line inside the sandbox and its
environment (the devices it sees, L{cuda_environment}), forks it through its
device's ready worker template (L{WorkerTemplates}) or spawns it, and gives
it what every worker gets (the compile service, the channel budget, grant
watching).  It also starts the one-request workers of multi-GPU programs.
Which seat a worker fills, and when, is the pool's.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import attrs
from twisted.internet.defer import Deferred
from twisted.logger import Logger

from kcoral.config import ServerConfig
from kcoral.server.leases.gpus import GpuDevice, cuda_environment
from kcoral.server.leases.lease import Leases
from kcoral.server.sandbox.interface import ISandbox
from kcoral.server.workers.backoff import Backoff
from kcoral.server.workers.channelbudget import ChannelBudget
from kcoral.server.workers.job import WorkerHandle
from kcoral.server.workers.processes import worker_command_args
from kcoral.server.workers.reactor import RunBlocking, WorkerReactor
from kcoral.server.workers.template import TemplateError, WorkerTemplate, WorkerTemplates
from kcoral.server.workers.workerproc import WorkerProcess, WorkerSettings

if TYPE_CHECKING:
    from kcoral.server.workers.compiles import IsolatedCompiles


class Place(Protocol):
    """
    Where workers are made: the pool's sandbox and directory, which the
    server sets once it probed them.
    """

    sandbox: ISandbox
    root_dir: Path


def safe_name(worker_id: str) -> str:
    """C{worker_id} as a directory name."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", worker_id)


def remove_trees(paths: list[Path]) -> None:
    """Blocking: delete worker directories (run in a thread)."""
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


#: The environment switch for workers' watching awake: C{0} never, C{1}
#: always, unset where L{cores_to_spare}.
GRANT_WATCH_ENV = "KCORAL_GRANT_WATCH"


def watch_allowed(config: ServerConfig, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether workers may watch awake (L{GRANT_WATCH_ENV}, else L{cores_to_spare})."""
    switch = environ.get(GRANT_WATCH_ENV)
    if switch in ("0", "1"):
        return switch == "1"
    return cores_to_spare(config)


def cores_to_spare(config: ServerConfig, cpus: int | None = None) -> bool:
    """
    Whether this machine (C{cpus}, by default the cores this process may
    run on) has a core for every process of the server that may be busy at
    once (each worker and warm spare, each front end, the lease broker)
    and one more per GPU: the worker first in line for that GPU, which
    polls for its grant awake rather than sleeping
    (L{kcoral.wire.channel.LeaseNext}).  Only then does a worker's watching
    for its grant, or for its next program after an answer, never take a
    core another process needs.
    """
    if cpus is None:
        cpus = len(os.sched_getaffinity(0))
    spares = config.spares_per_group * config.front_ends
    broker = 1 if config.front_ends > 1 else 0
    if config.cpu_mode:
        return cpus >= config.num_workers + spares + config.front_ends + broker
    gpus = len(config.distinct_gpus)
    busy = (config.workers_per_gpu + spares) * gpus + config.front_ends + broker
    return cpus >= busy + gpus


@attrs.define(eq=False)
class WorkerMaker:
    """
    Makes worker processes for a pool.

    @ivar spawn_worker: how a process is spawned (replaced in tests).
    @ivar fork_worker: how a process is forked through a template.
    """

    config: ServerConfig
    _reactor: WorkerReactor
    leases: Leases
    _place: Place
    _run_blocking: RunBlocking
    #: Whether a worker answering now may watch awake for its next program
    #: (L{WorkerSettings.may_watch_next}): the pool's C{serving_one}.
    _may_watch_next: Callable[[], bool]
    #: The wait before a failed template is started again.
    backoff: Backoff = Backoff()
    #: Extra environment variables for every worker (e.g. the compile cache).
    worker_env: dict[str, str] = attrs.field(factory=dict)
    #: Runs workers' compiles for the shared compile cache (L{kcoral.server.workers.compiles}).
    compiler: IsolatedCompiles | None = None
    #: What every worker's channel is read under, all workers together
    #: (C{--max-channel-bytes}, L{kcoral.server.workers.channelbudget}); C{None}: no budget.
    channel_budget: ChannelBudget | None = attrs.field(
        default=attrs.Factory(
            lambda self: (
                ChannelBudget(self.config.max_channel_bytes)
                if self.config.max_channel_bytes > 0
                else None
            ),
            takes_self=True,
        )
    )
    spawn_worker: Callable[..., WorkerHandle] = WorkerProcess.spawn
    fork_worker: Callable[..., WorkerHandle] = WorkerProcess.fork
    #: Workers watch awake for their grant when next in line, and for their
    #: next program for a moment after one that ran alone
    #: (L{WorkerSettings.grant_watch}): by default where L{cores_to_spare};
    #: C{KCORAL_GRANT_WATCH} in the server's environment overrides (C{0}
    #: never, C{1} always).
    grant_watch: bool = attrs.field(
        default=attrs.Factory(lambda self: watch_allowed(self.config), takes_self=True)
    )
    #: The worker templates by GPU id (C{None}: the CPU template), once
    #: started; a worker whose template is missing or failed is spawned.
    templates: WorkerTemplates = attrs.field(
        default=attrs.Factory(
            lambda self: WorkerTemplates(
                self._reactor,
                lambda template, key: Deferred.fromCoroutine(self._start_template(template, key)),
                backoff=self.backoff,
            ),
            takes_self=True,
        )
    )
    #: The configured GPUs by id (discovered at start; an id missing here
    #: stands for itself: node C{/dev/nvidia<id>}, no UUID).
    gpu_devices: dict[int, GpuDevice] = attrs.field(factory=dict)
    #: One-request workers of multi-GPU programs, alive or starting.
    transient_workers: set[WorkerHandle] = attrs.field(factory=set)
    _transients: int = 0

    log = Logger()

    def _devices(self, gpus: tuple[int, ...]) -> list[GpuDevice]:
        return [self.gpu_devices.get(gpu) or GpuDevice(gpu, gpu) for gpu in gpus]

    async def _start_template(self, template: WorkerTemplate, gpu_id: int | None) -> None:
        """Start C{template}'s process in the sandbox; wait until it is ready."""
        sandbox, root_dir = self._place.sandbox, self._place.root_dir
        work_dir = await self._run_blocking(
            sandbox.prepare_seat, root_dir / f"template-{template.name}"
        )
        devices = self._devices(() if gpu_id is None else (gpu_id,))
        try:
            executable, args, env = sandbox.template_command(
                python=sys.executable,
                template_args=[
                    "--device",
                    "cpu" if gpu_id is None else "gpu",
                    "--tensor-api",
                    self.config.tensor_api,
                ],
                template_dir=work_dir,
                spaces_dir=root_dir,
                gpu_devices=[str(device.minor) for device in devices],
            )
        except Exception as e:
            template.broken(f"no command line: {e}")
            await template.ready
        template.start(executable, args, {**env, **self.worker_env}, path=str(work_dir))
        await template.ready

    def template_for(self, gpus: tuple[int, ...]) -> WorkerTemplate | None:
        """The ready template that can fork a worker for C{gpus}, if any."""
        return self.templates.ready_for(gpus, self._place.sandbox.isolates_devices)

    def fork_failed(self, worker: WorkerHandle, gpus: tuple[int, ...], error: Exception) -> bool:
        """
        C{worker} did not start: when it was forked, its template is given
        up (a template whose children cannot start is no template: its
        workers are spawned from now on, C{worker_start_fallback}).
        Returns whether it was, so the caller may spawn one instead.
        """
        template = self.template_for(gpus)
        if getattr(worker, "made", "spawn") != "fork" or template is None:
            return False
        template.broken(f"a forked worker failed to start: {error}")
        self.log.error(
            "worker template {templates} forks workers that cannot start: "
            "new workers are spawned, each paying its imports",
            kcoral_event="worker_start_fallback",
            templates=[template.name],
            errors=[str(error)],
        )
        return True

    def spawn(
        self, worker_id: str, generation: int, gpus: tuple[int, ...], work_dir: Path
    ) -> WorkerHandle:
        """Start a worker process that sees exactly C{gpus} (none: a CPU worker)."""
        sandbox = self._place.sandbox
        devices = self._devices(gpus)
        worker_args = worker_command_args(
            "gpu" if gpus else "cpu", tensor_api=self.config.tensor_api
        )
        executable, args, env = sandbox.command(
            python=sys.executable,
            worker_args=worker_args,
            work_dir=work_dir,
            gpu_devices=[str(device.minor) for device in devices],
        )
        env = {**env, **self.worker_env}
        if devices:
            # CUDA device i is gpus[i], whatever the front end was given.
            env.update(
                cuda_environment(
                    devices,
                    isolated=sandbox.isolates_devices,
                    connections=self.config.work_queues,
                )
            )
        template = self.template_for(gpus)
        worker: WorkerHandle | None = None
        common: dict[str, Any] = {
            "seat": worker_id,
            "generation": generation,
            "gpus": gpus,
            "leases": self.leases,
            "env": env,
            "settings": WorkerSettings(
                grace_seconds=self.config.worker_termination_grace_seconds,
                compiler=self.compiler,
                channel_budget=self.channel_budget,
                trace_instructions=self.config.log_level == "debug",
                grant_watch=self.grant_watch,
                may_watch_next=self._may_watch_next,
            ),
        }
        if template is not None:
            try:
                worker = self.fork_worker(
                    self._reactor,
                    template=template,
                    args=worker_args,
                    cwd=sandbox.worker_path(work_dir),
                    workspace=_relative(work_dir, self._place.root_dir),
                    capture_bytes=sandbox.capture_bytes,
                    workspace_bytes=sandbox.workspace_bytes,
                    **common,
                )
            except TemplateError as e:
                self.log.warn(
                    "worker {worker_id} spawned: its template cannot fork ({error})",
                    kcoral_event="template_fork_failed",
                    worker_id=worker_id,
                    template=template.name,
                    error=str(e),
                )
        if worker is None:
            worker = self.spawn_worker(self._reactor, executable=executable, args=args, **common)
        return worker

    async def start_transient(
        self, worker_id: str, gpus: tuple[int, ...]
    ) -> tuple[WorkerHandle, Path]:
        """
        Start a one-request worker that sees all of C{gpus} (a multi-GPU
        program), for the request that holds seat C{worker_id}.

        It starts like any worker: imports first, then its context under
        its GPUs' lease, which it gives back once ready.  Returns the worker
        (ready) and its directory, which the caller removes with
        L{remove_transient}.
        """
        self._transients += 1
        directory = self._place.root_dir / f"{safe_name(worker_id)}-multi{self._transients}"
        work_dir = await self._run_blocking(self._place.sandbox.prepare_seat, directory)
        worker = self.spawn(worker_id, 0, gpus, work_dir)
        self.transient_workers.add(worker)

        def forget(result: int | None) -> int | None:
            self.transient_workers.discard(worker)
            return result

        worker.ended.addBoth(forget)
        try:
            await worker.ready
        except BaseException:
            await worker.kill()
            await self._run_blocking(remove_trees, [directory])
            raise
        return worker, work_dir

    def remove_transient(self, worker: WorkerHandle, work_dir: Path) -> Deferred[None]:
        """Stop a transient worker and delete its directory."""

        async def remove() -> None:
            if worker.alive:
                await worker.kill()
            await self._run_blocking(remove_trees, [work_dir.parent])

        return Deferred.fromCoroutine(remove())


def _relative(work_dir: Path, root: Path) -> str | None:
    """C{work_dir} relative to C{root} (how a template child finds it), if below it."""
    relative = os.path.relpath(os.path.realpath(work_dir), os.path.realpath(root))
    return None if relative == ".." or relative.startswith("../") else relative
