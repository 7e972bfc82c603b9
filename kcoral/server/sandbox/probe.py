# -*- test-case-name: tests.integration.test_sandbox_probe,tests.unit.test_sandbox -*-
"""
Which sandbox a server run gets (server spec 6.5).

L{probe_sandbox} runs the real bwrap command line once per device
configuration at start-up; L{choose_sandbox} returns
L{kcoral.server.sandbox.nosandbox.NoSandbox} for C{--sandbox none},
else a probed L{kcoral.server.sandbox.bubblewrap.BubblewrapSandbox}, and
falls back to no sandbox with a warning under C{--sandbox auto} when the
probe fails.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Sequence
from functools import partial
from pathlib import Path

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorProcess, IReactorThreads
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger

from kcoral.config import ServerConfig
from kcoral.server.sandbox.bubblewrap import PROBE_MARKER, BubblewrapSandbox
from kcoral.server.sandbox.collect import Finished, Sink, kill_group, run_bounded
from kcoral.server.sandbox.interface import ISandbox, SandboxError
from kcoral.server.sandbox.nosandbox import NoSandbox
from kcoral.server.sandbox.seats import remove_seat

#: Runs the probe's command in a new session (its own process group, so a
#: timeout can kill everything it started), stdin on /dev/null, stderr merged
#: into stdout.
_SESSION_TRAMPOLINE = (
    "import os, sys\n"
    "os.setsid()\n"
    "fd = os.open(os.devnull, os.O_RDONLY)\n"
    "os.dup2(fd, 0)\n"
    "os.dup2(1, 2)\n"
    "os.execv(sys.argv[1], sys.argv[1:])\n"
)

#: How much probe output is kept for the failure message.
PROBE_OUTPUT_TAIL = 8192

FALLBACK_PREFIX = (
    "bubblewrap could not start; filesystem isolation is disabled for this server run: "
)


def _run_in_session(
    reactor: IReactorProcess, argv: list[str], timeout: float
) -> Deferred[Finished]:
    """
    Run C{argv} (C{argv[0]} a path) in a new session with stdin on /dev/null
    and stderr merged into stdout, keeping the output's tail.  On timeout,
    SIGKILL its process group; fires once it has ended.
    """
    env = {k: v for k, v in os.environ.items() if isinstance(v, str)}
    trampoline = [sys.executable, "-I", "-S", "-c", _SESSION_TRAMPOLINE, *argv]
    return run_bounded(
        reactor,
        sys.executable,
        trampoline,
        env=env,
        sinks={"output": Sink((1, 2), 4 * PROBE_OUTPUT_TAIL, tail=True)},
        timeout=timeout,
        kill=kill_group,
    )


def _timeout_message(timeout: float) -> str:
    return f"bubblewrap startup probe timed out after {float(timeout)!r}s"


def _exit_message(status: int, output: bytes) -> str:
    tail = output[-PROBE_OUTPUT_TAIL:].decode("utf-8", "replace").strip()
    return f"bubblewrap startup probe exited with status {status}: {tail or 'no readiness confirmation'}"


def _prepare_probe(sandbox: BubblewrapSandbox) -> tuple[str, Path, Path]:
    """BLOCKING: find bwrap, resolve the mount plan, create the probe's seat."""
    found = shutil.which(sandbox.bwrap)
    if found is None:
        raise SandboxError("bubblewrap isolation requires bwrap on PATH; install bubblewrap")
    sandbox.resolve_mounts()
    seat = Path(tempfile.mkdtemp(prefix="kcoral-sandbox-"))
    try:
        work = sandbox.prepare_seat(seat)
    except BaseException:
        shutil.rmtree(seat, ignore_errors=True)
        raise
    return os.path.abspath(found), seat, work


async def probe_sandbox(
    reactor: IReactorProcess,
    sandbox: BubblewrapSandbox,
    *,
    gpu_device_sets: list[list[str]],
    timeout: float = 10.0,
) -> str | None:
    """
    Run the real bubblewrap command line once per distinct device
    configuration (an empty list is the CPU configuration) with a tiny
    program that checks its workspace and prints L{PROBE_MARKER}.

    Sets C{sandbox.executable}, C{sandbox.disable_userns} and
    C{sandbox.share_net} as a side effect.

    @param reactor: an C{IReactorProcess}, C{IReactorTime} and
        C{IReactorThreads} provider.
    @return: C{None} if bubblewrap works, else the failure message (spec 6.5).
    """
    if not sys.platform.startswith("linux"):
        return "bubblewrap isolation requires Linux"
    threads = IReactorThreads(reactor)
    pool = threads.getThreadPool()
    try:
        bwrap, seat, work = await deferToThreadPool(threads, pool, _prepare_probe, sandbox)
    except SandboxError as e:
        return str(e)
    except OSError as e:
        return f"could not create the bubblewrap probe workspace: {e}"

    error: str | None = None
    try:
        sandbox.executable = bwrap
        helped = await _run_in_session(reactor, [bwrap, "--help"], timeout)
        if helped.timed_out:
            error = _timeout_message(timeout)
        else:
            sandbox.disable_userns = b"--disable-userns" in helped.output["output"]
            sandbox.share_net = b"--share-net" in helped.output["output"]
            distinct: list[list[str]] = []
            for devices in gpu_device_sets or [[]]:
                if list(devices) not in distinct:
                    distinct.append(list(devices))
            for index, devices in enumerate(distinct):
                if index:
                    await deferToThreadPool(threads, pool, sandbox.clear_workspace, work)
                try:
                    argv = sandbox.probe_command(work, devices)
                except SandboxError as e:
                    error = str(e)
                    break
                probed = await _run_in_session(reactor, argv, timeout)
                output = bytes(probed.output["output"])
                if probed.timed_out:
                    error = _timeout_message(timeout)
                    break
                if (
                    probed.status != 0
                    or PROBE_MARKER not in output.decode("utf-8", "replace").split()
                ):
                    error = _exit_message(probed.status, output)
                    break
    finally:
        try:
            await deferToThreadPool(threads, pool, remove_seat, seat)
        except OSError as e:
            if error is None:
                error = f"could not remove the bubblewrap probe workspace: {e}"
    return error


def choose_sandbox(
    reactor: IReactorProcess,
    config: ServerConfig,
    log: Logger | None = None,
    *,
    bwrap: str = "bwrap",
    gpu_minors: Sequence[int] | None = None,
    scratch: Path | None = None,
) -> Deferred[ISandbox]:
    """
    Pick the server run's L{ISandbox}: L{NoSandbox} for C{sandbox="none"}
    (no probe); else probe bubblewrap.  When the probe fails, C{"bubblewrap"}
    fails with L{SandboxError} (the server does not start) and C{"auto"}
    falls back to L{NoSandbox} with a C{sandbox_disabled} WARNING event and
    a C{RuntimeWarning}.

    @param config: a C{kcoral.config.ServerConfig} (C{sandbox},
        C{sandbox_readonly_paths}, C{device}, C{gpus}).
    @param bwrap: the bwrap executable to probe and use.
    @param gpu_minors: the device node minors of the configured GPUs (from
        L{kcoral.server.leases.gpus}); when not given, each GPU id is taken to be
        its minor (spec 6.2's fallback).
    @param scratch: the server's scratch root: the seccomp filter is
        compiled into it (none without it, or without libseccomp).
    @return: a Deferred firing with the L{ISandbox} provider.
    """
    return Deferred.fromCoroutine(
        _choose_sandbox(reactor, config, log or _log, bwrap, gpu_minors, scratch)
    )


async def _choose_sandbox(
    reactor: IReactorProcess,
    config: ServerConfig,
    log: Logger,
    bwrap: str,
    gpu_minors: Sequence[int] | None,
    scratch: Path | None = None,
) -> ISandbox:
    if config.sandbox == "none":
        return NoSandbox()
    sandbox = BubblewrapSandbox(
        tuple(config.sandbox_readonly_paths or ()),
        bwrap=bwrap,
        capture_bytes=config.output_space_bytes,
        workspace_bytes=_workspace_bytes(config),
        hidden_paths=_server_paths(config),
    )
    if scratch is not None:
        from kcoral.server.sandbox.seccomp import (
            COMPILE_FILTER,
            TEMPLATE_ALLOWED,
            SeccompUnavailable,
            write_filter,
        )

        threads = IReactorThreads(reactor)
        try:
            sandbox.seccomp_path = await deferToThreadPool(
                threads, threads.getThreadPool(), write_filter, scratch
            )
            sandbox.template_seccomp_path = await deferToThreadPool(
                threads,
                threads.getThreadPool(),
                write_filter,
                scratch,
                "template-seccomp.bpf",
                TEMPLATE_ALLOWED,
            )
            sandbox.compile_seccomp_path = await deferToThreadPool(
                threads,
                threads.getThreadPool(),
                partial(write_filter, scratch, COMPILE_FILTER, sockets=False),
            )
        except (SeccompUnavailable, OSError) as e:
            log.warn(
                "no seccomp filter for the sandbox: {error}",
                kcoral_event="seccomp_unavailable",
                error=str(e),
            )
    if config.device == "gpu":
        minors = list(gpu_minors) if gpu_minors is not None else list(config.gpus)
        device_sets = [[str(minor)] for minor in dict.fromkeys(minors)]
    else:
        device_sets = [[]]
    error = await probe_sandbox(reactor, sandbox, gpu_device_sets=device_sets)
    if error is None:
        return sandbox
    if config.sandbox != "auto":
        # The operator asked for the sandbox: never run programs without it.
        raise SandboxError(
            f"--sandbox bubblewrap: bubblewrap cannot run ({error}); fix it, or choose "
            "--sandbox auto to fall back to no sandbox"
        )
    full_text = FALLBACK_PREFIX + error
    log.warn(
        "bubblewrap could not start; filesystem isolation is disabled for this server run: {error}",
        kcoral_event="sandbox_disabled",
        sandbox="none",
        error=error,
        message=full_text,
    )
    warnings.warn(full_text, RuntimeWarning, stacklevel=2)
    return NoSandbox()


def _server_paths(config: ServerConfig) -> tuple[str, ...]:
    """The server's directories no worker may see: logs and caches."""
    paths = [os.fspath(path) for path in (config.log_dir, config.disk_cache_dir) if path]
    cache = config.disk_cache_dir
    if cache:
        # The compile cache beside it (its host path; workers use their bind).
        paths.append(os.path.join(os.path.dirname(os.fspath(cache)), "compile"))
    return tuple(paths)


def _workspace_bytes(config: ServerConfig) -> int | None:
    """
    The size of a worker's private workspace tmpfs: C{--workspace-bytes},
    for workers that serve one request (a reused worker keeps the seat's
    host directory, which the parent empties between its programs).
    """
    size = config.workspace_bytes
    if not size or config.max_requests_per_worker != 1:
        return None
    return int(size)


_log = Logger(namespace="kcoral.server.sandbox")
