# -*- test-case-name: tests.unit.test_cli -*-
"""
The C{kcoral} command.

C{kcoral server [options]} checks its options with L{kcoral.server.cli.tap.Options}
(the same parser as C{twistd kcoral}), then runs twistd in the foreground
with the C{kcoral} plugin, as Tahoe-LAFS's C{tahoe run} does: it builds
twistd's C{ServerOptions} from C{--nodaemon --pidfile= kcoral [options]} and
hands them to an injectable C{run_app} (L{twisted.scripts.twistd.runApp}
by default), so tests can capture the twistd configuration without starting
a reactor.

A bad option is reported as one line, C{kcoral server: error: <message>},
with exit status 2.  A server that fails to start exits 1; its cause is the
console mirror's C{server_start_failed} line, or, with C{--no-log-console},
one line C{kcoral server: error: the server failed to start: <cause>} on
standard error.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import IO, Any

from twisted.application.service import IService, IServiceMaker, ServiceMaker
from twisted.logger import ILogObserver, textFileLogObserver
from twisted.python import usage
from zope.interface import implementer, provider

__all__ = ["TWISTD_ARGS", "main", "quiet_log_observer", "stderr_log_observer", "twistd_args"]

#: twistd's own options for C{kcoral server}: stay in the foreground, write
#: no pidfile, log to standard error.
TWISTD_ARGS: tuple[str, ...] = (
    "--nodaemon",
    "--pidfile=",
    "--logger=kcoral.server.cli.command.stderr_log_observer",
)

_USAGE = """\
Usage: kcoral <command> [options]

Commands:
  server     Run the KCoral server in the foreground (kcoral server --help).
  gateway    Run the gateway of a pool of nodes on NATS (kcoral gateway --help).
  run        Run a tool on a KCoral server (kcoral run python|shell|... --help).
  health     Print a KCoral server's /health (kcoral health --help).

Options:
  --help     Show this message and exit.
  --version  Show the version and exit.
"""

_SERVER_SYNOPSIS = "Usage: kcoral server [options]"


def stderr_log_observer() -> ILogObserver:
    """
    Write twistd's log as text to standard error (twistd's C{--logger} hook).

    Called before twistd redirects C{sys.stderr} into the log, so it holds
    the real stream.
    """
    text: ILogObserver = textFileLogObserver(sys.stderr)  # type: ignore[assignment]

    @provider(ILogObserver)
    def observer(event: dict[str, Any]) -> None:
        # kcoral's own events reach the console through its console mirror
        # (--no-log-console turns that off); print only Twisted's here.
        if "kcoral_event" not in event:
            text(event)

    return observer


def quiet_log_observer() -> ILogObserver:
    """
    Like L{stderr_log_observer}, but only Twisted's warnings and errors:
    no start-up chatter, no access log.  Used for C{--no-log-console} and
    C{--log-level} above C{info}.
    """
    from twisted.logger import LogLevel

    from kcoral.server.observe.logs import twisted_console_observer

    observer: ILogObserver = twisted_console_observer(sys.stderr, LogLevel.warn)
    return observer


def twistd_args(flags: Sequence[str], *, quiet: bool = False) -> list[str]:
    """
    The twistd command line that runs C{kcoral server <flags>}.

    @param quiet: log only Twisted's warnings and errors (L{quiet_log_observer}).
    """
    if not quiet:
        return [*TWISTD_ARGS, "kcoral", *flags]
    args = [a for a in TWISTD_ARGS if not a.startswith("--logger=")]
    return [*args, "--logger=kcoral.server.cli.command.quiet_log_observer", "kcoral", *flags]


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("kcoral-server")
    except metadata.PackageNotFoundError:
        return "unknown"


@implementer(IServiceMaker)
class _KcoralServiceMaker:
    """
    The C{kcoral} plugin (declared once, in C{twisted/plugins/kcoral_plugin.py})
    as C{kcoral server} hands it to twistd: its options read the environment
    C{main} was given rather than C{os.environ}.
    """

    def __init__(self, plugin: ServiceMaker, environ: Mapping[str, str]) -> None:
        self._plugin = plugin
        self._environ = environ
        self.tapname: str = plugin.tapname
        self.description: str = plugin.description

    def options(self) -> usage.Options:
        options: usage.Options = self._plugin.options(environ=self._environ)
        return options

    def makeService(self, options: usage.Options) -> IService:
        # The plugin's module (kcoral.server.cli.tap), asked for kcoral's own
        # console mirror: `kcoral server` leaves kcoral events out of twistd's.
        from kcoral.server.cli import tap

        assert isinstance(options, tap.Options)
        service: IService = tap.makeService(options, console_mirror=True)
        return service


def _declared_plugin() -> ServiceMaker:
    """The C{kcoral} L{IServiceMaker} that twistd finds."""
    from twisted.plugins.kcoral_plugin import kcoral  # type: ignore[import-not-found]

    plugin: ServiceMaker = kcoral
    return plugin


def _default_run_app(config: usage.Options, failures: IO[str] | None = None) -> int:
    """
    Run twistd's application runner in the foreground.

    Unlike C{twistd}, a graceful stop on SIGTERM or SIGINT exits with status
    0 rather than re-raising the signal; a server that failed to start exits 1.

    @param failures: where a failed start is reported in one line, when
        the console mirror does not show it (C{--no-log-console}).
    """
    from twisted.application.service import IServiceCollection
    from twisted.scripts.twistd import _SomeApplicationRunner  # type: ignore[attr-defined]

    runner = _SomeApplicationRunner(config)
    runner.run()
    application = getattr(runner, "application", None)
    if application is None:
        return 1
    root = IServiceCollection(application).getServiceNamed("kcoral")
    failure = getattr(root, "start_failure", None)
    if failure and failures is not None:
        failures.write(f"kcoral server: error: the server failed to start: {failure}\n")
        failures.flush()
    return 1 if failure else 0


def _exit_code(exc: SystemExit, err: IO[str]) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    err.write(f"kcoral server: error: {exc.code}\n")
    return 1


def main(
    argv: Sequence[str],
    *,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    environ: Mapping[str, str] | None = None,
    run_app: Callable[[usage.Options], object] | None = None,
) -> int:
    """
    Run the C{kcoral} command.

    @param argv: the arguments after the program name, e.g.
        C{["server", "--port", "8001"]}.
    @param stdout: where help and version text go; C{sys.stdout} if C{None}.
    @param stderr: where errors go; C{sys.stderr} if C{None}.
    @param environ: the environment for C{KCORAL_*} defaults; C{os.environ}
        if C{None}.
    @param run_app: called with the parsed twistd C{ServerOptions}; runs the
        server until it stops.  L{twisted.scripts.twistd.runApp} if C{None}.
    @return: the exit status: 0 on success, 2 for a usage error.
    """
    out = sys.stdout if stdout is None else stdout
    err = sys.stderr if stderr is None else stderr
    env = os.environ if environ is None else environ
    args = list(argv)

    if not args:
        err.write(_USAGE)
        return 2
    command, rest = args[0], args[1:]
    if command in ("--help", "-h"):
        out.write(_USAGE)
        return 0
    if command == "--version":
        out.write(f"kcoral {_version()}\n")
        return 0
    if command != "server":
        err.write(_USAGE)
        err.write(f"kcoral: error: unknown command {command!r}\n")
        return 2
    return _server(rest, out, err, env, run_app)


def _server(
    flags: list[str],
    out: IO[str],
    err: IO[str],
    env: Mapping[str, str],
    run_app: Callable[[usage.Options], object] | None,
) -> int:
    from twisted.scripts.twistd import ServerOptions  # type: ignore[attr-defined]

    from kcoral.server.cli import tap

    options = tap.Options(environ=env)
    options.synopsis = _SERVER_SYNOPSIS  # type: ignore[attr-defined]
    try:
        with contextlib.redirect_stdout(out):
            options.parseOptions(flags)
    except usage.UsageError as e:
        err.write(f"kcoral server: error: {e}\n")
        return 2
    except SystemExit as e:  # --help, --version
        return _exit_code(e, err)

    config = options.config
    if config.device == "gpu" and env.get("CUDA_VISIBLE_DEVICES"):
        err.write(
            "kcoral server: warning: CUDA_VISIBLE_DEVICES does not restrict the server; "
            "workers are pinned to the physical GPU ids given by --gpus\n"
        )

    if run_app is None:
        if config.join_url is not None:
            # nats-py on the reactor's own loop: no thread hop per job.
            from kcoral.gateway.natsbridge import install_asyncio_reactor

            install_asyncio_reactor()
        # Without the console mirror (or with it above ERROR) nothing would
        # say why a start failed: one line on standard error does.
        mirrored = config.log_console and config.log_level != "critical"
        run_app = partial(_default_run_app, failures=None if mirrored else err)

    maker = _KcoralServiceMaker(_declared_plugin(), env)

    def get_plugins(interface: Any, package: Any = None) -> list[Any]:
        # Only the kcoral plugin, whether or not twisted/plugins is on sys.path.
        return [maker]

    twistd_config = ServerOptions(stdout=out)  # type: ignore[no-untyped-call]
    twistd_config._getPlugins = get_plugins
    try:
        quiet = not config.log_console or config.log_level not in ("debug", "info")
        twistd_config.parseOptions(twistd_args(flags, quiet=quiet))  # type: ignore[no-untyped-call]
    except usage.UsageError as e:
        err.write(f"kcoral server: error: {e}\n")
        return 2
    try:
        status = run_app(twistd_config)
    except SystemExit as e:
        return _exit_code(e, err)
    return status if isinstance(status, int) else 0
