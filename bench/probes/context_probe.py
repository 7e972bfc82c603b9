"""Probe what CUDA context creation and teardown cost, and what they disturb.

Run on the GPU machine (the parent never initialises CUDA; every CUDA user is
a forked child, as a worker of the template is):

    python3 bench/probes/context_probe.py --output bench/results/context_probe.json

A measuring child copies 1 GiB device to device in a loop, timing each copy
with CUDA events.  Beside it, batches of forked children go through the
phases of a worker's life one phase at a time: cuInit only, primary context
creation, explicit context teardown (pop + detach), and creation followed by
process exit without teardown.  For each phase window the probe reports the
median and coefficient of variation of the measuring child's copies, and the
phase's own duration, so the scheduling of creation and teardown on the
lease rests on numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/
import common  # noqa: E402

CHILDREN = 8


def _measure(stop_r: int, out_w: int, ready_w: int) -> None:
    import pycuda.driver as cuda

    cuda.init()
    ctx = cuda.Device(0).retain_primary_context()
    ctx.push()
    n = 1 << 30
    a = cuda.mem_alloc(n)
    b = cuda.mem_alloc(n)
    start, end = cuda.Event(), cuda.Event()
    samples = []
    os.set_blocking(stop_r, False)
    os.write(ready_w, b"r")
    while True:
        try:
            if os.read(stop_r, 1):
                break
        except BlockingIOError:
            pass
        t = time.time()
        start.record()
        cuda.memcpy_dtod(b, a, n)
        end.record()
        end.synchronize()
        samples.append((t, end.time_since(start)))
    ctx.pop()
    os.write(out_w, json.dumps(samples).encode())
    os.close(out_w)
    os._exit(0)


def _child(cmd_r: int, ack_w: int) -> None:
    """A worker-like child: waits for phase commands, acknowledges each."""
    import pycuda.driver as cuda

    ctx = None
    f = os.fdopen(cmd_r, "rb", buffering=0)
    while True:
        op = f.read(1)
        if op == b"i":
            cuda.init()
        elif op == b"c":
            ctx = cuda.Device(0).retain_primary_context()
            ctx.push()
            cuda.mem_alloc(1 << 20)
        elif op == b"s":
            # What a worker's first module upload does (kcoral.worker.cuptiwatch):
            # subscribe to the driver API domain, switch it on, then off.
            from cupti import cupti

            watch = cupti.subscribe(lambda *a: None, None)
            cupti.enable_domain(1, watch, cupti.CallbackDomain.DRIVER_API)
            if ctx is not None:
                cuda.mem_alloc(1 << 20)
            cupti.enable_domain(0, watch, cupti.CallbackDomain.DRIVER_API)
        elif op == b"d":
            ctx.pop()
            ctx.detach()
            ctx = None
        elif op in (b"x", b""):
            os.write(ack_w, b"k")
            os._exit(0)
        os.write(ack_w, b"k")


def _spawn_children(count: int, env: dict[str, str] | None = None) -> list[tuple[int, int, int]]:
    kids = []
    for _ in range(count):
        cmd_r, cmd_w = os.pipe()
        ack_r, ack_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(cmd_w)
            os.close(ack_r)
            # Read by the driver at cuInit, which the child makes later.
            os.environ.update(env or {})
            _child(cmd_r, ack_w)
        os.close(cmd_r)
        os.close(ack_w)
        kids.append((pid, cmd_w, ack_r))
    return kids


def _phase(kids, op: bytes, windows: list, name: str) -> None:
    t0 = time.time()
    for _, cmd_w, _ in kids:
        os.write(cmd_w, op)
    for _, _, ack_r in kids:
        os.read(ack_r, 1)
    if op == b"x":
        for pid, _, _ in kids:
            os.waitpid(pid, 0)
    windows.append({"phase": name, "start": t0, "end": time.time(), "children": len(kids)})


#: Quiet before each measured phase and after a sequence, so no phase's
#: window holds the tail of another's work.
QUIET_S = 0.5


def _phases(kids, windows: list, steps: list[tuple[bytes, str]]) -> None:
    """
    Run C{steps} (op, window name) on C{kids} in turn.  A step named
    C{(setup) ...} only brings the children to the state the next one
    measures: it gets no quiet before it.
    """
    for op, name in steps:
        if not name.startswith("(setup)"):
            time.sleep(QUIET_S)
        _phase(kids, op, windows, name)
    time.sleep(QUIET_S)


def _bound(children: int, rounds: int, env: dict[str, str] | None = None) -> dict:
    """The replacement bound on an idle GPU: contexts made and destroyed per second.

    Serial: one child at a time creates its context, then tears it down (what a
    one-at-a-time replacement costs).  Batched: C{children} children create
    together, then tear down together (what a maintenance batch costs).
    """
    result = {}
    for mode, size in (("serial", 1), ("batched", children)):
        created = torn = exited = 0.0
        t_all = time.time()
        total = 0
        for _ in range(rounds):
            kids = _spawn_children(size, env)
            windows: list = []
            _phase(kids, b"i", windows, "init")
            _phase(kids, b"c", windows, "create")
            _phase(kids, b"d", windows, "detach")
            _phase(kids, b"x", windows, "exit")
            created += windows[1]["end"] - windows[1]["start"]
            torn += windows[2]["end"] - windows[2]["start"]
            exited += windows[3]["end"] - windows[3]["start"]
            total += size
        wall = time.time() - t_all
        result[mode] = {
            "contexts": total,
            "create_ms_each": created / total * 1000,
            "teardown_ms_each": torn / total * 1000,
            "exit_ms_each": exited / total * 1000,
            "gpu_side_per_s": total / (created + torn),
            "wall_per_s": total / wall,
        }
        print(
            f"bound {mode:8} x{size}{' ' + str(env) if env else ''}: create {created / total * 1000:.1f} ms, "
            f"teardown {torn / total * 1000:.1f} ms, exit after it {exited / total * 1000:.1f} ms "
            f"per context; {total / (created + torn):.2f} contexts/s on the GPU side, "
            f"{total / wall:.2f}/s wall"
        )
    result["mixed"] = _mixed_bound(children, rounds, env)
    return result


def _mixed_bound(children: int, rounds: int, env: dict[str, str] | None) -> dict:
    """
    Replacements the way a busy server batches them: C{children} new
    contexts created while C{children} old ones are torn down and their
    processes exit, all at once.  Compared with the batched figures, this
    shows what mixing creations and teardowns in one batch costs.
    """
    replaced = 0
    spent = 0.0
    old = _spawn_children(children, env)
    windows: list = []
    _phase(old, b"i", windows, "init")
    _phase(old, b"c", windows, "create")
    for _ in range(rounds):
        new = _spawn_children(children, env)
        _phase(new, b"i", windows, "init")
        time.sleep(QUIET_S)
        t0 = time.time()
        for _, cmd_w, _ in new:
            os.write(cmd_w, b"c")
        for _, cmd_w, _ in old:
            os.write(cmd_w, b"d")
        for _, _, ack_r in old:
            os.read(ack_r, 1)
        for _, cmd_w, _ in old:
            os.write(cmd_w, b"x")
        for pid, _, ack_r in old:
            os.read(ack_r, 1)
            os.waitpid(pid, 0)
        for _, _, ack_r in new:
            os.read(ack_r, 1)
        spent += time.time() - t0
        replaced += children
        old = new
    _phase(old, b"d", windows, "detach")
    _phase(old, b"x", windows, "exit")
    print(
        f"bound mixed    x{children}{' ' + str(env) if env else ''}: "
        f"{spent / replaced * 1000:.1f} ms per replacement (create beside teardown and exit); "
        f"{replaced / spent:.2f} replacements/s"
    )
    return {"replacements": replaced, "ms_each": spent / replaced * 1000, "per_s": replaced / spent}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output", default="bench/results/context_probe.json")
    parser.add_argument("--children", type=int, default=CHILDREN)
    parser.add_argument("--torch", action="store_true", help="import torch in the template first")
    parser.add_argument(
        "--bound-rounds", type=int, default=3, help="rounds of the idle-GPU bound (0: skip)"
    )
    parser.add_argument(
        "--bound-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="also measure the bound with this variable in the children's environment",
    )
    parser.add_argument("--bound-only", action="store_true", help="skip the disturbance phases")
    args = parser.parse_args()
    t_imp = time.time()
    import pycuda.driver  # noqa: F401  (imported, never initialised)

    if args.torch:
        import torch  # noqa: F401
    imports_s = time.time() - t_imp

    bound = _bound(args.children, args.bound_rounds) if args.bound_rounds else {}
    for setting in args.bound_env:
        name, _, value = setting.partition("=")
        bound[setting] = _bound(args.children, max(args.bound_rounds, 1), {name: value})
    if args.bound_only:
        common.write_result(args.output, {"imports_s": imports_s, "bound": bound})
        return 0
    stop_r, stop_w = os.pipe()
    out_r, out_w = os.pipe()
    ready_r, ready_w = os.pipe()
    mpid = os.fork()
    if mpid == 0:
        _measure(stop_r, out_w, ready_w)
    os.close(out_w)
    os.read(ready_r, 1)
    windows: list = []
    time.sleep(1.0)
    windows.append({"phase": "idle", "start": time.time(), "end": time.time() + 1.5, "children": 0})
    time.sleep(1.5)

    n = args.children
    for size in (1, n):
        t_fork = time.time()
        kids = _spawn_children(size)
        fork_s = (time.time() - t_fork) / size
        _phases(
            kids,
            windows,
            [
                (b"i", f"cuInit x{size}"),
                (b"c", f"context create x{size}"),
                (b"d", f"context detach x{size}"),
                (b"c", f"context re-create x{size}"),
                (b"x", f"exit with live context x{size}"),
            ],
        )
        windows.append(
            {"phase": f"fork per child x{size}", "start": 0, "end": fork_s, "children": size}
        )
    # What a retired worker does after its teardown, and what a spare does
    # before its context: exit after pop+detach; exit after cuInit alone.
    _phases(
        _spawn_children(n),
        windows,
        [
            (b"i", f"(setup) cuInit x{n}"),
            (b"c", f"(setup) context create x{n}"),
            (b"d", f"(setup) context detach x{n}"),
            (b"x", f"exit after detach x{n}"),
        ],
    )
    _phases(
        _spawn_children(n),
        windows,
        [(b"i", f"(setup) cuInit x{n}"), (b"x", f"exit after cuInit only x{n}")],
    )
    # CUPTI: a subscription made before the context (a spare could make it
    # off the lease) and one made with a live context (a first upload).
    for size in (1, n):
        _phases(
            _spawn_children(size),
            windows,
            [
                (b"i", f"(setup) cuInit x{size}"),
                (b"s", f"cupti subscribe, no context x{size}"),
                (b"c", f"context create after cupti x{size}"),
                (b"d", f"context detach after cupti x{size}"),
                (b"x", f"exit after cupti+detach x{size}"),
            ],
        )
        _phases(
            _spawn_children(size),
            windows,
            [
                (b"i", f"(setup) cuInit x{size}"),
                (b"c", f"(setup) context create x{size}"),
                (b"s", f"cupti subscribe, live context x{size}"),
                (b"d", f"(setup) detach x{size}"),
                (b"x", f"(setup) exit x{size}"),
            ],
        )
    time.sleep(0.5)
    windows.append(
        {"phase": "idle again", "start": time.time(), "end": time.time() + 1.5, "children": 0}
    )
    time.sleep(1.5)
    os.write(stop_w, b"s")
    data = b""
    while chunk := os.read(out_r, 1 << 20):
        data += chunk
    os.waitpid(mpid, 0)
    samples = json.loads(data)
    report = {"imports_s": imports_s, "torch": args.torch, "bound": bound, "phases": []}
    print(f"template imports: {imports_s:.2f} s (torch={args.torch})")
    print(f"{'phase':34} {'dur ms':>8} {'copies':>6} {'median ms':>10} {'CV %':>6} {'max ms':>8}")
    for w in windows:
        if w["start"] == 0:
            print(f"{w['phase']:34} {w['end'] * 1000:8.3f}")
            report["phases"].append({"phase": w["phase"], "ms": w["end"] * 1000})
            continue
        inside = [ms for t, ms in samples if w["start"] <= t <= w["end"]]
        row = {
            "phase": w["phase"],
            "duration_ms": (w["end"] - w["start"]) * 1000,
            "copies": len(inside),
        }
        if len(inside) >= 2:
            med = statistics.median(inside)
            cv = statistics.stdev(inside) / statistics.mean(inside) * 100
            row.update(
                median_ms=med, cv_percent=cv, max_ms=max(inside), gbps=2 * (1 << 30) / med / 1e6
            )
            print(
                f"{w['phase']:34} {row['duration_ms']:8.1f} {len(inside):6d} {med:10.4f} {cv:6.2f} {max(inside):8.4f}"
            )
        else:
            print(f"{w['phase']:34} {row['duration_ms']:8.1f} {len(inside):6d}")
        report["phases"].append(row)
    common.write_result(args.output, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
