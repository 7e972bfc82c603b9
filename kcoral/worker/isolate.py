# -*- test-case-name: tests.integration.test_template -*-
"""
What a child forked by the worker template does to itself, under
bubblewrap, before it runs a worker: the fresh sandbox of one request.

The template's sandbox (C{bwrap --unshare-all --cap-add CAP_SYS_ADMIN
...}) gives the template capabilities inside its own user namespace only.
Each child uses them once, to leave everything the template (and every
earlier child) shares:

  1. L{enter_namespaces}: new mount, PID, network, IPC and UTS namespaces;
     every mount made private, so nothing done here reaches the template.
  2. L{mount_private_places}: the request's own workspace (a host
     directory the parent made for this worker, seen through the template's
     bound C{spaces} directory, or a bounded tmpfs with the same
     directories) over the workspace path, the spaces
     directory itself hidden, a fresh bounded tmpfs for captured output.
     C{/tmp}, C{/dev/shm}, home and the caches are links into the
     workspace, so they are the request's own too (where C{/tmp} cannot
     be a link, L{own_tmp} mounts the workspace's tmp there).
  3. The caller forks: the worker is PID 1 of the new PID namespace
     (everything it starts dies with it).  L{finish_in_pid_namespace}
     mounts a fresh C{/proc}, remounts every other mount read-only (the
     template sandbox's tmpfs root is one superblock shared by all
     children: anything writable there would leak between requests), then
     L{drop_privileges}: every capability (bounding, effective, permitted,
     inheritable, ambient), C{no_new_privs}, and the worker's seccomp filter
     (the one C{bwrap --seccomp} gives a spawned worker).

Linux only; every call raises L{IsolationError} with the failing step.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import os
import socket
import stat
import struct
from collections.abc import Sequence

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_RELATIME = 1 << 21
MS_STRICTATIME = 1 << 24

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
SECCOMP_MODE_FILTER = 2
LINUX_CAPABILITY_VERSION_3 = 0x20080522

#: Mount options that must be kept on a remount (the kernel locks them on
#: mounts a user namespace inherited) and their flags.
_KEPT_OPTIONS = {
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": MS_NOATIME,
    "nodiratime": MS_NODIRATIME,
    "relatime": MS_RELATIME,
    "strictatime": MS_STRICTATIME,
}

_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1


class IsolationError(Exception):
    """A step of the child's isolation failed; the child must not run a worker."""


_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise IsolationError(f"{what}: {os.strerror(err)}")


def _mount(
    source: str | None, target: str, fstype: str | None, flags: int, data: str | None
) -> None:
    _check(
        _libc.mount(
            None if source is None else source.encode(),
            target.encode(),
            None if fstype is None else fstype.encode(),
            ctypes.c_ulong(flags),
            None if data is None else data.encode(),
        ),
        f"mount {target}",
    )


def forbid_user_namespaces() -> None:
    """
    In the template, once: no process of its user namespace may make
    another one (what C{bwrap --disable-userns} does for a spawned worker;
    the seccomp filter denies it too).
    """
    try:
        with open("/proc/sys/user/max_user_namespaces", "w", encoding="ascii") as f:
            f.write("0")
    except OSError as e:
        raise IsolationError(f"user namespaces limit: {e}") from None


def enter_namespaces() -> None:
    """New mount, PID (for the next child), network, IPC and UTS namespaces."""
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")
    _mount(None, "/", None, MS_REC | MS_PRIVATE, None)
    _loopback_up()


def _loopback_up() -> None:
    """Bring C{lo} up in the new network namespace (a spawned worker has it up)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(s, _SIOCGIFFLAGS, request))[1]
        try:
            fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | _IFF_UP))
        except OSError as e:
            raise IsolationError(f"loopback up: {e}") from None


def mount_private_places(
    *,
    workspace_source: str,
    workspace: str,
    spaces: str,
    capture_dir: str | None,
    capture_bytes: int | None,
    workspace_bytes: int | None = None,
) -> None:
    """
    Bind this request's workspace (or, with C{workspace_bytes}, mount a
    tmpfs of that size there, with the directories the parent made in it),
    hide every other workspace, and give captured output a fresh tmpfs.
    """
    if workspace_bytes:
        # What the program writes stays in memory, bounded, and goes with
        # the sandbox: it never reaches the host's disk.  Its inodes are
        # bounded too (one per 8 KiB, at least 65,536).
        mode = stat.S_IMODE(os.stat(workspace_source).st_mode)
        inodes = max(1 << 16, int(workspace_bytes) // 8192)
        _mount(
            "tmpfs",
            workspace,
            "tmpfs",
            MS_NOSUID | MS_NODEV,
            f"size={int(workspace_bytes)},nr_inodes={inodes},mode={mode:o}",
        )
        _copy_directories(workspace_source, workspace)
    else:
        _mount(workspace_source, workspace, None, MS_BIND | MS_REC, None)
    # Hidden under an empty read-only tmpfs (the mount is locked: it came
    # with the template's namespace, so it cannot be unmounted; nor can the
    # worker unmount the tmpfs, without capabilities and under seccomp).
    _mount("tmpfs", spaces, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k")
    if capture_dir is not None:
        size = f"size={int(capture_bytes)}" if capture_bytes else None
        _mount(
            "tmpfs",
            capture_dir,
            "tmpfs",
            MS_NOSUID | MS_NODEV,
            ",".join(filter(None, [size, "mode=0700"])),
        )


def _copy_directories(source: str, target: str) -> None:
    """Make in C{target} the directories of C{source} (the reserved layout), with their modes."""
    for root, dirs, _ in os.walk(source):
        relative = os.path.relpath(root, source)
        for name in dirs:
            made = os.path.normpath(os.path.join(target, relative, name))
            os.mkdir(made)
            os.chmod(made, stat.S_IMODE(os.stat(os.path.join(root, name)).st_mode))


def own_tmp(private_tmp: str, links: Sequence[str]) -> None:
    """
    Put this request's tmp (C{private_tmp}, in its workspace) over each of
    C{links}, then the read-only runtime mounts that were beneath them back
    on top, read-only as they were.

    Where a checkout or virtualenv lies under C{/tmp}, the template's
    sandbox could not make C{/tmp} a link into the workspace: it is a bind
    of the template's own tmp, which every child would otherwise share.
    """
    for link in links:
        held = _top_mounts_below(link)
        fds = [os.open(point, os.O_PATH | os.O_CLOEXEC) for point in held]
        try:
            _mount(private_tmp, link, None, MS_BIND, None)
            for point, fd in zip(held, fds, strict=True):
                _make_mount_point(point, is_dir=stat.S_ISDIR(os.fstat(fd).st_mode))
                # (The magic link reaches the held mount, hidden under the
                # new tmp; a recursive bind brings its own submounts along.)
                _mount(f"/proc/self/fd/{fd}", point, None, MS_BIND | MS_REC, None)
        finally:
            for fd in fds:
                os.close(fd)
        for point, options in mounts():
            if _is_below(point, link):
                _remount_read_only(point, options)


def _is_below(path: str, root: str) -> bool:
    return path.startswith(root.rstrip("/") + "/")


def _top_mounts_below(link: str) -> list[str]:
    """The mount points under C{link} that no other mount under it holds."""
    below = list(dict.fromkeys(p for p, _ in mounts() if _is_below(p, link)))
    return [p for p in below if not any(_is_below(p, other) for other in below)]


def _make_mount_point(point: str, *, is_dir: bool) -> None:
    if is_dir:
        os.makedirs(point, exist_ok=True)
        return
    os.makedirs(os.path.dirname(point), exist_ok=True)
    os.close(os.open(point, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))


def set_parent_death_signal(signum: int) -> None:
    """Die with C{signum} when the parent (the namespace's maker) dies."""
    _check(_libc.prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(signum), 0, 0, 0), "PR_SET_PDEATHSIG")


def set_name(name: str) -> None:
    """
    The process name C{ps} and psutil show (a forked worker keeps the
    template's command line): C{kcoral-template}, C{kcoral-sandbox} (a
    child that made namespaces and waits for its worker), C{kcoral-worker}.
    """
    _libc.prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


def mounts() -> list[tuple[str, set[str]]]:
    """C{(mount point, per-mount options)} from C{/proc/self/mountinfo}, in order."""
    found = []
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")
            found.append((point, set(fields[5].split(","))))
    return found


def remount_read_only(writable: tuple[str, ...]) -> None:
    """
    Remount every mount read-only but those in C{writable} (and C{/proc}
    beneath them), keeping the options the kernel locks.
    """
    for point, options in mounts():
        if any(point == w or _is_below(point, w) for w in writable):
            continue
        if "ro" in options:
            continue
        _remount_read_only(point, options)


def _remount_read_only(point: str, options: set[str]) -> None:
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY
    for name, flag in _KEPT_OPTIONS.items():
        if name in options:
            flags |= flag
    _mount(None, point, None, flags, None)


def finish_in_pid_namespace(*, writable: tuple[str, ...], proc_read_only: bool) -> None:
    """
    As PID 1 of the new PID namespace: a fresh C{/proc} (read-only for a
    CPU worker, as bubblewrap gives a spawned one), the rest read-only.
    """
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
    if proc_read_only or "ro" in dict(mounts()).get("/proc", set()):
        # (The kernel also refuses a proc mount less restricted than the
        # one the namespace already shows.)
        flags |= MS_RDONLY
    _mount("proc", "/proc", "proc", flags, None)
    remount_read_only((*writable, "/proc"))


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


class _SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_ushort),
        ("jt", ctypes.c_ubyte),
        ("jf", ctypes.c_ubyte),
        ("k", ctypes.c_uint32),
    ]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _last_capability() -> int:
    try:
        with open("/proc/sys/kernel/cap_last_cap", encoding="ascii") as f:
            return int(f.read())
    except OSError:
        return 63


def drop_privileges(seccomp_program: bytes | None) -> None:
    """
    Drop every capability for good, set C{no_new_privs}, then load
    C{seccomp_program} (a BPF program as exported by libseccomp), if any.
    """
    for cap in range(_last_capability() + 1):
        result = _libc.prctl(PR_CAPBSET_DROP, ctypes.c_ulong(cap), 0, 0, 0)
        if result != 0 and ctypes.get_errno() != 22:  # EINVAL: no such capability
            _check(result, f"drop capability {cap} from the bounding set")
    _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = _CapHeader(LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    _check(_libc.capset(ctypes.byref(header), data), "capset")
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "PR_SET_NO_NEW_PRIVS")
    if seccomp_program:
        count = len(seccomp_program) // ctypes.sizeof(_SockFilter)
        program = (_SockFilter * count).from_buffer_copy(seccomp_program)
        fprog = _SockFprog(count, program)
        _check(
            _libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0),
            "load the seccomp filter",
        )
