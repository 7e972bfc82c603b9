"""
Planting a compiled image in the shared compile cache (issue 13, item 6):
the cache is read-only in every worker; the parent compiles in a sandbox of
its own and writes the entries, which reads check against their sha256.
"""

from __future__ import annotations

import json
import os
import shutil
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


#: A hostile toolchain: as nvcc's descendants would, it tries to write each
#: of the compile process's descriptors through /proc, then reports what it
#: could do as the "image".
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
report=""
for fd in 0 1 2 3; do
  if (printf 'FORGED\n' > /proc/$PPID/fd/$fd) 2>/dev/null; then
    report="$report fd$fd:written"
  else
    report="$report fd$fd:refused"
  fi
done
printf '%s' "$report" > "$out"
"""


@pytest.fixture(scope="module")
def hostile_toolchain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    base = tmp_path_factory.mktemp("hostile-toolchain")
    bin_dir = base / "bin"
    bin_dir.mkdir()
    nvcc = bin_dir / "nvcc"
    nvcc.write_text(HOSTILE_NVCC)
    nvcc.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    server = ServerProcess(
        ["--device", "cpu", "--sandbox", "bubblewrap", "--num-workers", "1"]
        + ["--log-dir", "", "--disk-cache-dir", str(base / "files")]
        + ["--sandbox-readonly-path", str(bin_dir)],
        env=env,
    )
    server.start()
    yield server
    server.stop()


def test_the_compiles_descendants_cannot_write_its_descriptors(
    hostile_toolchain: ServerProcess,
) -> None:
    """
    Issue 32, item 1: whatever runs below the isolated compile (here nvcc
    itself, replaced by a script) cannot open the compile process's
    descriptors through /proc (it is non-dumpable), so it cannot write the
    answer; the server stores what nvcc wrote under the request's own key.
    """
    response = hostile_toolchain.execute(_compile_program(VICTIM, "victim"))
    body, parts = decode_response(response.headers["content-type"], response.body)
    assert body["status"] == "COMPLETED", body
    report = decode_results(body["results"], parts)["image"].decode()
    assert report.split() == ["fd0:refused", "fd1:refused", "fd2:refused", "fd3:refused"], report
