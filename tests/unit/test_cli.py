"""
Tests for L{kcoral.server.cli.command}, the C{kcoral} command.
"""

from __future__ import annotations

import io
import os
import re
import sys
from pathlib import Path
from typing import Any

from twisted.logger import ILogObserver
from twisted.trial.unittest import SynchronousTestCase

from kcoral.config import ServerConfig
from kcoral.server.cli import command as cli

BARE_ENV = {"HOME": "/home/op"}


class Run:
    """
    Run L{cli.main} with captured streams and a recording C{run_app}.
    """

    def __init__(self, argv: list[str], environ: dict[str, str] | None = None, exit: Any = None):
        self.stdout = io.StringIO()
        self.stderr = io.StringIO()
        self.configs: list[Any] = []

        def run_app(config: Any) -> None:
            self.configs.append(config)
            if exit is not None:
                raise SystemExit(exit)

        self.code = cli.main(
            argv,
            stdout=self.stdout,
            stderr=self.stderr,
            environ=BARE_ENV if environ is None else environ,
            run_app=run_app,
        )

    @property
    def out(self) -> str:
        """
        What was written to standard output.
        """
        return self.stdout.getvalue()

    @property
    def err(self) -> str:
        """
        What was written to standard error.
        """
        return self.stderr.getvalue()


class ServerErrorTests(SynchronousTestCase):
    """
    Bad C{kcoral server} input is one error line and exit status 2.
    """

    def assertOneLine(self, argv: list[str], message: str, environ: Any = None) -> None:
        """
        Running C{argv} prints exactly C{kcoral server: error: <message>} on
        standard error, returns 2 and does not start twistd.
        """
        run = Run(argv, environ)
        self.assertEqual(run.code, 2)
        self.assertEqual(run.err, f"kcoral server: error: {message}\n")
        self.assertEqual(run.out, "")
        self.assertEqual(run.configs, [])

    def test_bad_port(self) -> None:
        """
        An out-of-range port.
        """
        self.assertOneLine(["server", "--port", "0"], "--port must be between 1 and 65535")

    def test_not_an_integer(self) -> None:
        """
        A non-integer value.
        """
        self.assertOneLine(
            ["server", "--workers-per-gpu", "many"],
            "--workers-per-gpu must be an integer, got 'many'",
        )

    def test_unknown_flag(self) -> None:
        """
        An unknown or abbreviated flag.
        """
        self.assertOneLine(["server", "--gpu", "0"], "option --gpu not recognized")

    def test_bad_gpus(self) -> None:
        """
        A non-integer GPU id gives a clean error, not a traceback.
        """
        self.assertOneLine(
            ["server", "--gpus", "0,a"],
            "--gpus must be a comma-separated list of integers, got '0,a'",
        )

    def test_bad_env(self) -> None:
        """
        A bad environment value is reported the same way.
        """
        self.assertOneLine(
            ["server"],
            "KCORAL_SERVER_PORT must be an integer, got 'x'",
            {"KCORAL_SERVER_PORT": "x"},
        )

    def test_readonly_paths_without_sandbox(self) -> None:
        """
        A reference check reports its reference message.
        """
        self.assertOneLine(
            ["server", "--sandbox", "none", "--sandbox-readonly-path", "/opt/x"],
            "--sandbox-readonly-path requires --sandbox bubblewrap",
        )


class ServerRunTests(SynchronousTestCase):
    """
    Good C{kcoral server} input runs twistd in the foreground.
    """

    def test_twistd_args(self) -> None:
        """
        The twistd command line stays in the foreground, writes no pidfile,
        logs to standard error and runs the C{kcoral} plugin with the flags.
        """
        self.assertEqual(
            cli.twistd_args(["--port", "8001"]),
            [
                "--nodaemon",
                "--pidfile=",
                "--logger=kcoral.server.cli.command.stderr_log_observer",
                "kcoral",
                "--port",
                "8001",
            ],
        )

    def test_runs_app(self) -> None:
        """
        C{run_app} gets twistd options for the C{kcoral} subcommand carrying
        the parsed config and endpoint.
        """
        run = Run(["server", "--device", "cpu", "--num-workers", "16", "--port", "8001"])
        self.assertEqual((run.code, run.err), (0, ""))
        [config] = run.configs
        self.assertTrue(config["nodaemon"])
        self.assertEqual(config["pidfile"], "")
        self.assertIs(config["logger"], cli.stderr_log_observer)
        self.assertEqual(config.subCommand, "kcoral")
        self.assertEqual(
            config.subOptions.config,
            ServerConfig(
                device="cpu",
                num_workers=16,
                log_dir=Path("logs"),
                disk_cache_dir=Path("/home/op/.cache/kcoral/files"),
            ),
        )
        self.assertEqual(
            config.subOptions.endpoint, "tcp:port=8001:interface=127.0.0.1:backlog=1024"
        )

    def test_plugin_makes_service(self) -> None:
        """
        twistd will build the service with the C{kcoral} plugin's maker.
        """
        run = Run(["server"])
        [config] = run.configs
        maker = config.loadedPlugins[config.subCommand]
        self.assertEqual(maker.tapname, "kcoral")

    def test_environment_passed_on(self) -> None:
        """
        The environment given to C{main} supplies defaults to the options
        twistd parses.
        """
        run = Run(["server"], {"KCORAL_SERVER_HOST": "0.0.0.0", "KCORAL_SERVER_DEVICE": "cpu"})
        [config] = run.configs
        self.assertEqual(config.subOptions.endpoint, "tcp:port=8000:interface=0.0.0.0:backlog=1024")
        self.assertEqual(config.subOptions.config.device, "cpu")

    def test_exit_status(self) -> None:
        """
        A C{SystemExit} from twistd becomes the exit status.
        """
        self.assertEqual(Run(["server"], exit=3).code, 3)
        self.assertEqual(Run(["server"], exit=None).code, 0)

    def test_exit_message(self) -> None:
        """
        A C{SystemExit} with a message prints it as one error line, status 1.
        """
        run = Run(["server"], exit="cannot listen")
        self.assertEqual((run.code, run.err), (1, "kcoral server: error: cannot listen\n"))

    def test_cuda_visible_devices_warning(self) -> None:
        """
        In GPU mode a set C{CUDA_VISIBLE_DEVICES} draws a warning, because
        workers are pinned by C{--gpus}.
        """
        run = Run(["server"], {"CUDA_VISIBLE_DEVICES": "1"})
        self.assertEqual(run.code, 0)
        self.assertIn("warning: CUDA_VISIBLE_DEVICES does not restrict", run.err)
        self.assertEqual(Run(["server", "--device", "cpu"], {"CUDA_VISIBLE_DEVICES": "1"}).err, "")

    def test_server_help(self) -> None:
        """
        C{kcoral server --help} prints the options to standard output.
        """
        run = Run(["server", "--help"])
        self.assertEqual(run.code, 0)
        self.assertTrue(run.out.startswith("Usage: kcoral server [options]"))
        self.assertIn("--workers-per-gpu=", run.out)
        self.assertEqual(run.configs, [])


#: An option's first line in Twisted's usage text: C{  -h, --help  ...}.
OPTION_LINE = r"^  (?:-\w,|   ) --([a-z-]+)"


class ServerHelpTests(SynchronousTestCase):
    """C{kcoral server --help} and C{-h}: the options grouped by topic."""

    def test_short_help(self) -> None:
        """C{-h} is C{--help}."""
        short, long = Run(["server", "-h"]), Run(["server", "--help"])
        self.assertEqual((short.code, short.err, short.configs), (0, "", []))
        self.assertEqual(short.out, long.out)

    def test_grouped(self) -> None:
        """
        The options come under L{tap.OPTION_GROUPS}' titles, in its order,
        sorted within each; every option is listed once, and every option
        has a group (a new flag needs its place in L{tap.OPTION_GROUPS}).
        """
        from kcoral.server.cli import tap

        out = Run(["server", "--help"]).out
        self.assertTrue(out.startswith("Usage: kcoral server [options]\n"))
        titles = [line[:-1] for line in out.splitlines() if line.endswith(":") and line[0] != " "]
        expected = [title for title, _ in tap.OPTION_GROUPS]
        self.assertEqual([t for t in titles if t in expected or t == tap.OTHER_GROUP], expected)
        names = [n.rstrip("=") for n in tap.Options(environ={}).longOpt]
        listed = re.findall(OPTION_LINE, out, re.M)
        self.assertEqual(sorted(listed), sorted(names))
        sections = re.split(r"^(\S.*):$", out, flags=re.M)
        for title, members in tap.OPTION_GROUPS:
            body = sections[sections.index(title) + 1]
            found = re.findall(OPTION_LINE, body, re.M)
            self.assertEqual(found, sorted(members))
        grouped = {name for _, members in tap.OPTION_GROUPS for name in members}
        self.assertEqual(sorted(set(names) - grouped), [])


class TopLevelTests(SynchronousTestCase):
    """
    The C{kcoral} command outside C{server}.
    """

    def test_unknown_command(self) -> None:
        """
        An unknown command prints the usage on standard error, status 2.
        """
        run = Run(["--device", "cpu"])
        self.assertEqual(run.code, 2)
        self.assertIn("Usage: kcoral <command>", run.err)
        self.assertTrue(run.err.endswith("kcoral: error: unknown command '--device'\n"))

    def test_no_command(self) -> None:
        """
        No command prints the usage on standard error, status 2.
        """
        run = Run([])
        self.assertEqual(run.code, 2)
        self.assertIn("server", run.err)

    def test_help(self) -> None:
        """
        C{--help} prints the usage on standard output.
        """
        run = Run(["--help"])
        self.assertEqual((run.code, run.err), (0, ""))
        self.assertIn("Usage: kcoral <command>", run.out)

    def test_version(self) -> None:
        """
        C{--version} prints one line naming kcoral.
        """
        run = Run(["--version"])
        self.assertEqual(run.code, 0)
        self.assertRegex(run.out, r"^kcoral \S+\n$")


class LogObserverTests(SynchronousTestCase):
    """
    L{cli.stderr_log_observer}.
    """

    def test_writes_stderr(self) -> None:
        """
        The observer writes formatted events to C{sys.stderr}.
        """
        stream = io.StringIO()
        self.patch(sys, "stderr", stream)
        observer = cli.stderr_log_observer()
        self.assertTrue(ILogObserver.providedBy(observer))
        observer({"log_format": "hello {who}", "who": "op", "log_time": 0.0})
        self.assertIn("hello op", stream.getvalue())

    def test_leaves_kcoral_events_to_the_console_mirror(self) -> None:
        """
        Events with C{kcoral_event} are not printed twice: the console
        mirror shows them (or, with C{--no-log-console}, nothing does).
        """
        stream = io.StringIO()
        self.patch(sys, "stderr", stream)
        observer = cli.stderr_log_observer()
        observer({"log_format": "x {n}", "n": 1, "log_time": 0.0, "kcoral_event": "pool_ready"})
        self.assertEqual(stream.getvalue(), "")


class QuietConsoleTests(SynchronousTestCase):
    """
    C{--no-log-console} and C{--log-level} above C{info} also quiet twistd's
    own chatter (start-up lines, the access log).
    """

    def test_default_logger(self) -> None:
        """Without either flag, twistd logs through L{cli.stderr_log_observer}."""
        run = Run(["server", "--device", "cpu"])
        [config] = run.configs
        self.assertIs(config["logger"], cli.stderr_log_observer)

    def test_quiet_logger(self) -> None:
        """Either flag selects L{cli.quiet_log_observer}."""
        for flags in (["--no-log-console"], ["--log-level", "warn"], ["--log-level", "error"]):
            run = Run(["server", "--device", "cpu", *flags])
            [config] = run.configs
            self.assertIs(config["logger"], cli.quiet_log_observer, flags)

    def test_quiet_observer_keeps_warnings_only(self) -> None:
        """
        The quiet observer drops Twisted's info events and kcoral events, and
        prints Twisted's warnings.
        """
        from twisted.logger import LogLevel

        stream = io.StringIO()
        self.patch(sys, "stderr", stream)
        observer = cli.quiet_log_observer()
        observer(
            {
                "log_format": "GET /health",
                "log_level": LogLevel.info,
                "log_time": 0.0,
                "log_namespace": "twisted.web",
            }
        )
        observer(
            {
                "log_format": "x",
                "log_level": LogLevel.error,
                "log_time": 0.0,
                "kcoral_event": "worker_failed",
            }
        )
        self.assertEqual(stream.getvalue(), "")
        observer(
            {
                "log_format": "disk full",
                "log_level": LogLevel.warn,
                "log_time": 0.0,
                "log_namespace": "twisted.test",
            }
        )
        self.assertIn("disk full", stream.getvalue())


class ModuleEntryTests(SynchronousTestCase):
    """
    C{python -m kcoral} dispatches to L{cli.main}.
    """

    def test_dispatch(self) -> None:
        """
        L{kcoral.__main__.main} passes its arguments on and returns the
        status.
        """
        from kcoral.__main__ import main

        stream = io.StringIO()
        self.patch(sys, "stdout", stream)
        self.assertEqual(main(["--version"]), 0)
        self.assertTrue(stream.getvalue().startswith("kcoral "))

    def test_reader_gone(self) -> None:
        """
        Help written to a pipe whose reader is gone (C{kcoral server --help
        | head}) ends quietly with status 141, no C{BrokenPipeError}.
        """
        from kcoral.__main__ import main

        read, write = os.pipe()
        os.close(read)
        stream = os.fdopen(write, "w")
        self.addCleanup(stream.close)
        self.patch(sys, "stdout", stream)
        self.assertEqual(main(["server", "--help"]), 141)
        stream.write("more")  # the stream now goes to /dev/null
        stream.flush()
