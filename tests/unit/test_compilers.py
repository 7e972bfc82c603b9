"""
Tests for L{kcoral.compilers}: the backend contract, plugin discovery,
argument policy, the compile cache and L{kcoral.compilers.compile_binary}.

Nothing here runs a compiler; see C{tests/integration/test_nvcc.py}.
"""

from __future__ import annotations

import importlib
import os
import shutil
import stat
import sys
import tempfile
import textwrap

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.logger import capturedLogs
from twisted.plugin import IPlugin
from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyObject

import kcoral.plugins
from kcoral import compilers
from kcoral.compilers import (
    DuplicateBackend,
    MissingBackend,
    backends,
    compile_binary,
    compile_stats,
    configure_cache,
    get_backend,
)
from kcoral.compilers.cache import CompileCache, cache_key
from kcoral.compilers.interfaces import KINDS, ICompilerBackend
from kcoral.compilers.nvcc import (
    NvccBackend,
    find_nvcc,
    parse_nvcc_version,
    probe_versions,
    shorten,
    validate_arch,
    validate_options,
)
from kcoral.compilers.sourcemodule import SourceModuleBackend, load_module_image
from kcoral.errors import ExecutionError
from kcoral.testing.fakes import FAKE_MAGIC, FakeCompilerBackend

SOURCE = 'extern "C" __global__ void k(float* x) { x[threadIdx.x] = 1.0f; }\n'


def _mktemp(case: SynchronousTestCase) -> str:
    """A fresh path (not created) in a private temporary directory, like C{mktemp}."""
    base = tempfile.mkdtemp(prefix="kcoral-test-compilers-")
    case.addCleanup(shutil.rmtree, base, True)
    return os.path.join(base, "temp")


def _executable(path: str, text: str = "#!/bin/sh\nexit 0\n") -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, 0o755)
    return path


class BackendContractTests:
    """
    What every L{ICompilerBackend} provider must do. Mix into a
    C{SynchronousTestCase} and define C{make_backend()}.
    """

    def make_backend(self):
        raise NotImplementedError

    def test_verifyObject(self):
        """The backend provides L{ICompilerBackend} (and C{IPlugin}) completely."""
        backend = self.make_backend()
        self.assertTrue(verifyObject(ICompilerBackend, backend))
        self.assertTrue(IPlugin.providedBy(backend))

    def test_name_and_kind(self):
        """C{name} is a non-empty string and C{kind} one of L{KINDS}."""
        backend = self.make_backend()
        self.assertIsInstance(backend.name, str)
        self.assertTrue(backend.name)
        self.assertIn(backend.kind, KINDS)

    def test_available(self):
        """C{available()} is C{(bool, str)}, with a reason when false."""
        ok, reason = self.make_backend().available()
        self.assertIsInstance(ok, bool)
        self.assertIsInstance(reason, str)
        if not ok:
            self.assertTrue(reason)

    def test_versions(self):
        """C{versions()} maps strings to strings."""
        versions = self.make_backend().versions()
        self.assertIsInstance(versions, dict)
        for key, value in versions.items():
            self.assertIsInstance(key, str)
            self.assertIsInstance(value, str)

    def test_badArch(self):
        """A malformed arch is a C{parse} error, toolchain or not."""
        for arch in ("sm90", "sm_9", "sm_90x", "gfx90a", "sm_90a; rm -rf /", 90):
            with self.assertRaises(ExecutionError) as ctx:
                self.make_backend().compile(SOURCE, arch, (), 30.0)
            self.assertEqual(ctx.exception.kind, "parse", arch)

    def test_disallowedFlag(self):
        """A flag that writes files or changes the output is a C{parse} error."""
        for flags in (("-o", "x"), ("--run",), ("-E",), ("-odir", "out"), ("-arch=sm_80",)):
            with self.assertRaises(ExecutionError) as ctx:
                self.make_backend().compile(SOURCE, "sm_90a", flags, 30.0)
            self.assertEqual(ctx.exception.kind, "parse", flags)

    def test_compileOrUnavailable(self):
        """C{compile} returns non-empty bytes, or fails C{unavailable} when not available."""
        backend = self.make_backend()
        ok, _ = backend.available()
        if ok:
            image = backend.compile(SOURCE, "sm_90a", (), 120.0)
            self.assertIsInstance(image, bytes)
            self.assertTrue(image)
        else:
            with self.assertRaises(ExecutionError) as ctx:
                backend.compile(SOURCE, "sm_90a", (), 120.0)
            self.assertEqual(ctx.exception.kind, "unavailable")


class FakeBackendContractTests(BackendContractTests, SynchronousTestCase):
    """L{FakeCompilerBackend} meets the contract."""

    def make_backend(self):
        return FakeCompilerBackend()


class UnavailableFakeBackendContractTests(BackendContractTests, SynchronousTestCase):
    """An unusable L{FakeCompilerBackend} meets the contract."""

    def make_backend(self):
        return FakeCompilerBackend(usable=(False, "no toolchain"))


class NvccBackendContractTests(BackendContractTests, SynchronousTestCase):
    """L{NvccBackend} meets the contract (compiling only where nvcc exists)."""

    def make_backend(self):
        return NvccBackend()


class MissingNvccBackendContractTests(BackendContractTests, SynchronousTestCase):
    """L{NvccBackend} without a toolchain meets the contract."""

    def make_backend(self):
        return NvccBackend(nvcc_path=os.path.join(_mktemp(self), "nvcc"))


class SourceModuleBackendContractTests(BackendContractTests, SynchronousTestCase):
    """L{SourceModuleBackend} meets the contract (unavailable without PyCUDA)."""

    def make_backend(self):
        return SourceModuleBackend()


class NvccLocationTests(SynchronousTestCase):
    """L{find_nvcc} and L{NvccBackend.available} without running anything."""

    def test_missingExplicitPath(self):
        """A configured nvcc that does not exist is unavailable, with the reason."""
        backend = NvccBackend(nvcc_path="/nonexistent/nvcc")
        ok, reason = backend.available()
        self.assertFalse(ok)
        self.assertIn("/nonexistent/nvcc", reason)
        self.assertEqual(backend.versions(), {})
        with self.assertRaises(ExecutionError) as ctx:
            backend.compile(SOURCE, "sm_90a", (), 10.0)
        self.assertEqual(ctx.exception.kind, "unavailable")

    def test_nothingFound(self):
        """The reason lists each place searched."""
        self.patch(compilers.nvcc, "_wheel_candidates", lambda: [])
        self.patch(compilers.nvcc, "STANDARD_LOCATIONS", ("/nonexistent/cuda/bin/nvcc",))
        path, reason = find_nvcc({"PATH": _mktemp(self)})
        self.assertIsNone(path)
        self.assertIn("not on PATH", reason)
        self.assertIn("$CUDA_HOME is not set", reason)
        self.assertIn("nvidia-cuda-nvcc", reason)
        self.assertIn("not at /nonexistent/cuda/bin/nvcc", reason)

    def test_path(self):
        """nvcc on C{PATH} wins."""
        d = _mktemp(self)
        nvcc = _executable(os.path.join(d, "nvcc"))
        home = _executable(os.path.join(_mktemp(self), "bin", "nvcc"))
        env = {"PATH": d, "CUDA_HOME": os.path.dirname(os.path.dirname(home))}
        self.assertEqual(find_nvcc(env), (nvcc, ""))

    def test_cudaHome(self):
        """Without nvcc on C{PATH}, C{$CUDA_HOME/bin/nvcc} is used."""
        home = _mktemp(self)
        nvcc = _executable(os.path.join(home, "bin", "nvcc"))
        self.assertEqual(find_nvcc({"PATH": _mktemp(self), "CUDA_HOME": home}), (nvcc, ""))

    def test_wheel(self):
        """
        Last, the C{nvidia-cuda-nvcc} wheel: C{nvidia/cu13/bin/nvcc} (13.x) or
        C{nvidia/cuda_nvcc/bin/nvcc} (12.x) inside the C{nvidia} namespace package.
        """
        if "nvidia" in sys.modules:
            raise self.skipTest("an nvidia package is already imported")
        for layout in (("cu13",), ("cuda_nvcc",)):
            site = _mktemp(self)
            nvcc = _executable(os.path.join(site, "nvidia", *layout, "bin", "nvcc"))
            sys.path.insert(0, site)
            importlib.invalidate_caches()
            try:
                path, _ = find_nvcc({"PATH": _mktemp(self)})
            finally:
                sys.path.remove(site)
            self.assertEqual(path, nvcc)


class ProbeTests(SynchronousTestCase):
    """
    C{nvcc --version} runs once per toolchain (issue 38): the answer is
    kept under the file's identity and asked again only when it changes.
    """

    def _nvcc(self, version: str) -> tuple[str, str]:
        base = _mktemp(self)
        calls = os.path.join(os.path.dirname(base), "calls")
        text = (
            f"#!/bin/sh\necho probed >> {calls}\n"
            f"echo 'Cuda compilation tools, release {version}, V{version}.1'\n"
        )
        return _executable(os.path.join(base, "bin", "nvcc"), text), calls

    def _calls(self, path: str) -> int:
        with open(path) as f:
            return len(f.readlines())

    def test_once_per_toolchain(self):
        """Asked twice, the same file is probed once; replaced, it is probed again."""
        nvcc, calls = self._nvcc("13.0")
        self.assertEqual(probe_versions(nvcc), {"nvcc": "13.0.1", "cuda": "13.0"})
        self.assertEqual(NvccBackend(nvcc_path=nvcc).versions()["nvcc"], "13.0.1")
        self.assertEqual(self._calls(calls), 1)
        with open(nvcc, "w") as f:  # an upgrade in place: new size and mtime
            f.write(
                f"#!/bin/sh\necho probed >> {calls}\n"
                "echo 'Cuda compilation tools, release 13.1, V13.1.7'\n"
            )
        os.utime(nvcc, ns=(1, 1))
        self.assertEqual(probe_versions(nvcc), {"nvcc": "13.1.7", "cuda": "13.1"})
        self.assertEqual(self._calls(calls), 2)

    def test_missing(self):
        """No file: no versions, nothing remembered."""
        self.assertEqual(probe_versions(os.path.join(_mktemp(self), "nvcc")), {})

    def test_warm_up(self):
        """C{warm_up} discovers the backends before a fork."""
        compilers._reset_for_tests()
        self.addCleanup(compilers._reset_for_tests)
        compilers.warm_up()
        self.assertIsNotNone(compilers._known)
        self.assertIn("nvcc", compilers._known)


class ValidationTests(SynchronousTestCase):
    """The arch and flag policy shared by the nvcc-based backends."""

    def test_archs(self):
        """C{sm_NN}/C{compute_NN} with optional C{a}/C{f} are accepted."""
        for arch in ("sm_80", "sm_90a", "sm_100f", "sm_120a", "compute_90a", "compute_75"):
            self.assertEqual(validate_arch(arch), arch)

    def test_allowedFlags(self):
        """The documented flags pass, with two-argument forms kept together."""
        workspace = _mktemp(self)
        os.makedirs(os.path.join(workspace, "include"))
        flags = (
            "-O3",
            "-lineinfo",
            "-std=c++17",
            "-DBLOCK=128",
            "-D",
            "TILE=32",
            "-DPATH_LIKE=a/b.c:d,e+f-g@h%i=j",
            "--use_fast_math",
            "-maxrregcount=64",
            "-Xptxas",
            "-v,-O3",
            "-Xptxas=--warn-on-spills",
            "-Iinclude",
            "-I",
            "include",
            "-fatbin",
        )
        args, fatbin = validate_options(flags, workspace)
        inc = "-I" + os.path.realpath(os.path.join(workspace, "include"))
        self.assertTrue(fatbin)
        self.assertEqual(
            args,
            [
                "-O3",
                "-lineinfo",
                "-std=c++17",
                "-DBLOCK=128",
                "-D",
                "TILE=32",
                "-DPATH_LIKE=a/b.c:d,e+f-g@h%i=j",
                "--use_fast_math",
                "-maxrregcount=64",
                "-Xptxas",
                "-v,-O3",
                "-Xptxas",
                "--warn-on-spills",
                inc,
                inc,
            ],
        )
        self.assertEqual(validate_options([], workspace), ([], False))

    def test_rejectedFlags(self):
        """Output-changing, file-writing and unknown flags are C{parse} errors."""
        workspace = _mktemp(self)
        os.makedirs(workspace)
        for flags in (
            ("-o", "out"),
            ("--output-file=x",),
            ("-odir", "."),
            ("--run",),
            ("-E",),
            ("-ptx",),
            ("-rdc=true",),
            ("-gencode", "arch=compute_90,code=sm_90"),
            ("-ccbin", "/bin/sh"),
            ("-I/etc",),
            ("-I", "../.."),
            ("-Xptxas", "-v,--output-file=out/x"),
            ("-Xcompiler", "-fPIC"),
            ("-D",),
            ("-std", "gnu99"),
            ("-maxrregcount=9999",),
            "-O3",
            (3,),
        ):
            with self.assertRaises(ExecutionError) as ctx:
                validate_options(flags, workspace)
            self.assertEqual(ctx.exception.kind, "parse", flags)

    def test_shellMetacharactersRefused(self):
        """
        nvcc runs its sub-commands through C{/bin/sh} with each value in
        double quotes (issue 32, item 1): a value holding any shell
        metacharacter is refused, in every form that takes a value, and
        the error names the flag and says why.
        """
        workspace = _mktemp(self)
        os.makedirs(os.path.join(workspace, "in$(id)"))
        os.makedirs(os.path.join(workspace, "ok"))
        os.symlink("in$(id)", os.path.join(workspace, "ok", "link"))
        for value in (
            "$(id)",
            "`id`",
            "a;b",
            "a b",
            'a"b',
            "a'b",
            "a\\b",
            "a|b",
            "a&b",
            "a>b",
            "a<b",
            "(1)",
            "*",
            "?",
            "[x]",
            "{x}",
            "~",
            "#",
            "!",
            "a\nb",
            "a\tb",
            "\x00",
            "\u00e9",
        ):
            for flags in (
                (f"-DX={value}",),
                ("-D", f"X={value}"),
                (f"--define-macro=X={value}",),
                ("--define-macro", f"X={value}"),
            ):
                with self.assertRaises(ExecutionError) as ctx:
                    validate_options(flags, workspace)
                self.assertEqual(ctx.exception.kind, "parse", flags)
                self.assertIn("compiler flag not allowed", ctx.exception.message)
                self.assertIn("#define", ctx.exception.message)
        for flags in (
            ("-Iin$(id)",),
            ("-I", "in$(id)"),
            ("--include-path=in$(id)",),
            ("-Iok/link",),  # resolves to a directory with a metacharacter
            ("-Xptxas", "-v;id"),
            ("-Xptxas=-v,$(id)",),
            ("-Xcompiler", "-DX=1"),
            ("-Xcompiler=-DX=$(id)",),
            ("--compiler-options", "-DX=1"),
            ("-Xcudafe", "x"),
            ("-Xnvlink", "x"),
            ("-Xlinker", "x"),
            ("--options-file", "flags.txt"),
            ("-optf", "flags.txt"),
            ("--compiler-bindir", "/bin"),
            ("-include", "x.h"),
            ("-isystem", "x"),
            ("-MF", "x"),
            ("--dependency-output", "x"),
            ("-O3\n",),
            ("-UX\n",),
            ("-U", "X\n"),
            ("-maxrregcount=\u0663",),
            ("-std=c++\u0661\u0667",),
        ):
            with self.assertRaises(ExecutionError) as ctx:
                validate_options(flags, workspace)
            self.assertEqual(ctx.exception.kind, "parse", flags)
        for arch in ("sm_90a\n", "sm_90a;", "sm_\u0669\u0660"):
            with self.assertRaises(ExecutionError):
                validate_arch(arch)

    @settings(max_examples=300, deadline=None)
    @given(
        st.lists(
            st.one_of(
                st.text(max_size=12),
                st.sampled_from(["-D", "-U", "-I", "-Xptxas", "-std", "-maxrregcount"]),
                st.builds(lambda v: "-DX=" + v, st.text(max_size=8)),
            ),
            max_size=6,
        )
    )
    def test_acceptedValuesAreShellInert(self, flags):
        """Whatever flags pass, every argument holds only letters, digits and C{_.,+=@%:/-}."""
        workspace = os.path.realpath(tempfile.gettempdir())
        try:
            args, _ = validate_options(flags, workspace)
        except ExecutionError:
            return
        for arg in args:
            self.assertRegex(arg, r"\A[A-Za-z0-9_.,+=@%:/-]*\Z")

    def test_shorten(self):
        """Long diagnostics keep both ends and stay near 600 characters."""
        text = "kernel.cu(3): error: first\n" + "x" * 5000 + "\n1 error detected"
        short = shorten(text)
        self.assertLessEqual(len(short), 620)
        self.assertTrue(short.startswith("kernel.cu(3): error: first"))
        self.assertTrue(short.endswith("1 error detected"))
        self.assertIn("characters omitted", short)
        self.assertEqual(shorten("  short\n"), "short")

    def test_parseVersion(self):
        """C{nvcc --version} yields the full and the CUDA release version."""
        out = (
            "nvcc: NVIDIA (R) Cuda compiler driver\n"
            "Cuda compilation tools, release 13.0, V13.0.88\n"
        )
        self.assertEqual(parse_nvcc_version(out), {"nvcc": "13.0.88", "cuda": "13.0"})
        self.assertEqual(parse_nvcc_version("garbage"), {})


class SourceModuleTests(SynchronousTestCase):
    """L{SourceModuleBackend} and L{load_module_image} without PyCUDA."""

    def setUp(self):
        try:
            import pycuda.driver  # noqa: F401
        except Exception:
            return
        raise self.skipTest("pycuda is importable here")

    def test_unavailable(self):
        """Without PyCUDA the backend says so and compile is C{unavailable}."""
        ok, reason = SourceModuleBackend().available()
        self.assertFalse(ok)
        self.assertIn("pycuda", reason)
        with self.assertRaises(ExecutionError) as ctx:
            SourceModuleBackend().compile(SOURCE, "sm_90a", (), 10.0)
        self.assertEqual(ctx.exception.kind, "unavailable")

    def test_loadUnavailable(self):
        """Loading an image without PyCUDA is C{unavailable}."""
        with self.assertRaises(ExecutionError) as ctx:
            load_module_image(b"\x7fELF")
        self.assertEqual(ctx.exception.kind, "unavailable")


class CompileCacheTests(SynchronousTestCase):
    """L{CompileCache}."""

    def test_key(self):
        """Every input changes the key."""
        base = (SOURCE, "sm_90a", ("-O3",), "nvcc", {"nvcc": "13.0.88"})
        key = cache_key(*base)
        self.assertEqual(len(key), 64)
        self.assertEqual(key, cache_key(*base))
        for i, other in enumerate(
            [SOURCE + " ", "sm_90", ("-O2",), "sourcemodule", {"nvcc": "13.0.89"}]
        ):
            changed = list(base)
            changed[i] = other
            self.assertNotEqual(cache_key(*changed), key, i)

    def test_roundTrip(self):
        """C{put} then C{get} returns the image; the file is private; counters move."""
        cache = CompileCache(_mktemp(self), 1 << 20)
        key = cache_key(SOURCE, "sm_90a", (), "fake", "1")
        self.assertIsNone(cache.get(key))
        cache.put(key, b"IMAGE", compile_seconds=1.5)
        self.assertEqual(cache.get(key), b"IMAGE")
        self.assertEqual(cache.stats(), {"hits": 1, "misses": 1, "saved_seconds": 1.5})
        path = os.path.join(cache.directory, key + ".bin")
        self.assertEqual(stat.S_IMODE(os.stat(path).st_mode), 0o600)
        self.assertEqual(stat.S_IMODE(os.stat(cache.directory).st_mode) & 0o077, 0)
        self.assertEqual([n for n in os.listdir(cache.directory) if n.startswith(".")], [])

    def test_corrupt(self):
        """A file without the header is a miss."""
        cache = CompileCache(_mktemp(self), 1 << 20)
        key = "a" * 64
        with open(os.path.join(cache.directory, key + ".bin"), "wb") as f:
            f.write(b"junk")
        self.assertIsNone(cache.get(key))
        self.assertEqual(cache.misses, 1)

    def test_badKey(self):
        """Keys are hex digests; anything else (a path, say) is refused."""
        cache = CompileCache(_mktemp(self), 1 << 20)
        self.assertRaises(ValueError, cache.get, "../../etc/passwd")

    def test_lru(self):
        """Over capacity, the least recently used (oldest mtime) entries go first."""
        cache = CompileCache(_mktemp(self), 3 * 1100)
        keys = [cache_key(str(i), "sm_90a", (), "fake", "1") for i in range(3)]
        for i, key in enumerate(keys):
            cache.put(key, b"x" * 1000)
            path = os.path.join(cache.directory, key + ".bin")
            os.utime(path, (1000 + i, 1000 + i))
        cache.get(keys[0])  # now the most recent
        new = cache_key("new", "sm_90a", (), "fake", "1")
        cache.put(new, b"y" * 1000)
        self.assertIsNone(cache.get(keys[1]))
        self.assertIsNotNone(cache.get(keys[0]))
        self.assertIsNotNone(cache.get(keys[2]))
        self.assertIsNotNone(cache.get(new))
        self.assertLessEqual(cache.size_bytes(), 3 * 1100)

    def test_tooBig(self):
        """An image larger than the whole cache is not stored."""
        cache = CompileCache(_mktemp(self), 100)
        key = "b" * 64
        cache.put(key, b"z" * 1000)
        self.assertIsNone(cache.get(key))


class CompileBinaryTests(SynchronousTestCase):
    """L{compile_binary} and L{compile_stats} with L{FakeCompilerBackend}."""

    def setUp(self):
        compilers._reset_for_tests()
        self.addCleanup(compilers._reset_for_tests)

    def test_compile(self):
        """The backend's image is returned; no cache unless configured."""
        fake = FakeCompilerBackend()
        image = compile_binary(SOURCE, "sm_90a", ("-O3",), 5.0, backend=fake)
        self.assertTrue(image.startswith(FAKE_MAGIC))
        self.assertEqual(fake.calls, [(SOURCE, "sm_90a", ("-O3",), 5.0)])
        stats = compile_stats()
        self.assertEqual((stats["compiles"], stats["uncached"], stats["cache_hits"]), (1, 1, 0))

    def test_remote_compile_reads_the_parents_entry(self):
        """
        With a remote compiler (a sandboxed worker's parent), the image comes
        from the entry the remote stored, not from a local compile.
        """
        fake = FakeCompilerBackend()
        d = _mktemp(self)
        asked = []

        def remote(source, arch, flags, backend, timeout):
            asked.append((arch, flags, backend))
            key = cache_key(source, arch, flags, backend, {"parent": "1"})
            CompileCache(d).put(key, b"IMAGE-FROM-PARENT", 2.0)
            return key, 2.0, False

        compilers.configure_remote(remote)
        image = compile_binary(SOURCE, "sm_90a", ("-O3",), backend=fake, cache_dir=d)
        self.assertEqual(image, b"IMAGE-FROM-PARENT")
        self.assertEqual(asked, [("sm_90a", ("-O3",), "fake")])
        self.assertEqual(fake.calls, [])
        stats = compile_stats()
        self.assertEqual((stats["compiles"], stats["cache_misses"], stats["cache_hits"]), (1, 1, 0))

    def test_remote_hit(self):
        """
        The remote found the entry: a hit, no compile counted, and this
        process neither probed the toolchain nor looked the cache up itself.
        """

        class NoProbe(FakeCompilerBackend):
            def versions(self):
                raise AssertionError("versions() probed")

        fake = NoProbe()
        d = _mktemp(self)
        key = "cd" * 32
        CompileCache(d).put(key, b"CACHED", 3.0)
        compilers.configure_remote(lambda *args: (key, 3.0, True))
        self.assertEqual(compile_binary(SOURCE, "sm_90a", (), backend=fake, cache_dir=d), b"CACHED")
        stats = compile_stats()
        self.assertEqual(
            (stats["compiles"], stats["cache_hits"], stats["saved_seconds"]), (0, 1, 3.0)
        )

    def test_remote_unavailable_compiles_here_uncached(self):
        """A backend the parent cannot run is compiled here, and nothing is cached."""
        fake = FakeCompilerBackend()
        d = _mktemp(self)

        def remote(source, arch, flags, backend, timeout):
            raise ExecutionError("unavailable", "no such backend in the parent")

        compilers.configure_remote(remote)
        image = compile_binary(SOURCE, "sm_90a", (), backend=fake, cache_dir=d)
        self.assertTrue(image.startswith(FAKE_MAGIC))
        self.assertEqual(CompileCache(d).entries(), [])

    def test_remote_compile_error(self):
        """A compile error from the parent is the request's compile error."""
        d = _mktemp(self)

        def remote(source, arch, flags, backend, timeout):
            raise ExecutionError("compile", "k.cu(1): error")

        compilers.configure_remote(remote)
        with self.assertRaises(ExecutionError) as caught:
            compile_binary(SOURCE, "sm_90a", (), backend=FakeCompilerBackend(), cache_dir=d)
        self.assertEqual(caught.exception.kind, "compile")

    def test_tampered_entry_is_a_miss(self):
        """Every read checks the image against the sha256 in its header."""
        d = _mktemp(self)
        cache = CompileCache(d)
        key = "ab" * 32
        cache.put(key, b"good image", 1.0)
        path = os.path.join(d, key + ".bin")
        data = bytearray(open(path, "rb").read())
        data[-1] ^= 0xFF
        with open(path, "wb") as f:
            f.write(data)
        self.assertIsNone(cache.read(key))
        self.assertIsNone(cache.get(key))
        self.assertEqual(cache.misses, 1)

    def test_cacheHit(self):
        """A resubmitted compile is served from the cache without calling the backend."""
        fake = FakeCompilerBackend()
        d = _mktemp(self)
        first = compile_binary(SOURCE, "sm_90a", (), backend=fake, cache_dir=d)
        second = compile_binary(SOURCE, "sm_90a", (), backend=fake, cache_dir=d)
        self.assertEqual(first, second)
        self.assertEqual(len(fake.calls), 1)
        compile_binary(SOURCE, "sm_80", (), backend=fake, cache_dir=d)
        self.assertEqual(len(fake.calls), 2)
        stats = compile_stats()
        self.assertEqual(stats["cache_hits"], 1)
        self.assertEqual(stats["cache_misses"], 2)
        self.assertEqual(stats["compiles"], 2)
        self.assertGreaterEqual(stats["saved_seconds"], 0.0)
        self.assertIn(os.path.abspath(d), stats["caches"])

    def test_toolchainVersionInKey(self):
        """A new toolchain version misses the cache."""
        d = _mktemp(self)
        compile_binary(SOURCE, "sm_90a", backend=FakeCompilerBackend(version="1"), cache_dir=d)
        newer = FakeCompilerBackend(version="2")
        compile_binary(SOURCE, "sm_90a", backend=newer, cache_dir=d)
        self.assertEqual(len(newer.calls), 1)

    def test_configuredCache(self):
        """L{configure_cache} sets the cache used without C{cache_dir}."""
        fake = FakeCompilerBackend()
        configure_cache(_mktemp(self))
        compile_binary(SOURCE, "sm_90a", backend=fake)
        compile_binary(SOURCE, "sm_90a", backend=fake)
        self.assertEqual(len(fake.calls), 1)
        configure_cache(None)

    def test_includeNotCached(self):
        """Compiles with C{-I} bypass the cache: headers are not in the key."""
        fake = FakeCompilerBackend()
        d = _mktemp(self)
        for _ in range(2):
            compile_binary(SOURCE, "sm_90a", ("-I.",), backend=fake, cache_dir=d)
        self.assertEqual(len(fake.calls), 2)

    def test_failureNotCached(self):
        """A failed compile raises the backend's error and stores nothing."""
        fake = FakeCompilerBackend(fail=ExecutionError("compile", "kernel.cu(1): error"))
        d = _mktemp(self)
        for _ in range(2):
            with self.assertRaises(ExecutionError) as ctx:
                compile_binary(SOURCE, "sm_90a", backend=fake, cache_dir=d)
            self.assertEqual(ctx.exception.kind, "compile")
        self.assertEqual(len(fake.calls), 2)
        self.assertEqual(compile_stats()["failures"], 2)

    def test_unavailable(self):
        """A backend that is not available fails C{unavailable} with its reason."""
        fake = FakeCompilerBackend(usable=(False, "nvcc not found"))
        with self.assertRaises(ExecutionError) as ctx:
            compile_binary(SOURCE, "sm_90a", backend=fake)
        self.assertEqual(ctx.exception.kind, "unavailable")
        self.assertIn("nvcc not found", ctx.exception.message)
        self.assertEqual(fake.calls, [])

    def test_unknownBackend(self):
        """An unknown backend name is C{unavailable}."""
        with self.assertRaises(ExecutionError) as ctx:
            compile_binary(SOURCE, "sm_90a", backend="no-such-backend")
        self.assertEqual(ctx.exception.kind, "unavailable")
        self.assertIn("no-such-backend", ctx.exception.message)

    def test_badArguments(self):
        """A non-string arch or flag is a C{parse} error before any compile."""
        fake = FakeCompilerBackend()
        for arch, flags in ((90, ()), ("sm_90a", "-O3"), ("sm_90a", (1,))):
            with self.assertRaises(ExecutionError) as ctx:
                compile_binary(SOURCE, arch, flags, backend=fake)
            self.assertEqual(ctx.exception.kind, "parse")
        self.assertEqual(fake.calls, [])


class DiscoveryTests(SynchronousTestCase):
    """L{backends} and L{get_backend} over C{kcoral.plugins}."""

    def setUp(self):
        compilers._reset_for_tests()
        self.addCleanup(compilers._reset_for_tests)

    def plugin_dir(self, modules: dict[str, str]) -> None:
        """
        Write C{modules} into C{<tmp>/kcoral/plugins/} (no C{__init__.py}, as a
        third party would ship them), put C{<tmp>} on C{sys.path}, and extend
        C{kcoral.plugins.__path__} as C{pluginPackagePaths} does at import.
        """
        from twisted.plugin import pluginPackagePaths

        root = os.path.abspath(_mktemp(self))
        plugins = os.path.join(root, "kcoral", "plugins")
        os.makedirs(plugins)
        for name, text in modules.items():
            with open(os.path.join(plugins, name + ".py"), "w") as f:
                f.write(textwrap.dedent(text))
            self.addCleanup(sys.modules.pop, "kcoral.plugins." + name, None)
        sys.path.insert(0, root)
        self.addCleanup(sys.path.remove, root)
        extra = [p for p in pluginPackagePaths("kcoral.plugins") if p.startswith(root)]
        self.assertEqual(extra, [plugins])
        self.patch(kcoral.plugins, "__path__", list(kcoral.plugins.__path__) + extra)

    def test_builtins(self):
        """Both built-in backends are discovered, each providing the interface."""
        found = backends()
        self.assertIsInstance(found["nvcc"], NvccBackend)
        self.assertIsInstance(found["sourcemodule"], SourceModuleBackend)
        for name, backend in found.items():
            self.assertEqual(backend.name, name)
            self.assertTrue(verifyObject(ICompilerBackend, backend))
        self.assertIs(get_backend("nvcc"), found["nvcc"])

    def test_missing(self):
        """An unknown name raises L{MissingBackend} naming the known ones."""
        with self.assertRaises(MissingBackend) as ctx:
            get_backend("triton")
        self.assertIn("triton", str(ctx.exception))
        self.assertIn("nvcc", str(ctx.exception))

    def test_thirdParty(self):
        """
        A module in another C{kcoral/plugins} directory on C{sys.path} adds a
        backend that L{compile_binary} can use by name.
        """
        self.plugin_dir(
            {
                "thirdparty_backend": """
                from kcoral.testing.fakes import FakeCompilerBackend

                thirdparty = FakeCompilerBackend(name="thirdparty", version="7")
                """
            }
        )
        found = backends()
        self.assertIn("nvcc", found)
        self.assertIn("thirdparty", found)
        image = compile_binary(SOURCE, "sm_90a", backend="thirdparty")
        self.assertTrue(image.startswith(FAKE_MAGIC))
        self.assertEqual(len(found["thirdparty"].calls), 1)

    def test_thirdPartyFoundLazily(self):
        """L{get_backend} rescans when a name is not known yet."""
        backends()
        self.plugin_dir(
            {
                "late_backend": """
                from kcoral.testing.fakes import FakeCompilerBackend

                late = FakeCompilerBackend(name="late")
                """
            }
        )
        self.assertEqual(get_backend("late").name, "late")

    def test_duplicate(self):
        """Two backends with one name are an error."""
        self.plugin_dir(
            {
                "dup_backend": """
                from kcoral.testing.fakes import FakeCompilerBackend

                one = FakeCompilerBackend(name="nvcc")
                """
            }
        )
        with self.assertRaises(DuplicateBackend) as ctx:
            backends()
        self.assertIn("'nvcc'", str(ctx.exception))

    def test_invalidSkipped(self):
        """A plugin claiming the interface without implementing it is skipped with a warning."""
        self.plugin_dir(
            {
                "broken_backend": """
                from twisted.plugin import IPlugin
                from zope.interface import directlyProvides

                from kcoral.compilers.interfaces import ICompilerBackend


                class Broken:
                    name = "broken"


                broken = Broken()
                directlyProvides(broken, IPlugin, ICompilerBackend)
                """
            }
        )
        with capturedLogs() as events:
            found = backends()
        self.assertNotIn("broken", found)
        self.assertIn("nvcc", found)
        warnings = [e for e in events if "skipping invalid compiler backend" in e["log_format"]]
        self.assertEqual(len(warnings), 1)


def test_add_extern_c_gives_kernels_plain_names() -> None:
    """Non-template kernels get C linkage; templates and explicit extern "C" are left alone."""
    from kcoral.compilers.source import add_extern_c

    assert add_extern_c("__global__ void k(int *p) {}") == 'extern "C" __global__ void k(int *p) {}'
    template = "template <int N>\n__global__ void t(float *p) {}"
    assert add_extern_c(template) == template
    explicit = 'extern "C" __global__ void k() {}'
    assert add_extern_c(explicit) == explicit
