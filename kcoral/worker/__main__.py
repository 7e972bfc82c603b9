# -*- test-case-name: tests.integration.test_worker_process -*-
"""
C{python -m kcoral.worker}: one worker process.

The parent writes messages on fd 3 and reads ours on fd 4 (both defined in
L{kcoral.wire.channel}; see docs/architecture.md, "The control channel").
Fds 1 and 2 stay free for diagnostics and, while a program runs, for its
captured output; channel bytes never travel on them.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import IO, Any

import attrs

from kcoral.ipc import board
from kcoral.ipc.channel_io import read_message, write_message
from kcoral.ipc.shared import SharedBuffer
from kcoral.ipc.shared import available as shared_memory_available
from kcoral.wire.channel import (
    DESCRIPTOR_FD,
    FROM_WORKER_FD,
    PROGRESS_FD,
    RETIRE_REQUEST_LIMIT,
    TO_WORKER_FD,
    Blob,
    Execute,
    Exit,
    Failed,
    Outcome,
    Ready,
    Teardown,
    TornDown,
)
from kcoral.worker import runtime
from kcoral.worker.builtins import registry_for
from kcoral.worker.devices import make_backend, prepare_backend
from kcoral.worker.engine import Engine
from kcoral.worker.lease import LeaseClient, NullLease, watch_inbox
from kcoral.worker.measure import ChannelMeasurer
from kcoral.worker.remote_compile import COMPILE_IN_PARENT_ENV, RemoteCompiler


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m kcoral.worker")
    parser.add_argument("--device", choices=("cpu", "gpu"), required=True)
    parser.add_argument("--gpu-ordinal", type=int, default=0)
    parser.add_argument("--tensor-api", choices=("auto", "torch", "pycuda"), default="auto")
    return parser.parse_args(argv)


def _detach() -> None:
    """Lead our own session (so the parent can kill our process group); ignore SIGINT."""
    if os.getsid(0) != os.getpid():
        try:
            os.setsid()
        except OSError:
            pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def serve(
    inbox: IO[bytes],
    outbox: IO[bytes],
    device: str,
    descriptors: socket.socket | None = None,
    **backend_options: Any,
) -> int:
    """
    Handshake, then run programs until told to exit; return the exit status.
    The worker retires after the program the parent marks as its last
    (L{Execute.last}): the parent alone counts its requests.

    With C{descriptors} (the channel's descriptor socket), blobs may arrive
    and large returned parts leave as sealed shared buffers.
    """
    # A GPU worker creates its CUDA context while holding its GPU's lease,
    # so warming a new worker never overlaps another worker's measurement.
    lease: Any = LeaseClient(inbox, outbox) if device != "cpu" else NullLease()
    try:
        prepare_backend(device, **backend_options)
        lease.acquire()
        backend = make_backend(device, **backend_options)
        target = backend.target()
        versions = backend.versions()
        # Start-up objects (imported modules, the backend) are never garbage:
        # keep them out of every later collection, which then stays cheap.
        gc.collect()
        gc.freeze()
    except Exception as e:
        traceback.print_exc()
        write_message(outbox, Failed(f"{type(e).__name__}: {e}"))
        return 1
    if not backend.uses_lease:
        lease.release()
        lease = NullLease()
    if os.environ.get(COMPILE_IN_PARENT_ENV) == "1":
        from kcoral.compilers import configure_remote

        configure_remote(RemoteCompiler(inbox, outbox))
    if device != "cpu":
        # benchmark's raw measurements go to the parent, which computes
        # the results out of the uploaded code's reach.
        runtime.install_measurer(ChannelMeasurer(inbox, outbox))
    engine = Engine(
        backend,
        lease,
        registry_for(backend),
        send=lambda message: write_message(outbox, message, descriptors),
        stream_returns=True,
        share_parts=descriptors is not None and shared_memory_available(),
        freeze_after_first_settle=True,
        progress=_progress_board(),
    )
    write_message(
        outbox, Ready(pid=os.getpid(), target=target, versions=versions, device=backend.name)
    )
    lease.release()
    socket_identity = None if descriptors is None else _identity(descriptors)
    blobs: dict[str, bytes | SharedBuffer] = {}
    while True:
        message = read_message(inbox, descriptors=descriptors)
        if message is None or isinstance(message, Exit):
            return 0
        if isinstance(message, Blob):
            blobs[message.digest] = message.data
        elif isinstance(message, Execute):
            outcome = engine.run(message, blobs, retiring=message.last)
            for blob in blobs.values():
                if isinstance(blob, SharedBuffer):
                    blob.close()
            blobs = {}
            if descriptors is not None and not _same_socket(descriptors, socket_identity):
                # The program closed or replaced the descriptor socket: send
                # the parts inline, and retire (the next request could not
                # get its blobs).
                print("kcoral worker: retiring, the descriptor socket was changed", file=sys.stderr)
                outcome = attrs.evolve(
                    outcome,
                    parts=tuple(_inline(part) for part in outcome.parts),
                    retire=outcome.retire or RETIRE_REQUEST_LIMIT,
                )
                descriptors.detach()  # fd 5 may be another file now: never close it
                descriptors = None
            try:
                write_message(outbox, outcome, descriptors)
            except ValueError:
                # Text without a UTF-8 form (a lone surrogate in an error
                # message or a key): nothing was written yet; send it mended.
                write_message(outbox, _mended(outcome), descriptors)
            _log_notices(backend, sys.stderr)
            if outcome.retire is not None:
                return _retire(inbox, outbox, backend)
            # Host state back to how the first program found it, while the
            # parent answers (the next program waits in the pipe meanwhile).
            engine.settle()
            if message.watch_next_seconds > 0:
                # A core is spare: the next program finds this worker awake.
                watch_inbox(inbox, message.watch_next_seconds)
        else:
            print(f"kcoral worker: ignoring message {message.TYPE!r}", file=sys.stderr, flush=True)


def _identity(sock: socket.socket) -> tuple[int, int] | None:
    """The device and inode behind C{sock}'s fd (C{None}: it is closed)."""
    try:
        info = os.fstat(sock.fileno())
    except (OSError, ValueError):
        return None
    return (info.st_dev, info.st_ino)


def _same_socket(sock: socket.socket, identity: tuple[int, int] | None) -> bool:
    return identity is not None and _identity(sock) == identity


def _inline(part: bytes | SharedBuffer) -> bytes:
    return part if isinstance(part, bytes) else part.tobytes()


def _log_notices(backend: Any, stream: Any) -> None:
    """
    Write the backend's notes for the log (a GPU backend's fallback from
    page-locked returns, say) to the worker's stderr: written between
    programs, because during one fd 2 is the program's captured stderr.
    """
    for notice in getattr(backend, "take_notices", list)():
        print(f"kcoral worker: {notice}", file=stream, flush=True)


def _retire(inbox: IO[bytes], outbox: IO[bytes], backend: Any) -> int:
    """
    Leave after a retiring outcome.  A GPU worker waits for L{Teardown}
    (the parent then holds its GPUs' maintenance lease), destroys its
    contexts, answers L{TornDown} and leaves at once with C{os._exit}, so
    nothing touches CUDA after the answer; L{Exit} or the end of the
    channel (the parent is stopping) leave normally.
    """
    if not backend.uses_lease:
        return 0
    while True:
        message = read_message(inbox)
        if message is None or isinstance(message, Exit):
            return 0
        if isinstance(message, Teardown):
            started = time.monotonic()
            destroy = getattr(backend, "destroy_context", None)
            destroyed = bool(destroy()) if destroy is not None else False
            write_message(outbox, TornDown(destroyed=destroyed, seconds=time.monotonic() - started))
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


def _mend(value: Any) -> Any:
    """C{value} with every string's unencodable characters replaced."""
    if isinstance(value, str):
        return value.encode("utf-8", "replace").decode("utf-8")
    if isinstance(value, dict):
        return {_mend(k): _mend(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_mend(v) for v in value]
    return value


def _mended(outcome: Outcome) -> Outcome:
    """The outcome with its text fields mended (see L{_mend})."""
    return attrs.evolve(
        outcome,
        results=_mend(outcome.results),
        error=_mend(outcome.error),
        stdout=_mend(outcome.stdout),
        stderr=_mend(outcome.stderr),
    )


def _widen_pipe(fd: int, size: int = 1 << 20) -> None:
    """Give a channel pipe a 1 MiB buffer: blobs and tensors cross it in fewer steps."""
    try:
        import fcntl

        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), size)
    except OSError:
        pass  # not a pipe, or over the system's limit: the default works too


def _progress_board() -> Callable[[int], None] | None:
    """Where to post instruction indices, when the parent gave a board (fd 6)."""
    # Mapped, then closed: a program sees no descriptor of it.
    poster = board.attach(PROGRESS_FD, close=True)
    return None if poster is None else poster.post


def _descriptor_socket() -> socket.socket | None:
    """The channel's descriptor socket, when the parent gave us one."""
    try:
        sock = socket.socket(fileno=DESCRIPTOR_FD)
    except OSError:
        return None  # started without one (by hand, or an older parent)
    os.set_inheritable(DESCRIPTOR_FD, False)
    return sock


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    _detach()
    for fd in (TO_WORKER_FD, FROM_WORKER_FD):
        os.set_inheritable(fd, False)
        _widen_pipe(fd)
    inbox = os.fdopen(TO_WORKER_FD, "rb", buffering=1 << 16)
    outbox = os.fdopen(FROM_WORKER_FD, "wb", buffering=1 << 16)
    descriptors = _descriptor_socket()
    options: dict[str, Any] = {}
    if args.device == "gpu":
        options = {"gpu_ordinal": args.gpu_ordinal, "tensor_api": args.tensor_api}
    try:
        return serve(inbox, outbox, args.device, descriptors, **options)
    except BrokenPipeError:
        return 1
    finally:
        sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
