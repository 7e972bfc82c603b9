# -*- test-case-name: tests.unit.test_gateway_service -*-
"""
C{kcoral gateway [options]}: checks its options with L{kcoral.gateway.tap.Options}
(the parser of C{twistd kcoral-gateway}), then runs twistd in the foreground
with that plugin, as C{kcoral server} does (L{kcoral.server.cli.command}).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Sequence
from typing import IO, Any

from twisted.application.service import ServiceMaker
from twisted.python import usage

__all__ = ["main"]

TWISTD_ARGS = (
    "--nodaemon",
    "--pidfile=",
    "--logger=kcoral.server.cli.command.stderr_log_observer",
)


def main(
    argv: Sequence[str],
    *,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    run_app: Callable[[usage.Options], object] | None = None,
) -> int:
    """Run C{kcoral gateway}; 2 for a usage error, 1 when the gateway fails to start."""
    from twisted.scripts.twistd import ServerOptions  # type: ignore[attr-defined]

    from kcoral.gateway import tap
    from kcoral.gateway.natsbridge import install_asyncio_reactor

    if run_app is None:
        install_asyncio_reactor()
    out = sys.stdout if stdout is None else stdout
    err = sys.stderr if stderr is None else stderr
    options = tap.Options()
    try:
        with contextlib.redirect_stdout(out):
            options.parseOptions(list(argv))
    except usage.UsageError as e:
        err.write(f"kcoral gateway: error: {e}\n")
        return 2
    except SystemExit as e:  # --help
        return int(e.code or 0) if not isinstance(e.code, str) else 2
    maker = ServiceMaker(
        "kcoral-gateway",
        "kcoral.gateway.tap",
        "One KCoral URL for a pool of nodes that join over NATS.",
        "kcoral-gateway",
    )

    def get_plugins(interface: Any, package: Any = None) -> list[Any]:
        return [maker]

    twistd_config = ServerOptions(stdout=out)  # type: ignore[no-untyped-call]
    twistd_config._getPlugins = get_plugins
    try:
        twistd_config.parseOptions([*TWISTD_ARGS, "kcoral-gateway", *argv])  # type: ignore[no-untyped-call]
    except usage.UsageError as e:
        err.write(f"kcoral gateway: error: {e}\n")
        return 2
    if run_app is None:
        run_app = _run_app
    try:
        status = run_app(twistd_config)
    except SystemExit as e:
        return int(e.code) if isinstance(e.code, int) else 1
    return status if isinstance(status, int) else 0


def _run_app(config: usage.Options) -> int:
    """twistd's runApp; 1 when the gateway's start failed (it stops the reactor then)."""
    from twisted.scripts.twistd import runApp  # type: ignore[attr-defined]

    from kcoral.gateway import service

    runApp(config)
    return 1 if service.START_FAILED else 0
