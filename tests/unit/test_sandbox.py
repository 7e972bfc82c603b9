"""
Tests for L{kcoral.server.sandbox.bubblewrap}: the bubblewrap command line, workspace
preparation and clearing, and the sandbox choice without a probe.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyObject

from kcoral.server.sandbox import bubblewrap as sandbox_module
from kcoral.server.sandbox.bubblewrap import PACKAGE_MOUNT, RUNTIME_MOUNT, BubblewrapSandbox
from kcoral.server.sandbox.interface import ISandbox, SandboxError, package_root
from kcoral.server.sandbox.nosandbox import NoSandbox
from kcoral.server.sandbox.probe import choose_sandbox
from kcoral.server.sandbox.seats import RESERVED_SUBDIRS


def _worker_python(path: str = sys.executable) -> str:
    """C{path} (the server's interpreter) as a sandboxed worker names it."""
    return BubblewrapSandbox([]).path_inside(path)


def _pairs(argv: list[str], flag: str) -> list[tuple[str, str]]:
    """The C{(a, b)} operands of every C{flag a b} in C{argv}."""
    return [(argv[i + 1], argv[i + 2]) for i, arg in enumerate(argv) if arg == flag]


def _singles(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv) if arg == flag]


class _TempMixin:
    def make_dir(self) -> Path:
        """A fresh directory under the system temp dir, removed after the test."""
        path = Path(tempfile.mkdtemp(prefix="kcoral-test-"))
        self.addCleanup(_force_rmtree, path)  # type: ignore[attr-defined]
        return path


def _force_rmtree(path: Path) -> None:
    def onerror(func, p, exc):  # type: ignore[no-untyped-def]
        os.chmod(os.path.dirname(p), 0o700)
        func(p)

    if path.exists():
        for root, dirs, _files in os.walk(path):
            for d in dirs:
                full = os.path.join(root, d)
                if not os.path.islink(full):
                    os.chmod(full, 0o700)
        shutil.rmtree(path, onerror=onerror)


class InterfaceTests(SynchronousTestCase):
    """Both sandboxes provide L{ISandbox}."""

    def test_bubblewrap_provides(self) -> None:
        """L{BubblewrapSandbox} provides L{ISandbox} and names itself."""
        sandbox = BubblewrapSandbox([])
        self.assertTrue(verifyObject(ISandbox, sandbox))
        self.assertEqual((sandbox.name, sandbox.reserved), ("bubblewrap", ".kcoral"))

    def test_none_provides(self) -> None:
        """L{NoSandbox} provides L{ISandbox} and reserves nothing."""
        sandbox = NoSandbox()
        self.assertTrue(verifyObject(ISandbox, sandbox))
        self.assertEqual((sandbox.name, sandbox.reserved), ("none", None))


class BubblewrapCommandTests(_TempMixin, SynchronousTestCase):
    """The bubblewrap argv and environment follow the server spec 6.2."""

    def setUp(self) -> None:
        self.seat = self.make_dir()
        self.work = self.seat / "work"
        self.work.mkdir()

    def command(self, sandbox: BubblewrapSandbox, gpu_devices: list[str] | None = None):
        return sandbox.command(
            python=sys.executable,
            worker_args=["--worker-id", "cpu/w0"],
            work_dir=self.work,
            gpu_devices=gpu_devices or [],
        )

    def test_private_workspace_only_for_workers(self) -> None:
        """
        With C{workspace_bytes} a worker's (and the probe's) workspace is a
        tmpfs of that size with the reserved layout; a compile's
        (C{run_command}), whose output the server reads on the host, and a
        template's stay the host directory, bound.
        """
        sandbox = BubblewrapSandbox([], workspace_bytes=1 << 20)
        _executable, argv, _env = self.command(sandbox)
        at = argv.index("--tmpfs")
        while argv[at + 1] != "/work":
            at = argv.index("--tmpfs", at + 1)
        self.assertEqual(argv[at - 4 : at], ["--size", str(1 << 20), "--perms", "0700"])
        self.assertIn("/work/.kcoral/tmp", argv)
        self.assertNotIn(os.path.realpath(self.work), argv)
        for argv in (
            sandbox.run_command(["true"], self.work)[1],
            self.command(BubblewrapSandbox([]))[1],
        ):
            bound = argv.index("/work") - 2
            self.assertEqual(argv[bound : bound + 2], ["--bind", os.path.realpath(self.work)])
        probe = sandbox.probe_command(self.work, [])
        self.assertIn(str(1 << 20), probe)

    def test_tmp_bound_when_runtime_under_tmp(self) -> None:
        """
        A read-only path under /tmp cannot sit below a /tmp symlink: the
        private tmp directory is bound at /tmp first, the path mounted on it,
        and clearing the workspace keeps that mount point.
        """
        with tempfile.TemporaryDirectory(dir="/tmp") as extra:
            sandbox = BubblewrapSandbox([extra])
            _executable, argv, _env = self.command(sandbox)
            tmp_bind = argv.index("/tmp") - 2
            self.assertEqual(argv[tmp_bind], "--bind")
            self.assertTrue(argv[tmp_bind + 1].endswith("/.kcoral/tmp"))
            self.assertLess(tmp_bind, argv.index(extra) - 2)
            self.assertNotIn(
                "/work/.kcoral/tmp",
                [
                    argv[i + 1]
                    for i, a in enumerate(argv)
                    if a == "--symlink" and argv[i + 2] == "/tmp"
                ],
            )
            keep = sandbox._mount_points_in_workspace()
            parts = os.path.relpath(extra, "/tmp").split(os.sep)
            node = keep[".kcoral"]["tmp"]
            for part in parts[:-1]:
                node = node[part]
            self.assertEqual(node[parts[-1]], {})

    def test_run_command_binds_its_workspace(self) -> None:
        """
        The server's compiles (C{run_command}) see the host workspace at
        /work, where the server wrote the source and reads the image, even
        when workers get a private tmpfs there (C{workspace_bytes}); the
        given environment replaces the server's.
        """
        sandbox = BubblewrapSandbox([], workspace_bytes=1 << 20)
        _, worker, _ = self.command(sandbox)
        self.assertIn(
            "--tmpfs", [worker[i] for i in range(len(worker)) if worker[i + 1 : i + 2] == ["/work"]]
        )
        _, argv, env = sandbox.run_command(["/usr/bin/true"], self.work, env={"PATH": "/bin"})
        binds = [
            argv[i + 1] for i, a in enumerate(argv) if a == "--bind" and argv[i + 2] == "/work"
        ]
        self.assertEqual(binds, [os.path.realpath(self.work)])
        self.assertNotIn(["--tmpfs", "/work"], [argv[i : i + 2] for i in range(len(argv))])
        self.assertEqual(env, {"PATH": "/bin"})

    def test_order(self) -> None:
        """Flags, mounts, devices, links, env, chdir and the root remount come in spec order."""
        executable, argv, _env = self.command(BubblewrapSandbox([]))
        # Where this checkout or its virtualenv lives under /tmp, /tmp is bound
        # first (test_tmp_bound_when_runtime_under_tmp); the rest is the same.
        tmp_linked = True
        while argv[8] == "--bind" and argv[10] in ("/tmp", "/var/tmp"):
            tmp_linked = False
            del argv[8:11]
        self.assertEqual(executable, "bwrap")
        self.assertEqual(argv[0], "bwrap")
        self.assertEqual(
            argv[1:9],
            [
                "--unshare-all",
                "--unshare-user",
                "--die-with-parent",
                "--new-session",
                "--cap-drop",
                "ALL",
                "--disable-userns",
                "--ro-bind",
            ],
        )

        def first(flag: str, operand: str | None = None) -> int:
            for i, arg in enumerate(argv):
                if arg == flag and (operand is None or argv[i + 1] == operand):
                    return i
            self.fail(f"{flag} {operand} missing")

        last_ro = max(i for i, a in enumerate(argv) if a == "--ro-bind")
        positions = [
            last_ro,
            first("--bind"),
            first("--proc"),
            first("--dir", "/dev"),
            first("--dev-bind", "/dev/null"),
            first("--symlink"),
            first("--setenv"),
            first("--remount-ro", "/proc"),
            first("--chdir"),
            first("--remount-ro", "/"),
            first("--"),
        ]
        self.assertEqual(positions, sorted(positions))
        self.assertEqual(
            argv[first("--") :],
            ["--", _worker_python(), "-m", "kcoral.worker", "--worker-id", "cpu/w0"],
        )
        self.assertEqual(_pairs(argv, "--bind"), [(os.path.realpath(self.work), "/work")])
        self.assertEqual(_singles(argv, "--chdir"), ["/work"])
        self.assertEqual(
            [d for d, _ in _pairs(argv, "--dev-bind")],
            ["/dev/null", "/dev/zero", "/dev/random", "/dev/urandom", "/dev/full"],
        )
        tmp_links = [("/work/.kcoral/tmp", "/tmp")] if tmp_linked else []
        self.assertEqual(
            [(s, d) for s, d in _pairs(argv, "--symlink")],
            [
                *tmp_links,
                ("/work/.kcoral/tmp", "/var/tmp"),
                ("/work/.kcoral/shm", "/dev/shm"),
                ("/proc/self/fd", "/dev/fd"),
                ("/proc/self/fd/0", "/dev/stdin"),
                ("/proc/self/fd/1", "/dev/stdout"),
                ("/proc/self/fd/2", "/dev/stderr"),
            ],
        )

    def test_executable_from_probe(self) -> None:
        """Once the probe resolved bwrap, its path is the executable and argv[0]."""
        executable, argv, _ = self.command(BubblewrapSandbox([], executable="/usr/bin/bwrap"))
        self.assertEqual((executable, argv[0]), ("/usr/bin/bwrap", "/usr/bin/bwrap"))

    def test_disable_userns_optional(self) -> None:
        """Without C{--disable-userns} support the flag is left out."""
        _, argv, _ = self.command(BubblewrapSandbox([], disable_userns=False))
        self.assertNotIn("--disable-userns", argv)

    def test_runtime_mounts(self) -> None:
        """
        Existing runtime paths are bound read-only, resolved source at the
        unresolved destination, in spec order, followed by the Python prefixes.
        """
        _, argv, _ = self.command(BubblewrapSandbox([]))
        binds = _pairs(argv, "--ro-bind")
        expected = [
            (os.path.realpath(p), p)
            for p in ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/sys")
            if os.path.exists(p)
        ]
        self.assertEqual(binds[: len(expected)], expected)
        dests = [d for _, d in binds]
        self.assertIn(_worker_python(sys.prefix), dests)
        self.assertEqual(len(dests), len(set(dests)))
        if os.path.islink("/bin"):
            self.assertIn((os.path.realpath("/bin"), "/bin"), binds)
        self.assertNotIn("/etc", dests)
        self.assertNotIn("/home", dests)

    def test_package_root(self) -> None:
        """
        Only the C{kcoral} package directory is bound (not the checkout
        around it), and its parent is first on C{PYTHONPATH}; under C{/work}
        it is bound below L{PACKAGE_MOUNT} instead.
        """
        _, argv, env = self.command(BubblewrapSandbox([]))
        root = package_root()
        dest = PACKAGE_MOUNT if root == "/work" or root.startswith("/work/") else root
        binds = _pairs(argv, "--ro-bind")
        self.assertIn((os.path.join(root, "kcoral"), os.path.join(dest, "kcoral")), binds)
        self.assertNotIn((root, dest), binds)
        setenv = dict(_pairs(argv, "--setenv"))
        self.assertEqual(setenv["PYTHONPATH"].split(":")[0], dest)

    def test_virtualenv_under_workspace_moved(self) -> None:
        """
        A virtualenv where the workspace is mounted (a checkout under
        C{/work} on the host) is bound below L{RUNTIME_MOUNT} instead, and
        the worker's interpreter is named by its path there, so that Python
        still finds the virtualenv's C{pyvenv.cfg}.
        """
        workspace = self.make_dir()
        venv = workspace / "checkout" / ".venv"
        (venv / "bin").mkdir(parents=True)
        python = str(venv / "bin" / "python")
        self.patch(sandbox_module, "WORKSPACE", str(workspace))
        self.patch(sys, "prefix", str(venv))
        sandbox = BubblewrapSandbox([])
        executable, argv, _ = sandbox.command(
            python=python, worker_args=["-x"], work_dir=self.work, gpu_devices=[]
        )
        moved = f"{RUNTIME_MOUNT}/0"
        self.assertIn((os.path.realpath(venv), moved), _pairs(argv, "--ro-bind"))
        self.assertNotIn(str(venv), [d for _, d in _pairs(argv, "--ro-bind")])
        self.assertEqual(argv[argv.index("--") + 1], f"{moved}/bin/python")
        self.assertEqual(sandbox.path_inside("/usr/bin/python3"), "/usr/bin/python3")

    def test_server_paths_under_a_mount_are_masked(self) -> None:
        """
        A log directory inside a bound directory (a virtualenv, a --target
        directory) is covered by an empty read-only tmpfs.
        """
        base = self.make_dir()
        logs = base / "logs"
        logs.mkdir()
        outside = self.make_dir()
        sandbox = BubblewrapSandbox([base], hidden_paths=[logs, outside])
        _, argv, _ = self.command(sandbox)
        i = argv.index(str(logs))
        self.assertEqual(
            argv[i - 3 : i + 3], ["--size", "4096", "--tmpfs", str(logs), "--remount-ro", str(logs)]
        )
        # After the mount that would show it.
        self.assertLess(argv.index(str(base)), i)
        self.assertNotIn(str(outside), argv)

    def test_readonly_symlink_resolved(self) -> None:
        """An extra read-only path that is a link is bound from its target at its own name."""
        base = self.make_dir()
        (base / "real").mkdir()
        (base / "link").symlink_to(base / "real")
        _, argv, _ = self.command(BubblewrapSandbox([base / "link"]))
        self.assertIn((str(base / "real"), str(base / "link")), _pairs(argv, "--ro-bind"))

    def test_duplicates_skipped(self) -> None:
        """The same destination is bound once, whether repeated or already a runtime path."""
        base = self.make_dir()
        extra = str(base / "lib")
        os.mkdir(extra)
        _, argv, _ = self.command(BubblewrapSandbox([extra, extra, "/usr", extra + "/"]))
        dests = [d for _, d in _pairs(argv, "--ro-bind")]
        self.assertEqual(dests.count(extra), 1)
        self.assertEqual(dests.count("/usr"), 1)

    def test_relative_made_absolute(self) -> None:
        """A relative read-only path is made absolute."""
        base = self.make_dir()
        (base / "rel").mkdir()
        cwd = os.getcwd()
        os.chdir(base)
        self.addCleanup(os.chdir, cwd)
        _, argv, _ = self.command(BubblewrapSandbox(["rel"]))
        self.assertIn((str(base / "rel"), str(base / "rel")), _pairs(argv, "--ro-bind"))

    def test_refuse_root(self) -> None:
        """A read-only path that is, or resolves to, C{/} is refused."""
        base = self.make_dir()
        (base / "root-link").symlink_to("/")
        for path in ("/", str(base / "root-link")):
            error = self.assertRaises(SandboxError, self.command, BubblewrapSandbox([path]))
            self.assertEqual(
                str(error), f"read-only runtime path contains sandbox workspaces: {path}"
            )

    def test_refuse_containing_workspace(self) -> None:
        """A read-only path containing the seat's workspace is refused."""
        for path in (self.seat, self.seat.parent, self.work):
            error = self.assertRaises(SandboxError, self.command, BubblewrapSandbox([path]))
            self.assertEqual(
                str(error), f"read-only runtime path contains sandbox workspaces: {path}"
            )

    def test_refuse_containing_workspace_through_link(self) -> None:
        """The check uses resolved paths: a link to the seat is refused too."""
        base = self.make_dir()
        (base / "seat-link").symlink_to(self.seat)
        self.assertRaises(SandboxError, self.command, BubblewrapSandbox([base / "seat-link"]))

    def test_refuse_under_workspace_mount(self) -> None:
        """An extra path hidden by the C{/work} mount point is refused."""
        if not os.path.isdir("/work"):
            raise self.skipTest("no /work on this host")
        self.assertRaises(SandboxError, self.command, BubblewrapSandbox(["/work"]))

    def test_missing_readonly_path(self) -> None:
        """A missing extra read-only path makes the command impossible."""
        missing = str(self.make_dir() / "missing")
        error = self.assertRaises(SandboxError, self.command, BubblewrapSandbox([missing]))
        self.assertEqual(str(error), f"sandbox read-only path does not exist: {missing}")

    def test_readonly_dirs_on_pythonpath(self) -> None:
        """Extra read-only directories, not files, follow the package dir on C{PYTHONPATH}."""
        base = self.make_dir()
        (base / "a").mkdir()
        (base / "b").mkdir()
        (base / "f.txt").write_text("x")
        sandbox = BubblewrapSandbox([base / "b", base / "f.txt", base / "a"])
        _, argv, env = self.command(sandbox)
        setenv = dict(_pairs(argv, "--setenv"))
        self.assertEqual(setenv["PYTHONPATH"].split(":")[1:], [str(base / "b"), str(base / "a")])
        self.assertEqual(env["PYTHONPATH"], setenv["PYTHONPATH"])
        self.assertIn((str(base / "f.txt"), str(base / "f.txt")), _pairs(argv, "--ro-bind"))

    def test_readonly_under_tmp_skips_tmp_link(self) -> None:
        """A read-only mount under C{/tmp} suppresses the C{/tmp} link, not C{/var/tmp}."""
        base = Path(tempfile.mkdtemp(dir="/tmp"))
        self.addCleanup(_force_rmtree, base)
        _, argv, _ = self.command(BubblewrapSandbox([base]))
        links = [d for _, d in _pairs(argv, "--symlink")]
        self.assertNotIn("/tmp", links)
        self.assertIn("/var/tmp", links)

    def test_environment(self) -> None:
        """The spec's variables are set inside; the spawn env is the server's plus them."""
        _, argv, env = self.command(BubblewrapSandbox([]))
        setenv = dict(_pairs(argv, "--setenv"))
        expected = {
            "HOME": "/work/.kcoral/home",
            "TMPDIR": "/work/.kcoral/tmp",
            "TMP": "/work/.kcoral/tmp",
            "TEMP": "/work/.kcoral/tmp",
            "XDG_CACHE_HOME": "/work/.kcoral/cache",
            "CUDA_CACHE_PATH": "/work/.kcoral/cuda",
            "TRITON_CACHE_DIR": "/work/.kcoral/triton",
            "TORCH_EXTENSIONS_DIR": "/work/.kcoral/extensions",
            "TVM_FFI_CACHE_DIR": "/work/.kcoral/cache/tvm-ffi",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONNOUSERSITE": "1",
        }
        for key, value in expected.items():
            self.assertEqual(setenv[key], value)
            self.assertEqual(env[key], value)
        self.assertIn("PYTHONPATH", setenv)
        for key, value in os.environ.items():
            if key not in setenv:
                self.assertEqual(env[key], value)

    def test_cpu_remounts_proc(self) -> None:
        """CPU workers get a read-only C{/proc}, GPU workers a writable one."""
        _, cpu, _ = self.command(BubblewrapSandbox([]))
        self.assertEqual(_singles(cpu, "--remount-ro"), ["/proc", "/"])
        node = self.make_dir() / "nvidia7"
        node.write_text("")
        _, gpu, _ = self.command(BubblewrapSandbox([]), [str(node)])
        self.assertEqual(_singles(gpu, "--remount-ro"), ["/"])

    def test_gpu_nodes(self) -> None:
        """
        A GPU worker gets its own existing device nodes (paths or minors) after
        the pseudo devices, plus any control nodes; missing ones are skipped.
        """
        base = self.make_dir()
        node = base / "nvidia3"
        node.write_text("")
        missing = str(base / "nvidia4")
        _, argv, _ = self.command(BubblewrapSandbox([]), [str(node), missing, "98765"])
        devs = [d for d, _ in _pairs(argv, "--dev-bind")]
        self.assertEqual(
            devs[:6],
            ["/dev/null", "/dev/zero", "/dev/random", "/dev/urandom", "/dev/full", str(node)],
        )
        self.assertNotIn(missing, devs)
        self.assertNotIn("/dev/nvidia98765", devs)
        for control in ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"):
            self.assertEqual(control in devs, os.path.exists(control))
        for src, dst in _pairs(argv, "--dev-bind"):
            self.assertEqual(src, dst)

    def test_cpu_has_no_gpu_nodes(self) -> None:
        """A CPU worker gets only the five pseudo devices."""
        _, argv, _ = self.command(BubblewrapSandbox([]))
        self.assertEqual(len(_pairs(argv, "--dev-bind")), 5)

    def test_probe_command(self) -> None:
        """The probe runs the same command line with an isolated Python program."""
        argv = BubblewrapSandbox([]).probe_command(self.work, [])
        tail = argv[argv.index("--") + 1 :]
        self.assertEqual(tail[:4], [_worker_python(), "-I", "-S", "-c"])
        self.assertIn("kcoral-sandbox-ready", tail[4])

    def test_worker_path(self) -> None:
        """The worker sees its workspace at C{/work}."""
        self.assertEqual(BubblewrapSandbox([]).worker_path(self.work), "/work")


class NoSandboxCommandTests(_TempMixin, SynchronousTestCase):
    """Without a sandbox the worker runs directly."""

    def test_command(self) -> None:
        """argv runs the worker module; env is the server's with the package on PYTHONPATH."""
        work = self.make_dir()
        executable, argv, env = NoSandbox().command(
            python="/usr/bin/python3", worker_args=["-x"], work_dir=work, gpu_devices=["0"]
        )
        self.assertEqual(executable, "/usr/bin/python3")
        self.assertEqual(argv, ["/usr/bin/python3", "-m", "kcoral.worker", "-x"])
        self.assertEqual(env["PYTHONPATH"].split(":")[0], package_root())
        for key, value in os.environ.items():
            if key != "PYTHONPATH":
                self.assertEqual(env[key], value)

    def test_worker_path(self) -> None:
        """The worker sees the host path."""
        work = self.make_dir()
        self.assertEqual(NoSandbox().worker_path(work), str(work))


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


class WorkspaceTests(_TempMixin, SynchronousTestCase):
    """Seats are prepared and cleared on the host without following links."""

    def test_prepare_bubblewrap(self) -> None:
        """C{work/} and the reserved layout are created with mode 0700."""
        seat = self.make_dir() / "seat"
        work = BubblewrapSandbox([]).prepare_seat(seat)
        self.assertEqual(work, Path(os.path.realpath(seat / "work")))
        self.assertEqual(_mode(work), 0o700)
        self.assertEqual(sorted(os.listdir(work)), [".kcoral"])
        self.assertEqual(sorted(os.listdir(work / ".kcoral")), sorted(RESERVED_SUBDIRS))
        for sub in [".kcoral", *(f".kcoral/{s}" for s in RESERVED_SUBDIRS)]:
            self.assertEqual(_mode(work / sub), 0o700)

    def test_prepare_none(self) -> None:
        """Without a sandbox the layout is only C{.kcoral/output}."""
        seat = self.make_dir()
        work = NoSandbox().prepare_seat(seat)
        self.assertEqual(os.listdir(work / ".kcoral"), ["output"])
        self.assertEqual(_mode(work), 0o700)

    def _populate(self, work: Path, outside: Path) -> None:
        (outside / "keep.txt").write_text("precious")
        (work / "sub" / "deeper").mkdir(parents=True)
        (work / "sub" / "deeper" / "f").write_text("x")
        (work / "link-to-outside").symlink_to(outside)
        (work / "sub" / "link-to-file").symlink_to(outside / "keep.txt")
        (work / "dangling").symlink_to(work / "nowhere")
        (work / ".kcoral" / "output" / "scratch").write_text("x")
        ro_dir = work / "ro-dir"
        ro_dir.mkdir()
        (ro_dir / "ro-file").write_text("x")
        os.chmod(ro_dir / "ro-file", 0o400)
        os.chmod(ro_dir, 0o500)
        (work / "ro-top").write_text("x")
        os.chmod(work / "ro-top", 0o000)
        (work / "unreadable-dir").mkdir()
        (work / "unreadable-dir" / "x").write_text("x")
        os.chmod(work / "unreadable-dir", 0o000)

    def test_clear(self) -> None:
        """
        Clearing removes files, links, read-only entries and nested dirs, keeps
        the directory inode, never follows links, and recreates the layout.
        """
        for sandbox, layout in (
            (BubblewrapSandbox([]), sorted(RESERVED_SUBDIRS)),
            (NoSandbox(), ["output"]),
        ):
            seat = self.make_dir()
            outside = self.make_dir()
            work = sandbox.prepare_seat(seat)
            inode = os.stat(work).st_ino
            self._populate(work, outside)
            os.chmod(work, 0o500)
            sandbox.clear_workspace(work)
            self.assertEqual(os.listdir(work), [".kcoral"])
            self.assertEqual(sorted(os.listdir(work / ".kcoral")), layout)
            for sub in layout:
                self.assertEqual(os.listdir(work / ".kcoral" / sub), [])
            self.assertEqual(os.stat(work).st_ino, inode)
            self.assertEqual(_mode(work), 0o700)
            self.assertEqual((outside / "keep.txt").read_text(), "precious")
            self.assertEqual(_mode(outside), 0o700)

    def test_clear_replaced_reserved(self) -> None:
        """A reserved directory replaced by a link to outside is unlinked, not followed."""
        sandbox = BubblewrapSandbox([])
        work = sandbox.prepare_seat(self.make_dir())
        outside = self.make_dir()
        (outside / "keep.txt").write_text("precious")
        shutil.rmtree(work / ".kcoral")
        (work / ".kcoral").symlink_to(outside)
        sandbox.clear_workspace(work)
        self.assertFalse((work / ".kcoral").is_symlink())
        self.assertEqual(os.listdir(outside), ["keep.txt"])

    def test_clear_link_raises(self) -> None:
        """A workspace path that is itself a link is not cleared: it raises."""
        outside = self.make_dir()
        (outside / "keep.txt").write_text("precious")
        link = self.make_dir() / "work"
        link.symlink_to(outside)
        self.assertRaises(OSError, BubblewrapSandbox([]).clear_workspace, link)
        self.assertEqual(os.listdir(outside), ["keep.txt"])

    def test_clear_missing_raises(self) -> None:
        """A missing workspace raises, so the caller retires the worker."""
        missing = self.make_dir() / "gone"
        self.assertRaises(OSError, NoSandbox().clear_workspace, missing)


class ChooseWithoutProbeTests(SynchronousTestCase):
    """C{sandbox="none"} needs no probe."""

    def test_none(self) -> None:
        """No process is spawned and the result is a L{NoSandbox}."""
        reactor = MemoryReactorClock()
        config = SimpleNamespace(sandbox="none", sandbox_readonly_paths=(), device="cpu", gpus=(0,))
        result = self.successResultOf(choose_sandbox(reactor, config))
        self.assertIsInstance(result, NoSandbox)


class ServerImportDirsTests(_TempMixin, SynchronousTestCase):
    """
    What the server imports from outside its runtime (PYTHONPATH, user
    site-packages) is bound read-only for workers and put on their
    PYTHONPATH, or the start fails naming the path (issue 17, item 7).
    """

    def setUp(self) -> None:
        import kcoral.server.sandbox.bubblewrap as module

        self.module = module
        # Plan mounts as on a machine whose runtime lies outside the workspace.
        self.patch(sys, "prefix", "/usr")
        self.patch(sys, "base_prefix", "/usr")
        self.package = self.make_dir()
        self.patch(module, "package_root", lambda: str(self.package))
        self.seat = self.make_dir()
        self.work = self.seat / "work"
        self.work.mkdir()

    def test_import_dirs(self) -> None:
        """PYTHONPATH entries and the user site that exist, made absolute, once each."""
        a, b = self.make_dir(), self.make_dir()
        environ = {"PYTHONPATH": os.pathsep.join([str(a), "", "/nonexistent-h17", str(a)])}
        self.assertEqual(
            self.module.server_import_dirs(environ, user_site=str(b)), (str(a), str(b))
        )
        self.assertEqual(self.module.server_import_dirs({}, user_site=""), ())

    def test_pythonpath_dir_bound_and_on_path(self) -> None:
        """A C{pip install --target} directory is bound read-only and importable."""
        target = self.make_dir()
        self.patch(self.module, "server_import_dirs", lambda: (str(target),))
        sandbox = BubblewrapSandbox([])
        _executable, argv, env = sandbox.command(
            python=sys.executable, worker_args=[], work_dir=self.work, gpu_devices=[]
        )
        binds = [argv[i + 1 : i + 3] for i, a in enumerate(argv) if a == "--ro-bind"]
        self.assertIn([os.path.realpath(target), str(target)], binds)
        self.assertIn(str(target), env["PYTHONPATH"].split(":"))

    def test_import_dir_in_workspace_refused(self) -> None:
        """A directory the workspace would hide stops the start, naming the path and flag."""
        workspace = self.make_dir()
        inside = workspace / "site"
        inside.mkdir()
        self.patch(self.module, "WORKSPACE", str(workspace))
        self.patch(self.module, "server_import_dirs", lambda: (str(inside),))
        error = self.assertRaises(SandboxError, BubblewrapSandbox([]).resolve_mounts)
        self.assertIn(str(inside), str(error))
        self.assertIn("--sandbox-readonly-path", str(error))


# -- is_clean_layout: whether a workspace needs a clear -----------------------


def _fresh_layout(tmp_path: Path, subdirs: tuple[str, ...] = ("output", "tmp")) -> Path:
    from kcoral.server.sandbox.seats import make_layout, mkdir_private

    work = tmp_path / "work"
    mkdir_private(str(work))
    make_layout(str(work), subdirs)
    return work


def test_clean_layout_is_clean(tmp_path: Path) -> None:
    from kcoral.server.sandbox.seats import is_clean_layout

    work = _fresh_layout(tmp_path)
    assert is_clean_layout(work, ("output", "tmp"))
    assert not is_clean_layout(work, ("output",))
    assert not is_clean_layout(work, ("output", "tmp", "home"))


def test_what_a_program_leaves_makes_it_unclean(tmp_path: Path) -> None:
    """A file anywhere, a changed mode, a link for a directory, a missing one."""
    from kcoral.server.sandbox.seats import RESERVED, is_clean_layout

    subdirs = ("output", "tmp")
    cases = {
        "file at the top": lambda w: (w / "result.txt").write_text("x"),
        "hidden file": lambda w: (w / ".secret").write_text("x"),
        "file in tmp": lambda w: (w / RESERVED / "tmp" / "f").write_text("x"),
        "empty dir in output": lambda w: (w / RESERVED / "output" / "d").mkdir(),
        "file in reserved": lambda w: (w / RESERVED / "extra").write_text("x"),
        "tmp opened up": lambda w: os.chmod(w / RESERVED / "tmp", 0o777),
        "top opened up": lambda w: os.chmod(w, 0o755),
        "tmp missing": lambda w: os.rmdir(w / RESERVED / "tmp"),
        "tmp a link": lambda w: (
            os.rmdir(w / RESERVED / "tmp"),
            os.symlink(w / RESERVED / "output", w / RESERVED / "tmp"),
        ),
        "reserved a file": lambda w: (
            shutil.rmtree(w / RESERVED),
            (w / RESERVED).write_text("x"),
        ),
    }
    for name, change in cases.items():
        case = tmp_path / name.replace(" ", "_")
        case.mkdir()
        work = _fresh_layout(case, subdirs)
        change(work)
        assert not is_clean_layout(work, subdirs), name


def test_a_missing_workspace_is_not_clean(tmp_path: Path) -> None:
    from kcoral.server.sandbox.seats import is_clean_layout

    assert not is_clean_layout(tmp_path / "gone", ("output",))
