# -*- test-case-name: tests.unit.test_seccomp -*-
"""
The seccomp filter bubblewrap loads before it starts a worker.

A benchmark never needs to mount filesystems, trace processes, load BPF
programs or kernel modules, boot another kernel or make namespaces, and
each of those widens what a kernel bug can give a hostile program.  The
filter allows everything else (it is a deny list of what a benchmark never
needs, not a profile of what it does) and fails the denied calls with
C{EPERM}; C{clone3}, whose flags a filter cannot see, fails with C{ENOSYS},
so the C library falls back to C{clone}, whose namespace flags are checked.

It also keeps the kernel's shared state out of reach (issue 32): the key
management calls (C{add_key}, C{request_key}, C{keyctl}: workers forked
from one template share a user keyring, and keys count against the host
user's quota), C{io_uring} and C{userfaultfd} (kernel attack surface that
no toolchain here uses), and sockets of the C{AF_VSOCK} family and of every
C{AF_NETLINK} protocol but C{NETLINK_ROUTE} (the C library's
C{getifaddrs} and C{getaddrinfo}, and NCCL's interface discovery, ask the
sandbox's own loopback-only network namespace through it).

The server's nvcc compiles (L{kcoral.server.workers.compiles}) get a third
filter, the worker filter with C{socket} refused for every family
(L{COMPILE_FILTER}): their sandbox has no network namespace of its own
(making one costs each compile a network namespace's creation and teardown,
serialized in the kernel), so not being able to make a socket is what keeps
them off the host's network, its loopback and its abstract Unix sockets.
C{socketpair} stays allowed: a pair is connected only to itself.

The program is compiled by libseccomp through the C{pyseccomp} bindings and
handed to C{bwrap --seccomp FD}.
"""

from __future__ import annotations

import errno
import os
import tempfile
from typing import Any

#: System calls a worker may not make (those this architecture lacks are skipped).
DENIED = (
    # mounts
    "mount",
    "umount",
    "umount2",
    "pivot_root",
    "move_mount",
    "open_tree",
    "fsopen",
    "fsmount",
    "fsconfig",
    "fspick",
    "mount_setattr",
    # tracing other processes
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    # BPF programs
    "bpf",
    # another kernel, kernel modules
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    # namespaces
    "unshare",
    "setns",
    # the kernel keyrings (shared by every worker forked from one template,
    # charged to the host user's key quota)
    "add_key",
    "request_key",
    "keyctl",
    # io_uring, userfaultfd
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "userfaultfd",
)

#: C{socket} address families a worker may not use at all.
DENIED_FAMILIES = {"AF_VSOCK": 40}

#: C{AF_NETLINK}, and the one protocol of it a worker may use.
AF_NETLINK = 16
NETLINK_ROUTE = 0

#: C{clone} flags that make a namespace.
NAMESPACE_FLAGS = {
    "CLONE_NEWNS": 0x00020000,
    "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
    "CLONE_NEWTIME": 0x00000080,
}


class SeccompUnavailable(Exception):
    """The filter cannot be built here (no libseccomp or bindings)."""


#: What the worker template's own sandbox filter allows beyond a worker's:
#: each forked child makes its namespaces and mounts before it loads the
#: worker filter (L{kcoral.worker.isolate}).
TEMPLATE_ALLOWED = ("mount", "umount", "umount2", "unshare")


#: The file name of the compile filter in the server's scratch root.
COMPILE_FILTER = "compile-seccomp.bpf"


def build_rules(allow: tuple[str, ...] = (), *, sockets: bool = True) -> object:
    """
    BLOCKING: the filter as a C{pyseccomp.SyscallFilter}, ready to
    C{load()} in the calling process or to export.

    @param allow: names of L{DENIED} to leave allowed (L{TEMPLATE_ALLOWED}).
    @param sockets: whether C{socket} is allowed (less L{DENIED_FAMILIES}
        and netlink's other protocols); when not, every C{socket} call fails
        with C{EACCES} (the compile filter).
    @raise SeccompUnavailable: libseccomp or its bindings are missing.
    """
    try:
        import pyseccomp as sc
    except (ImportError, OSError) as e:  # no module, or no libseccomp.so
        raise SeccompUnavailable(f"{type(e).__name__}: {e}") from None
    deny = sc.ERRNO(errno.EPERM)
    rules = sc.SyscallFilter(sc.ALLOW)
    for name in DENIED:
        if name in allow or sc.resolve_syscall(sc.Arch.NATIVE, name) < 0:
            continue
        rules.add_rule(deny, name)
    for flag in NAMESPACE_FLAGS.values():
        rules.add_rule(deny, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    if sc.resolve_syscall(sc.Arch.NATIVE, "clone3") >= 0:
        rules.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    if not sockets:
        rules.add_rule(sc.ERRNO(errno.EACCES), "socket")
        if sc.resolve_syscall(sc.Arch.NATIVE, "socketcall") >= 0:
            # (Where the C library can still make sockets through the
            # multiplexer: s390x, and 32-bit architectures.)
            rules.add_rule(sc.ERRNO(errno.EACCES), "socketcall")
    elif sc.resolve_syscall(sc.Arch.NATIVE, "socket") >= 0:
        no_family = sc.ERRNO(errno.EAFNOSUPPORT)
        for family in DENIED_FAMILIES.values():
            rules.add_rule(no_family, "socket", sc.Arg(0, sc.EQ, family))
        rules.add_rule(
            sc.ERRNO(errno.EPROTONOSUPPORT),
            "socket",
            sc.Arg(0, sc.EQ, AF_NETLINK),
            sc.Arg(2, sc.NE, NETLINK_ROUTE),
        )
    return rules


def build_filter(allow: tuple[str, ...] = (), *, sockets: bool = True) -> bytes:
    """
    BLOCKING: the filter as a BPF program for C{bwrap --seccomp}
    (arguments as L{build_rules}).

    @raise SeccompUnavailable: libseccomp or its bindings are missing.
    """
    rules: Any = build_rules(allow, sockets=sockets)
    with tempfile.TemporaryFile() as f:
        rules.export_bpf(f)
        f.seek(0)
        return f.read()


def write_filter(
    directory: str | os.PathLike[str],
    name: str = "seccomp.bpf",
    allow: tuple[str, ...] = (),
    *,
    sockets: bool = True,
) -> str:
    """
    BLOCKING: write the filter (arguments as L{build_rules}) to
    C{directory}/C{name} (0600); return its path.
    """
    program = build_filter(allow, sockets=sockets)
    path = os.path.join(os.fspath(directory), name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(program)
    return path
