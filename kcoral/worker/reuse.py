# -*- test-case-name: tests.unit.test_worker_engine -*-
"""
The reuse checks of a worker that serves more than one program
(spec/server.md §3.6): leftover processes, threads and open files, and the
process state (environment, C{sys.path}, workspace modules) restored after
each program.
"""

from __future__ import annotations

import builtins
import linecache
import os
import signal
import sys
import threading
from collections.abc import Container, Mapping
from itertools import compress, repeat
from operator import is_not
from typing import Any

import attrs

from kcoral.proctree import descendants_of


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _sandbox_processes() -> list[int] | None:
    """
    Inside a private PID namespace (bubblewrap's, or a forked worker's
    under C{kcoral-init}), every process except the namespace's init and
    this worker: orphans re-parented to init included.
    C{None} when this worker does not run in its own PID namespace.
    """
    try:
        if os.getpid() == 1 or os.readlink("/proc/self/ns/pid") != os.readlink("/proc/1/ns/pid"):
            return None
        with open("/proc/1/cmdline", "rb") as f:
            init = f.read().split(b"\0", 1)[0]
        with open("/proc/1/comm", "rb") as f:
            name = f.read().strip()
        # bwrap's own init, or a forked worker's (kcoral.worker.template).
        if not init.endswith(b"bwrap") and name != b"kcoral-init":
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


def child_processes(quiet_tasks: Container[str] = ()) -> list[int]:
    """
    This worker's descendants (in a bubblewrap PID namespace, every other
    process in it).

    @param quiet_tasks: this process's threads whose children need not be
        read (L{ProcessState.quiet_tasks}).
    """
    sandboxed = _sandbox_processes()
    if sandboxed is not None:
        return sandboxed
    descendants = descendants_of(os.getpid(), quiet_tasks)
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


def _open_files() -> dict[int, tuple[int, int]]:
    """Each open descriptor's file, as C{(st_dev, st_ino)}."""
    files = {}
    try:
        entries = os.listdir("/proc/self/fd")
    except OSError:  # pragma: no cover - not Linux
        return {}
    for entry in entries:
        fd = int(entry)
        try:
            st = os.fstat(fd)
        except OSError:
            continue  # the listing's own descriptor, closed by now
        files[fd] = (st.st_dev, st.st_ino)
    return files


def _open_fds_under(root: str, known: Mapping[int, tuple[int, int]]) -> list[str]:
    """
    The paths under C{root} that open descriptors name.  A descriptor open
    on the same file as in C{known} (the baseline's L{_open_files}) is not
    resolved: a GPU worker holds dozens of the driver's, and resolving each
    link costs several times an C{fstat}.
    """
    found = []
    for fd, file in _open_files().items():
        if known.get(fd) == file:
            continue
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if _under(target, root):
            found.append(target)
    return found


def _quiet_tasks(python_threads: set[int]) -> frozenset[str]:
    """
    This process's threads that run no Python: the driver's, the thread
    pools' (C{/proc/self/task} minus C{python_threads}, native ids).
    """
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:  # pragma: no cover - not Linux
        return frozenset()
    return frozenset(task for task in tasks if int(task) not in python_threads)


def _python_threads() -> set[int]:
    """
    The native ids of this process's Python threads.  The calling thread's
    and the main task's are asked of the kernel: in a process forked from a
    template, Python 3.11 keeps the template's id for the thread that forked.
    """
    ids = {t.native_id for t in threading.enumerate() if t.native_id is not None}
    ids.update((threading.get_native_id(), os.getpid()))
    return ids


@attrs.define
class ProcessState:
    """
    What a reused worker restores after each program: the environment,
    C{sys.path}, the module table and the import system's path finders; and
    the baseline that leftover threads are compared against.
    """

    environ: dict[str, str]
    path: list[str]
    #: The module table before the first program, by name.
    modules: dict[str, Any]
    threads: frozenset[int]
    #: Child processes that were there before the program (a worker has
    #: none; a test running the engine in its own process may).
    children: frozenset[int] = frozenset()
    #: The baseline's threads that run no Python (the CUDA driver's, the
    #: thread pools'): a program starts processes from Python threads, its
    #: own or the worker's, so these threads' children are not read after
    #: each program.  Under bubblewrap every process of the namespace is
    #: listed instead.
    quiet_tasks: frozenset[str] = frozenset()
    #: The baseline's open descriptors and their files (L{_open_files}).
    files: dict[int, tuple[int, int]] = attrs.field(factory=dict)
    #: C{sys.path_importer_cache} keys before the first program.
    path_finders: frozenset[str] = frozenset()
    #: The builtins namespace before the first program (C{None}: left alone).
    builtin_names: dict[str, Any] | None = None
    #: The baseline's modules and those a program imported from outside its
    #: workspace (found so once: later restores skip them), by name.
    _known: dict[str, Any] = attrs.field(factory=dict)
    #: Whether a baseline path finder's directory lies in a workspace, by
    #: C{(key, workspace)}: the realpath is resolved once.
    _finder_inside: dict[tuple[str, str], bool] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        self._known.update(self.modules)

    @classmethod
    def snapshot(cls) -> ProcessState:
        return cls(
            environ=dict(os.environ),
            path=list(sys.path),
            modules=dict(sys.modules),
            path_finders=frozenset(sys.path_importer_cache),
            builtin_names=dict(vars(builtins)),
            threads=frozenset(t.ident or 0 for t in threading.enumerate()),
            children=frozenset(child_processes()),
            quiet_tasks=_quiet_tasks(_python_threads()),
            files=_open_files(),
        )

    def new_children(self) -> list[int]:
        """The child processes started since the snapshot (the program's)."""
        # A quiet thread that runs Python since (a callback's) is read again.
        quiet = self.quiet_tasks - {str(tid) for tid in _python_threads()}
        return [pid for pid in child_processes(quiet) if pid not in self.children]

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
        fds = _open_fds_under(root, self.files)
        if fds:
            found.append(f"open files: {fds}")
        return found

    def restore(self, workspace: str) -> None:
        """
        Put the environment, C{sys.path}, the module table, the path
        finders and the builtins back.

        A module the worker had before is put back if a program replaced or
        removed it; one a program imported from its workspace is dropped;
        one it imported from elsewhere stays (a library), checked once.
        Path finders of directories in the workspace, or new since the
        baseline, are dropped, so the next program's imports read its own
        files (what L{importlib.invalidate_caches} does, for those
        directories only: invalidating every finder cost a GPU worker a
        third of a millisecond a program).
        """
        for name in list(os.environ):
            if name not in self.environ:
                del os.environ[name]
        for name, value in self.environ.items():
            if os.environ.get(name) != value:
                os.environ[name] = value
        sys.path[:] = self.path
        root = os.path.realpath(workspace)
        table = sys.modules
        for name, module in self._changed_modules():
            if name in self.modules:
                table[name] = self.modules[name]
            elif module is None or _from_workspace(module, root):
                # (A new None entry is an import the program blocked.)
                del table[name]
            else:
                self._known[name] = module
        _fill_missing(table, self.modules)
        finders = sys.path_importer_cache
        for key in [k for k in finders if not self._baseline_finder_outside(k, root)]:
            del finders[key]
        for key in [k for k in linecache.cache if k.startswith("<uploaded:")]:
            del linecache.cache[key]
        if self.builtin_names is not None:
            _put_back(vars(builtins), self.builtin_names)

    def _changed_modules(self) -> list[tuple[str, Any]]:
        """The module table's entries that are neither the baseline's nor known libraries."""
        table = sys.modules
        return [(name, table[name]) for name in _not_identical(table, self._known)]

    def _baseline_finder_outside(self, key: Any, root: str) -> bool:
        """Whether path finder C{key} is the baseline's, for a directory outside C{root}."""
        if not isinstance(key, str) or key not in self.path_finders:
            return False
        inside = self._finder_inside.get((key, root))
        if inside is None:
            inside = self._finder_inside[(key, root)] = _under(os.path.realpath(key), root)
        return not inside


def _not_identical(namespace: dict[str, Any], reference: dict[str, Any]) -> list[str]:
    """
    The names in C{namespace} whose object is not C{reference}'s (or that
    C{reference} lacks), compared by identity in C: nothing of a program's
    runs, and a GPU worker's module table holds thousands of entries (a
    loop in Python cost a quarter of a millisecond).
    """
    names = list(namespace)
    looked_up = map(reference.get, names, repeat(_UNKNOWN))
    return list(compress(names, map(is_not, namespace.values(), looked_up)))


def _fill_missing(namespace: dict[str, Any], baseline: dict[str, Any]) -> None:
    """Put back the entries of C{baseline} that C{namespace} lost."""
    if not baseline.keys() <= namespace.keys():
        for name, value in baseline.items():
            namespace.setdefault(name, value)


def _put_back(namespace: dict[str, Any], baseline: dict[str, Any]) -> None:
    """
    Make C{namespace} hold exactly C{baseline}'s objects again (a program
    may replace, add or delete builtins: C{print}, C{__import__}, ...).
    """
    for name in _not_identical(namespace, baseline):
        if name in baseline:
            namespace[name] = baseline[name]
        else:
            del namespace[name]
    _fill_missing(namespace, baseline)


#: What a name the restore does not know maps to (C{None} is a valid entry
#: of the module table: an import a program blocked).
_UNKNOWN = object()


def _from_workspace(module: Any, root: str) -> bool:
    """Whether C{module} was loaded from a file or package directory under C{root}."""
    origin = getattr(module, "__file__", None)
    try:
        paths = list(getattr(module, "__path__", None) or [])
    except Exception:  # a broken namespace path: treat it as the program's
        return True
    if origin:
        paths.append(origin)
    return any(_under(os.path.realpath(p), root) for p in paths if isinstance(p, str))
