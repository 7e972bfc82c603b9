# -*- test-case-name: tests.unit.test_sandbox,tests.integration.test_sandbox_probe -*-
"""
Worker filesystem isolation with bubblewrap (server spec section 6).

L{BubblewrapSandbox} is the L{ISandbox} under which a worker runs in
C{bwrap}: its workspace is bound at C{/work}, runtime dependencies are
read-only, the network and other namespaces are private (section 6.2).  It
turns "run C{python -m kcoral.worker ...} in this seat" into the
executable, argv and environment handed to C{reactor.spawnProcess}.

The server's nvcc compiles run in a sandbox of their own
(L{BubblewrapSandbox.compile_command}): a worker's, less the network
namespace and C{/proc}, with a filter that refuses C{socket}.

C{command} and C{worker_path} are cheap: the read-only mount plan is
resolved once (by the start-up probe, L{kcoral.server.sandbox.probe}, in a
thread) and cached.  The seat's host side is L{kcoral.server.sandbox.seats}.
"""

from __future__ import annotations

import glob
import os
import shlex
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import ClassVar

import attrs
from zope.interface import implementer

from kcoral.server.sandbox.interface import ISandbox, SandboxError, package_root
from kcoral.server.sandbox.seats import (
    COMPILE_SUBDIRS,
    RESERVED,
    RESERVED_SUBDIRS,
    KeepTree,
    empty_directory,
    is_clean_layout,
    layout_paths,
    make_layout,
    make_seat,
)

#: Where the seat's workspace appears inside the sandbox.
WORKSPACE = "/work"

#: Where workers see the shared compile cache under bubblewrap.
COMPILE_CACHE = "/var/cache/kcoral/compile"

#: The worker's private, size-limited tmpfs for captured output, and the
#: variable that tells the worker (C{kcoral.worker.capture.CAPTURE_DIR_ENV}).
CAPTURE_DIR = "/run/kcoral/output"
CAPTURE_DIR_ENV = "KCORAL_CAPTURE_DIR"

#: The fd bwrap reads the seccomp filter from, and the shell that opens it.
SECCOMP_FD = 9
SHELL = "/bin/sh"

#: The fd on which a worker template reads the worker seccomp filter.
WORKER_FILTER_FD = 8  # one digit: sh redirects only fds 0-9

#: Where a worker template's sandbox sees every workspace (the pool's
#: root; L{kcoral.worker.template.SPACES}).
TEMPLATE_SPACES = "/run/kcoral/spaces"

#: Capabilities a worker template keeps inside its own user namespace.
TEMPLATE_CAPABILITIES = ("CAP_SYS_ADMIN", "CAP_NET_ADMIN", "CAP_SETPCAP", "CAP_SYS_RESOURCE")

#: Runtime directories bound read-only when they exist, in this order.
RUNTIME_PATHS = (
    "/usr",
    "/bin",
    "/sbin",
    "/lib",
    "/lib64",
    "/sys",
    "/opt/nvidia/nsight-compute",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/alternatives",
    "/etc/localtime",
)

#: Device nodes every sandboxed worker gets.
PSEUDO_DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom", "/dev/full")

#: NVIDIA control nodes a GPU worker gets besides its own C{/dev/nvidia<minor>}.
GPU_CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
GPU_CAPS_GLOB = "/dev/nvidia-caps/nvidia-cap*"

#: Where the directory holding the C{kcoral} package is bound when its own
#: path would be hidden by the workspace mount (a checkout under C{/work}).
PACKAGE_MOUNT = "/run/kcoral/package"

#: Where a runtime path (the server's virtualenv or Python) is bound, one
#: numbered directory each, when its own path would be hidden by the
#: workspace mount: a checkout or virtualenv under C{/work} on the host.
RUNTIME_MOUNT = "/run/kcoral/runtime"

#: The line the startup probe prints on success.
PROBE_MARKER = "kcoral-sandbox-ready"

#: The one file of C{/proc} an nvcc compile's sandbox shows (the host's,
#: read-only): the toolchain's allocators read it to choose how they give
#: memory back.
COMPILE_PROC_FILES = ("/proc/sys/vm/overcommit_memory",)

#: The startup probe's program: run as C{python -I -S -c PROBE_PROGRAM} inside the sandbox.
PROBE_PROGRAM = (
    "import os\n"
    f"assert os.getcwd() == {WORKSPACE!r}, os.getcwd()\n"
    f"with open(os.path.join({RESERVED!r}, 'probe'), 'w') as f:\n"
    "    f.write('ok')\n"
    f"print({PROBE_MARKER!r}, flush=True)\n"
)


# -- helpers ---------------------------------------------------------------


def server_import_dirs(
    environ: Mapping[str, str] | None = None, user_site: str | None = None
) -> tuple[str, ...]:
    """
    The directories this server imports from that a sandboxed worker would
    lose: the C{PYTHONPATH} entries (for instance C{pip install --target
    DIR}) and the user site-packages when Python uses it.  The sandbox binds
    them read-only and puts them on the worker's C{PYTHONPATH}.

    @param environ: the environment; L{os.environ} by default.
    @param user_site: the user site-packages directory when it is in use;
        by default C{site.USER_SITE} when C{site.ENABLE_USER_SITE}.
    """
    env = os.environ if environ is None else environ
    dirs = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if user_site is None:
        import site

        if site.ENABLE_USER_SITE and site.USER_SITE:
            user_site = site.USER_SITE
    if user_site:
        dirs.append(user_site)
    found = [os.path.abspath(d) for d in dirs if os.path.isdir(d)]
    return tuple(dict.fromkeys(found))


def _covered_tmp_links(mounts: Sequence[_Mount]) -> list[str]:
    """
    C{/tmp} and C{/var/tmp} where a read-only runtime path lies beneath
    (a checkout or virtualenv there): bwrap cannot make such a directory a
    link into the workspace, so it is a bind of the workspace's tmp instead.
    """
    return [link for link in ("/tmp", "/var/tmp") if any(_is_within(m.dest, link) for m in mounts)]


def _is_within(path: str, root: str) -> bool:
    """Whether C{path} is C{root} or lies beneath it (both absolute and normalized)."""
    if root == "/":
        return True
    return path == root or path.startswith(root.rstrip("/") + "/")


def _gpu_node(device: str) -> str:
    device = str(device)
    if device.startswith("/"):
        return os.path.normpath(device)
    return f"/dev/nvidia{int(device)}"


def _to_path_strings(paths: Iterable[str | os.PathLike[str]]) -> tuple[str, ...]:
    return tuple(os.fspath(p) for p in paths)


@attrs.frozen
class _Mount:
    """A read-only bind: C{source} is resolved, C{dest} is the path as named."""

    source: str
    dest: str
    is_dir: bool
    #: Goes on the worker's C{PYTHONPATH} (the server imports from it).
    on_path: bool = False
    #: The C{kcoral} package directory itself; its parent goes first on
    #: the worker's C{PYTHONPATH}.
    is_package: bool = False
    #: The host path as the server names it, where C{dest} differs from it
    #: (a runtime path moved out of the workspace's way).
    named: str = ""

    @property
    def host_path(self) -> str:
        """The path on the host that this mount shows."""
        return self.named or self.dest


# -- bubblewrap ------------------------------------------------------------


@implementer(ISandbox)
@attrs.define
class BubblewrapSandbox:
    """
    Workers run under C{bwrap} with a private C{/work} (server spec 6.2).

    @ivar readonly_paths: extra paths bound read-only at the same location
        (C{--sandbox-readonly-path}); directories also go on C{PYTHONPATH}.
    @ivar bwrap: the bwrap executable (a name looked up on C{PATH}, or a path).
    @ivar disable_userns: whether to pass C{--disable-userns}; the startup
        probe sets it from C{bwrap --help}.
    @ivar executable: the resolved bwrap path, set by the probe (else C{bwrap}).
    """

    name: ClassVar[str] = "bubblewrap"
    reserved: ClassVar[str] = RESERVED
    isolates_devices: ClassVar[bool] = True

    readonly_paths: tuple[str, ...] = attrs.field(converter=_to_path_strings)
    bwrap: str = attrs.field(default="bwrap", kw_only=True)
    disable_userns: bool = attrs.field(default=True, kw_only=True)
    executable: str | None = attrs.field(default=None, kw_only=True)
    #: The server's own directories (logs, caches) that no worker may see:
    #: hidden under an empty tmpfs where a read-only mount would show them.
    hidden_paths: tuple[str, ...] = attrs.field(
        default=(), kw_only=True, converter=_to_path_strings
    )
    #: The compiled seccomp filter (L{kcoral.server.sandbox.seccomp}) bwrap loads
    #: before it starts the worker, or C{None} for none.
    seccomp_path: str | None = attrs.field(default=None, kw_only=True)
    #: The filter of nvcc compiles' sandboxes (the worker filter with
    #: C{socket} refused, L{kcoral.server.sandbox.seccomp.COMPILE_FILTER}),
    #: or C{None}: without it a compile's sandbox keeps a network namespace
    #: of its own (L{compile_command}).
    compile_seccomp_path: str | None = attrs.field(default=None, kw_only=True)
    #: Whether bwrap takes C{--share-net} (the startup probe sets it from
    #: C{bwrap --help}).
    share_net: bool = attrs.field(default=True, kw_only=True)
    #: The filter of worker templates' sandboxes (the worker filter less
    #: L{kcoral.server.sandbox.seccomp.TEMPLATE_ALLOWED}), or C{None} for none.
    template_seccomp_path: str | None = attrs.field(default=None, kw_only=True)
    #: Bytes of the worker's private tmpfs at L{CAPTURE_DIR} that holds its
    #: captured stdout and stderr (C{None}: capture into the workspace).
    capture_bytes: int | None = attrs.field(default=None, kw_only=True)
    #: Bytes of the private tmpfs each one-request worker gets as its
    #: workspace (C{--workspace-bytes}), so that what a program writes
    #: there never reaches the host's disk; C{None}: the seat's host
    #: directory, bound (what a reused worker gets: the parent empties it
    #: between programs).
    workspace_bytes: int | None = attrs.field(default=None, kw_only=True)
    #: A host directory shared read-write by every worker at L{COMPILE_CACHE}
    #: (the compile cache), or C{None}.
    compile_cache: str | None = attrs.field(default=None, kw_only=True)
    _mounts: tuple[_Mount, ...] | None = attrs.field(default=None, init=False, repr=False)
    _device_nodes: dict[tuple[str, ...], tuple[str, ...]] = attrs.field(
        factory=dict, init=False, repr=False
    )

    # ISandbox

    def prepare_seat(self, seat_dir: Path) -> Path:
        return make_seat(seat_dir, RESERVED_SUBDIRS)

    def clear_workspace(self, work_dir: Path) -> None:
        empty_directory(work_dir, self._mount_points_in_workspace())
        make_layout(os.fspath(work_dir), RESERVED_SUBDIRS)

    def workspace_is_clean(self, work_dir: Path) -> bool:
        # (Mount points kept inside the private tmp directory make it
        # non-empty: such a workspace is always cleared.)
        return is_clean_layout(work_dir, RESERVED_SUBDIRS)

    def _mount_points_in_workspace(self) -> KeepTree:
        """
        Where the sandbox mounts read-only paths inside the workspace: under
        the private tmp directory, when /tmp is bound there because a runtime
        path lives under /tmp.
        """
        tree: KeepTree = {}
        for m in self.resolve_mounts():
            for link in ("/tmp", "/var/tmp"):
                if _is_within(m.dest, link) and m.dest != link:
                    node = tree.setdefault(RESERVED, {}).setdefault("tmp", {})
                    parts = os.path.relpath(m.dest, link).split(os.sep)
                    for part in parts[:-1]:
                        node = node.setdefault(part, {})
                    node[parts[-1]] = {}
        return tree

    def worker_path(self, work_dir: Path) -> str:
        return WORKSPACE

    def command(
        self, *, python: str, worker_args: list[str], work_dir: Path, gpu_devices: list[str]
    ) -> tuple[str, list[str], dict[str, str]]:
        return self._command(
            [python, "-m", "kcoral.worker", *worker_args], work_dir, list(gpu_devices)
        )

    def template_command(
        self,
        *,
        python: str,
        template_args: list[str],
        template_dir: Path,
        spaces_dir: Path,
        gpu_devices: list[str],
    ) -> tuple[str, list[str], dict[str, str]]:
        """
        The template's sandbox: a worker's, plus L{TEMPLATE_CAPABILITIES}
        inside its own user namespace
        (each child uses them to make its own namespaces and mounts, then
        drops them), every workspace at L{TEMPLATE_SPACES}, the template
        seccomp filter, and the worker filter on L{WORKER_FILTER_FD} for the
        children to load themselves.
        """
        tail = [python, "-m", "kcoral.worker.template", *template_args]
        tail += ["--isolation", "namespaces", "--workspace", WORKSPACE]
        covered = _covered_tmp_links(self.resolve_mounts())
        if covered:
            # The template's /tmp is a bind of its own tmp, not a link: each
            # child puts its workspace's tmp there (kcoral.worker.isolate).
            tail += ["--private-tmp", f"{WORKSPACE}/{RESERVED}/tmp"]
            for link in covered:
                tail += ["--bound-tmp", link]
        if self.capture_bytes is not None:
            tail += ["--capture-dir", CAPTURE_DIR]
        if self.seccomp_path is not None:
            tail += ["--seccomp-fd", str(WORKER_FILTER_FD)]
        return self._command(tail, template_dir, list(gpu_devices), spaces=spaces_dir)

    # building the command line

    def resolve_mounts(self) -> tuple[_Mount, ...]:
        """
        BLOCKING (a few C{stat}s): the read-only mount plan, computed once.

        @raise SandboxError: an extra read-only path does not exist, or a
            runtime path resolves to C{/}.
        """
        if self._mounts is None:
            self._mounts = self._plan_mounts()
        return self._mounts

    def _plan_mounts(self) -> tuple[_Mount, ...]:
        mounts: list[_Mount] = []
        seen: set[str] = set()
        pkg = package_root()
        candidates: list[tuple[str, str]] = [(p, "runtime") for p in RUNTIME_PATHS]
        candidates += [(sys.prefix, "runtime"), (sys.base_prefix, "runtime"), (pkg, "package")]
        candidates += [(p, "extra") for p in self.readonly_paths]
        candidates += [(p, "import") for p in server_import_dirs()]
        for path, kind in candidates:
            dest = os.path.abspath(path)
            named = ""
            if kind == "extra" and not os.path.exists(dest):
                raise SandboxError(f"sandbox read-only path does not exist: {dest}")
            if not os.path.exists(dest):
                continue
            source = os.path.realpath(dest)
            if kind == "import" and source == os.path.realpath(pkg):
                continue  # kcoral's own checkout: mounted as the package
            if source == "/" or dest == "/":
                raise SandboxError(f"read-only runtime path contains sandbox workspaces: {dest}")
            if kind == "import" and any(_is_within(dest, m.host_path) for m in mounts):
                # Already visible below a runtime mount (a venv's site-packages).
                continue
            if any(m.named == dest for m in mounts):
                continue  # the same runtime path named twice, already moved
            if _is_within(dest, WORKSPACE) or _is_within(WORKSPACE, dest):
                if kind == "import":
                    raise SandboxError(
                        f"the server imports from {dest} (PYTHONPATH or user site-packages), "
                        f"which overlaps the sandbox workspace {WORKSPACE}: workers could not "
                        "import from it; install the packages elsewhere and name that "
                        "directory with --sandbox-readonly-path"
                    )
                if kind == "extra":
                    raise SandboxError(
                        f"read-only runtime path overlaps the sandbox workspace {WORKSPACE}: {dest}"
                    )
                if kind == "runtime":
                    # A virtualenv under /work: shown elsewhere, and the
                    # worker's interpreter named by its path there (L{path_inside}),
                    # so that Python still finds the venv's pyvenv.cfg.
                    named = dest
                    dest = f"{RUNTIME_MOUNT}/{sum(1 for m in mounts if m.named)}"
                else:
                    dest = PACKAGE_MOUNT
            if kind == "package":
                # Only the package directory: the rest of a checkout (its
                # logs, caches, configuration) stays out of the sandbox.
                source = os.path.join(source, "kcoral")
                dest = os.path.join(dest, "kcoral")
            if dest in seen:
                continue
            seen.add(dest)
            mounts.append(
                _Mount(
                    source=source,
                    dest=dest,
                    is_dir=os.path.isdir(source),
                    on_path=kind == "import" and os.path.isdir(source),
                    is_package=kind == "package",
                    named=named,
                )
            )
        return tuple(mounts)

    def path_inside(self, path: str) -> str:
        """
        BLOCKING (as L{resolve_mounts}): the host's C{path} as the sandbox
        shows it, moved with a runtime mount that the workspace would hide.
        """
        for m in self.resolve_mounts():
            if m.named and _is_within(path, m.named):
                return os.path.normpath(os.path.join(m.dest, os.path.relpath(path, m.named)))
        return path

    def _gpu_nodes(self, gpu_devices: Sequence[str]) -> tuple[str, ...]:
        key = tuple(str(d) for d in gpu_devices)
        nodes = self._device_nodes.get(key)
        if nodes is None:
            found: list[str] = []
            wanted = [_gpu_node(d) for d in key]
            wanted += list(GPU_CONTROL_NODES) + sorted(glob.glob(GPU_CAPS_GLOB))
            for node in wanted:
                if node not in found and os.path.exists(node):
                    found.append(node)
            nodes = self._device_nodes[key] = tuple(found)
        return nodes

    def _command(
        self,
        tail: list[str],
        work_dir: Path,
        gpu_devices: list[str],
        spaces: Path | None = None,
        bind_work: bool = False,
        compile_only: bool = False,
        filter_fd: bool = False,
    ) -> tuple[str, list[str], dict[str, str]]:
        """
        The command line of one sandbox.  C{compile_only}: nvcc's sandbox
        (L{compile_command}): the host's network namespace, no C{/proc} but
        L{COMPILE_PROC_FILES}, and L{compile_seccomp_path}'s filter, read
        from L{SECCOMP_FD} as the spawner maps it when C{filter_fd}.
        """
        mounts = self.resolve_mounts()
        tail = [self.path_inside(tail[0]), *tail[1:]]
        host_work = os.path.abspath(os.fspath(work_dir))
        resolved_work = os.path.realpath(host_work)
        for m in mounts:
            if _is_within(host_work, m.source) or _is_within(resolved_work, m.source):
                raise SandboxError(f"read-only runtime path contains sandbox workspaces: {m.dest}")

        executable = self.executable or self.bwrap
        argv = [executable, "--unshare-all", "--unshare-user", "--die-with-parent"]
        if compile_only:
            # No network namespace to make and tear down per compile; the
            # compile filter refuses every socket instead.
            argv.append("--share-net")
        argv += ["--new-session", "--cap-drop", "ALL"]
        if spaces is not None:
            for cap in TEMPLATE_CAPABILITIES:
                argv += ["--cap-add", cap]
        if self.disable_userns and spaces is None:
            # (A template cannot take it: its children could not mount a
            # fresh /proc in the nested user namespace it makes; the
            # template sets the same limit itself, L{kcoral.worker.isolate}.)
            argv.append("--disable-userns")
        private_tmp = os.path.join(resolved_work, RESERVED, "tmp")
        covered = _covered_tmp_links(mounts)
        for link in covered:
            # A runtime path lives under /tmp (a checkout or virtualenv there):
            # a symlink cannot replace a directory that holds mounts, so bind
            # the private tmp directory at /tmp first and mount on top of it.
            argv += ["--bind", private_tmp, link]
        for m in mounts:
            argv += ["--ro-bind", m.source, m.dest]
        for path in self._masked(mounts):
            # Server files below a bound path (a log directory inside a
            # virtualenv or a --target directory): an empty tmpfs over them.
            argv += ["--size", "4096", "--tmpfs", path, "--remount-ro", path]
        if self.workspace_bytes and spaces is None and not bind_work:
            # A bounded tmpfs of the sandbox's own, with the layout the
            # parent makes on the host: nothing written there reaches the
            # host's disk, and it goes with the sandbox.
            argv += ["--size", str(self.workspace_bytes), "--perms", "0700", "--tmpfs", WORKSPACE]
            for path in layout_paths(WORKSPACE):
                argv += ["--perms", "0700", "--dir", path]
        else:
            argv += ["--bind", resolved_work, WORKSPACE]
        if spaces is not None:
            argv += ["--bind", os.path.realpath(os.fspath(spaces)), TEMPLATE_SPACES]
        if compile_only:
            # No procfs: with the host's network namespace, /proc/net would
            # show the host's sockets and connections.
            for path in COMPILE_PROC_FILES:
                if os.path.exists(path):
                    argv += ["--ro-bind", path, path]
            argv += ["--dir", "/dev"]
        else:
            argv += ["--proc", "/proc", "--dir", "/dev"]
        for dev in PSEUDO_DEVICES:
            argv += ["--dev-bind", dev, dev]
        nodes = self._gpu_nodes(gpu_devices) if gpu_devices else ()
        for node in nodes:
            argv += ["--dev-bind", node, node]
        private = f"{WORKSPACE}/{RESERVED}"
        mounted = [m.dest for m in mounts] + list(nodes)
        for link in ("/tmp", "/var/tmp"):
            # bwrap cannot make the link where a mount already made a directory.
            if link not in covered and not any(_is_within(dest, link) for dest in mounted):
                argv += ["--symlink", f"{private}/tmp", link]
        argv += ["--symlink", f"{private}/shm", "/dev/shm"]
        argv += ["--symlink", "/proc/self/fd", "/dev/fd"]
        for fd, stream in enumerate(("stdin", "stdout", "stderr")):
            argv += ["--symlink", f"/proc/self/fd/{fd}", f"/dev/{stream}"]
        overrides = self._environment(mounts)
        for key, value in overrides.items():
            argv += ["--setenv", key, value]
        env = {k: v for k, v in os.environ.items() if isinstance(v, str)}
        env.update(overrides)
        if not gpu_devices and spaces is None and not compile_only:
            # (A template's children each mount a /proc of their own,
            # read-only for CPU workers too.)
            argv += ["--remount-ro", "/proc"]
        if self.compile_cache is not None:
            # Read-only: the parent writes every entry (compiles run in a
            # sandbox of their own, kcoral.server.workers.compiles).
            argv += ["--ro-bind", self.compile_cache, COMPILE_CACHE]
        if self.capture_bytes is not None:
            # Captured output stays in the sandbox's memory, bounded: a
            # program printing without end fills this, not the host's disk.
            argv += ["--size", str(self.capture_bytes), "--tmpfs", CAPTURE_DIR]
            argv += ["--setenv", CAPTURE_DIR_ENV, CAPTURE_DIR]
            env[CAPTURE_DIR_ENV] = CAPTURE_DIR
        argv += ["--chdir", WORKSPACE, "--remount-ro", "/", "--", *tail]
        if spaces is not None and self.seccomp_path is not None:
            # The template's own filter lets its children mount and unshare;
            # each child loads the worker filter (read from this fd) itself.
            script = f'exec "$0" "$@" {WORKER_FILTER_FD}<{shlex.quote(self.seccomp_path)}'
            if self.template_seccomp_path is not None:
                script += f" {SECCOMP_FD}<{shlex.quote(self.template_seccomp_path)}"
                argv = [argv[0], "--seccomp", str(SECCOMP_FD), *argv[1:]]
            argv = [SHELL, "-c", script, *argv]
            executable = SHELL
        elif compile_only and filter_fd and self.compile_seccomp_path is not None:
            # The spawner maps SECCOMP_FD to the filter (childFDs): bwrap
            # reads and closes it before nvcc starts; no shell opens it.
            argv = [argv[0], "--seccomp", str(SECCOMP_FD), *argv[1:]]
        elif filter_path := self.compile_seccomp_path if compile_only else self.seccomp_path:
            # bwrap reads the filter from an fd: a shell opens the file on
            # SECCOMP_FD and execs bwrap (same pid), so the fd exists only
            # for bwrap, which closes it before the worker starts.
            script = f'exec "$0" "$@" {SECCOMP_FD}<{shlex.quote(filter_path)}'
            argv = [SHELL, "-c", script, argv[0], "--seccomp", str(SECCOMP_FD), *argv[1:]]
            executable = SHELL
        return executable, argv, env

    def _masked(self, mounts: Sequence[_Mount]) -> list[str]:
        """The L{hidden_paths} that some read-only mount would show."""
        masked = []
        for hidden in self.hidden_paths:
            for path in dict.fromkeys((os.path.abspath(hidden), os.path.realpath(hidden))):
                if not os.path.isdir(path):
                    continue
                for m in mounts:
                    if _is_within(path, m.source) and m.is_dir:
                        inside = os.path.join(m.dest, os.path.relpath(path, m.source))
                        if inside not in masked:
                            masked.append(os.path.normpath(inside))
        return masked

    def _environment(self, mounts: Sequence[_Mount]) -> dict[str, str]:
        private = f"{WORKSPACE}/{RESERVED}"
        pkg_dest = next(
            (os.path.dirname(m.dest) for m in mounts if m.is_package),
            os.path.abspath(package_root()),
        )
        extras = {os.path.abspath(p) for p in self.readonly_paths}
        pythonpath = [pkg_dest]
        for m in mounts:
            if (m.on_path or (m.dest in extras and m.is_dir)) and m.dest not in pythonpath:
                pythonpath.append(m.dest)
        return {
            "HOME": f"{private}/home",
            "TMPDIR": f"{private}/tmp",
            "TMP": f"{private}/tmp",
            "TEMP": f"{private}/tmp",
            "XDG_CACHE_HOME": f"{private}/cache",
            "CUDA_CACHE_PATH": f"{private}/cuda",
            "TRITON_CACHE_DIR": f"{private}/triton",
            "TORCH_EXTENSIONS_DIR": f"{private}/extensions",
            "TVM_FFI_CACHE_DIR": f"{private}/cache/tvm-ffi",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONPATH": ":".join(pythonpath),
            "PYTHONNOUSERSITE": "1",
        }

    def run_command(
        self, tail: list[str], work_dir: Path, env: dict[str, str] | None = None
    ) -> tuple[str, list[str], dict[str, str]]:
        """
        The command line that runs C{tail} (no GPUs) in this sandbox at
        C{work_dir}; with C{env}, bwrap and so C{tail} get that environment
        (plus the sandbox's own C{--setenv}s) instead of the server's.
        C{work_dir} is bound at L{WORKSPACE} even with L{workspace_bytes}
        (the server's compiles: it writes the source there and reads the
        image back, L{kcoral.server.workers.compiles}).
        """
        executable, argv, full = self._command(tail, work_dir, [], bind_work=True)
        return executable, argv, full if env is None else dict(env)

    def prepare_compile_seat(self, seat_dir: Path) -> Path:
        """
        BLOCKING: a seat for an nvcc compile (L{compile_command}): its
        workspace with only the reserved C{tmp} directory (C{/tmp} and
        C{TMPDIR}), which is all nvcc writes to besides its output.
        """
        return make_seat(seat_dir, COMPILE_SUBDIRS)

    @property
    def compile_filter(self) -> str | None:
        """
        The filter L{compile_command}C{(..., filter_fd=True)} expects on
        L{SECCOMP_FD} (the caller maps it to a descriptor of this file, as
        C{spawnProcess}'s C{childFDs} do), or C{None}: nothing to map.
        """
        if self.compile_seccomp_path is None or not self.share_net:
            return None
        return self.compile_seccomp_path

    def compile_command(
        self, tail: list[str], work_dir: Path, env: dict[str, str], *, filter_fd: bool = False
    ) -> tuple[str, list[str], dict[str, str]]:
        """
        The command line that runs nvcc's C{tail} as the only program of a
        compile's sandbox (L{kcoral.server.workers.compiles}), with C{env}
        as L{run_command}'s.

        With L{compile_seccomp_path} (and a bwrap that takes
        C{--share-net}), the sandbox has every namespace of a worker's but
        the network's: it stays in the host's, and the compile filter
        refuses every C{socket} call, so nothing in it reaches a network, the
        host's loopback or its abstract Unix sockets; it has no C{/proc}
        (which would show the host's sockets) but L{COMPILE_PROC_FILES}.
        Making and tearing down a network namespace costs each compile
        about 11 ms, serialized in the kernel.  Without the filter it is
        L{run_command}'s sandbox.

        The filter reaches bwrap on L{SECCOMP_FD}: opened by a shell that
        then execs bwrap, or, with C{filter_fd}, mapped there by the caller
        from a descriptor of L{compile_filter} (one exec less per compile).
        """
        if self.compile_filter is None:
            return self.run_command(tail, work_dir, env=env)
        executable, argv, _ = self._command(
            tail, work_dir, [], bind_work=True, compile_only=True, filter_fd=filter_fd
        )
        return executable, argv, dict(env)

    def probe_command(self, work_dir: Path, gpu_devices: list[str]) -> list[str]:
        """The startup probe's argv for one device configuration."""
        tail = [sys.executable, "-I", "-S", "-c", PROBE_PROGRAM]
        return self._command(tail, work_dir, list(gpu_devices))[1]
