# -*- test-case-name: tests.unit.test_workerproc,tests.unit.test_proctree -*-
"""
The operating system's side of a worker process: spawned with wide pipe
reads, its descriptors and arguments, how its end reads as an exit code,
and its process tree, signalled as a whole.
"""

from __future__ import annotations

import errno
import os
import socket

import psutil
from twisted.internet import main, process
from twisted.internet.interfaces import IProcessTransport, IReactorProcess
from twisted.internet.posixbase import PosixReactorBase
from twisted.internet.protocol import ProcessProtocol
from twisted.python.runtime import platform

from kcoral.proctree import descendants_of
from kcoral.wire.channel import (
    WORKER_CHANNEL_FDS,
)

#: Bytes read from a worker pipe per reactor wakeup.  Twisted's process
#: reader reads 8 KiB at a time, which makes a 64 MiB tensor cost thousands
#: of reactor iterations; the channel pipes are 1 MiB (the worker widens them).
READ_SIZE = 1 << 20


class WideReader(process.ProcessReader):
    """A process pipe reader that takes up to L{READ_SIZE} bytes per read."""

    def doRead(self) -> Exception | None:
        try:
            data = os.read(self.fd, READ_SIZE)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EINTR):
                return None
            return main.CONNECTION_LOST
        if not data:
            return main.CONNECTION_DONE
        self.dataReceived(data)
        return None


def flush_pipe(transport: object, fd: int) -> None:
    """
    Write what the transport holds for pipe C{fd} now, as the reactor
    would once the pipe is writable (L{IWriteDescriptor.doWrite}); what
    does not fit stays buffered for the reactor, and an error is left for
    the reactor to find on its own next write.
    """
    writer = getattr(transport, "pipes", {}).get(fd)
    if writer is not None:
        writer.doWrite()


class WorkerTransport(process.Process):
    """Twisted's POSIX process transport with L{WideReader} pipes."""

    processReaderFactory = WideReader


def spawn_process(
    reactor: IReactorProcess,
    protocol: ProcessProtocol,
    executable: str,
    args: list[str],
    env: dict[str, str],
    child_fds: dict[int, int | str],
) -> IProcessTransport:
    """
    C{spawnProcess} with wide pipe reads on a real POSIX reactor; any other
    reactor (a test's fake included) gets a plain C{spawnProcess}.
    """
    if isinstance(reactor, PosixReactorBase) and platform.isLinux():
        return WorkerTransport(
            reactor, executable, args, env, None, protocol, None, None, child_fds
        )
    return IReactorProcess(reactor).spawnProcess(
        protocol, executable, args, env=env, childFDs=child_fds
    )


def signal_all(processes: list[psutil.Process], signum: int) -> None:
    for victim in processes:
        try:
            victim.send_signal(signum)
        except psutil.Error:
            pass
    # Workers run in their own session; signal the group too, in case a
    # child escaped the tree walk between listing and signalling.
    if processes:
        try:
            os.killpg(processes[0].pid, signum)
        except (OSError, ProcessLookupError):
            pass


def process_tree(pid: int | None) -> list[psutil.Process]:
    """
    The process C{pid} and its descendants, parents first (none for C{None}
    or a process that is gone).  Read from procfs (L{kcoral.proctree}):
    this runs on the reactor as a worker retires, and psutil's full scan
    took milliseconds of every answer.
    """
    if pid is None:
        return []
    try:
        root = psutil.Process(pid)
    except psutil.Error:
        return []
    pids = descendants_of(pid)
    if pids is None:
        try:
            return [root, *root.children(recursive=True)]
        except psutil.Error:
            return [root]
    tree = [root]
    for child in pids:
        try:
            tree.append(psutil.Process(child))
        except psutil.Error:
            pass  # gone since it was listed
    return tree


def exit_code_of(value: BaseException) -> int | None:
    """A process end (C{ProcessDone}, C{ProcessTerminated}) as an exit code; a signal is negative."""
    code = getattr(value, "exitCode", None)
    sig = getattr(value, "signal", None)
    if sig is not None:
        return -int(sig)
    return code if code is None else int(code)


def worker_child_fds(
    descriptors: socket.socket, progress: int | None = None
) -> dict[int, int | str]:
    """
    What a worker's fds are, for C{spawnProcess}'s C{childFDs}: stdin (closed
    at once), stdout and stderr (read for diagnostics), and the control
    channel's fds (L{kcoral.wire.channel.WORKER_CHANNEL_FDS}), the descriptor
    socket being the worker's end C{descriptors} and the progress board
    C{progress} (left out when there is none).
    """
    fds: dict[int, int | str] = {0: "w", 1: "r", 2: "r"}
    for fd, role in WORKER_CHANNEL_FDS.items():
        if role == "socket":
            fds[fd] = descriptors.fileno()
        elif role == "board":
            if progress is not None:
                fds[fd] = progress
        else:
            fds[fd] = role
    return fds


def worker_command_args(device: str, *, tensor_api: str) -> list[str]:
    """
    The worker's own arguments (after C{python -m kcoral.worker}).  How many
    programs it serves is the parent's to decide, job by job (L{Job.last}).
    """
    return [
        "--device",
        device,
        "--tensor-api",
        tensor_api,
    ]
