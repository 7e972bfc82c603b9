"""Tests for L{kcoral.server.sandbox.seccomp} and its place in the bwrap command line."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from kcoral.server.sandbox.bubblewrap import (
    COMPILE_PROC_FILES,
    SECCOMP_FD,
    SHELL,
    BubblewrapSandbox,
)
from kcoral.server.sandbox.seccomp import build_filter, write_filter


def test_filter_is_a_bpf_program() -> None:
    """A classic BPF program: whole 8-byte instructions."""
    program = build_filter()
    assert program and len(program) % 8 == 0


def test_written_private(tmp_path: Path) -> None:
    path = write_filter(tmp_path)
    assert Path(path).read_bytes() == build_filter()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_command_loads_filter(tmp_path: Path) -> None:
    """
    With a filter, a shell opens it on the seccomp fd and execs bwrap with
    C{--seccomp}; without one the command is bwrap itself.
    """
    work = tmp_path / "seat" / "work"
    work.mkdir(parents=True)
    plain = BubblewrapSandbox([])
    executable, argv, _ = plain.command(
        python="/usr/bin/python3", worker_args=[], work_dir=work, gpu_devices=[]
    )
    assert "--seccomp" not in argv
    filtered = BubblewrapSandbox([], seccomp_path=str(tmp_path / "f.bpf"))
    executable, argv, _ = filtered.command(
        python="/usr/bin/python3", worker_args=[], work_dir=work, gpu_devices=[]
    )
    assert executable == SHELL
    assert argv[:2] == [SHELL, "-c"]
    assert argv[2] == f'exec "$0" "$@" {SECCOMP_FD}<{tmp_path / "f.bpf"}'
    assert argv[4:6] == ["--seccomp", str(SECCOMP_FD)]


def test_compile_filter_refuses_every_socket() -> None:
    """
    The compile filter (C{sockets=False}) fails C{socket} with C{EACCES} for
    every family, Unix and netlink included; a C{socketpair} still works.
    The worker filter lets an C{AF_INET} socket through.
    """
    assert build_filter(sockets=False) != build_filter()
    script = (
        "import errno, socket, sys\n"
        "from kcoral.server.sandbox.seccomp import build_rules\n"
        "build_rules(sockets=sys.argv[1] == 'worker').load()\n"
        "out = []\n"
        "for family, kind in ((socket.AF_INET, socket.SOCK_STREAM),\n"
        "                     (socket.AF_INET6, socket.SOCK_DGRAM),\n"
        "                     (socket.AF_UNIX, socket.SOCK_STREAM),\n"
        "                     (socket.AF_NETLINK, socket.SOCK_RAW)):\n"
        "    try:\n"
        "        socket.socket(family, kind).close()\n"
        "        out.append('ok')\n"
        "    except OSError as e:\n"
        "        out.append(errno.errorcode[e.errno])\n"
        "a, b = socket.socketpair()\n"
        "a.send(b'x')\n"
        "out.append(b.recv(1).decode())\n"
        "print(' '.join(out))\n"
    )
    compile_run = subprocess.run(
        [sys.executable, "-c", script, "compile"], capture_output=True, text=True, timeout=60
    )
    assert compile_run.stdout.split() == ["EACCES"] * 4 + ["x"], compile_run.stderr
    worker_run = subprocess.run(
        [sys.executable, "-c", script, "worker"], capture_output=True, text=True, timeout=60
    )
    assert worker_run.stdout.split()[0] == "ok", worker_run.stderr


def _pairs(argv: list[str], flag: str) -> list[tuple[str, str]]:
    return [(argv[i + 1], argv[i + 2]) for i, arg in enumerate(argv) if arg == flag]


def test_compile_command_shares_the_network_behind_the_compile_filter(tmp_path: Path) -> None:
    """
    With a compile filter, an nvcc compile's sandbox keeps the host's
    network namespace (C{--share-net}), loads that filter, and has no procfs
    but the one file of L{COMPILE_PROC_FILES}; the workspace is bound and
    the given environment is the one used.
    """
    work = tmp_path / "seat" / "work"
    work.mkdir(parents=True)
    filters = {"seccomp_path": str(tmp_path / "w.bpf")}
    sandbox = BubblewrapSandbox([], **filters, compile_seccomp_path=str(tmp_path / "c.bpf"))
    executable, argv, env = sandbox.compile_command(["/usr/bin/true"], work, {"PATH": "/bin"})
    assert executable == SHELL
    assert argv[2] == f'exec "$0" "$@" {SECCOMP_FD}<{tmp_path / "c.bpf"}'
    assert "--share-net" in argv and "--unshare-all" in argv
    assert "--proc" not in argv
    assert "/proc" not in [argv[i + 1] for i, a in enumerate(argv) if a == "--remount-ro"]
    shown = [(a, b) for a, b in _pairs(argv, "--ro-bind") if b.startswith("/proc")]
    assert shown == [(p, p) for p in COMPILE_PROC_FILES if os.path.exists(p)]
    assert (os.path.realpath(work), "/work") in _pairs(argv, "--bind")
    assert env == {"PATH": "/bin"}
    # Workers and the Python compile keep their own network namespace and /proc.
    for _, other, _ in (
        sandbox.run_command(["/usr/bin/true"], work),
        sandbox.command(python="/usr/bin/python3", worker_args=[], work_dir=work, gpu_devices=[]),
    ):
        assert "--share-net" not in other and "--proc" in other
        assert other[2] == f'exec "$0" "$@" {SECCOMP_FD}<{tmp_path / "w.bpf"}'


def test_compile_command_with_the_filter_on_a_mapped_descriptor(tmp_path: Path) -> None:
    """
    With C{filter_fd}, the command is bwrap itself, told to read its filter
    from L{SECCOMP_FD} (which the caller maps to a descriptor of
    C{compile_filter}): no shell, the same sandbox otherwise.
    """
    work = tmp_path / "seat" / "work"
    work.mkdir(parents=True)
    sandbox = BubblewrapSandbox([], compile_seccomp_path=str(tmp_path / "c.bpf"))
    assert sandbox.compile_filter == str(tmp_path / "c.bpf")
    executable, argv, env = sandbox.compile_command(
        ["/usr/bin/true"], work, {"PATH": "/bin"}, filter_fd=True
    )
    _, shelled, _ = sandbox.compile_command(["/usr/bin/true"], work, {"PATH": "/bin"})
    assert executable == argv[0] == sandbox.bwrap
    assert argv[1:3] == ["--seccomp", str(SECCOMP_FD)]
    assert argv == shelled[3:]
    assert env == {"PATH": "/bin"}
    assert BubblewrapSandbox([]).compile_filter is None
    unshared = BubblewrapSandbox([], compile_seccomp_path=str(tmp_path / "c.bpf"), share_net=False)
    assert unshared.compile_filter is None


def test_compile_command_without_a_compile_filter(tmp_path: Path) -> None:
    """
    Without the compile filter (no libseccomp) or a bwrap that takes
    C{--share-net}, a compile's sandbox is L{run_command}'s: a network
    namespace of its own.
    """
    work = tmp_path / "seat" / "work"
    work.mkdir(parents=True)
    for sandbox in (
        BubblewrapSandbox([]),
        BubblewrapSandbox([], compile_seccomp_path=str(tmp_path / "c.bpf"), share_net=False),
    ):
        _, argv, env = sandbox.compile_command(["/usr/bin/true"], work, {"PATH": "/bin"})
        assert argv == sandbox.run_command(["/usr/bin/true"], work)[1]
        assert "--share-net" not in argv and "--proc" in argv
        assert env == {"PATH": "/bin"}
