"""
Fresh workers forked by a worker template (C{--worker-start fork}, the
default): what one request leaves behind cannot be seen by the next on the
same seat, under bubblewrap and under no sandbox; the template itself runs
no request's code and outlives a crashing child.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import pytest

from kcoral.testing.live_server import ServerProcess, servers_by_flags

pytestmark = pytest.mark.integration

requires_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="no bwrap")

SANDBOXES = [pytest.param("bubblewrap", marks=requires_bwrap), "none"]

#: The loopback port and SysV IPC key a request leaves in use.
PORT = 47123
IPC_KEY = 0x4B43

#: Leaves everything it can behind: a module global, a module, an
#: environment variable, a file in each writable place, a thread, a
#: process in a session of its own, a listening socket, a SysV shared
#: memory segment.  (The server sees the process and fails the request:
#: poison detection is unchanged.)
LEAVE = r"""
import ctypes, os, socket, subprocess, sys, threading, time, types

def leave(mark, ipc):
    import json as j
    j.KCORAL_MARK = mark
    sys.modules["kcoral_mark_module"] = types.ModuleType("kcoral_mark_module")
    os.environ["KCORAL_MARK"] = mark
    unwritable = []
    for base in ("/tmp", "/dev/shm", os.path.expanduser("~"), os.getcwd()):
        try:
            with open(os.path.join(base, "kcoral-mark-" + mark), "w") as f:
                f.write(mark)
        except OSError:
            unwritable.append(base)
    threading.Thread(target=time.sleep, args=(60,), name="kcoral-mark-" + mark).start()
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "kcoral-mark-" + mark],
                     start_new_session=True)
    try:
        s = socket.socket()
        s.bind(("127.0.0.1", PORT_NUMBER))
        s.listen()
        globals()["kept_socket"] = s
    except OSError:
        unwritable.append("port")
    libc = ctypes.CDLL(None, use_errno=True)
    if ipc and libc.shmget(IPC_KEY_NUMBER, 4096, 0o1666) < 0:
        unwritable.append("shm")
    return unwritable
""".replace("PORT_NUMBER", str(PORT)).replace("IPC_KEY_NUMBER", str(IPC_KEY))

#: Looks for what L{LEAVE} left.
LOOK = r"""
import ctypes, json, os, socket, sys, threading

def look(mark):
    import json as j
    found = {}
    if getattr(j, "KCORAL_MARK", None) is not None:
        found["global"] = j.KCORAL_MARK
    if "kcoral_mark_module" in sys.modules:
        found["module"] = True
    if "KCORAL_MARK" in os.environ:
        found["env"] = os.environ["KCORAL_MARK"]
    for base in ("/tmp", "/dev/shm", os.path.expanduser("~"), os.getcwd()):
        if os.path.exists(os.path.join(base, "kcoral-mark-" + mark)):
            found["file " + base] = True
    if any(t.name.startswith("kcoral-mark-") for t in threading.enumerate()):
        found["thread"] = True
    for pid in os.listdir("/proc"):
        try:
            with open(os.path.join("/proc", pid, "cmdline"), "rb") as f:
                if b"kcoral-mark-" + mark.encode() in f.read():
                    found["process"] = int(pid)
        except OSError:
            pass
    s = socket.socket()
    s.settimeout(1)
    if s.connect_ex(("127.0.0.1", PORT_NUMBER)) == 0:
        found["port"] = True
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.shmget(IPC_KEY_NUMBER, 0, 0) >= 0:
        found["shm"] = True
    return json.dumps(found)
""".replace("PORT_NUMBER", str(PORT)).replace("IPC_KEY_NUMBER", str(IPC_KEY))


def run(source: str, fn: str, *args: Any) -> dict[str, Any]:
    return {
        "instructions": [
            {"op": "upload", "id": "m", "kind": "module", "source": source},
            {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": fn},
            {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": list(args)},
            {"op": "return", "key": "out", "value": {"$ref": "r"}},
        ]
    }


def value(server: ServerProcess, program: dict[str, Any]) -> Any:
    response = server.execute(program)
    body = response.json()
    assert body["status"] == "COMPLETED", (body.get("error"), body.get("stderr"))
    return body["results"]["out"]["value"]


@pytest.fixture(scope="module")
def fresh_server() -> Iterator[Callable[..., ServerProcess]]:
    """One-worker CPU servers in fresh mode (a worker per request), forked."""
    yield from servers_by_flags(
        ["--device", "cpu", "--num-workers", "1", "--log-dir", "", "--disk-cache-dir", ""]
    )


def templates_of(server: ServerProcess) -> list[psutil.Process]:
    assert server.process is not None
    below = psutil.Process(server.process.pid).children(recursive=True)
    found = []
    for p in below:
        try:
            if p.name() == "kcoral-template" and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            pass
    return found


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_next_request_sees_nothing(
    fresh_server: Callable[..., ServerProcess], sandbox: str
) -> None:
    server = fresh_server("--sandbox", sandbox)
    health = server.health()
    assert health["worker_start"] == "fork", health
    assert health["templates"] == {"cpu": "ready"}
    # (Without a sandbox a segment would outlive the test on the host.)
    body = server.execute(run(LEAVE, "leave", "m1", sandbox != "none")).json()
    assert body["status"] == "FAILED", body
    assert "background processes" in body["error"]["message"], body["error"]
    found = json.loads(value(server, run(LOOK, "look", "m1")))
    if sandbox == "none":
        # No sandbox: the file system and the IPC namespace are the host's;
        # the interpreter, its environment and its processes are new.
        for key in list(found):
            if key.startswith("file "):
                found.pop(key)
        assert found == {}, found
        return
    assert found == {}, found


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_template_runs_no_request(fresh_server: Callable[..., ServerProcess], sandbox: str) -> None:
    """
    The template's working directory is its own, it holds no request's
    files, and a crashing child leaves it serving.
    """
    server = fresh_server("--sandbox", sandbox)
    [template] = templates_of(server)
    before = template.pid
    crash = server.execute(run("import os\ndef f():\n    os._exit(3)\n", "f")).json()
    assert crash["status"] != "COMPLETED"
    assert value(server, run("def f():\n    return 5\n", "f")) == 5
    [template] = templates_of(server)
    assert template.pid == before
    if sandbox == "none":
        cwd = template.cwd()
        assert os.path.basename(os.path.dirname(cwd)) == "template-cpu", cwd
    for f in template.open_files():
        assert "-g" not in os.path.basename(os.path.dirname(f.path)), f.path


@requires_bwrap
def test_child_cannot_reach_template_or_siblings(
    fresh_server: Callable[..., ServerProcess],
) -> None:
    """
    Under bubblewrap a worker is PID 2 of a namespace of its own, under its
    own init: no other pid exists, and it cannot signal that init.
    """
    server = fresh_server("--sandbox", "bubblewrap")
    source = (
        "import json, os\n"
        "def f():\n"
        "    pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\n"
        "    reached = []\n"
        "    for pid in range(2, 64):\n"
        "        try:\n"
        "            os.kill(pid, 0)\n"
        "            reached.append(pid)\n"
        "        except OSError:\n"
        "            pass\n"
        "    return json.dumps([os.getpid(), os.getppid(), pids, reached])\n"
    )
    pid, ppid, pids, reached = json.loads(value(server, run(source, "f")))
    # (Its parent, the namespace's maker, is outside the namespace.)
    assert (pid, ppid) == (2, 0)
    assert pids == [1, 2] and reached == [2], (pids, reached)


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_killed_template_restarts(fresh_server: Callable[..., ServerProcess], sandbox: str) -> None:
    """
    A template killed while serving takes its workers with it; requests
    keep being served (spawned workers meanwhile) and the template comes
    back.
    """
    import signal
    import time

    server = fresh_server("--sandbox", sandbox, "--worker-termination-grace-seconds", "1")
    [template] = templates_of(server)
    health = server.health()
    before = {w["pid"] for w in health["workers"] + health.get("spares", [])}
    template.send_signal(signal.SIGKILL)
    # Its idle workers and spares die with it; the pool replaces them (a
    # request that took one in between would be answered "worker crashed",
    # as for any worker killed from outside).
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        health = server.health()
        workers = health["workers"] + health.get("spares", [])
        if all(w.get("pid") not in before for w in workers) and all(
            w["state"] == "idle" for w in health["workers"]
        ):
            break
        time.sleep(0.1)
    for i in range(3):
        assert value(server, run("def f(x):\n    return x + 1\n", "f", i)) == i + 1
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        health = server.health()
        if health["worker_start"] == "fork":
            break
        time.sleep(0.2)
    assert health["templates"] == {"cpu": "ready"}, health
    [again] = templates_of(server)
    assert again.pid != template.pid
    assert value(server, run("def f():\n    return 7\n", "f")) == 7
