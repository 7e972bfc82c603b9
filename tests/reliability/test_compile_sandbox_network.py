"""
The network from inside an nvcc compile (issue 38).

The server's nvcc compiles run in a sandbox without a network namespace of
its own (making and tearing one down per compile is serialized in the
kernel); the compile filter refuses every C{socket} call instead, and the
sandbox has no C{/proc}.  A hostile toolchain (nvcc replaced by a script
that runs Python) tries the host's loopback over TCP and UDP and one of its
abstract Unix sockets, reports what it could do as its "image", and the host
side checks that nothing arrived.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kcoral.server.sandbox.bubblewrap import BubblewrapSandbox
from kcoral.testing import ServerProcess
from kcoral.wire.multipart import decode_response
from kcoral.wire.values import decode_results
from tests.reliability.conftest import requires_bwrap

pytestmark = [pytest.mark.integration, requires_bwrap]

#: What the hostile toolchain runs (as a file beside it): each way out it
#: knows, each outcome by name; C{sys.argv[1]} is where the report goes.
PROBE = r"""
import errno
import json
import os
import socket
import sys

TCP, UDP, ABSTRACT = {tcp}, {udp}, {abstract!r}


def is_open(fd):
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def attempt(family, kind, action):
    try:
        s = socket.socket(family, kind)
    except OSError as e:
        return "socket:" + errno.errorcode.get(e.errno, str(e.errno))
    try:
        s.settimeout(5)
        action(s)
        return "reached"
    except OSError as e:
        return "refused:" + errno.errorcode.get(e.errno, str(e.errno))
    finally:
        s.close()


report = {{
    "tcp": attempt(socket.AF_INET, socket.SOCK_STREAM, lambda s: s.connect(("127.0.0.1", TCP))),
    "udp": attempt(
        socket.AF_INET, socket.SOCK_DGRAM, lambda s: s.sendto(b"escaped", ("127.0.0.1", UDP))
    ),
    "abstract": attempt(socket.AF_UNIX, socket.SOCK_STREAM, lambda s: s.connect(ABSTRACT)),
    "netlink": attempt(socket.AF_NETLINK, socket.SOCK_RAW, lambda s: s.bind((0, 0))),
    "proc_net": os.path.exists("/proc/net/tcp"),
    "filter_fd": is_open(9),
}}
with open(sys.argv[1], "w") as f:
    json.dump(report, f)
"""

#: nvcc, as a shell script: answers the server's version probe, and
#: otherwise runs L{PROBE} with the C{-o} path.
HOSTILE_NVCC = """#!/bin/sh
if [ "$1" = "--version" ]; then
  echo "Cuda compilation tools, release 13.0, V13.0.88"
  exit 0
fi
out=""
prev=""
for a in "$@"; do
  [ "$prev" = "-o" ] && out="$a"
  prev="$a"
done
exec {python} -I {probe} "$out"
"""

KERNEL = "__global__ void escape(float *p) { p[threadIdx.x] = 1.0f; }\n"


class HostListeners:
    """A TCP, a UDP and an abstract Unix listener on the host, in its network namespace."""

    def __init__(self) -> None:
        self.tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.tcp.bind(("127.0.0.1", 0))
        self.tcp.listen(8)
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", 0))
        self.abstract_name = f"\0kcoral-compile-attack-{uuid.uuid4().hex}"
        self.abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.abstract.bind(self.abstract_name)
        self.abstract.listen(8)
        for s in (self.tcp, self.udp, self.abstract):
            s.setblocking(False)

    def arrived(self) -> dict[str, bool]:
        """Whether anything connected or was sent to each (draining it)."""
        seen = {}
        for name, s, take in (
            ("tcp", self.tcp, lambda s: s.accept()[0].close()),
            ("udp", self.udp, lambda s: s.recv(64)),
            ("abstract", self.abstract, lambda s: s.accept()[0].close()),
        ):
            try:
                take(s)
            except BlockingIOError:
                seen[name] = False
            else:
                seen[name] = True
        return seen

    def close(self) -> None:
        for s in (self.tcp, self.udp, self.abstract):
            s.close()


@pytest.fixture(scope="module")
def listeners() -> Iterator[HostListeners]:
    host = HostListeners()
    yield host
    host.close()


@pytest.fixture(scope="module")
def hostile_bin(tmp_path_factory: pytest.TempPathFactory, listeners: HostListeners) -> Path:
    bin_dir = tmp_path_factory.mktemp("hostile-network") / "bin"
    bin_dir.mkdir()
    probe = bin_dir / "probe.py"
    probe.write_text(
        PROBE.format(
            tcp=listeners.tcp.getsockname()[1],
            udp=listeners.udp.getsockname()[1],
            abstract=listeners.abstract_name,
        )
    )
    # The interpreter by its path inside the sandbox (a virtualenv under
    # /work is shown elsewhere); the host's path serves the direct run.
    python = os.path.realpath(sys.executable)
    nvcc = bin_dir / "nvcc"
    nvcc.write_text(
        HOSTILE_NVCC.format(python=BubblewrapSandbox([]).path_inside(python), probe=probe)
    )
    nvcc.chmod(0o755)
    return bin_dir


@pytest.fixture(scope="module")
def server(hostile_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    base = tmp_path_factory.mktemp("hostile-network-server")
    env = dict(os.environ, PATH=f"{hostile_bin}{os.pathsep}{os.environ.get('PATH', '')}")
    server = ServerProcess(
        ["--device", "cpu", "--sandbox", "bubblewrap", "--num-workers", "1"]
        + ["--log-dir", "", "--disk-cache-dir", str(base / "files")]
        + ["--sandbox-readonly-path", str(hostile_bin)],
        env=env,
    )
    server.start()
    yield server
    server.stop()


def _compile_program() -> dict[str, Any]:
    return {
        "instructions": [
            {"op": "upload", "kind": "module", "id": "src", "language": "cuda", "source": KERNEL},
            {"op": "get_function", "id": "fn", "module": {"$ref": "src"}, "name": "escape"},
            {
                "op": "run",
                "id": "image",
                "fn": "builtin.compile_cuda_binary",
                "args": [{"$ref": "fn"}, {"arch": "sm_90a"}],
            },
            {"op": "return", "key": "image", "value": {"$ref": "image"}},
        ]
    }


def test_the_probe_reaches_the_host_outside_a_sandbox(
    hostile_bin: Path, listeners: HostListeners, tmp_path: Path
) -> None:
    """
    The hostile toolchain, run directly on the host, reaches every
    listener: the attack below fails because of the sandbox, not the probe.
    """
    out = tmp_path / "report.json"
    subprocess.run([str(hostile_bin / "nvcc"), "-o", str(out)], check=True, timeout=60)
    report = json.loads(out.read_text())
    assert (report["tcp"], report["udp"], report["abstract"]) == ("reached",) * 3, report
    assert listeners.arrived() == {"tcp": True, "udp": True, "abstract": True}


def test_a_compile_reaches_no_network(server: ServerProcess, listeners: HostListeners) -> None:
    """
    Inside a compile's sandbox every C{socket} call is refused (C{EACCES},
    the compile filter), there is no C{/proc/net} to read the host's sockets
    from, nothing reached the host's TCP, UDP or abstract Unix listener, and
    the descriptor the filter came on is closed.
    """
    listeners.arrived()  # (drain whatever another test left)
    response = server.execute(_compile_program())
    body, parts = decode_response(response.headers["content-type"], response.body)
    assert body["status"] == "COMPLETED", body
    report = json.loads(decode_results(body["results"], parts)["image"])
    assert report == {
        "tcp": "socket:EACCES",
        "udp": "socket:EACCES",
        "abstract": "socket:EACCES",
        "netlink": "socket:EACCES",
        "proc_net": False,
        # bwrap read its filter from fd 9 and closed it: nvcc never has it.
        "filter_fd": False,
    }, report
    assert listeners.arrived() == {"tcp": False, "udp": False, "abstract": False}
