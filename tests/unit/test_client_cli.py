# -*- test-case-name: tests.unit.test_client_cli -*-
"""
Tests for L{kcoral.client.cli} (C{kcoral run}, C{kcoral health}), the
uploaded runner of L{kcoral.client.tools} and L{kcoral.client.progress}.
"""

from __future__ import annotations

import io
import os
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyObject

from kcoral.client.async_client import IProgress
from kcoral.client.cli import (
    build_program,
    health_main,
    pack_inputs,
    parse_tool_arguments,
    run_tool,
)
from kcoral.client.files import ReturnedFile, ReturnedFolder
from kcoral.client.progress import TerminalProgress
from kcoral.client.results import ProgramResult
from kcoral.client.tools import TOOLS, source
from kcoral.testing.fakes import FakeClient

ENV = {"KCORAL_URL": "http://h:1", "HOME": "/home/u"}


def parse(tool: str, *argv: str, env: dict[str, str] | None = None) -> Any:
    return parse_tool_arguments(
        tool, list(argv), environ=ENV if env is None else env, err=io.StringIO()
    )


def outcome(code: int, missing: list[str] | None = None, **results: Any) -> ProgramResult:
    return ProgramResult(
        status="COMPLETED",
        request_id="r",
        queue_ms=0,
        elapsed_ms=0,
        lease_wait_ms=0,
        lease_held_ms=0,
        results={"outcome": {"returncode": code, "missing": missing or []}, **results},
        stdout="remote out\n",
        stderr="remote err\n",
        stdout_truncated=False,
        stderr_truncated=False,
    )


class ArgumentTests(SynchronousTestCase):
    """The 0.1.1 flags and their checks."""

    def test_defaults(self) -> None:
        args, rest = parse("python", "--", "x.py", "-v")
        self.assertEqual(rest, ["x.py", "-v"])
        self.assertEqual(
            (args.url, args.timeout, args.output_limit_bytes), ("http://h:1", 300, 1 << 28)
        )
        self.assertEqual((args.send, args.env, args.fetch, args.out), ([], {}, [], None))

    def test_host_port(self) -> None:
        args, _ = parse("shell", "--host", "::1", "--port", "9", "--", "ls")
        self.assertEqual(args.url, "http://[::1]:9")
        args, _ = parse("shell", "--port", "9", "--", "ls", env={})
        self.assertEqual(args.url, "http://127.0.0.1:9")

    def test_env(self) -> None:
        args, _ = parse("shell", "-e", "A=1", "-e", "HOME", "--", "ls")
        self.assertEqual(args.env, {"A": "1", "HOME": "/home/u"})

    def test_usage_errors(self) -> None:
        """Each mistake exits with status 2 before anything is sent."""
        bad = [
            ("python", ["x.py"]),
            ("python", ["--"]),
            ("python", ["--", "-i", "x.py"]),
            ("python", ["--", "-"]),
            ("python", ["--", "-c"]),
            ("python", ["--url", "http://a", "--port", "1", "--", "x.py"]),
            ("python", ["--port", "0", "--", "x.py"]),
            ("python", ["--host", "a/b", "--", "x.py"]),
            ("python", ["--timeout", "0", "--", "x.py"]),
            ("shell", ["-e", "CUDA_VISIBLE_DEVICES=1", "--", "ls"]),
            ("shell", ["-e", "NOT_SET_HERE", "--", "ls"]),
            ("shell", ["-e", "1A=2", "--", "ls"]),
            ("shell", ["--fetch", "x", "--", "ls"]),
            ("shell", ["--out", "o", "--fetch", "../x", "--", "ls"]),
            ("ncu", ["--", "python", "x.py"]),
            ("ncu", ["--out", "o", "--", "--exp", "f", "--", "python", "x.py"]),
            ("ncu", ["--out", "o", "--", "-of", "--", "python", "x.py"]),
            ("run-iket", ["--out", "o", "--", "--", "x"]),
            ("shell", ["--", "ls"], {}),
        ]
        for tool, argv, *env in bad:
            with self.assertRaises(SystemExit) as caught:
                parse(tool, *argv, env=env[0] if env else None)
            self.assertEqual(caught.exception.code, 2, (tool, argv))

    def test_python_forms(self) -> None:
        for argv in (
            ["-c", "print(1)"],
            ["-m", "mod"],
            ["-u", "x.py"],
            ["-W", "error", "x.py"],
            ["-cprint(1)"],
        ):
            parse("python", "--", *argv)
        parse("ncu", "--out", "o", "--", "--set", "full", "--", "python", "x.py")
        parse("run-iket", "--out", "o", "--", "profile", "--", "python", "x.py")


class PackTests(SynchronousTestCase):
    """--send archives: names, modes, skips and refusals."""

    def test_pack(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            (root / "exp" / "sub" / "__pycache__").mkdir(parents=True)
            (root / "exp" / "run.sh").write_text("echo")
            (root / "exp" / "run.sh").chmod(0o755)
            (root / "exp" / "sub" / "d.txt").write_text("d")
            (root / "exp" / "sub" / "__pycache__" / "x.pyc").write_text("")
            (root / "one.py").write_text("1")
            data = pack_inputs([root / "exp", root / "one.py"])
            with tarfile.open(fileobj=io.BytesIO(data)) as tar:
                members = {m.name: m.mode for m in tar}
            self.assertEqual(
                members, {"exp/run.sh": 0o700, "exp/sub/d.txt": 0o600, "one.py": 0o600}
            )
            self.assertEqual(len(pack_inputs([])), 10240)
            self.assertRaises(ValueError, pack_inputs, [root / "one.py", root / "one.py"])
            self.assertRaises(ValueError, pack_inputs, [root / "missing"])
            os.symlink(root / "one.py", root / "exp" / "link")
            self.assertRaises(ValueError, pack_inputs, [root / "exp"])


class ProgramTests(SynchronousTestCase):
    """The program of protocol §12.2."""

    def test_shape(self) -> None:
        args, rest = parse("python", "-e", "A=1", "--out", "o", "--fetch", "r", "--", "x.py")
        program = build_program("python", args, rest)
        ids = [(i["op"], i.get("id"), i.get("key")) for i in program.instructions]
        self.assertEqual(
            ids,
            [
                ("upload", "tool_runner", None),
                ("get_function", "runner", None),
                ("upload", "definition", None),
                ("get_function", "tool_run", None),
                ("upload", "inputs", None),
                ("run", "run", None),
                ("return", None, "outcome"),
                ("return", None, "artifacts"),
            ],
        )
        run = program.instructions[5]
        self.assertEqual(
            run["args"],
            [{"$ref": "inputs"}, {"$ref": "tool_run"}, ["x.py"], {"A": "1"}, ["r"]],
        )
        self.assertEqual(program.instructions[0]["source"], source("runner"))
        self.assertEqual(program.instructions[2]["source"], source("python"))

    def test_tool_sources_compile(self) -> None:
        for module in ["runner", *TOOLS.values()]:
            namespace: dict[str, Any] = {}
            exec(compile(source(module), module, "exec"), namespace)
            self.assertTrue(callable(namespace["run"]))


class RunToolTests(SynchronousTestCase):
    """run_tool's output, artifacts and exit status."""

    def run_with(
        self, result: Any, *argv: str, tool: str = "shell"
    ) -> tuple[int, str, str, FakeClient]:
        args, rest = parse(tool, *argv)
        fake = FakeClient(result)
        out, err = io.StringIO(), io.StringIO()
        code = run_tool(tool, args, rest, client_factory=fake, out=out, err=err)
        return code, out.getvalue(), err.getvalue(), fake

    def test_exit_status(self) -> None:
        code, out, err, fake = self.run_with(outcome(3), "--timeout", "7", "--", "ls")
        self.assertEqual((code, out), (3, "remote out\n"))
        self.assertIn("remote err", err)
        self.assertEqual(fake.calls[0][2], {"timeout_seconds": 7, "output_limit_bytes": 1 << 28})
        self.assertEqual(self.run_with(outcome(-9), "--", "ls")[0], 137)
        self.assertEqual(self.run_with(outcome(0, ["x"]), "--", "ls")[0], 1)

    def test_failed_program(self) -> None:
        failed = outcome(0)
        failed.status = "FAILED"
        failed.error = {"kind": "engine", "message": "RuntimeError: no ls", "traceback": "tb"}
        code, _, err, _ = self.run_with(failed, "--", "ls")
        self.assertEqual(code, 1)
        self.assertIn("RuntimeError: no ls", err)

    def test_transport_error(self) -> None:
        from kcoral.client.errors import TransportError

        code, _, err, _ = self.run_with(TransportError("refused"), "--", "ls")
        self.assertEqual(code, 1)
        self.assertIn("refused", err)

    def test_artifacts_saved(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            target = Path(tmp, "out")
            folder = ReturnedFolder({"r/a": ReturnedFile(b"a")}, ("r",))
            code, _, _, _ = self.run_with(
                outcome(0, artifacts=folder), "--out", str(target), "--fetch", "r", "--", "ls"
            )
            self.assertEqual(code, 0)
            self.assertEqual((target / "r" / "a").read_bytes(), b"a")
            code, _, err, _ = self.run_with(
                outcome(0), "--out", str(target), "--fetch", "r", "--", "ls"
            )
            self.assertEqual(code, 1)
            self.assertIn("already exists", err)

    def test_health(self) -> None:
        out = io.StringIO()
        self.assertEqual(
            health_main(["--url", "http://h"], client_factory=FakeClient(None), out=out), 0
        )  # type: ignore[arg-type]
        self.assertIn('"status": "ok"', out.getvalue())
        self.assertEqual(
            health_main(["--url", "http://h"], client_factory=FakeClient(OSError("x"))), 1
        )


class RunnerTests(SynchronousTestCase):
    """The uploaded runner, run here in a scratch directory."""

    def test_runner(self) -> None:
        namespace: dict[str, Any] = {}
        exec(compile(source("runner"), "runner", "exec"), namespace)
        shell: dict[str, Any] = {}
        exec(compile(source("shell"), "shell", "exec"), shell)
        archive = io.BytesIO()
        with tarfile.open(fileobj=archive, mode="w") as tar:
            info = tarfile.TarInfo("d/s.sh")
            script = b"mkdir -p res/x && echo hi > res/x/f && echo $KCORAL_DIR > res/dir"
            info.size = len(script)
            tar.addfile(info, io.BytesIO(script))
        cwd = os.getcwd()
        with tempfile.TemporaryDirectory() as tmp:
            os.chdir(tmp)
            try:
                result = namespace["run"](
                    archive.getvalue(), shell["run"], ["sh", "d/s.sh"], {"A": "1"}, ["res", "gone"]
                )
            finally:
                os.chdir(cwd)
            self.assertEqual(result, {"returncode": 0, "missing": ["gone"]})
            self.assertEqual(Path(tmp, "outputs", "res", "x", "f").read_text(), "hi\n")
            self.assertEqual(
                Path(tmp, "outputs", "res", "dir").read_text().strip(),
                str(Path(tmp, "inputs").resolve()),
            )


class ProgressTests(SynchronousTestCase):
    """TerminalProgress draws only after a phase has lasted a second."""

    def test_draws_late_and_clears(self) -> None:
        clock = Clock()
        stream = io.StringIO()
        progress = TerminalProgress(stream, clock=clock, now=clock.seconds)
        verifyObject(IProgress, progress)
        progress.sending(10, 100)
        self.assertEqual(stream.getvalue(), "")
        clock.advance(1.5)
        progress.sending(50, 100)
        self.assertIn("upload [###############", stream.getvalue())
        progress.waiting()
        clock.advance(0.5)
        self.assertNotIn("waiting", stream.getvalue())
        clock.advance(1.0)
        self.assertIn("waiting for the server", stream.getvalue())
        progress.receiving(5, None)
        progress.done()
        self.assertTrue(stream.getvalue().endswith("\r\x1b[K"))
        self.assertEqual(clock.getDelayedCalls(), [])


class DispatchTests(SynchronousTestCase):
    """C{kcoral run} and C{kcoral health} reach the client CLI."""

    def test_dispatch(self) -> None:
        from contextlib import redirect_stderr

        from kcoral.__main__ import main

        with redirect_stderr(io.StringIO()) as err:
            self.assertEqual(main(["health", "--port", "0"]), 2)
            self.assertEqual(main(["run", "no-such-tool"]), 2)
            self.assertEqual(main(["run", "shell", "--url", "http://h", "--"]), 2)
        self.assertIn("kcoral health", err.getvalue())
        self.assertIn("kcoral run", err.getvalue())
