"""
Integration tests for L{kcoral.compilers.nvcc.NvccBackend}: real nvcc (skipped
only when no nvcc can be found at all), and a scripted stand-in for the
process-handling paths.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import tempfile
import threading
import time

import pytest
from twisted.trial.unittest import SynchronousTestCase

from kcoral import compilers
from kcoral.compilers import compile_binary, compile_stats
from kcoral.compilers.nvcc import NvccBackend, find_nvcc
from kcoral.errors import ExecutionError

NVCC, WHY_NOT = find_nvcc()

GOOD = """\
extern "C" __global__ void add(float* a, const float* b, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) a[i] += b[i];
}
"""

# The error is on line 3.
BAD = """\
extern "C" __global__ void add(float* a, int n) {
  int i = threadIdx.x;
  a[i] = undefined_symbol_here;
}
"""


def _tmpdir(case: SynchronousTestCase) -> str:
    path = tempfile.mkdtemp(prefix="kcoral-test-nvcc-")
    case.addCleanup(shutil.rmtree, path, True)
    return path


def _elf_sm(image: bytes) -> int:
    """The SM number a CUDA ELF's C{e_flags} names (bits 8-15)."""
    (flags,) = struct.unpack_from("<I", image, 0x30)
    return (flags >> 8) & 0xFF


@pytest.mark.integration
class RealNvccTests(SynchronousTestCase):
    """L{NvccBackend} and L{compile_binary} with the real toolchain."""

    def setUp(self):
        if NVCC is None:
            raise self.skipTest(WHY_NOT)
        compilers._reset_for_tests()
        self.addCleanup(compilers._reset_for_tests)
        self.backend = NvccBackend()

    def test_versions(self):
        """C{versions()} reports nvcc's release."""
        versions = self.backend.versions()
        self.assertRegex(versions["nvcc"], r"^\d+\.\d+\.\d+$")
        self.assertTrue(versions["nvcc"].startswith(versions["cuda"]))
        self.assertEqual(self.backend.available(), (True, ""))

    def test_cubin(self):
        """Good source becomes a cubin (ELF) for exactly sm_90a."""
        image = self.backend.compile(GOOD, "sm_90a", ("-O3", "-lineinfo"), 120.0)
        self.assertEqual(image[:4], b"\x7fELF")
        self.assertEqual(_elf_sm(image), 90)
        cuobjdump = shutil.which("cuobjdump") or (
            os.path.join(os.path.dirname(NVCC), "cuobjdump") if NVCC else None
        )
        if cuobjdump and os.path.exists(cuobjdump):
            path = os.path.join(_tmpdir(self), "k.cubin")
            with open(path, "wb") as f:
                f.write(image)
            listing = subprocess.run(
                [cuobjdump, "--list-elf", path], capture_output=True, text=True, check=True
            ).stdout
            self.assertIn("sm_90a", listing)

    def test_otherArch(self):
        """The arch asked for is the arch produced."""
        self.assertEqual(_elf_sm(self.backend.compile(GOOD, "sm_80", (), 120.0)), 80)

    def test_fatbin(self):
        """C{-fatbin} or a virtual arch yields a fatbin, not an ELF cubin."""
        for arch, flags in (("sm_90a", ("-fatbin",)), ("compute_90a", ())):
            image = self.backend.compile(GOOD, arch, flags, 120.0)
            self.assertEqual(image[:4], b"\x50\xed\x55\xba", arch)

    def test_syntaxError(self):
        """A compile error is C{compile}, with the file name and line number."""
        with self.assertRaises(ExecutionError) as ctx:
            self.backend.compile(BAD, "sm_90a", (), 120.0)
        self.assertEqual(ctx.exception.kind, "compile")
        self.assertIn("kernel.cu(3)", ctx.exception.message)
        self.assertIn("undefined_symbol_here", ctx.exception.message)
        self.assertNotIn(tempfile.gettempdir(), ctx.exception.message)
        self.assertLess(len(ctx.exception.message), 700)

    def test_badArch(self):
        """A malformed arch is C{parse}; nvcc is not run."""
        for arch in ("sm90a", "sm_90z", "--run"):
            with self.assertRaises(ExecutionError) as ctx:
                self.backend.compile(GOOD, arch, (), 120.0)
            self.assertEqual(ctx.exception.kind, "parse")

    def test_unsupportedArch(self):
        """A well-formed arch nvcc does not support is nvcc's C{compile} error."""
        with self.assertRaises(ExecutionError) as ctx:
            self.backend.compile(GOOD, "sm_20", (), 120.0)
        self.assertEqual(ctx.exception.kind, "compile")
        self.assertIn("sm_20", ctx.exception.message)

    def test_disallowedFlag(self):
        """A flag choosing output files is C{parse}."""
        for flags in (("-o", "out/x.cubin"), ("--run",), ("-E",)):
            with self.assertRaises(ExecutionError) as ctx:
                self.backend.compile(GOOD, "sm_90a", flags, 120.0)
            self.assertEqual(ctx.exception.kind, "parse")

    def test_timeout(self):
        """A compile past its time limit is C{compile} 'nvcc timed out'."""
        with self.assertRaises(ExecutionError) as ctx:
            self.backend.compile(GOOD, "sm_90a", (), 0.001)
        self.assertEqual(ctx.exception.kind, "compile")
        self.assertEqual(ctx.exception.message, "nvcc timed out after 0.001s")

    def test_concurrent(self):
        """Two compiles in two threads both succeed, each with its own result."""
        results: dict[str, object] = {}

        def work(arch: str) -> None:
            try:
                results[arch] = self.backend.compile(GOOD, arch, (), 120.0)
            except BaseException as e:
                results[arch] = e

        threads = [threading.Thread(target=work, args=(a,)) for a in ("sm_90a", "sm_80")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(240)
        self.assertEqual(_elf_sm(results["sm_90a"]), 90)
        self.assertEqual(_elf_sm(results["sm_80"]), 80)

    def test_cacheHit(self):
        """Resubmitting a compile is a cache hit: nvcc runs once."""
        d = _tmpdir(self)
        first = compile_binary(GOOD, "sm_90a", ("-O3",), cache_dir=d)
        second = compile_binary(GOOD, "sm_90a", ("-O3",), cache_dir=d)
        self.assertEqual(first, second)
        stats = compile_stats()
        self.assertEqual(stats["compiles"], 1)
        self.assertEqual(stats["cache_hits"], 1)
        self.assertEqual(stats["cache_misses"], 1)
        self.assertGreater(stats["saved_seconds"], 0.0)


FAKE_NVCC = """\
#!/bin/sh
# stand-in for nvcc: MODE decides what happens
case "$*" in
  *--version*) echo "Cuda compilation tools, release 99.1, V99.1.7"; exit 0 ;;
esac
MODE={mode}
if [ "$MODE" = hang ]; then
  sleep 300 &
  echo $! > {pidfile}
  wait
fi
if [ "$MODE" = fail ]; then
  i=0
  while [ $i -lt 100 ]; do echo "kernel.cu($i): warning: noise noise noise"; i=$((i+1)); done
  echo "kernel.cu(7): error: the last error"
  exit 2
fi
if [ "$MODE" = env ]; then
  env > {pidfile}
fi
while [ $# -gt 0 ]; do
  if [ "$1" = -o ]; then printf 'IMAGE' > "$2"; fi
  shift
done
"""


@pytest.mark.integration
class ScriptedNvccTests(SynchronousTestCase):
    """Process handling of L{NvccBackend}, against a shell-script nvcc."""

    def backend(self, mode: str) -> tuple[NvccBackend, str]:
        d = _tmpdir(self)
        pidfile = os.path.join(d, "pid")
        path = os.path.join(d, "nvcc")
        with open(path, "w") as f:
            f.write(FAKE_NVCC.format(mode=mode, pidfile=pidfile))
        os.chmod(path, 0o755)
        return NvccBackend(nvcc_path=path), pidfile

    def test_versions(self):
        """C{versions()} parses and caches C{nvcc --version}."""
        backend, _ = self.backend("ok")
        self.assertEqual(backend.versions(), {"nvcc": "99.1.7", "cuda": "99.1"})
        self.assertEqual(backend.versions(), {"nvcc": "99.1.7", "cuda": "99.1"})

    def test_output(self):
        """The file nvcc wrote with C{-o} is returned."""
        backend, _ = self.backend("ok")
        self.assertEqual(backend.compile("x", "sm_90a", (), 30.0), b"IMAGE")

    def test_longDiagnostics(self):
        """Long diagnostics are shortened keeping both ends."""
        backend, _ = self.backend("fail")
        with self.assertRaises(ExecutionError) as ctx:
            backend.compile("x", "sm_90a", (), 30.0)
        message = ctx.exception.message
        self.assertEqual(ctx.exception.kind, "compile")
        self.assertIn("exit status 2", message)
        self.assertIn("kernel.cu(0): warning", message)
        self.assertTrue(message.endswith("kernel.cu(7): error: the last error"))
        self.assertLess(len(message), 700)

    def test_environment(self):
        """nvcc gets a scrubbed environment: no NVCC_APPEND_FLAGS smuggling."""
        backend, envfile = self.backend("env")
        self.patch(os, "environ", dict(os.environ, NVCC_APPEND_FLAGS="-o evil.cubin"))
        backend.compile("x", "sm_90a", (), 30.0)
        with open(envfile) as f:
            env = f.read()
        self.assertNotIn("NVCC_APPEND_FLAGS", env)
        self.assertIn("TMPDIR=", env)

    def test_timeoutKillsGroup(self):
        """On timeout nvcc's whole process group, grandchildren too, is killed."""
        backend, pidfile = self.backend("hang")
        started = time.monotonic()
        with self.assertRaises(ExecutionError) as ctx:
            backend.compile("x", "sm_90a", (), 0.5)
        self.assertLess(time.monotonic() - started, 10)
        self.assertEqual(ctx.exception.kind, "compile")
        self.assertEqual(ctx.exception.message, "nvcc timed out after 0.5s")
        with open(pidfile) as f:
            grandchild = int(f.read())
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{grandchild}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                break
            if state == "Z":
                break
            time.sleep(0.05)
        else:
            self.fail(f"grandchild {grandchild} survived the timeout")
