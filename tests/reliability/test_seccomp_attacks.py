"""
What a benchmark never needs is denied by the sandbox's seccomp filter
(issue 13, item 5): tracing processes, reading other processes' memory,
making namespaces.  Process creation still works.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from kcoral.testing.live_server import ServerProcess
from tests.reliability.conftest import assert_serves, body_of, requires_bwrap, run_program

pytestmark = [pytest.mark.integration, requires_bwrap]

PROBE = r"""
import ctypes
import errno
import json
import os
import subprocess

libc = ctypes.CDLL(None, use_errno=True)


class IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _result(value):
    return "ok" if value >= 0 else errno.errorcode.get(ctypes.get_errno(), "?")


def probe():
    out = {}
    # ptrace(PTRACE_TRACEME) succeeds for any process a filter lets through.
    out["ptrace"] = _result(libc.ptrace(0, 0, None, None))
    buffer = ctypes.create_string_buffer(b"x" * 16)
    local = IoVec(ctypes.cast(buffer, ctypes.c_void_p), 16)
    remote = IoVec(ctypes.cast(buffer, ctypes.c_void_p), 16)
    libc.process_vm_readv.argtypes = [
        ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    out["process_vm_readv"] = _result(
        libc.process_vm_readv(os.getpid(), ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    )
    out["unshare"] = _result(libc.unshare(0x00020000))
    out["subprocess"] = subprocess.run(["true"]).returncode
    out["fds"] = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
    return json.dumps(out)
"""


@pytest.fixture(scope="module")
def server(attacked_server: Callable[..., ServerProcess]) -> ServerProcess:
    return attacked_server("--num-workers", "1")


def test_seccomp_denies(server: ServerProcess) -> None:
    body = body_of(server.execute(run_program(PROBE, "probe")))
    assert body["status"] == "COMPLETED", body
    seen = json.loads(body["results"]["out"]["value"])
    assert seen["ptrace"] == "EPERM", seen
    assert seen["process_vm_readv"] == "EPERM", seen
    assert seen["unshare"] == "EPERM", seen
    assert seen["subprocess"] == 0, seen
    # The filter's fd went with bwrap.
    assert 9 not in seen["fds"], seen
    assert_serves(server)
