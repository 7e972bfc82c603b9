"""
Attacks through the kernel's state shared beyond one worker (issue 32,
items 3 and 5): the key management calls, io_uring, userfaultfd and the
socket families a benchmark never needs.

Workers forked from one template share one user namespace and so one
user keyring: a key one request stored was found by the next request,
another client's, on a new worker; and keys count against the host user's
quota.  The seccomp filter now denies C{add_key}, C{request_key} and
C{keyctl}, C{io_uring_*}, C{userfaultfd}, C{AF_VSOCK} sockets and every
C{AF_NETLINK} protocol but C{NETLINK_ROUTE}.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Callable

import pytest

from kcoral.testing.live_server import ServerProcess
from tests.reliability.conftest import (
    assert_serves,
    body_of,
    post_from,
    requires_bwrap,
    run_program,
)

pytestmark = [pytest.mark.integration, requires_bwrap]

#: System call numbers, by machine.
SYSCALLS = {
    "x86_64": {"add_key": 248, "request_key": 249, "keyctl": 250},
    "aarch64": {"add_key": 217, "request_key": 218, "keyctl": 219},
}

#: Stores C{count} keys in the user and session keyrings; returns the
#: first outcome of each call.
PLANT = r"""
import ctypes
import errno
import json

NUMBERS = %(numbers)s
libc = ctypes.CDLL(None, use_errno=True)
KEY_SPEC_SESSION_KEYRING = -3
KEY_SPEC_USER_KEYRING = -4


def _errno(value):
    return "ok" if value >= 0 else errno.errorcode.get(ctypes.get_errno(), "?")


def plant(count):
    seen = {}
    secret = b"kcoral-keyring-secret"
    for keyring, name in ((KEY_SPEC_USER_KEYRING, "user"), (KEY_SPEC_SESSION_KEYRING, "session")):
        seen[name] = _errno(libc.syscall(
            NUMBERS["add_key"], b"user", b"kcoral-planted", secret, len(secret),
            ctypes.c_int(keyring),
        ))
    for i in range(count):
        description = b"kcoral-fill-%%d" %% i
        if libc.syscall(NUMBERS["add_key"], b"user", description, b"x" * 64, 64,
                        ctypes.c_int(KEY_SPEC_USER_KEYRING)) < 0:
            break
    seen["filled"] = i
    return json.dumps(seen)
"""

#: Looks for the planted key from another request and reads it.
STEAL = r"""
import ctypes
import errno
import json

NUMBERS = %(numbers)s
libc = ctypes.CDLL(None, use_errno=True)
KEYCTL_SEARCH = 10
KEYCTL_READ = 11


def steal():
    found = {}
    for keyring, name in ((-4, "user"), (-3, "session")):
        key = libc.syscall(NUMBERS["keyctl"], KEYCTL_SEARCH, ctypes.c_int(keyring), b"user",
                           b"kcoral-planted", 0)
        if key < 0:
            found[name] = errno.errorcode.get(ctypes.get_errno(), "?")
            continue
        buffer = ctypes.create_string_buffer(256)
        size = libc.syscall(NUMBERS["keyctl"], KEYCTL_READ, key, buffer, 256)
        found[name] = buffer.raw[:max(size, 0)].decode("latin-1")
    key = libc.syscall(NUMBERS["request_key"], b"user", b"kcoral-planted", None, 0)
    found["request_key"] = key if key >= 0 else errno.errorcode.get(ctypes.get_errno(), "?")
    return json.dumps(found)
"""

#: io_uring, userfaultfd and sockets of the denied families and protocols,
#: next to what must keep working.
SURFACE = r"""
import ctypes
import errno
import json
import os
import socket
import subprocess

libc = ctypes.CDLL(None, use_errno=True)
NUMBERS = %(numbers)s


def _errno(value):
    return "ok" if value >= 0 else errno.errorcode.get(ctypes.get_errno(), "?")


def _socket(family, kind, protocol):
    try:
        socket.socket(family, kind, protocol).close()
        return "ok"
    except OSError as e:
        return errno.errorcode.get(e.errno, "?")


def probe():
    out = {}
    params = ctypes.create_string_buffer(120)
    out["io_uring_setup"] = _errno(libc.syscall(NUMBERS["io_uring_setup"], 8, params))
    out["io_uring_enter"] = _errno(libc.syscall(NUMBERS["io_uring_enter"], -1, 0, 0, 0, None, 0))
    out["io_uring_register"] = _errno(libc.syscall(NUMBERS["io_uring_register"], -1, 0, None, 0))
    out["userfaultfd"] = _errno(libc.syscall(NUMBERS["userfaultfd"], os.O_CLOEXEC))
    out["vsock"] = _socket(40, socket.SOCK_STREAM, 0)
    out["netlink_audit"] = _socket(16, socket.SOCK_RAW, 9)
    out["netlink_uevent"] = _socket(16, socket.SOCK_RAW, 15)
    out["netlink_generic"] = _socket(16, socket.SOCK_RAW, 16)
    # What ordinary programs use keeps working.
    out["netlink_route"] = _socket(16, socket.SOCK_RAW, 0)
    out["interfaces"] = [name for _, name in socket.if_nameindex()]
    out["addrinfo"] = socket.getaddrinfo("127.0.0.1", 80, flags=socket.AI_ADDRCONFIG)[0][4][0]
    out["unix"] = _socket(socket.AF_UNIX, socket.SOCK_STREAM, 0)
    out["tcp"] = _socket(socket.AF_INET, socket.SOCK_STREAM, 0)
    out["subprocess"] = subprocess.run(["true"]).returncode
    return json.dumps(out)
"""

#: The rest of the numbers the probes need.
MORE_SYSCALLS = {
    "x86_64": {"io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
               "userfaultfd": 323},
    "aarch64": {"io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
                "userfaultfd": 282},
}  # fmt: skip

requires_known_machine = pytest.mark.skipif(
    platform.machine() not in SYSCALLS, reason=f"no system call numbers for {platform.machine()}"
)


def _numbers() -> str:
    machine = platform.machine()
    return repr({**SYSCALLS[machine], **MORE_SYSCALLS[machine]})


def _host_keys() -> int | None:
    """How many keys the kernel charges to this user (C{/proc/key-users})."""
    try:
        with open("/proc/key-users", encoding="ascii") as f:
            for line in f:
                uid, rest = line.split(":", 1)
                if int(uid) == os.getuid():
                    return int(rest.split()[0])
    except (OSError, ValueError):
        return None
    return 0


@pytest.fixture(scope="module", params=["fork", "spawn"])
def server(
    attacked_server: Callable[..., ServerProcess], request: pytest.FixtureRequest
) -> ServerProcess:
    # Two workers, forked from one template (the default) or spawned, one
    # request each.
    return attacked_server("--num-workers", "2", "--worker-start", request.param)


@requires_known_machine
def test_keyring_is_not_shared_and_not_filled(server: ServerProcess) -> None:
    """
    A key stored by one client's request is not found by another client's
    next request on a fresh worker; the attempt fails with C{EPERM} and
    charges nothing to the host user's key quota.
    """
    before = _host_keys()
    planted = post_from(
        server, "127.0.0.2", run_program(PLANT % {"numbers": _numbers()}, "plant", 500)
    )
    assert planted.status == 200, planted.body[:2000]
    body = body_of(planted)
    assert body["status"] == "COMPLETED", body
    seen = json.loads(body["results"]["out"]["value"])
    assert seen["user"] == "EPERM" and seen["session"] == "EPERM", seen
    after = _host_keys()
    if before is not None and after is not None:
        # The old server let the program add all 500 keys to the host's count.
        assert after - before < 100, (before, after)
    stolen = post_from(server, "127.0.0.3", run_program(STEAL % {"numbers": _numbers()}, "steal"))
    assert stolen.status == 200, stolen.body[:2000]
    body = body_of(stolen)
    assert body["status"] == "COMPLETED", body
    found = json.loads(body["results"]["out"]["value"])
    assert "kcoral-keyring-secret" not in json.dumps(found), found
    assert found == {"user": "EPERM", "session": "EPERM", "request_key": "EPERM"}, found
    assert_serves(server)


@requires_known_machine
def test_kernel_surface_denied(server: ServerProcess) -> None:
    """
    io_uring, userfaultfd, C{AF_VSOCK} and netlink other than
    C{NETLINK_ROUTE} are refused; interface lists, C{getaddrinfo},
    Unix and TCP sockets and subprocesses still work.
    """
    body = body_of(server.execute(run_program(SURFACE % {"numbers": _numbers()}, "probe")))
    assert body["status"] == "COMPLETED", body
    seen = json.loads(body["results"]["out"]["value"])
    for call in ("io_uring_setup", "io_uring_enter", "io_uring_register", "userfaultfd"):
        assert seen[call] == "EPERM", (call, seen)
    assert seen["vsock"] == "EAFNOSUPPORT", seen
    for protocol in ("netlink_audit", "netlink_uevent", "netlink_generic"):
        assert seen[protocol] == "EPROTONOSUPPORT", (protocol, seen)
    assert seen["netlink_route"] == "ok", seen
    assert seen["interfaces"] == ["lo"], seen
    assert seen["addrinfo"] == "127.0.0.1", seen
    assert seen["unix"] == "ok" and seen["tcp"] == "ok", seen
    assert seen["subprocess"] == 0, seen
    assert_serves(server)
