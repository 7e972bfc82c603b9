#!/usr/bin/env python3
"""
How fast the blocking client and C{kcoral health} answer over TLS on
loopback (issue 36 item 1: the target is under 1 s).

Starts a CPU server listening on C{ssl:} (127.0.0.1, a fresh self-signed
certificate, trusted through C{SSL_CERT_FILE}) and measures, each in a fresh
interpreter so that nothing is warm:

 - C{client first}: C{Client(url).health()} in a script, from the call to
   the answer (connect, TLS handshake, request), the interpreter's start and
   imports excluded;
 - C{client warm}: further C{health()} calls on the same client (a kept
   connection);
 - C{kcoral health}: the whole command, interpreter start included, and the
   same command's floor, C{kcoral health --help} (start and imports only).

Prints the numbers and writes C{bench/results/client_tls.json} (or
C{--output}).

    python3 bench/probes/client_tls.py --repeat 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/

import common  # noqa: E402

from kcoral.testing.live_server import ServerProcess, free_port  # noqa: E402
from tests.integration.test_client_tls import self_signed  # noqa: E402

SCRIPT = """
import json, sys, time
start = time.monotonic()
from kcoral import Client
imported = time.monotonic()
client = Client(sys.argv[1])
client.health()
first = time.monotonic()
warm = []
for _ in range(20):
    t = time.monotonic()
    client.health()
    warm.append((time.monotonic() - t) * 1000)
client.close()
print(json.dumps({"import_ms": (imported - start) * 1000, "first_ms": (first - imported) * 1000,
                  "warm_ms": warm}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--repeat", type=int, default=5, help="fresh processes per measurement")
    parser.add_argument("--output", default=str(common.RESULTS / "client_tls.json"))
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="kcoral-bench-tls-"))
    key, cert = self_signed(root)
    tls_port = free_port()
    server = ServerProcess(["--device", "cpu", "--num-workers", "1", "--log-dir", ""])
    server.args += [
        "--listen",
        f"tcp:{server.port}:interface=127.0.0.1",
        "--listen",
        f"ssl:{tls_port}:interface=127.0.0.1:privateKey={key}:certKey={cert}",
    ]
    url = f"https://127.0.0.1:{tls_port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KCORAL_")}
    env["SSL_CERT_FILE"] = str(cert)
    env["PYTHONPATH"] = str(common.ROOT)

    def timed(argv: list[str]) -> tuple[float, str]:
        start = time.monotonic()
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise SystemExit(f"{argv}: {done.stderr}")
        return (time.monotonic() - start) * 1000, done.stdout

    first, warm, imports, command, floor = [], [], [], [], []
    with server:
        for _ in range(args.repeat):
            _, out = timed([sys.executable, "-c", SCRIPT, url])
            record = json.loads(out)
            first.append(record["first_ms"])
            imports.append(record["import_ms"])
            warm.extend(record["warm_ms"])
            command.append(timed([sys.executable, "-m", "kcoral", "health", "--url", url])[0])
            floor.append(timed([sys.executable, "-m", "kcoral", "health", "--help"])[0])
    results = {
        "client_first_ms": common.describe(first),
        "client_warm_ms": common.describe(warm),
        "client_import_ms": common.describe(imports),
        "kcoral_health_ms": common.describe(command),
        "kcoral_health_help_ms": common.describe(floor),
        "kcoral_health_minus_floor_ms": statistics.median(command) - statistics.median(floor),
    }
    print(f"client, first health over TLS:  {common.fmt(results['client_first_ms'])}")
    print(f"client, warm health over TLS:   {common.fmt(results['client_warm_ms'])}")
    print(f"import kcoral.Client:           {common.fmt(results['client_import_ms'])}")
    print(f"kcoral health (whole command):  {common.fmt(results['kcoral_health_ms'])}")
    print(f"kcoral health --help (floor):   {common.fmt(results['kcoral_health_help_ms'])}")
    print(f"kcoral health minus its floor:  {results['kcoral_health_minus_floor_ms']:.0f} ms (p50)")
    common.write_result(args.output, {"benchmark": "client_tls", "url": url, **results})


if __name__ == "__main__":
    main()
