#!/usr/bin/env python3
"""
Service through a slowloris flood: /health and program probes answered while
thousands of connections trickle request heads (issue 32, item 4).

C{--connections} connections (4,300 by default, the issue's figure) from
C{--sources} loopback addresses (127.0.0.2 on) each send the start of a
request head and then a byte every C{--interval} seconds, never finishing
it; a connection the server closes is opened again at once.  Meanwhile
C{--rounds} rounds of one C{GET /health} and one ordinary program (with
C{--token} when the server has tokens) are sent from 127.0.0.1, each on a
fresh connection.  Prints the percentage of each answered and writes
C{bench/results/connection_flood.json} (or C{--output}).

Examples::

    python3 bench/probes/connection_flood.py --spawn "--device cpu --num-workers 1 --log-dir '' \\
        --sandbox bubblewrap"
    python3 bench/probes/connection_flood.py --spawn "--device cpu --num-workers 1 --log-dir '' \\
        --sandbox bubblewrap" --fd-limit 1024 --connections 1100 --label "hard fd limit 1024"

C{--fd-limit} starts the spawned server with that soft and hard limit on
open files.  The client needs about C{--connections} descriptors itself
(its soft limit is raised to its hard limit).
"""

from __future__ import annotations

import argparse
import resource
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/

import common  # noqa: E402

from kcoral.testing.flood import Probes, TricklingFlood, sources  # noqa: E402
from kcoral.testing.live_server import ServerProcess  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_server_args(parser, "connection_flood")
    parser.add_argument("--connections", type=int, default=4300)
    parser.add_argument("--sources", type=int, default=8, help="flooding addresses")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between bytes")
    parser.add_argument("--rounds", type=int, default=67, help="probe rounds (the issue's 67)")
    parser.add_argument("--pause", type=float, default=0.3, help="seconds between rounds")
    parser.add_argument("--token", default=None, help="bearer token for the program probes")
    parser.add_argument("--fd-limit", type=int, default=None, help="spawned server's fd limit")
    args = parser.parse_args(argv)

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    if args.spawn:
        log = Path(args.output).with_suffix(".server.log")
        log.parent.mkdir(parents=True, exist_ok=True)
        server = ServerProcess(shlex.split(args.spawn), log_path=log, fd_limit=args.fd_limit)
        server.start(timeout=args.spawn_timeout)
        port, where = server.port, f"a spawned server ({args.spawn})"
    else:
        server = None
        host, _, port_text = args.url.rpartition(":")
        port, where = int(port_text), args.url
    try:
        print(f"connection flood against {where}: {args.connections} connections")
        flood = TricklingFlood(port, args.connections, sources(2, args.sources), args.interval)
        started = time.monotonic()
        with flood:
            probes = Probes(port, token=args.token)
            probes.rounds(args.rounds, args.pause)
            open_at_end = flood.open_now()
        seconds = time.monotonic() - started
    finally:
        if server is not None:
            server.stop()
    percent = probes.percentages()
    print(
        f"  /health answered {probes.answered['health']} of {probes.sent['health']} "
        f"({percent['health']:.1f} %), programs {probes.answered['program']} of "
        f"{probes.sent['program']} ({percent['program']:.1f} %), slowest probe "
        f"{probes.slowest_s * 1e3:.0f} ms"
    )
    print(
        f"  flood: {flood.opened} connections opened ({flood.reopened} again after the server "
        f"closed them, {flood.connect_failures} connects failed), {open_at_end} open at the "
        f"end, {seconds:.1f} s"
    )
    for failure in probes.failures[:5]:
        print(f"  failed probe: {failure}")
    log_bytes = None
    if server is not None and server.log_path is not None:
        text = server.log_path.read_text(errors="replace")
        log_bytes = len(text)
        print(f"  server log: {log_bytes} bytes, {text.count('EMFILE')} lines naming EMFILE")
    common.write_result(
        args.output,
        {
            "benchmark": "connection_flood",
            "label": args.label,
            "target": where,
            "connections": args.connections,
            "sources": args.sources,
            "interval_s": args.interval,
            "fd_limit": args.fd_limit,
            "sent": probes.sent,
            "answered": probes.answered,
            "percent": percent,
            "slowest_probe_ms": probes.slowest_s * 1e3,
            "failures": probes.failures[:20],
            "flood_opened": flood.opened,
            "flood_reopened": flood.reopened,
            "flood_connect_failures": flood.connect_failures,
            "seconds": seconds,
            "server_log_bytes": log_bytes,
        },
    )
    return 0 if percent == {"health": 100.0, "program": 100.0} else 1


if __name__ == "__main__":
    sys.exit(main())
