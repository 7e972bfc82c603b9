# -*- test-case-name: tests.unit.test_worker_engine -*-
"""
The reuse checks of a worker that serves more than one program
(spec/server.md §3.6): leftover processes, threads and open files, and the
process state (environment, C{sys.path}, workspace modules) restored after
each program.
"""

from __future__ import annotations

import importlib
import linecache
import os
import signal
import sys
import threading

import attrs

from kcoral.proctree import descendants_of


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _sandbox_processes() -> list[int] | None:
    """
    Inside a private PID namespace (bubblewrap), every process except the
    namespace's init and this worker: orphans re-parented to init included.
    C{None} when this worker does not run in its own PID namespace.
    """
    try:
        if os.readlink("/proc/self/ns/pid") == os.readlink("/proc/1/ns/pid"):
            with open("/proc/1/cmdline", "rb") as f:
                init = f.read().split(b"\0", 1)[0]
            if not init.endswith(b"bwrap"):
                return None
        else:
            return None
    except OSError:
        return None
    me = os.getpid()
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and int(e) not in (1, me)]


def terminate(pids: list[int]) -> None:
    """SIGKILL C{pids} and reap those that are our children."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    for pid in pids:
        try:
            os.waitpid(pid, 0)
        except OSError:
            pass  # not our child (re-parented to the sandbox's init)


def child_processes() -> list[int]:
    sandboxed = _sandbox_processes()
    if sandboxed is not None:
        return sandboxed
    descendants = descendants_of(os.getpid())
    if descendants is not None:
        return descendants
    try:
        import psutil
    except ImportError:
        pids = []
        me = str(os.getpid())
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[1] == me:
                pids.append(int(entry))
        return pids
    return [child.pid for child in psutil.Process().children(recursive=True)]


def _open_fds_under(root: str) -> list[str]:
    found = []
    try:
        entries = os.listdir("/proc/self/fd")
    except OSError:  # pragma: no cover - not Linux
        return []
    for entry in entries:
        try:
            target = os.readlink(f"/proc/self/fd/{entry}")
        except OSError:
            continue
        if _under(target, root):
            found.append(target)
    return found


@attrs.define
class ProcessState:
    """
    What a reused worker restores after each program: the environment,
    C{sys.path}, modules imported from the workspace; and the baseline that
    leftover threads are compared against.
    """

    environ: dict[str, str]
    path: list[str]
    modules: frozenset[str]
    threads: frozenset[int]
    #: Child processes that were there before the program (a worker has
    #: none; a test running the engine in its own process may).
    children: frozenset[int] = frozenset()

    @classmethod
    def snapshot(cls) -> ProcessState:
        return cls(
            environ=dict(os.environ),
            path=list(sys.path),
            modules=frozenset(sys.modules),
            threads=frozenset(t.ident or 0 for t in threading.enumerate()),
            children=frozenset(child_processes()),
        )

    def new_children(self) -> list[int]:
        """The child processes started since the snapshot (the program's)."""
        return [pid for pid in child_processes() if pid not in self.children]

    def leftovers(self, workspace: str, children: list[int] | None = None) -> list[str]:
        """
        Describe threads, child processes and open files the program left behind.

        @param children: the child processes already found, if the caller looked.
        """
        root = os.path.realpath(workspace)
        found = []
        threads = [t.name for t in threading.enumerate() if (t.ident or 0) not in self.threads]
        if threads:
            found.append(f"threads: {', '.join(threads)}")
        if children is None:
            children = self.new_children()
        if children:
            found.append(f"child processes: {children}")
        fds = _open_fds_under(root)
        if fds:
            found.append(f"open files: {fds}")
        return found

    def restore(self, workspace: str) -> None:
        """Put the environment, C{sys.path} and the module table back."""
        for name in list(os.environ):
            if name not in self.environ:
                del os.environ[name]
        for name, value in self.environ.items():
            if os.environ.get(name) != value:
                os.environ[name] = value
        sys.path[:] = self.path
        root = os.path.realpath(workspace)
        for name, module in list(sys.modules.items()):
            if name in self.modules:
                continue
            origin = getattr(module, "__file__", None)
            paths = list(getattr(module, "__path__", None) or [])
            if origin:
                paths.append(origin)
            if any(_under(os.path.realpath(p), root) for p in paths if isinstance(p, str)):
                del sys.modules[name]
        importlib.invalidate_caches()
        for key in [k for k in linecache.cache if k.startswith("<uploaded:")]:
            del linecache.cache[key]
