# -*- test-case-name: tests.integration.test_sandbox_escapes -*-
"""
Escape attempts against a real kcoral server running its workers under the
real bubblewrap sandbox (server spec section 6, section 13 items 79-88).

Every attempt is made by uploaded Python code. The uploaded functions catch
the exception they expect and return its name (and errno name), so the
request itself COMPLETES and the test asserts on what the program saw. After
each attempt the server must still be healthy: C{/health} answers C{ok} and a
normal program still runs.

Two servers are shared per module: one in the default mode (one request per
worker, two workers) and one in reuse mode (C{--max-requests-per-worker 0},
one worker, so consecutive requests land on the same seat) with a
C{--sandbox-readonly-path}. The server's temporary directory (C{TMPDIR}) is
a test directory, so the test knows the host paths of the seats.

docs/security.md's escape-attempt table points at these tests.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import random
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from kcoral.testing.live_server import Response, ServerProcess, sha256

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed"),
]

#: The uploaded module. Every function returns a JSON string.
PROBES = r'''
import errno
import json
import os
import socket
import subprocess
import sys
import tempfile
import time


def _err(e):
    return [type(e).__name__, errno.errorcode.get(e.errno or 0, "")]


def try_write(path):
    try:
        with open(path, "w") as f:
            f.write("escaped")
        return json.dumps("written")
    except OSError as e:
        return json.dumps(_err(e))


def try_mkdir(path):
    try:
        os.mkdir(path)
        return json.dumps("created")
    except OSError as e:
        return json.dumps(_err(e))


def try_list(path):
    try:
        return json.dumps(sorted(os.listdir(path)))
    except OSError as e:
        return json.dumps(_err(e))


def try_read(path):
    try:
        with open(path, "rb") as f:
            return json.dumps(f.read(100).decode("latin-1"))
    except OSError as e:
        return json.dumps(_err(e))


def exists(paths):
    return json.dumps({p: os.path.lexists(p) for p in paths})


def processes():
    """Every process visible in /proc: [pid, cwd, argv0]."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            cwd = os.readlink(f"/proc/{name}/cwd")
        except OSError as e:
            cwd = _err(e)
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            argv0 = os.path.basename(argv[0].decode())
        except OSError as e:
            argv0 = _err(e)
        out.append([int(name), cwd, argv0])
    return json.dumps(out)


def write_secret_and_sleep(name, secret, seconds):
    for d in ("/work", "/tmp", "/dev/shm", "/work/.kcoral/home"):
        with open(os.path.join(d, name), "w") as f:
            f.write(secret)
    time.sleep(seconds)
    return json.dumps(os.path.exists(name))


_SKIP = {"/proc", "/sys", "/usr", "/lib", "/lib64", "/bin", "/sbin"}


def search_secret(name, secret, host_paths):
    """Look everywhere we can for another worker's secret file."""
    skip = _SKIP | {os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix)}
    found = []
    for root, dirs, files in os.walk("/"):
        dirs[:] = [d for d in dirs if os.path.join(root, d) not in skip]
        if name in files or name in dirs:
            found.append(os.path.join(root, name))
    # Other processes' working directories, roots and open files.
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        for sub in ("cwd", "root"):
            p = f"/proc/{pid}/{sub}/{name}"
            if os.path.lexists(p):
                try:
                    with open(p) as f:
                        if f.read() == secret:
                            found.append(p)
                except OSError:
                    pass
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    if os.readlink(f"/proc/{pid}/fd/{fd}").endswith(name):
                        found.append(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    pass
        except OSError:
            pass
    for p in host_paths:
        if os.path.lexists(p):
            found.append(p)
    return json.dumps({"found": found, "seats": {p: try_list_raw(p) for p in host_paths}})


def try_list_raw(path):
    try:
        return sorted(os.listdir(path))
    except OSError as e:
        return _err(e)


def try_connect(host, port):
    s = socket.socket()
    s.settimeout(3)
    try:
        s.connect((host, port))
        return json.dumps("connected")
    except OSError as e:
        return json.dumps(_err(e))
    finally:
        s.close()


def try_connect_unix(path):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(3)
    try:
        s.connect(path)
        return json.dumps("connected")
    except OSError as e:
        return json.dumps(_err(e))
    finally:
        s.close()


def plant_symlink(target, name):
    os.symlink(target, name)
    return json.dumps(os.readlink(name))


def leave_background(seconds):
    p = subprocess.Popen(["sleep", str(seconds)])
    return json.dumps(p.pid)


def leave_orphan(seconds):
    """Double fork: the sleeper is reparented to the sandbox's init, not a child of ours."""
    subprocess.run(["sh", "-c", f"sleep {seconds} >/dev/null 2>&1 &"], check=True)
    for _ in range(200):  # the backgrounded shell may not have exec'd sleep yet
        found = sandbox_sleepers(seconds)
        if found:
            break
        time.sleep(0.01)
    return json.dumps(found)


def sandbox_sleepers(seconds):
    """PIDs (in this sandbox) running C{sleep seconds}."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if argv[:2] == [b"sleep", str(seconds).encode()]:
                found.append(int(name))
    return found


def sandbox_sleepers_json(seconds):
    return json.dumps(sandbox_sleepers(seconds))


def nested_symlink_folder(target):
    os.mkdir("out")
    with open("out/plain.txt", "w") as f:
        f.write("plain")
    os.symlink(target, "out/link")
    return json.dumps(sorted(os.listdir("out")))


def write_reserved():
    written = []
    for p in ("/work/.kcoral/planted", "/work/.kcoral/tmp/planted", tempfile.gettempdir() + "/planted2",
              "/work/.kcoral/home/planted", "/work/planted"):
        with open(p, "w") as f:
            f.write("x")
        written.append(p)
    os.mkdir("/work/.kcoral/newdir")
    written.append("/work/.kcoral/newdir")
    return json.dumps(written)


def _holds_mount(path):
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    return any(p == path or p.startswith(path + "/") for p in points)


def tmp_info(name):
    with open(os.path.join("/tmp", name), "w") as f:
        f.write("t")
    return json.dumps({
        "realpath": "/work/.kcoral/tmp" if os.path.samefile("/tmp", "/work/.kcoral/tmp") else os.path.realpath("/tmp"),
        "var_tmp": "/work/.kcoral/tmp" if os.path.samefile("/var/tmp", "/work/.kcoral/tmp") else os.path.realpath("/var/tmp"),
        "dev_shm": os.path.realpath("/dev/shm"),
        "gettempdir": tempfile.gettempdir(),
        "in_workspace": os.path.exists(os.path.join("/work/.kcoral/tmp", name)),
        # Mount points of runtime paths that live under /tmp (a checkout or a
        # virtualenv there) are empty directories, not files of other workers.
        "listing": sorted(e for e in os.listdir("/tmp") if not _holds_mount("/tmp/" + e)),
    })


def import_readonly(module, directory):
    mod = __import__(module)
    return json.dumps({
        "value": mod.VALUE,
        "file": mod.__file__,
        "write_file": try_write_raw(os.path.join(directory, "new.py")),
        "overwrite": try_write_raw(mod.__file__),
        "in_path": directory in sys.path,
    })


def try_write_raw(path):
    try:
        with open(path, "w") as f:
            f.write("x")
        return "written"
    except OSError as e:
        return _err(e)


def forge_progress_and_die(index):
    # The worker's progress board: found through /proc/self/maps (the
    # worker closed its fd once mapped), claimed for another instruction,
    # reopened through map_files to shrink it; then the worker ends.
    import ctypes
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass  # the listing's own descriptor, closed by now
    assert not any("kcoral-progress" in target for target in targets), targets
    with open("/proc/self/maps") as maps:
        line = next(l for l in maps if "kcoral-progress" in l)
    span = line.split()[0]
    ctypes.c_int64.from_address(int(span.split("-")[0], 16)).value = index
    try:
        with open(f"/proc/self/map_files/{span}", "r+b") as board:
            os.ftruncate(board.fileno(), 0)
        shrunk = "shrunk"
    except OSError as e:
        shrunk = _err(e)
    sys.stdout.write(json.dumps(shrunk))
    sys.stdout.flush()
    os._exit(3)  # (a worker may be its PID namespace's init: SIGKILL to itself is ignored)


def plant_builtins(secret):
    # Leave something for the next program of this worker: a new builtin,
    # a replaced print and import function.
    import builtins
    builtins.kcoral_planted = secret
    builtins.print = lambda *a, **k: None
    original = builtins.__import__
    builtins.__import__ = lambda *a, **k: original(*a, **k)
    return json.dumps(os.getpid())


def look_for_builtins():
    import builtins
    return json.dumps(
        [
            os.getpid(),
            getattr(builtins, "kcoral_planted", None),
            builtins.print.__name__,
            builtins.__import__.__name__,
        ]
    )


def add(a, b):
    return a + b
'''


# -- helpers -----------------------------------------------------------------


def program(fn: str, *args: Any, extra: list[dict[str, Any]] = ()) -> dict[str, Any]:
    """Upload L{PROBES}, run C{fn(*args)}, then C{extra}, and return the result as C{out}."""
    return {
        "instructions": [
            {"op": "upload", "id": "m", "kind": "module", "source": PROBES},
            {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": fn},
            {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": list(args)},
            *extra,
            {"op": "return", "key": "out", "value": {"$ref": "r"}},
        ]
    }


def call(server: ServerProcess, fn: str, *args: Any) -> Any:
    """Run C{fn(*args)} in a worker; the request must COMPLETE. Returns the decoded result."""
    response = server.execute(program(fn, *args))
    body = completed(response)
    out = body["results"]["out"]
    assert out["type"] == "string", out
    return json.loads(out["value"])


def call_leaving_processes(server: ServerProcess, fn: str, *args: Any) -> Any:
    """
    Run C{fn(*args)}, which leaves background processes behind: the program is
    FAILED with kind runtime, its results kept, and the processes terminated.
    """
    response = server.execute(program(fn, *args))
    assert response.status == 200, response.body[:2000]
    body: dict[str, Any] = response.json()
    assert body["status"] == "FAILED", body
    assert body["error"]["kind"] == "runtime", body
    assert body["error"]["message"] == (
        "program left background processes running; they were terminated"
    )
    return json.loads(body["results"]["out"]["value"])


def completed(response: Response) -> dict[str, Any]:
    assert response.status == 200, response.body[:2000]
    body: dict[str, Any] = response.json()
    assert body["status"] == "COMPLETED", body
    return body


def failed(response: Response) -> dict[str, Any]:
    assert response.status == 200, response.body[:2000]
    body: dict[str, Any] = response.json()
    assert body["status"] == "FAILED", body
    return body


def denied(result: Any, *errnos: str) -> None:
    """C{result} is C{[exception name, errno name]} with one of C{errnos}."""
    assert isinstance(result, list) and len(result) == 2, result
    assert result[1] in errnos, result


def assert_healthy(server: ServerProcess) -> None:
    """C{/health} is ok and an ordinary program still computes."""
    health = server.health()
    assert health["status"] == "ok", health
    assert health["sandbox"] == "bubblewrap", health
    response = server.execute(
        {
            "instructions": [
                {"op": "upload", "id": "m", "kind": "module", "source": PROBES},
                {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "add"},
                {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": [2, 3]},
                {"op": "return", "key": "out", "value": {"$ref": "r"}},
            ]
        }
    )
    assert completed(response)["results"]["out"] == {"type": "integer", "value": 5}


def wait_for(predicate: Any, timeout: float = 20.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def idle_workers(server: ServerProcess) -> list[dict[str, Any]]:
    return [w for w in server.health()["workers"] if w["status"] == "idle"]


def wait_all_idle(server: ServerProcess, count: int) -> list[dict[str, Any]]:
    return wait_for(
        lambda: (workers := idle_workers(server)) and len(workers) == count and workers,
        what=f"{count} idle workers",
    )


def events(log_dir: Path) -> list[dict[str, Any]]:
    out = []
    for path in sorted(glob.glob(os.path.join(log_dir, "runs", "*", "events.jsonl"))):
        with open(path) as f:
            out += [json.loads(line) for line in f if line.strip()]
    return out


def event_field(record: dict[str, Any], key: str) -> Any:
    """A field of an events.jsonl record (top level or nested under C{fields})."""
    if key in record:
        return record[key]
    for nested in ("fields", "data", "extra"):
        if isinstance(record.get(nested), dict) and key in record[nested]:
            return record[nested][key]
    return None


def event_name(record: dict[str, Any]) -> Any:
    return event_field(record, "event") or event_field(record, "kcoral_event")


def sleepers(seconds: int) -> list[psutil.Process]:
    """Processes on this machine running C{sleep <seconds>}."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info.get("cmdline") or []
        if (
            len(cmdline) == 2
            and os.path.basename(cmdline[0]) == "sleep"
            and cmdline[1] == str(seconds)
        ):
            found.append(proc)
    return found


class Env:
    """One server and the host paths the tests attack."""

    def __init__(self, root: Path, *args: str) -> None:
        self.root = root
        self.server_tmp = root / "server-tmp"
        self.log_dir = root / "logs"
        self.cache_dir = root / "cache"
        self.outside = root / "outside"
        for d in (self.server_tmp, self.outside):
            d.mkdir()
        env = dict(os.environ, TMPDIR=str(self.server_tmp))
        self.server = ServerProcess(
            [
                "--device",
                "cpu",
                "--log-dir",
                str(self.log_dir),
                "--disk-cache-dir",
                str(self.cache_dir),
                *args,
            ],
            env=env,
            log_path=root / "server.log",
        )

    def seat_dirs(self) -> list[str]:
        """Host paths of the live seats' work directories."""
        return sorted(glob.glob(os.path.join(self.server_tmp, "kcoral-*", "*", "work")))


@pytest.fixture(scope="module")
def default_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """Two workers, one request per worker (the default)."""
    env = Env(tmp_path_factory.mktemp("sandbox-default"), "--num-workers", "2")
    with env.server:
        assert env.server.health()["sandbox"] == "bubblewrap"
        yield env


@pytest.fixture(scope="module")
def host_workspace_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """
    Two workers whose workspaces are host directories (C{--workspace-bytes
    0}; what a reused worker gets), so that a test can see a file land there.
    """
    env = Env(
        tmp_path_factory.mktemp("sandbox-host-workspace"),
        "--num-workers",
        "2",
        "--workspace-bytes",
        "0",
    )
    with env.server:
        yield env


READONLY_MODULE = "kcoral_escape_ro_module"


@contextlib.contextmanager
def _readonly_env(root: Path, readonly: Path, *args: str) -> Iterator[Env]:
    """A running bubblewrap server with C{readonly} (holding a module) as a read-only path."""
    (readonly / f"{READONLY_MODULE}.py").write_text("VALUE = 'from the read-only path'\n")
    env = Env(root, *args, "--sandbox-readonly-path", str(readonly))
    env.readonly = readonly  # type: ignore[attr-defined]
    with env.server:
        assert env.server.health()["sandbox"] == "bubblewrap"
        yield env


@pytest.fixture(scope="module")
def reuse_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """One worker reused for every request, with a read-only module directory."""
    root = tmp_path_factory.mktemp("sandbox-reuse")
    ro = root / "readonly"
    ro.mkdir()
    with _readonly_env(root, ro, "--num-workers", "1", "--max-requests-per-worker", "0") as env:
        yield env


# -- 1. writes outside /work ----------------------------------------------------


def test_write_outside_workspace(default_env: Env) -> None:
    server = default_env.server
    repo = str(Path(__file__).resolve().parents[2])
    targets = {
        "/usr/x": ("EROFS", "EACCES"),
        "/etc/x": ("EROFS", "ENOENT", "EACCES"),
        "/root/x": ("EROFS", "ENOENT", "EACCES"),
        "/x": ("EROFS", "EACCES"),
        f"{repo}/escaped-x": ("EROFS", "ENOENT", "EACCES"),
        f"{repo}/kcoral/escaped-x": ("EROFS", "ENOENT", "EACCES"),
        "/proc/x": ("EROFS", "ENOENT", "EACCES"),
        str(default_env.outside / "x"): ("EROFS", "ENOENT", "EACCES"),
    }
    if repo.startswith(("/tmp/", "/var/tmp/")):
        # Only the package is bound; the checkout's other directories are
        # made in the worker's private /tmp, where writing is allowed (the
        # host checkout stays untouched, checked below).
        del targets[f"{repo}/escaped-x"]
        assert call(server, "try_write", f"{repo}/escaped-x") in ("written", ["OSError", "EROFS"])
    for path, errnos in targets.items():
        denied(call(server, "try_write", path), *errnos)
    denied(call(server, "try_mkdir", "/usr/escaped-dir"), "EROFS", "EACCES")
    assert not os.path.exists(f"{repo}/escaped-x")
    assert not os.path.exists(f"{repo}/kcoral/escaped-x")
    assert not os.path.exists("/usr/escaped-dir")
    assert os.listdir(default_env.outside) == []
    # The workspace itself is writable.
    assert call(server, "try_write", "/work/fine") == "written"
    assert_healthy(server)


# -- 2. server's disk cache and logs ---------------------------------------------


def test_cache_and_log_directories_invisible(default_env: Env) -> None:
    server = default_env.server
    # Make sure both directories hold something (a blob, a program log).
    blob = b"cached blob for the escape test"
    response = server.execute(
        {
            "instructions": [
                {"op": "upload", "id": "b", "kind": "file", "blob": sha256(blob), "path": "f.bin"},
                *program("add", 1, 2)["instructions"],
            ]
        },
        [blob],
    )
    completed(response)
    # File-upload blobs are kept in the disk cache (server spec 7.2).
    blob_files = [p for p in default_env.cache_dir.rglob(sha256(blob)) if p.is_file()]
    assert blob_files, "the disk cache does not hold the blob"
    events_files = glob.glob(os.path.join(default_env.log_dir, "runs", "*", "events.jsonl"))
    assert events_files
    for path in (
        str(default_env.cache_dir),
        str(blob_files[0]),
        str(default_env.log_dir),
        events_files[0],
    ):
        denied(call(server, "try_list", path), "ENOENT")
        denied(call(server, "try_read", path), "ENOENT")
    hidden = call(
        server,
        "exists",
        [str(default_env.cache_dir), str(default_env.log_dir), str(default_env.root)],
    )
    assert not any(hidden.values()), hidden
    assert_healthy(server)


# -- 3. other workers ---------------------------------------------------------------


def test_other_seats_and_processes_invisible(default_env: Env) -> None:
    server = default_env.server
    wait_all_idle(server, 2)
    seats = default_env.seat_dirs()
    assert len(seats) >= 2, seats
    roots = sorted({os.path.dirname(os.path.dirname(s)) for s in seats})
    paths = seats + [os.path.dirname(s) for s in seats] + roots + [str(default_env.server_tmp)]
    for path in paths:
        denied(call(server, "try_list", path), "ENOENT")
    # /proc shows only this sandbox's processes: bwrap's init and the worker,
    # all in /work; no other worker, no server.
    procs = call(server, "processes")
    host_pids = {w["pid"] for w in server.health()["workers"]}
    assert 1 <= len(procs) <= 3, procs
    for _pid, cwd, argv0 in procs:
        assert cwd in ("/work", "/"), procs
        assert argv0 in ("bwrap", "python", "python3") or argv0.startswith("python"), procs
    assert not ({pid for pid, _, _ in procs} & host_pids - {1, 2, 3}), procs
    assert_healthy(server)


def test_concurrent_worker_cannot_find_secret(host_workspace_env: Env) -> None:
    default_env = host_workspace_env
    server = default_env.server
    wait_all_idle(server, 2)
    name = f"secret-{random.randrange(10**9)}"
    secret = f"the secret {random.random()}"
    writer_result: dict[str, Any] = {}

    def writer() -> None:
        writer_result["response"] = server.execute(
            program("write_secret_and_sleep", name, secret, 4)
        )

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        # Wait until the secret is on disk in the writer's host workspace.
        planted = wait_for(
            lambda: glob.glob(os.path.join(default_env.server_tmp, "kcoral-*", "*", "work", name)),
            what="the secret file",
        )
        host_paths = [os.path.dirname(planted[0]), planted[0]]
        result = call(server, "search_secret", name, secret, host_paths)
        # The writer was still running while we searched.
        assert thread.is_alive()
    finally:
        thread.join()
    assert json.loads(completed(writer_result["response"])["results"]["out"]["value"]) is True
    assert result["found"] == [], result
    for listing in result["seats"].values():
        denied(listing, "ENOENT")
    assert_healthy(server)


def test_concurrent_worker_cannot_find_in_memory_secret(default_env: Env) -> None:
    """
    The same with the default one-request workers, whose workspace is a
    tmpfs of their own (C{--workspace-bytes}): the secret is never on the
    host, and the other worker finds it nowhere.
    """
    server = default_env.server
    wait_all_idle(server, 2)
    name = f"secret-{random.randrange(10**9)}"
    secret = f"the secret {random.random()}"
    writer_result: dict[str, Any] = {}

    def writer() -> None:
        writer_result["response"] = server.execute(
            program("write_secret_and_sleep", name, secret, 6)
        )

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        time.sleep(2)
        assert glob.glob(os.path.join(default_env.server_tmp, "kcoral-*", "*", "work", name)) == []
        result = call(server, "search_secret", name, secret, default_env.seat_dirs())
        assert thread.is_alive()
    finally:
        thread.join()
    assert json.loads(completed(writer_result["response"])["results"]["out"]["value"]) is True
    assert result["found"] == [], result
    assert_healthy(server)


# -- 4. network -----------------------------------------------------------------------


def test_tcp_to_host_loopback_refused(default_env: Env) -> None:
    server = default_env.server
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        denied(call(server, "try_connect", "127.0.0.1", port), "ECONNREFUSED")
        # The kcoral server itself is unreachable too.
        denied(call(server, "try_connect", "127.0.0.1", server.port), "ECONNREFUSED")
        # No route out (no DNS either: use an address).
        denied(call(server, "try_connect", "192.0.2.1", 80), "ENETUNREACH", "EHOSTUNREACH")
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()
    assert_healthy(server)


# -- 5. the reserved directory ------------------------------------------------------


def test_upload_into_reserved_directory_fails(reuse_env: Env) -> None:
    server = reuse_env.server
    blob = b"reserved"
    for path in (".kcoral/x", ".kcoral/tmp/x", "./.kcoral//home/x"):
        body = failed(
            server.execute(
                {
                    "instructions": [
                        {
                            "op": "upload",
                            "id": "u",
                            "kind": "file",
                            "blob": sha256(blob),
                            "path": path,
                        }
                    ]
                },
                [blob],
            )
        )
        assert body["error"]["kind"] == "runtime", body
        assert ".kcoral" in body["error"]["message"], body
        assert "reserved" in body["error"]["message"], body
    for seat in reuse_env.seat_dirs():
        assert not os.path.exists(os.path.join(seat, ".kcoral", "x"))
    assert_healthy(server)


def test_reserved_directory_writes_are_wiped_between_requests(reuse_env: Env) -> None:
    server = reuse_env.server
    pid_before = wait_all_idle(server, 1)[0]["pid"]
    written = call(server, "write_reserved")
    assert "/work/.kcoral/planted" in written
    paths = written + ["/work/.kcoral/tmp/planted2"]
    # Same worker process (reuse mode), cleaned workspace.
    seen = call(server, "exists", paths)
    assert seen == {p: False for p in paths}, seen
    assert wait_all_idle(server, 1)[0]["pid"] == pid_before
    # The runtime layout was recreated.
    layout = call(server, "try_list", "/work/.kcoral")
    assert set(layout) >= {"tmp", "home", "cache", "output", "shm", "libraries"}, layout
    assert_healthy(server)


# -- 6. symbolic links ----------------------------------------------------------------


def test_symlink_out_of_workspace_cannot_be_returned(default_env: Env) -> None:
    server = default_env.server
    cases = [
        ("/etc", "folder"),
        ("/usr", "folder"),
        (str(default_env.cache_dir), "folder"),
        ("/etc/ld.so.cache", "file"),
        ("/usr/bin/env", "file"),
    ]
    for target, kind in cases:
        response = server.execute(
            program(
                "plant_symlink",
                target,
                "link",
                extra=[{"op": "return", "key": "link", "kind": kind, "path": "link"}],
            )
        )
        body = failed(response)
        assert body["error"]["kind"] == "serialization", body
        assert "link" not in body["results"], body
    # A link inside a returned folder is not followed out of the workspace.
    for target in ("/etc", "/etc/ld.so.cache", str(default_env.cache_dir)):
        response = server.execute(
            program(
                "nested_symlink_folder",
                target,
                extra=[{"op": "return", "key": "dir", "kind": "folder", "path": "out"}],
            )
        )
        body = failed(response)
        assert body["error"]["kind"] == "serialization", body
        assert "symbolic link" in body["error"]["message"], body
    assert_healthy(server)


def test_upload_through_planted_symlink(reuse_env: Env) -> None:
    server = reuse_env.server
    blob = b"must not escape"
    upload = {"op": "upload", "id": "u", "kind": "file", "blob": sha256(blob), "path": "d/x"}
    targets = [str(reuse_env.outside), "/usr", "/work/.kcoral", str(reuse_env.cache_dir)]
    for target in targets:
        # Same request: plant d -> target, then upload d/x.
        body = failed(server.execute(program("plant_symlink", target, "d", extra=[upload]), [blob]))
        assert body["error"]["kind"] == "runtime", body
        assert body["error"]["instruction_id"] == "u", body
        # Two requests on the same (reused) worker: plant, then upload.
        assert call(server, "plant_symlink", target, "d") == target
        response = server.execute(
            {
                "instructions": [
                    upload,
                    {"op": "upload", "id": "m", "kind": "module", "source": PROBES},
                    {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "try_list"},
                    {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": ["d"]},
                    {"op": "return", "key": "out", "value": {"$ref": "r"}},
                ]
            },
            [blob],
        )
        # The link was removed between requests: d is a fresh directory in /work.
        body = completed(response)
        assert json.loads(body["results"]["out"]["value"]) == ["x"], body
    assert os.listdir(reuse_env.outside) == []
    for seat in reuse_env.seat_dirs():
        assert not os.path.exists(os.path.join(seat, ".kcoral", "x"))
    assert not os.path.exists("/usr/x")
    assert not any(p.name == "x" for p in reuse_env.cache_dir.rglob("x"))
    assert_healthy(server)


# -- 7. background processes ----------------------------------------------------------


def test_background_process_dies_with_worker(default_env: Env) -> None:
    server = default_env.server
    seconds = random.randrange(900_000, 999_999)
    call_leaving_processes(server, "leave_background", seconds)
    wait_for(lambda: not sleepers(seconds), what=f"'sleep {seconds}' to end")
    assert_healthy(server)


def test_background_process_in_reuse_mode_replaces_the_worker(reuse_env: Env) -> None:
    server = reuse_env.server
    old_pid = wait_all_idle(server, 1)[0]["pid"]
    seconds = random.randrange(900_000, 999_999)
    call_leaving_processes(server, "leave_background", seconds)
    wait_for(lambda: not sleepers(seconds), what=f"'sleep {seconds}' to end")
    new_pid = wait_for(
        lambda: (w := idle_workers(server)) and w[0]["pid"] != old_pid and w[0]["pid"],
        what="a replacement worker",
    )
    nxt = server.execute(program("add", 1, 2))
    request_id = completed(nxt)["request_id"]
    routed = [
        e
        for e in events(reuse_env.log_dir)
        if event_name(e) == "request_routed" and event_field(e, "request_id") == request_id
    ]
    assert routed and event_field(routed[0], "pid") == new_pid, routed
    assert_healthy(server)


def test_orphaned_background_process_in_reuse_mode(reuse_env: Env) -> None:
    """A double-forked process is not a child of the worker; it must not outlive the request."""
    server = reuse_env.server
    old_pid = wait_all_idle(server, 1)[0]["pid"]
    seconds = random.randrange(900_000, 999_999)
    assert call_leaving_processes(server, "leave_orphan", seconds), "the orphan did not start"
    try:
        # The next program on this seat must not share its sandbox with the orphan.
        assert call(server, "sandbox_sleepers_json", seconds) == []
        assert wait_for(lambda: not sleepers(seconds), timeout=10, what="the orphan to end")
        assert wait_all_idle(server, 1)[0]["pid"] != old_pid
    finally:
        for proc in sleepers(seconds):
            proc.kill()
    assert_healthy(server)


# -- 8. /tmp ----------------------------------------------------------------------------


def test_builtins_planted_for_the_next_program_are_gone(reuse_env: Env) -> None:
    """
    A program that changes builtins (adds one, replaces print and the
    import function) in a worker that is reused: the next program, in the
    same process, finds them as the first program did.
    """
    server = reuse_env.server
    planter = call(server, "plant_builtins", "planted-secret")
    pid, planted, printer, importer = call(server, "look_for_builtins")
    assert pid == planter, "the worker was not reused: the test proves nothing"
    assert (planted, printer, importer) == (None, "print", "__import__")
    assert_healthy(server)


def test_forged_progress_board_is_checked(reuse_env: Env) -> None:
    """
    A program that writes its worker's progress board (shared memory the
    parent reads to say where a program died) and kills its worker: it has
    no descriptor of the board, the parent ignores a claim of an
    instruction the program does not have, the board cannot be shrunk
    under it, and the next request is served.
    """
    server = reuse_env.server
    # A claim of an instruction it does not have: where it died is unknown,
    # so its own request gets the engine error of a worker that broke its
    # channel (as for a forged control message), never a made-up place.
    response = server.execute(program("forge_progress_and_die", 99))
    assert response.status == 500, response.body[:2000]
    body = response.json()
    assert (body["status"], body["error"]["kind"]) == ("ERROR", "engine"), body
    assert "instruction_index" not in body["error"], body
    # The truth (the run, instruction 2) is taken, so the board was not
    # shrunk (an empty board would read as nothing).
    body = failed(server.execute(program("forge_progress_and_die", 2)))
    assert body["error"]["kind"] == "runtime", body
    assert body["error"]["instruction_index"] == 2, body["error"]
    assert_healthy(server)


def test_tmp_is_private_to_the_worker(default_env: Env) -> None:
    server = default_env.server
    info = call(server, "tmp_info", "tmp-probe")
    assert info["realpath"] == "/work/.kcoral/tmp", info
    assert info["var_tmp"] == "/work/.kcoral/tmp", info
    assert info["dev_shm"] == "/work/.kcoral/shm", info
    assert info["gettempdir"] == "/work/.kcoral/tmp", info
    assert info["in_workspace"] is True
    # The host's /tmp does not appear, and a fresh worker's /tmp is empty.
    assert info["listing"] == ["tmp-probe"], info
    info2 = call(server, "tmp_info", "tmp-probe-2")
    assert info2["listing"] == ["tmp-probe-2"], info2
    assert_healthy(server)


# -- 9. --sandbox-readonly-path ---------------------------------------------------------------


def test_readonly_path_importable_not_writable(reuse_env: Env) -> None:
    server = reuse_env.server
    ro = str(reuse_env.readonly)  # type: ignore[attr-defined]
    result = call(server, "import_readonly", READONLY_MODULE, ro)
    assert result["value"] == "from the read-only path"
    assert result["file"] == os.path.join(ro, f"{READONLY_MODULE}.py")
    assert result["in_path"] is True
    denied(result["write_file"], "EROFS")
    denied(result["overwrite"], "EROFS")
    assert sorted(os.listdir(ro)) == [f"{READONLY_MODULE}.py"]
    assert_healthy(server)


@pytest.fixture(scope="module")
def tmp_runtime_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """
    Forked workers (the default) with a read-only path under the host's
    C{/tmp}, as a checkout or virtualenv there gives: the sandbox cannot make
    C{/tmp} a link into the workspace, so each child mounts its own there.
    """
    ro = Path(tempfile.mkdtemp(prefix="kcoral-ro-", dir="/tmp"))
    try:
        root = tmp_path_factory.mktemp("sandbox-tmp-runtime")
        with _readonly_env(root, ro, "--num-workers", "2") as env:
            yield env
    finally:
        shutil.rmtree(ro)


def test_tmp_is_private_with_a_runtime_path_under_tmp(tmp_runtime_env: Env) -> None:
    server = tmp_runtime_env.server
    ro = str(tmp_runtime_env.readonly)  # type: ignore[attr-defined]
    for name in ("tmp-probe", "tmp-probe-2", "tmp-probe-3"):
        info = call(server, "tmp_info", name)
        assert info["in_workspace"] is True, info
        assert info["realpath"] == "/work/.kcoral/tmp", info
        # Only this request's file: not the template's tmp, not an earlier child's.
        assert info["listing"] == [name], info
    result = call(server, "import_readonly", READONLY_MODULE, ro)
    assert result["value"] == "from the read-only path"
    denied(result["write_file"], "EROFS")
    denied(result["overwrite"], "EROFS")
    assert sorted(os.listdir(ro)) == [f"{READONLY_MODULE}.py"]
    assert_healthy(server)


# -- probe timeout and fallback ------------------------------------------------------------------


@pytest.mark.slow
def test_hanging_bwrap_falls_back_to_no_sandbox(tmp_path: Path) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    seconds = random.randrange(900_000, 999_999)
    script = fake / "bwrap"
    script.write_text(f"#!/bin/sh\nexec sleep {seconds}\n")
    script.chmod(0o755)
    env = dict(os.environ, PATH=f"{fake}{os.pathsep}{os.environ.get('PATH', '')}")
    log_dir = tmp_path / "logs"
    server = ServerProcess(
        [
            "--device",
            "cpu",
            "--num-workers",
            "1",
            "--sandbox",
            "auto",
            "--log-dir",
            str(log_dir),
            "--disk-cache-dir",
            str(tmp_path / "cache"),
        ],
        env=env,
        log_path=tmp_path / "server.log",
    )
    started = time.monotonic()
    with server:
        elapsed = time.monotonic() - started
        assert elapsed >= 9.5, elapsed
        health = server.health()
        assert health["status"] == "ok"
        assert health["sandbox"] == "none"
        disabled = [e for e in events(log_dir) if event_name(e) == "sandbox_disabled"]
        assert len(disabled) == 1, events(log_dir)
        record = disabled[0]
        assert "timed out after 10.0s" in json.dumps(record), record
        assert "WARN" in json.dumps(record).upper(), record
        # The fake bwrap's process group was killed.
        wait_for(lambda: not sleepers(seconds), what="the fake bwrap to be killed")
        # Workers run unsandboxed but work.
        response = server.execute(program("add", 2, 3))
        assert completed(response)["results"]["out"] == {"type": "integer", "value": 5}


# -- several front ends: the lease broker ---------------------------------------


def test_programs_cannot_reach_the_lease_broker(tmp_path: Path) -> None:
    """
    With C{--front-ends 2}, the first front end serves every GPU's lease on
    a Unix socket in a private directory of the host's temporary directory
    (this test's server directory is too deep for a socket path, so
    C{/tmp}).  A program in either front end's sandbox tries to connect to
    it by its host path (which the test reads from the server's log) and
    fails: its /tmp is its own.
    """
    env = Env(tmp_path, "--num-workers", "2", "--front-ends", "2")
    with env.server:
        started = wait_for(
            lambda: [e for e in events(env.log_dir) if event_name(e) == "front_end_started"],
            what="front_end_started",
        )
        broker = event_field(started[0], "broker")
        # The socket is real and reachable from the host.
        with socket.socket(socket.AF_UNIX) as host:
            host.connect(broker)
        assert env.server.health()["front_end"]["of"] == 2
        # Each program's connection lands on either front end (SO_REUSEPORT).
        for _ in range(8):
            denied(call(env.server, "try_connect_unix", broker), "ENOENT", "EACCES", "ECONNREFUSED")
        assert_healthy(env.server)
