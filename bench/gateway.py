#!/usr/bin/env python3
"""
C{kcoral gateway} against going direct to a node (issue 37's targets).

Self-contained: starts its own C{nats-server} (C{--nats-server PATH}, else
the one on C{PATH}), a gateway and CPU nodes that join it (C{kcoral server
--join}), all on loopback, and stops them at the end.

Phases (C{--phases}, comma-separated; all by default):

  - C{latency}: null-program p50 through the gateway and direct to the
    node it runs on, one request at a time on a keep-alive connection, in
    three blocks and in C{--latency-rounds} alternating blocks (target:
    the gateway adds at most 2 ms);
  - C{kills}: C{--jobs} programs from C{--concurrency} threads while a
    node is SIGKILLed (and a fresh one joins) every C{--kill-every}
    seconds; each program appends its job tag to a file, so a double
    execution shows; every answer must be COMPLETED, 503 or 502 (target:
    0 double executions, 0 lost answers);
  - C{bigblob}: a C{--big-mib} blob up and the same bytes back, through
    the gateway and direct (target: within 1.5x);
  - C{throughput}: null-program requests/s from C{--concurrency} clients
    through the gateway with one node, then with three (target: at least
    2.7x on a machine with the cores, e.g. 16); with
    C{--compare-front-ends 2,4}, three nodes again behind a gateway of 2 and
    of 4 processes (C{--front-ends}).  Each figure says where the CPU went
    (L{cpumeter}: the host's busy share, each role's CPU per job and how
    busy its main process was, a speed probe), and each round its
    CPU-bound ceiling (three times one node, less what a node's CPU per
    job grew by with three on the host); C{--ballast N} adds one node
    beside N busy processes, for the ratio at equal host load.

Prints each figure and writes C{bench/results/gateway.json} (C{--output}).

Example (the GPU machine's 16 cores, CPU nodes)::

    python3 bench/gateway.py --phases throughput --node-workers 2 \
        --front-ends 4 --concurrency 32 --requests 3000 \
        --client-processes 4 --throughput-rounds 10 --ballast 6
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import multiprocessing
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402
import cpumeter  # noqa: E402

from kcoral.testing.gateway import GatewayPool, GatewayProcess  # noqa: E402

NULL = common.module_program("def noop():\n    return None\n", [("noop", [], False)])

MARK_SOURCE = (
    "import os\n"
    "def mark(path, tag):\n"
    "    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)\n"
    "    try:\n"
    "        os.write(fd, (tag + '\\n').encode())\n"
    "    finally:\n"
    "        os.close(fd)\n"
    "    return tag\n"
)

ECHO_SOURCE = "def echo(x):\n    return bytes(x)\n"


class Pool(GatewayPool):
    """nats-server, a gateway and joined CPU nodes, on loopback (L{GatewayPool})."""

    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        limit = str(args.big_mib * 1024 * 1024 + 16 * 1024 * 1024)
        limits = ["--max-request-bytes", limit, "--max-response-bytes", limit]
        super().__init__(
            tmp,
            [f"node-{i}" for i in range(args.max_nodes)],
            gateway_args=[
                *limits,
                "--queue-timeout",
                "120",
                "--front-ends",
                str(args.front_ends),
            ],
            node_args=[
                "--max-requests-per-worker",
                "0",
                "--sandbox",
                args.sandbox,
                *limits,
            ],
            node_timeout=180,
        )
        self.args = args
        self.free_ids = list(self.node_ids)
        #: Each node's C{--pin-nodes} slot (0-2).
        self.slots: dict[str, int] = {}

    def start(self) -> Pool:
        if self.args.nats_server:
            os.environ["PATH"] = (
                str(Path(self.args.nats_server).resolve().parent) + os.pathsep + os.environ["PATH"]
            )
        super().start()
        return self

    def restart_gateway(self, front_ends: int) -> None:
        """Stop the gateway and start it again with C{front_ends} processes (nodes stay)."""
        args = list(self.gateway_args)
        args[args.index("--front-ends") + 1] = str(front_ends)
        self.gateway_args = args
        assert self.gateway is not None
        self.gateway.stop()
        self.gateway = GatewayProcess(
            self.nats.url,
            self.nats.credentials_file("gateway"),
            args=args,
            port=self.gateway.port,
            log_path=self.tmp / "gateway.log",
        ).start()
        self.wait_nodes(len(self.nodes))

    def stop_node(self, node_id: str) -> None:
        """Stop the node gracefully; its id (and so its credentials) may serve again."""
        super().stop_node(node_id)
        self.free_ids.append(node_id)

    def add_node(self) -> str:
        node_id = self.free_ids.pop(0)
        taken = {self.slots.get(n) for n in self.nodes}
        slot = self.slots[node_id] = min(set(range(3)) - taken, default=0)
        cores = node_cores(self.args.pin_nodes, slot)
        with affinity(cores):
            self.node(node_id, seats=self.args.node_workers, wait=False)
        self.wait_nodes(len(self.nodes))
        return node_id


def node_cores(per_node: int, slot: int) -> set[int] | None:
    """
    The cores of node slot C{slot} (0-2) under C{--pin-nodes}: the last
    C{3 * per_node} cores of the host, C{per_node} each; C{None}: unpinned.
    """
    if per_node <= 0:
        return None
    cores = sorted(os.sched_getaffinity(0) | set(range(os.cpu_count() or 1)))
    end = len(cores) - slot * per_node
    return set(cores[end - per_node : end])


def rest_cores(per_node: int) -> set[int] | None:
    """The cores left to the gateway, nats-server and the clients under C{--pin-nodes}."""
    if per_node <= 0:
        return None
    cores = sorted(range(os.cpu_count() or 1))
    return set(cores[: len(cores) - 3 * per_node])


@contextlib.contextmanager
def affinity(cores: set[int] | None) -> Iterator[None]:
    """
    Run the block on C{cores} (this thread; a process it starts inherits
    them), then go back.
    """
    if cores is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def null_one(conn: common.Connection, _i: int) -> float:
    reply = conn.execute(NULL)
    if reply.outcome != "COMPLETED":
        raise RuntimeError(f"null program answered {reply.outcome}: {reply.describe_error()}")
    return reply.wall_ms


#: Requests at the head of each alternating block left out of its figures:
#: the other path's last request may still be settling (its worker replaced).
BLOCK_SETTLE = 2


def latency(pool: Pool, args: argparse.Namespace) -> dict[str, Any]:
    """
    Null-program p50 through the gateway and direct to its one node, one
    request at a time, measured two ways.

    Three blocks (C{--sequential} requests direct, through the gateway,
    direct again): the gateway's p50 less the lower direct p50
    (C{added_p50_ms}).  On a host whose speed drifts during the run (the
    two direct blocks of one run on the H200 machine differed by up to
    1 ms) the lower of two direct figures flatters going direct.

    Alternating blocks (C{--latency-rounds} rounds of a direct block and a
    gateway block, C{--sequential} requests on each path in all, the first
    L{BLOCK_SETTLE} of each block left out): the drift reaches both paths
    alike (C{alternating_added_p50_ms}, pooled p50s; and the median of the
    rounds' own differences).
    """
    node = next(iter(pool.nodes.values()))
    out: dict[str, Any] = {}
    for label, port in (("direct", node.port), ("gateway", pool.port), ("direct2", node.port)):
        common.run_concurrent("127.0.0.1", port, 1, args.warmup, null_one)
        meter = _meter(pool)
        meter.start()
        walls, _ = common.run_concurrent("127.0.0.1", port, 1, args.sequential, null_one)
        out[label] = common.describe(walls)
        out[label]["cpu"] = meter.stop(len(walls))
        print(f"  {label:<8} {common.fmt(out[label])}")
        print(f"           CPU ms per request: {cpumeter.describe(out[label]['cpu'])}")
    direct = min(out["direct"]["p50"], out["direct2"]["p50"])
    out["added_p50_ms"] = out["gateway"]["p50"] - direct
    print(f"  the gateway adds {out['added_p50_ms']:.2f} ms p50, three blocks (target <= 2 ms)")
    rounds = max(1, args.latency_rounds)
    per_block = max(BLOCK_SETTLE + 10, args.sequential // rounds)
    pooled: dict[str, list[float]] = {"direct": [], "gateway": []}
    differences = []
    for _ in range(rounds):
        p50s = {}
        for label, port in (("direct", node.port), ("gateway", pool.port)):
            walls, _ = common.run_concurrent("127.0.0.1", port, 1, per_block, null_one)
            kept = walls[BLOCK_SETTLE:]
            pooled[label] += kept
            p50s[label] = common.describe(kept)["p50"]
        differences.append(p50s["gateway"] - p50s["direct"])
    for label, walls in pooled.items():
        out[f"alternating_{label}"] = common.describe(walls)
        print(
            f"  {label:<8} {common.fmt(out[f'alternating_{label}'])} ({rounds} alternating blocks)"
        )
    out["alternating_added_p50_ms"] = (
        out["alternating_gateway"]["p50"] - out["alternating_direct"]["p50"]
    )
    out["alternating_round_differences_ms"] = differences
    differences.sort()
    out["alternating_round_median_ms"] = differences[len(differences) // 2]
    print(
        f"  the gateway adds {out['alternating_added_p50_ms']:.2f} ms p50, alternating "
        f"(rounds' median {out['alternating_round_median_ms']:.2f}; target <= 2 ms)"
    )
    return out


def kills(pool: Pool, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """C{--jobs} marked programs while nodes die and join."""
    marks = tmp / "marks"
    outcomes: dict[str, int] = {}
    answered: dict[str, str] = {}
    lost: list[str] = []
    tags = [uuid.uuid4().hex for _ in range(args.jobs)]
    lock = threading.Lock()
    stop = threading.Event()
    killed = 0

    def one(conn: common.Connection, i: int) -> str:
        program = common.module_program(MARK_SOURCE, [("mark", [str(marks), tags[i]], False)])
        try:
            reply = conn.execute(program)
        except Exception as e:  # noqa: BLE001 - counted
            conn.close()
            with lock:
                lost.append(f"{tags[i]}: {type(e).__name__}: {e}")
            return "lost"
        if reply.status == 200 and reply.outcome == "COMPLETED":
            outcome = "COMPLETED"
        elif reply.status in (502, 503):
            outcome = str(reply.status)
        else:
            outcome = f"other {reply.status} {reply.outcome}"
            with lock:
                lost.append(f"{tags[i]}: {outcome}: {reply.describe_error()}")
        with lock:
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            answered[tags[i]] = outcome
        return outcome

    def killer() -> None:
        nonlocal killed
        rng = random.Random(args.seed)
        while not stop.wait(args.kill_every):
            if len(pool.nodes) < 2:
                continue
            victim = rng.choice(sorted(pool.nodes))
            pool.kill_node(victim)
            killed += 1
            if pool.free_ids:
                try:
                    pool.add_node()
                except Exception as e:  # noqa: BLE001 - reported
                    print(f"  a replacement node failed to join: {e}")

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    started = time.perf_counter()
    try:
        common.run_concurrent("127.0.0.1", pool.port, args.concurrency, args.jobs, one)
    finally:
        stop.set()
        thread.join()
    seconds = time.perf_counter() - started
    runs: dict[str, int] = {}
    if marks.exists():
        for line in marks.read_text().split():
            runs[line] = runs.get(line, 0) + 1
    doubles = sorted(t for t, n in runs.items() if n > 1)
    # COMPLETED means run exactly once; 503 means never run.
    completed_wrong = [t for t, o in answered.items() if o == "COMPLETED" and runs.get(t) != 1]
    busy_but_ran = [t for t, o in answered.items() if o == "503" and runs.get(t, 0) > 0]
    out = {
        "jobs": args.jobs,
        "seconds": seconds,
        "nodes_killed": killed,
        "outcomes": outcomes,
        "double_executions": len(doubles),
        "lost_answers": len(lost),
        "lost_examples": lost[:5],
        "runs_recorded": sum(runs.values()),
        "completed_not_run_once": len(completed_wrong),
        "503_but_ran": len(busy_but_ran),
    }
    print(
        f"  {args.jobs} jobs in {seconds:.1f} s, {killed} nodes killed: {outcomes}; "
        f"double executions {len(doubles)}, lost answers {len(lost)} (targets 0, 0); "
        f"COMPLETED not run once {len(completed_wrong)}, 503 that ran {len(busy_but_ran)}"
    )
    return out


def bigblob(pool: Pool, args: argparse.Namespace) -> dict[str, Any]:
    """A C{--big-mib} blob up and back, direct and through the gateway (fresh blob each)."""
    node = next(iter(pool.nodes.values()))
    out: dict[str, Any] = {}
    for label, port in (("direct", node.port), ("gateway", pool.port)):
        blob = os.urandom(args.big_mib * 1024 * 1024)
        digest = hashlib.sha256(blob).hexdigest()
        program = {
            "instructions": [
                {"op": "upload", "id": "m", "kind": "module", "source": ECHO_SOURCE},
                {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "echo"},
                {"op": "upload", "id": "b", "kind": "bytes", "blob": digest},
                {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": [{"$ref": "b"}]},
                {"op": "return", "key": "out", "value": {"$ref": "r"}},
            ]
        }
        conn = common.Connection("127.0.0.1", port, timeout=600)
        try:
            reply, attempts, wall_ms = conn.execute_like_client(program, [blob])
        finally:
            conn.close()
        if reply.outcome != "COMPLETED":
            raise RuntimeError(f"{label}: {reply.outcome}: {reply.describe_error()}")
        back = next(iter(reply.parts.values()), b"")
        if hashlib.sha256(back).hexdigest() != digest:
            raise RuntimeError(f"{label}: the bytes came back different")
        out[label] = {"wall_ms": wall_ms, "attempts": attempts}
        print(
            f"  {label:<8} {args.big_mib} MiB up and back in {wall_ms:.0f} ms ({attempts} attempts)"
        )
        del blob, back, reply
    out["ratio"] = out["gateway"]["wall_ms"] / out["direct"]["wall_ms"]
    print(f"  gateway / direct = {out['ratio']:.2f}x (target <= 1.5x)")
    return out


def _meter(pool: Pool) -> cpumeter.CpuMeter:
    """CPU of the gateway, the nodes (workers included) and nats-server."""

    def pid(process: Any) -> list[int]:
        return [process.pid] if process is not None else []

    return cpumeter.CpuMeter(
        {
            "gateway": lambda: pid(pool.gateway.process if pool.gateway else None),
            "nodes": lambda: [p for s in pool.nodes.values() for p in pid(s.process)],
            "nats": lambda: pid(pool.nats.process),
        },
        counted=("nodes",),
    )


def _rate(pool: Pool, args: argparse.Namespace) -> dict[str, Any]:
    common.run_concurrent("127.0.0.1", pool.port, args.concurrency, args.warmup * 4, null_one)
    meter = _meter(pool)
    meter.start()
    rate = _rate_span(pool, args)
    rate["cpu"] = meter.stop(rate["requests"])
    return rate


def _rate_span(pool: Pool, args: argparse.Namespace) -> dict[str, Any]:
    processes = max(1, args.client_processes)
    if processes == 1:
        walls, seconds = common.run_concurrent(
            "127.0.0.1", pool.port, args.concurrency, args.requests, null_one, args.max_seconds
        )
        return {"requests": len(walls), "seconds": seconds, "per_second": len(walls) / seconds}
    # One client process is one GIL: past about 1,500 null programs a
    # second the load generator, not the pool, would set the figure.
    ctx = multiprocessing.get_context("fork")
    start = ctx.Barrier(processes)
    jobs = [
        (
            pool.port,
            args.concurrency // processes or 1,
            args.requests // processes,
            args.max_seconds,
        )
        for _ in range(processes)
    ]
    with ctx.Pool(processes, initializer=_client_init, initargs=(start,)) as clients:
        spans = clients.map(_client_share, jobs)
    requests = sum(count for count, _, _ in spans)
    seconds = max(end for _, _, end in spans) - min(begin for _, begin, _ in spans)
    return {
        "requests": requests,
        "seconds": seconds,
        "per_second": requests / seconds,
        "client_processes": processes,
    }


_BARRIER: Any = None


def _client_init(barrier: Any) -> None:
    global _BARRIER
    _BARRIER = barrier


def _client_share(job: tuple[int, int, int, float]) -> tuple[int, float, float]:
    """One client process's share of a throughput run: (requests, start, end), monotonic."""
    port, concurrency, count, max_seconds = job
    _BARRIER.wait()
    begin = time.monotonic()
    walls, _ = common.run_concurrent("127.0.0.1", port, concurrency, count, null_one, max_seconds)
    return len(walls), begin, time.monotonic()


def _ceiling(one: dict[str, Any], three: dict[str, Any]) -> dict[str, float]:
    """
    What three nodes could give at most against one, where each node's
    main process is the bottleneck (busy near 100% in both): three times
    one node's rate, less what each job's CPU in a node's main process grew
    by with three nodes on the host.  C{probe_growth} is the host's own
    slowdown on fixed work over the same spans (L{cpumeter.SpeedProbe}).
    """
    c1, c3 = one["ms_per_job"]["nodes_main"], three["ms_per_job"]["nodes_main"]
    return {
        "main_ms_1": c1,
        "main_ms_3": c3,
        "main_busy_1": one["main_busy"]["nodes"],
        "main_busy_3": three["main_busy"]["nodes"],
        "growth": c3 / c1 - 1.0,
        "probe_growth": three["probe_us"] / one["probe_us"] - 1.0,
        "probe_memory_growth": three["probe_memory_us"] / one["probe_memory_us"] - 1.0,
        "ceiling": 3.0 * c1 / c3,
        **_counter_growth(one, three),
    }


def _counter_growth(one: dict[str, Any], three: dict[str, Any]) -> dict[str, float]:
    """
    Where a node's main process's extra CPU per job went, from the CPU's
    counters: more instructions per job (more work), fewer instructions per
    cycle (the same work, slower), or a lower clock.  Empty without counters.
    """
    a = one.get("counters", {}).get("nodes", {})
    b = three.get("counters", {}).get("nodes", {})
    if "ipc" not in a or "ipc" not in b:
        return {}
    return {
        "instructions_growth": b["minstructions_per_job"] / a["minstructions_per_job"] - 1.0,
        "ipc_growth": b["ipc"] / a["ipc"] - 1.0,
        "clock_growth": b["ghz"] / a["ghz"] - 1.0,
    }


def throughput(pool: Pool, args: argparse.Namespace) -> dict[str, Any]:
    """
    Null-program requests/s through the gateway with one node, then three;
    then three again behind a gateway of each C{--compare-front-ends}
    count (the gateway restarted; the nodes stay).
    """
    out: dict[str, Any] = {"front_ends": args.front_ends}
    ratios = []
    ceilings: list[dict[str, float]] = []
    equal_load: list[float] = []
    #: Every round's figures with their CPU (C{nodes_1} and the like keep the last).
    rounds: list[dict[str, Any]] = []
    for _ in range(max(1, args.throughput_rounds)):
        # Each round measures one node, then three, so that a host whose
        # speed drifts reaches both figures of a round alike.
        while len(pool.nodes) > 1:
            pool.stop_node(sorted(pool.nodes)[-1])
        pool.wait_nodes(1)
        for count in (1, 3):
            while len(pool.nodes) < count:
                pool.add_node()
            out[f"nodes_{count}"] = rate = _rate(pool, args)
            print(
                f"  {count} node(s), {args.front_ends} front end(s): {rate['requests']} requests "
                f"in {rate['seconds']:.2f} s = {rate['per_second']:.1f} req/s"
            )
            print("    " + cpumeter.describe(rate["cpu"]))
        ratios.append(out["nodes_3"]["per_second"] / out["nodes_1"]["per_second"])
        rounds.append({"nodes_1": out["nodes_1"], "nodes_3": out["nodes_3"]})
        print(f"  3 nodes / 1 node = {ratios[-1]:.2f}x (target >= 2.7x with the cores)")
        if args.ballast:
            # One node again, now on a host as busy as three nodes made it.
            while len(pool.nodes) > 1:
                pool.stop_node(sorted(pool.nodes)[-1])
            pool.wait_nodes(1)
            with cpumeter.Ballast(args.ballast):
                out["nodes_1_ballast"] = rounds[-1]["nodes_1_ballast"] = rate = _rate(pool, args)
            equal_load.append(out["nodes_3"]["per_second"] / rate["per_second"])
            print(
                f"  1 node beside {args.ballast} busy ballast processes: "
                f"{rate['per_second']:.1f} req/s"
            )
            print("    " + cpumeter.describe(rate["cpu"]))
            print(f"  3 nodes / 1 node on a host as busy = {equal_load[-1]:.2f}x")
        ceilings.append(_ceiling(out["nodes_1"]["cpu"], out["nodes_3"]["cpu"]))
        busy = min(ceilings[-1]["main_busy_1"], ceilings[-1]["main_busy_3"])
        print(
            f"  nodes' main processes busy {busy:.0%} or more"
            + ("" if busy >= 0.9 else " (not the bottleneck: the ceiling below does not hold)")
        )
        print(
            f"  a node's main process spent {ceilings[-1]['growth']:+.0%} CPU per job with three "
            f"(the host's probe: core work {ceilings[-1]['probe_growth']:+.0%}, memory work "
            f"{ceilings[-1]['probe_memory_growth']:+.0%}): three such nodes flat out "
            f"give {ceilings[-1]['ceiling']:.2f}x; measured / that = "
            f"{ratios[-1] / ceilings[-1]['ceiling']:.2f}"
        )
        if "ipc_growth" in ceilings[-1]:
            print(
                f"  the CPU's counters, three nodes against one: instructions per job "
                f"{ceilings[-1]['instructions_growth']:+.0%}, instructions per cycle "
                f"{ceilings[-1]['ipc_growth']:+.0%}, clock {ceilings[-1]['clock_growth']:+.0%}"
            )
    out["ratio"] = ratios[-1]
    out["ratios"] = ratios
    out["ratio_median"] = statistics.median(ratios)
    out["ceilings"] = ceilings
    out["rounds"] = rounds
    if equal_load:
        out["ratios_equal_load"] = equal_load
        out["ratio_equal_load_median"] = statistics.median(equal_load)
        print(
            f"  median of {len(equal_load)} rounds on a host as busy: "
            f"{out['ratio_equal_load_median']:.2f}x"
        )
    out["ceiling_median"] = statistics.median(c["ceiling"] for c in ceilings)
    if len(ratios) > 1:
        print(
            f"  median of {len(ratios)} rounds: {out['ratio_median']:.2f}x "
            f"(CPU-bound ceiling {out['ceiling_median']:.2f}x)"
        )
    for front_ends in args.compare_front_ends:
        pool.restart_gateway(front_ends)
        out[f"nodes_3_front_ends_{front_ends}"] = rate = _rate(pool, args)
        ratio = rate["per_second"] / out["nodes_1"]["per_second"]
        out[f"ratio_front_ends_{front_ends}"] = ratio
        print(
            f"  3 node(s), {front_ends} front end(s): {rate['per_second']:.1f} req/s "
            f"= {ratio:.2f}x one node behind {args.front_ends}"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nats-server", help="the nats-server executable [default: on PATH]")
    parser.add_argument(
        "--phases", default="latency,kills,bigblob,throughput", help="comma-separated phases"
    )
    parser.add_argument("--node-workers", type=int, default=2, help="--num-workers of each node")
    parser.add_argument(
        "--front-ends", type=int, default=1, help="the gateway's --front-ends (processes)"
    )
    parser.add_argument(
        "--compare-front-ends",
        default="",
        help="throughput: also three nodes behind a gateway of each of these front-end "
        "counts (comma-separated), e.g. 2,4",
    )
    parser.add_argument("--sandbox", default="none", help="--sandbox of each node")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--sequential", type=int, default=200)
    parser.add_argument(
        "--latency-rounds",
        type=int,
        default=10,
        help="alternating direct/gateway blocks in the latency phase",
    )
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--kill-every", type=float, default=5.0, help="seconds between kills")
    parser.add_argument("--seed", type=int, default=37)
    parser.add_argument("--big-mib", type=int, default=256)
    parser.add_argument("--requests", "-n", type=int, default=1000)
    parser.add_argument("--concurrency", "-c", type=int, default=8)
    parser.add_argument(
        "--throughput-rounds",
        type=int,
        default=1,
        help="throughput: rounds of one node then three, each with its own ratio",
    )
    parser.add_argument(
        "--client-processes",
        type=int,
        default=1,
        help="throughput: client processes sharing --concurrency and --requests",
    )
    parser.add_argument(
        "--ballast",
        type=int,
        default=0,
        metavar="N",
        help="throughput: after each round, one node again beside N busy processes "
        "(bench/cpumeter.py Ballast), as busy a host as three nodes make it, for the "
        "ratio at equal host load [default: 0, not measured]",
    )
    parser.add_argument(
        "--pin-nodes",
        type=int,
        default=0,
        metavar="CORES",
        help="give each of up to three node slots CORES cores of its own (the last ones), "
        "as if each node had its own machine; the gateway, nats-server and the clients "
        "share the rest [default: 0, nothing pinned]",
    )
    parser.add_argument("--max-seconds", type=float, default=60.0)
    parser.add_argument(
        "--output", default=str(Path(__file__).resolve().parent / "results" / "gateway.json")
    )
    args = parser.parse_args(argv)
    args.max_nodes = 12
    args.compare_front_ends = [int(n) for n in args.compare_front_ends.split(",") if n.strip()]
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    tmp = Path(tempfile.mkdtemp(prefix="kcoral-bench-gateway-"))
    rest = rest_cores(args.pin_nodes)
    if rest is not None:
        # Nodes get their own cores, as on machines of their own; the rest
        # (and every process started from here but a node) share the others.
        os.sched_setaffinity(0, rest)
    try:
        pool = Pool(args, tmp).start()
    except BaseException:
        log = tmp / "gateway.log"
        if log.exists():
            print("gateway log (tail):\n" + "\n".join(log.read_text().splitlines()[-30:]))
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    results: dict[str, Any] = {"cpus": os.cpu_count(), "args": vars(args)}
    try:
        pool.add_node()
        if "latency" in phases:
            print("latency (null program, sequential):")
            results["latency"] = latency(pool, args)
        if "bigblob" in phases:
            print(f"{args.big_mib} MiB round trip:")
            results["bigblob"] = bigblob(pool, args)
        if "kills" in phases:
            while len(pool.nodes) < 3:
                pool.add_node()
            print(f"{args.jobs} jobs with node kills every {args.kill_every:.0f} s:")
            results["kills"] = kills(pool, args, tmp)
        if "throughput" in phases:
            print(f"throughput (null program, concurrency {args.concurrency}):")
            results["throughput"] = throughput(pool, args)
    finally:
        pool.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    common.write_result(args.output, results)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
