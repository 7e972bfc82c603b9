"""
Planting a compiled image in the shared compile cache (issue 13, item 6):
the cache is read-only in every worker; the parent compiles in a sandbox of
its own and writes the entries, which reads check against their sha256.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kcoral.testing import ServerProcess
from kcoral.wire.multipart import decode_response
from kcoral.wire.values import decode_results
from tests.reliability.conftest import requires_bwrap

pytestmark = [pytest.mark.integration, requires_bwrap]

PLANT = r"""
import errno
import json
import os


def plant():
    out = {}
    for name in ("planted.bin", "ab" * 32 + ".bin"):
        try:
            with open(os.path.join("/var/cache/kcoral/compile", name), "wb") as f:
                f.write(b"KCC3 evil image")
            out[name] = "written"
        except OSError as e:
            out[name] = errno.errorcode.get(e.errno, "?")
    return json.dumps(out)
"""

KERNEL = "__global__ void scale(float *p, float a) { p[threadIdx.x] *= a; }\n"


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("compile-attack")


@pytest.fixture(scope="module")
def server(base: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(
        ["--device", "cpu", "--sandbox", "bubblewrap", "--num-workers", "1"]
        + ["--log-dir", "", "--disk-cache-dir", str(base / "files")]
    )
    server.start()
    yield server
    server.stop()


def _plant_program() -> dict[str, Any]:
    return {
        "instructions": [
            {"op": "upload", "kind": "module", "id": "m", "source": PLANT},
            {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "plant"},
            {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": []},
            {"op": "return", "key": "out", "value": {"$ref": "r"}},
        ]
    }


def test_workers_cannot_write_the_compile_cache(server: ServerProcess, base: Path) -> None:
    response = server.execute(_plant_program())
    body = response.json()
    assert body["status"] == "COMPLETED", body
    seen = json.loads(body["results"]["out"]["value"])
    assert set(seen.values()) == {"EROFS"}, seen
    assert not [p for p in (base / "compile").glob("*") if "ab" * 32 in p.name]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on PATH")
def test_parent_compiles_into_the_cache(server: ServerProcess, base: Path) -> None:
    program = {
        "instructions": [
            {"op": "upload", "kind": "module", "id": "src", "language": "cuda", "source": KERNEL},
            {"op": "get_function", "id": "fn", "module": {"$ref": "src"}, "name": "scale"},
            {
                "op": "run",
                "id": "image",
                "fn": "builtin.compile_cuda_binary",
                "args": [{"$ref": "fn"}, {"arch": "sm_90a"}],
            },
            {"op": "return", "key": "image", "value": {"$ref": "image"}},
        ]
    }
    images = []
    for _ in range(2):
        response = server.execute(program)
        body, parts = decode_response(response.headers["content-type"], response.body)
        assert body["status"] == "COMPLETED", body
        images.append(decode_results(body["results"], parts)["image"])
    assert images[0] == images[1]
    assert images[0][:4] == b"\x7fELF"
    entries = list((base / "compile").glob("*.bin"))
    assert len(entries) == 1
    assert Path(entries[0]).read_bytes()[:4] == b"KCC3"


# -- issue 32, item 1: a forged compile answer ---------------------------------

#: Runs inside the isolated compile when nvcc's shell expands the attacker's
#: C{-D} value: find the compile process, put the attacker's bytes where it
#: leaves its image, write a forged answer naming the victim's cache key to
#: its stdout, and kill it before it answers itself.
FORGE = r"""
for p in /proc/[0-9]*; do
  case "$(cat $p/comm 2>/dev/null)" in python*)
    if grep -q 'kcoral[.]compilers[.]isolated' $p/cmdline 2>/dev/null; then pid=${p#/proc/}; fi
  esac
done
printf EVIL-IMAGE > /proc/$pid/cwd/image.bin
printf '{"key": "KEY", "seconds": 0.0}\n' > /proc/$pid/fd/1
kill -9 $pid
"""

#: The attacker's program: computes the victim's key the way the server
#: does (the code is public), and compiles a decoy with the shell payload.
ATTACK = r"""
import base64

from kcoral.builtins import compile_cuda_binary
from kcoral.compilers import get_backend
from kcoral.compilers.cache import cache_key
from kcoral.compilers.source import add_extern_c

FORGE = {forge!r}


def attack(victim, arch):
    key = cache_key(add_extern_c(victim), arch, (), "nvcc", get_backend("nvcc").versions())
    script = base64.b64encode(FORGE.replace("KEY", key).encode()).decode()
    flag = "-DX=$(echo " + script + "|base64 -d|sh)"
    try:
        compile_cuda_binary("__global__ void decoy() {{}}\n", {{"arch": arch, "extra_cuda_cflags": [flag]}})
    except Exception as e:
        return "refused: " + str(e)
    return "compiled"
"""

VICTIM = "__global__ void victim(float *p) { p[threadIdx.x] += 1.0f; }\n"


def _compile_program(source: str, name: str) -> dict[str, Any]:
    return {
        "instructions": [
            {"op": "upload", "kind": "module", "id": "src", "language": "cuda", "source": source},
            {"op": "get_function", "id": "fn", "module": {"$ref": "src"}, "name": name},
            {
                "op": "run",
                "id": "image",
                "fn": "builtin.compile_cuda_binary",
                "args": [{"$ref": "fn"}, {"arch": "sm_90a"}],
            },
            {"op": "return", "key": "image", "value": {"$ref": "image"}},
        ]
    }


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on PATH")
def test_a_compile_cannot_plant_an_image_for_another_client(server: ServerProcess) -> None:
    """
    Issue 32, item 1: an attacker's C{-D} value with a shell command
    substitution ran inside the isolated compile, forged its answer with a
    victim's key, and the server stored the attacker's bytes there.  Now
    the flag is refused, the server computes the key itself from the
    request it sent, and another client's compile gets nvcc's image.
    """
    source = ATTACK.format(forge=FORGE)
    program = {
        "instructions": [
            {"op": "upload", "kind": "module", "id": "m", "source": source},
            {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "attack"},
            {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": [VICTIM, "sm_90a"]},
            {"op": "return", "key": "out", "value": {"$ref": "r"}},
        ]
    }
    response = server.execute(program)
    body = response.json()
    assert body["status"] == "COMPLETED", body
    outcome = body["results"]["out"]["value"]

    response = server.execute(_compile_program(VICTIM, "victim"))
    body, parts = decode_response(response.headers["content-type"], response.body)
    assert body["status"] == "COMPLETED", body
    image = decode_results(body["results"], parts)["image"]
    assert b"EVIL-IMAGE" not in image
    assert image[:4] == b"\x7fELF", image[:64]
    assert outcome.startswith("refused: "), outcome
    assert "not allowed" in outcome, outcome


#: A hostile toolchain: as nvcc's descendants would, it tries to write a
#: forged answer (a victim's key, its own bytes) on each descriptor of its
#: parent through /proc and on its own output, then reports what it could
#: do as the "image".
HOSTILE_NVCC = r"""#!/bin/sh
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
forged='{"key": "VICTIM", "seconds": 0.0, "size": 4}'
report=""
for fd in 0 1 2 3; do
  if (printf '%s\nEVIL' "$forged" > /proc/$PPID/fd/$fd) 2>/dev/null; then
    report="$report fd$fd:written"
  else
    report="$report fd$fd:refused"
  fi
done
printf '%s\nEVIL' "$forged"
printf '%s\nEVIL' "$forged" >&2
printf '%s' "$report" > "$out"
"""


def _hostile_bin(base: Path, victim_key: str) -> Path:
    bin_dir = base / "bin"
    bin_dir.mkdir()
    nvcc = bin_dir / "nvcc"
    nvcc.write_text(HOSTILE_NVCC.replace("VICTIM", victim_key))
    nvcc.chmod(0o755)
    return bin_dir


def _victim_key(source: str) -> str:
    from kcoral.compilers.cache import cache_key
    from kcoral.compilers.source import add_extern_c

    toolchain = {"nvcc": "13.0.88", "cuda": "13.0"}  # what HOSTILE_NVCC --version says
    return cache_key(add_extern_c(source), "sm_90a", (), "nvcc", toolchain)


OTHER = "__global__ void other(float *p) { p[0] = 2.0f; }\n"


@pytest.fixture(scope="module")
def hostile_toolchain(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[ServerProcess, Path]]:
    base = tmp_path_factory.mktemp("hostile-toolchain")
    bin_dir = _hostile_bin(base, _victim_key(OTHER))
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    server = ServerProcess(
        ["--device", "cpu", "--sandbox", "bubblewrap", "--num-workers", "1"]
        + ["--log-dir", "", "--disk-cache-dir", str(base / "files")]
        + ["--sandbox-readonly-path", str(bin_dir)],
        env=env,
    )
    server.start()
    yield server, base / "compile"
    server.stop()


def test_a_hostile_toolchain_fills_only_its_own_entry(
    hostile_toolchain: tuple[ServerProcess, Path],
) -> None:
    """
    Issue 32, item 1: nvcc itself replaced by a script that writes a
    forged answer (another kernel's key, its own bytes) wherever it can.
    The server runs nvcc's command line directly in the compile's sandbox,
    so there is no answer to forge: it stores what the command wrote, under
    the key of the request it sent, and nothing under the other key.
    """
    server, cache_dir = hostile_toolchain
    response = server.execute(_compile_program(VICTIM, "victim"))
    body, parts = decode_response(response.headers["content-type"], response.body)
    assert body["status"] == "COMPLETED", body
    report = decode_results(body["results"], parts)["image"]
    assert report.startswith(b" fd0:"), report
    assert sorted(p.name for p in cache_dir.glob("*.bin")) == [_victim_key(VICTIM) + ".bin"]


def test_the_compiles_descendants_cannot_write_its_descriptors(tmp_path: Path) -> None:
    """
    Issue 32, item 1: below C{python -m kcoral.compilers.isolated} (the
    compile of backends that are not one command line), nvcc's descendants
    cannot open the compile process's descriptors through /proc (it is
    non-dumpable), so they cannot write its answer on fd 3.
    """
    import subprocess

    from kcoral.compilers.source import add_extern_c
    from kcoral.server.sandbox.bubblewrap import BubblewrapSandbox
    from kcoral.server.workers.compiles import parse_answer

    bin_dir = _hostile_bin(tmp_path, _victim_key(OTHER))
    sandbox = BubblewrapSandbox([str(bin_dir)])
    work = sandbox.prepare_seat(tmp_path / "seat")
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    executable, argv, env = sandbox.run_command(
        [sys.executable, "-m", "kcoral.compilers.isolated"], work, env=env
    )
    request = {
        "source": add_extern_c(VICTIM),
        "arch": "sm_90a",
        "options": [],
        "backend": "nvcc",
        "timeout": 60,
    }
    read, write = os.pipe()
    try:
        process = subprocess.Popen(
            argv,
            executable=executable,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(3,),
            preexec_fn=lambda: os.dup2(write, 3),
        )
        os.close(write)
        write = -1
        # (The answer is far smaller than a pipe's buffer.)
        _, err = process.communicate(json.dumps(request).encode(), timeout=120)
        with os.fdopen(read, "rb") as f:
            read = -1
            answer = f.read()
    finally:
        for fd in (read, write):
            if fd >= 0:
                os.close(fd)
    parsed = parse_answer(answer)
    assert parsed is not None, (answer[:500], err[-2000:])
    fields, image = parsed
    assert "kind" not in fields, fields
    assert image.decode().split() == [
        "fd0:refused",
        "fd1:refused",
        "fd2:refused",
        "fd3:refused",
    ], image
