# -*- test-case-name: tests.integration.test_template -*-
"""
C{python -m kcoral.worker.template}: the worker template ("zygote").

It does every import a worker needs (PyCUDA, and torch for C{--tensor-api
torch}, or C{auto} when torch is installed), never initialises CUDA, never
runs user code, and forks a worker per request.  A fork costs under a
millisecond where a new interpreter costs its imports (0.43 s for PyCUDA,
5.4 s of CPU for torch).

The parent talks to it over a Unix stream socket on fd L{TEMPLATE_FD}, one
JSON object per line (L{kcoral.server.workers.template} is the other end):

  - parent -> template: C{{"op": "fork", "id": N, "fds": [child fd, ...],
    "argv": [...], "env": {...}, "cwd": ..., "workspace": ...,
    "capture_bytes": ..., "workspace_bytes": ...}}, with the listed descriptors attached
    (C{SCM_RIGHTS}, in the order of C{fds}): the child gets each at the
    named number, and nothing else.
  - template -> parent: C{{"op": "ready", "pid": P}} once, then
    C{{"op": "forked", "id": N, "pid": P}} and, when that child is reaped,
    C{{"op": "exited", "id": N, "status": S}} (a C{waitpid} status), or
    C{{"op": "failed", "id": N, "error": ...}}.

Pids are as the template sees them (inside a bubblewrap sandbox, its own
PID namespace); the parent maps them to host pids.

Under C{--isolation namespaces} (the template runs in bubblewrap with
C{CAP_SYS_ADMIN} in its user namespace) each child makes itself a fresh
sandbox first (L{kcoral.worker.isolate}); under C{none} it only gets its
own session, descriptors, environment and working directory.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import selectors
import signal
import socket
import sys
import traceback
from collections.abc import Sequence
from typing import Any

#: The template's end of the parent's socket.
TEMPLATE_FD = 3

#: Descriptors taken per message at most; a request carries five.
MAX_FDS = 16

#: Where the template's sandbox binds the directory holding every worker's
#: workspace (the pool's root); each child binds its own and detaches this.
SPACES = "/run/kcoral/spaces"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m kcoral.worker.template")
    parser.add_argument("--device", choices=("cpu", "gpu"), required=True)
    parser.add_argument("--tensor-api", choices=("auto", "torch", "pycuda"), default="auto")
    parser.add_argument("--isolation", choices=("none", "namespaces"), default="none")
    parser.add_argument("--seccomp-fd", type=int, default=None)
    parser.add_argument("--workspace", default="/work")
    parser.add_argument("--capture-dir", default=None)
    parser.add_argument("--private-tmp", default=None)
    parser.add_argument("--bound-tmp", action="append", default=[])
    return parser.parse_args(argv)


def preload(device: str, tensor_api: str) -> None:
    """Every import a worker makes before it serves, CUDA left untouched."""
    import kcoral.worker.__main__  # noqa: F401  (engine, builtins, channel, backends)
    import kcoral.worker.isolate  # noqa: F401

    if device == "gpu":
        # The driver watch is imported at each program's start (a fresh
        # worker compiled and imported it in 5 ms of its only answer).
        import kcoral.worker.cuptiwatch  # noqa: F401
        from kcoral.worker.gpu import import_gpu_modules

        import_gpu_modules(tensor_api)
    # The compiler plugins, found once, and nvcc's version, probed once:
    # every forked worker inherits both, so a compile (a cache hit above
    # all) costs no plugin scan and no `nvcc --version` (issue 38).
    from kcoral.compilers import warm_up

    warm_up()


class Template:
    """The fork server: one request line at a time, children reaped by pidfd."""

    def __init__(
        self, sock: socket.socket, args: argparse.Namespace, seccomp: bytes | None
    ) -> None:
        self.sock = sock
        self.args = args
        self.seccomp = seccomp
        self.selector = selectors.DefaultSelector()
        self.buffer = b""
        self.fds: list[int] = []
        self.children: dict[int, tuple[int, int]] = {}  # pidfd -> (request id, pid)

    def send(self, message: dict[str, Any]) -> None:
        self.sock.sendall(json.dumps(message).encode() + b"\n")

    def serve(self) -> int:
        self.selector.register(self.sock, selectors.EVENT_READ)
        if self.args.isolation == "namespaces":
            self.probe()
        self.send({"op": "ready", "pid": os.getpid()})
        while True:
            for key, _ in self.selector.select():
                if key.fileobj is self.sock:
                    if not self.read_requests():
                        return 0
                else:
                    self.reap(key.fd)

    def probe(self) -> None:
        """
        Before it says ready: fork one child that isolates itself as a
        worker's child would (with the template's own workspace), and exit
        if it cannot, so that the parent falls back to spawning instead of
        forking workers that all fail.
        """
        from kcoral.worker import isolate

        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                isolate.set_parent_death_signal(signal.SIGKILL)
                self.isolate(self.args.workspace, None)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        if status != 0:
            raise isolate.IsolationError(
                f"a test child could not make its sandbox (wait status {status})"
            )

    def isolate(
        self,
        workspace_source: str,
        capture_bytes: int | None,
        workspace_bytes: int | None = None,
    ) -> None:
        """
        In a child: its own namespaces and mounts, then (as PID 2 of its own
        PID namespace, under a tiny init: the caller's process only waits and
        mirrors its end) read-only mounts, no capabilities, the worker filter.

        The worker is not the namespace's PID 1: the kernel ignores every
        signal a PID 1 sends itself without a handler, C{SIGKILL} included,
        so a program that kills itself must not run as one (issue 32).
        """
        from kcoral.worker import isolate

        isolate.enter_namespaces()
        isolate.mount_private_places(
            workspace_source=workspace_source,
            workspace=self.args.workspace,
            spaces=SPACES,
            capture_dir=self.args.capture_dir,
            capture_bytes=capture_bytes,
            workspace_bytes=workspace_bytes,
        )
        if self.args.bound_tmp:
            isolate.own_tmp(self.args.private_tmp, self.args.bound_tmp)
        # The first child made after unshare() is the namespace's init,
        # the next one the worker; both are children of this process.
        init = os.fork()
        if init == 0:
            _init(self.seccomp)
        try:
            pid = os.fork()
        except BaseException:
            os.kill(init, signal.SIGKILL)
            raise
        if pid:
            isolate.set_name("kcoral-sandbox")
            os._exit(_mirror(pid, init))
        isolate.set_parent_death_signal(signal.SIGKILL)
        writable = (
            self.args.workspace,
            *filter(None, [self.args.capture_dir]),
            *self.args.bound_tmp,
        )
        isolate.finish_in_pid_namespace(writable=writable, proc_read_only=self.args.device == "cpu")
        isolate.drop_privileges(self.seccomp)

    def read_requests(self) -> bool:
        """Handle complete request lines; C{False} once the parent is gone."""
        data, fds, _, _ = socket.recv_fds(self.sock, 1 << 20, MAX_FDS)
        if not data:
            return False
        self.buffer += data
        self.fds.extend(fds)
        while b"\n" in self.buffer:
            line, self.buffer = self.buffer.split(b"\n", 1)
            request = json.loads(line)
            count = len(request.get("fds", ()))
            taken, self.fds = self.fds[:count], self.fds[count:]
            if request.get("op") == "fork" and len(taken) == count:
                self.fork(request, taken)
            else:
                for fd in taken:
                    os.close(fd)
                self.send({"op": "failed", "id": request.get("id"), "error": "bad request"})
        return True

    def fork(self, request: dict[str, Any], fds: list[int]) -> None:
        try:
            pid = os.fork()
        except OSError as e:
            for fd in fds:
                os.close(fd)
            self.send({"op": "failed", "id": request["id"], "error": str(e)})
            return
        if pid == 0:
            code = 1
            try:
                code = self.become_worker(request, fds)
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        for fd in fds:
            os.close(fd)
        pidfd = os.pidfd_open(pid)
        self.children[pidfd] = (request["id"], pid)
        self.selector.register(pidfd, selectors.EVENT_READ)
        self.send({"op": "forked", "id": request["id"], "pid": pid})

    def reap(self, pidfd: int) -> None:
        request_id, pid = self.children.pop(pidfd)
        self.selector.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        self.send({"op": "exited", "id": request_id, "status": status})

    # -- in the child ------------------------------------------------------

    def become_worker(self, request: dict[str, Any], fds: list[int]) -> int:
        """
        In the forked child: its own descriptors, session and (under
        namespaces) sandbox, then the worker's C{main}.
        """
        from kcoral.worker import isolate

        parent = os.getppid()
        isolate.set_parent_death_signal(signal.SIGKILL)
        if os.getppid() != parent:
            return 1  # the template died meanwhile
        self.selector.close()
        self.sock.close()
        for pidfd in self.children:
            os.close(pidfd)
        _install_fds(fds, request["fds"])
        os.setsid()
        if self.args.isolation == "namespaces":
            self.isolate(
                os.path.join(SPACES, request["workspace"]),
                request.get("capture_bytes"),
                request.get("workspace_bytes"),
            )
        isolate.set_name("kcoral-worker")
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        _fresh_process_state()
        import kcoral.worker.__main__ as worker_main

        sys.argv = [worker_main.__file__, *request["argv"]]  # as a spawned worker's
        return worker_main.main(request["argv"])


def _install_fds(fds: list[int], targets: list[int]) -> None:
    """Put C{fds[i]} at C{targets[i]} and close every other descriptor."""
    moved = [fcntl_dupfd(fd, 256) for fd in fds]
    for fd, target in zip(moved, targets, strict=True):
        os.dup2(fd, target, inheritable=True)
    os.closerange(max(targets, default=-1) + 1, os.sysconf("SC_OPEN_MAX"))
    for fd in range(max(targets, default=-1) + 1):
        if fd not in targets:
            try:
                os.close(fd)
            except OSError:
                pass


def fcntl_dupfd(fd: int, lowest: int) -> int:
    """A duplicate of C{fd} numbered at least C{lowest}."""
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, lowest)


def _init(seccomp: bytes | None) -> None:
    """
    PID 1 of a forked worker's PID namespace: no descriptor, no
    capability, the worker filter; it reaps whatever is re-parented to it
    (C{SIGCHLD} ignored: the kernel reaps them) and waits to be killed,
    which ends every process of the namespace.  Never returns.
    """
    from kcoral.worker import isolate

    code = 1
    try:
        parent = os.getppid()
        isolate.set_parent_death_signal(signal.SIGKILL)
        if os.getppid() == parent:
            os.closerange(0, os.sysconf("SC_OPEN_MAX"))
            signal.signal(signal.SIGCHLD, signal.SIG_IGN)
            isolate.set_name("kcoral-init")
            isolate.drop_privileges(seccomp)
            while True:
                signal.pause()
    except BaseException:
        pass
    finally:
        os._exit(code)


def _mirror(pid: int, init: int | None = None) -> int:
    """
    The namespace maker's last job: wait for the worker (with no
    descriptor of its own), end its namespace by killing its C{init}
    (every process left in it dies before that C{init} can be reaped), then
    end the way the worker did.
    """
    os.closerange(0, os.sysconf("SC_OPEN_MAX"))
    _, status = os.waitpid(pid, 0)
    if init is not None:
        try:
            os.kill(init, signal.SIGKILL)
            os.waitpid(init, 0)
        except OSError:
            pass
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1


def _fresh_process_state() -> None:
    """
    What a new interpreter would not share with its siblings: signal
    dispositions back to the defaults, NumPy's global generator reseeded
    (the C{random} module reseeds itself after a fork).
    """
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # Python's own default
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    seccomp = None
    if args.seccomp_fd is not None:
        with os.fdopen(args.seccomp_fd, "rb") as f:
            seccomp = f.read()
    sock = socket.socket(fileno=TEMPLATE_FD)
    sock.setblocking(True)
    if args.isolation == "namespaces":
        from kcoral.worker.isolate import forbid_user_namespaces

        forbid_user_namespaces()
    preload(args.device, args.tensor_api)
    # Import-time objects are never garbage: out of every later collection,
    # so a child's own start-up collection is cheap and never touches (and
    # so copies) the pages it shares with the template.
    gc.collect()
    gc.freeze()
    from kcoral.worker.isolate import set_name

    set_name("kcoral-template")
    try:
        return Template(sock, args, seccomp).serve()
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
