"""
Attacks on a worker forked by a worker template under bubblewrap (the
default C{--worker-start fork}): the template's sandbox gives it
capabilities inside its user namespace so that each child can make its own
namespaces and mounts; the child must have none of them left, and nothing
of the template's when it runs the program.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from kcoral.server.sandbox.bubblewrap import CAPTURE_DIR, WORKSPACE
from kcoral.testing.live_server import ServerProcess
from tests.reliability.conftest import assert_serves, body_of, requires_bwrap, run_program

pytestmark = [pytest.mark.integration, requires_bwrap]

ATTACK = r"""
import ctypes, json, os, stat

libc = ctypes.CDLL(None, use_errno=True)

def attempt(result):
    return "ok" if result == 0 else os.strerror(ctypes.get_errno())

def attack():
    found = {}
    found["remount_root_rw"] = attempt(libc.mount(None, b"/", None, ctypes.c_ulong(32 | 4096), None))
    found["mount_tmpfs"] = attempt(libc.mount(b"tmpfs", b"/tmp", b"tmpfs", ctypes.c_ulong(0), None))
    found["umount_spaces"] = attempt(libc.umount2(b"/run/kcoral/spaces", 2))
    found["unshare_user"] = attempt(libc.unshare(0x10000000))
    found["unshare_mount"] = attempt(libc.unshare(0x00020000))
    found["unshare_net"] = attempt(libc.unshare(0x40000000))
    sockets = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink("/proc/self/fd/" + name)
        except OSError:
            continue
        if target.startswith("socket:"):
            sockets[name] = target
    found["sockets"] = sockets
    status = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp"):
                status[key] = rest.strip()
    found["status"] = status
    writable = []
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    for point in points:
        if point.startswith("/proc") or point.startswith("/dev/"):
            continue
        try:
            if not stat.S_ISDIR(os.stat(point).st_mode):
                continue
            path = os.path.join(point, ".kcoral-attack")
            with open(path, "w") as out:
                out.write("x")
            os.unlink(path)
            writable.append(point)
        except OSError:
            pass
    found["writable"] = sorted(set(writable))
    # Where a runtime path under /tmp made /tmp a mount, it is the
    # workspace's own tmp, mounted there.
    found["tmp_is_workspace_tmp"] = os.path.samefile("/tmp", "/work/.kcoral/tmp")
    try:
        found["spaces"] = os.listdir("/run/kcoral/spaces")
    except OSError as e:
        found["spaces"] = str(e)
    return json.dumps(found)
"""


def test_forked_child_has_nothing_left(attacked_server: Callable[..., ServerProcess]) -> None:
    server = attacked_server("--num-workers", "1")
    assert server.health()["worker_start"] == "fork"
    response = server.execute(run_program(ATTACK, "attack"))
    body = body_of(response)
    assert body["status"] == "COMPLETED", body
    found = json.loads(body["results"]["out"]["value"])
    for key in ("remount_root_rw", "mount_tmpfs", "umount_spaces"):
        assert found[key] == "Operation not permitted", (key, found[key])
    for key in ("unshare_user", "unshare_mount", "unshare_net"):
        assert found[key] != "ok", (key, found[key])
    # The descriptor socket of the control channel and nothing else: the
    # template's socket never reaches a child.
    assert list(found["sockets"]) == ["5"], found["sockets"]
    status = found["status"]
    for key in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(status[key], 16) == 0, (key, status[key])
    assert status["NoNewPrivs"] == "1"
    assert status["Seccomp"] == "2"
    # Only its own workspace and its own captured-output tmpfs are writable
    # (and /tmp where a checkout under /tmp made it the workspace's tmp
    # mounted there rather than a link to it).
    allowed = {WORKSPACE, CAPTURE_DIR}
    if found["tmp_is_workspace_tmp"]:
        allowed |= {"/tmp", "/var/tmp"}
    assert set(found["writable"]) <= allowed, found["writable"]
    assert found["spaces"] == [], found["spaces"]
    assert_serves(server)
