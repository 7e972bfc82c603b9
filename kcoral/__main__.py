"""C{python -m kcoral}: the C{kcoral} command."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Dispatch C{kcoral <subcommand>}: C{run} and C{health} are the client's."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["run"]:
        from kcoral.client.cli import run_main

        return run_main(args[1:])
    if args[:1] == ["health"]:
        from kcoral.client.cli import health_main

        return health_main(args[1:])
    from kcoral.server.cli import main as cli_main

    return cli_main(args)


if __name__ == "__main__":
    sys.exit(main())
