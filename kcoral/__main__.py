"""C{python -m kcoral}: the C{kcoral} command."""

from __future__ import annotations

import os
import signal
import sys


def main(argv: list[str] | None = None) -> int:
    """
    Run C{kcoral <subcommand>}.  Output to a reader that went away
    (C{kcoral server --help | head}) ends the command quietly, with the
    status a shell gives a process ended by SIGPIPE (141).
    """
    try:
        status = _dispatch(sys.argv[1:] if argv is None else argv)
        sys.stdout.flush()
    except BrokenPipeError:
        # Later writes, and the interpreter's last flush, go nowhere.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE
    return status


def _dispatch(args: list[str]) -> int:
    """Dispatch C{kcoral <subcommand>}: C{run} and C{health} are the client's."""
    from kcoral.client.install import report

    report(sys.stderr)  # the reference client installed beside us: one line
    if args[:1] in (["run"], ["health"]):
        from kcoral.client.cli import health_main, interruptible, run_main

        command = run_main if args[0] == "run" else health_main
        name = f"kcoral {args[0]}"
        if args[0] == "run" and args[1:2] and not args[1].startswith("-"):
            name += f" {args[1]}"  # the tool
        return interruptible(name, lambda: command(args[1:]))
    if args[:1] == ["gateway"]:
        from kcoral.gateway.command import main as gateway_main

        return gateway_main(args[1:])
    from kcoral.server.cli.command import main as cli_main

    return cli_main(args)


if __name__ == "__main__":
    sys.exit(main())
