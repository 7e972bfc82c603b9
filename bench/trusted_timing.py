"""
Issue 33's targets on one GPU, in one run: the exploit corpus of
tests/gpu/test_gpu_trusted_timing.py against kcoral and the reference
0.1.1 server, then kcoral's fidelity, noise and cost.

    . .gpu/activate.sh && python3 bench/trusted_timing.py [--ref-site /opt/kcoral-ref]

1. Corpus: each exploit and control runs on a kcoral server (bubblewrap,
   fresh worker per request) and on the reference server (8 workers,
   fresh worker per request, --sandbox none, its documented start).  An
   exploit is I{caught} when the program fails, the result is flagged
   (kcoral's C{validity}), or the median is still at least half the honest
   one; a control is I{clean} when it completes unflagged (kcoral) or
   completes (the reference, which has no C{validity}).
2. Fidelity and noise: C{benchmark} of a 2048x2048 float32 matmul and a
   256 MiB device copy through kcoral (200 iterations, L2 flushed) against
   local timing of the same work in this process: CUDA events around each
   call on the default stream, the L2 flushed before each, 200 iterations.
   Targets: medians within 0.5 %, CV at most 0.5 %.
3. Cost: in this process, the wall time of a 10 + 100 iteration
   C{benchmark} of a ~0.3 ms kernel (the 2048 matmul) against today's event
   timer (C{EventTimer}, the same counts).  Target: at most 1.3x.

Writes bench/results/trusted_timing.json (and $OUT/trusted_timing.json).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import common  # noqa: E402

from kcoral.testing.live_server import ServerProcess, free_port, post_program  # noqa: E402
from kcoral.wire.multipart import decode_response  # noqa: E402
from kcoral.wire.values import decode_results  # noqa: E402
from tests.gpu import test_gpu_trusted_timing as corpus  # noqa: E402

COPY = "import torch\n\ndef kernel(x, out):\n    out.copy_(x)\n"

#: The fidelity harness: times kernel(x, out) on given shapes.
FIDELITY_HARNESS = r"""
import torch
from kcoral.builtins import benchmark

def measure(kernel, numel, repeat):
    torch.manual_seed(0)
    x = torch.randn(numel, device="cuda")
    out = torch.zeros_like(x)
    shape = (2048, 2048) if numel == 2048 * 2048 else (numel,)
    return benchmark(kernel, x.view(shape), out.view(shape), {"warmup": 20, "repeat": repeat})
"""


def _post(port: int, program: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    response = post_program(port, program, timeout=600)
    body, parts = decode_response(response.headers["content-type"], response.body)
    results = decode_results(body.get("results", {}), parts) if "results" in body else {}
    return body, results


def _verdict(body: dict[str, Any], results: dict[str, Any], honest: float | None) -> dict[str, Any]:
    if body.get("status") != "COMPLETED":
        error = body.get("error") or {}
        return {"outcome": "failed", "detail": str(error.get("message", body))[:300]}
    value = results.get("r", {})
    validity = value.get("validity")
    median = value.get("latency_ms_median")
    out = {"outcome": "completed", "median_ms": median, "check": value.get("check")}
    if validity is not None:
        out["validity"] = validity
    if validity is not None and not validity["ok"]:
        out["outcome"] = "flagged"
    elif honest is not None and median is not None and median < 0.5 * honest:
        out["outcome"] = "fooled"
    return out


def run_corpus(port: int, name: str) -> dict[str, Any]:
    """Every exploit and control on the server at C{port}."""
    honest_body, honest_results = _post(
        port, corpus.corpus_program(corpus.python_kernel(corpus.MATMUL), {}, "matmul")
    )
    honest = honest_results.get("r", {}).get("latency_ms_median")
    print(f"  {name}: honest 2048 matmul median {honest} ms")
    table: dict[str, Any] = {"honest_median_ms": honest, "exploits": {}, "controls": {}}
    for case, (source, cfg) in sorted(corpus.EXPLOITS.items()):
        body, results = _post(
            port, corpus.corpus_program(corpus.python_kernel(source), cfg, "matmul")
        )
        table["exploits"][case] = _verdict(body, results, honest)
        print(f"  {name} exploit {case:32s} {table['exploits'][case]['outcome']}")
    for case, (source, cfg) in sorted(corpus.CONTROLS.items()):
        ref = corpus.REFERENCE.get(case, "matmul")
        body, results = _post(port, corpus.corpus_program(corpus.python_kernel(source), cfg, ref))
        table["controls"][case] = _verdict(body, results, None)
        print(f"  {name} control {case:32s} {table['controls'][case]['outcome']}")
    return table


def fidelity(port: int, repeat: int) -> dict[str, Any]:
    """kcoral's median and CV of the matmul and the 256 MiB copy."""
    out = {}
    for case, source, numel in (
        ("matmul_2048", corpus.MATMUL, 2048 * 2048),
        ("copy_256mib", COPY, 64 << 20),
    ):
        program = {
            "instructions": [
                *corpus.python_kernel(source),
                {"op": "upload", "kind": "module", "id": "h", "source": FIDELITY_HARNESS},
                {"op": "get_function", "id": "m", "module": {"$ref": "h"}, "name": "measure"},
                {
                    "op": "run",
                    "id": "r",
                    "fn": {"$ref": "m"},
                    "args": [{"$ref": "kern"}, numel, repeat],
                },
                {"op": "return", "key": "r", "value": {"$ref": "r"}},
            ]
        }
        body, results = _post(port, program)
        value = results.get("r") or {"error": body.get("error")}
        out[case] = value
        print(f"  kcoral {case}: median {value.get('latency_ms_median')} cv {value.get('cv')}")
    return out


def local_timing(repeat: int) -> dict[str, Any]:
    """The same work timed here: CUDA events per call, L2 flushed before each."""
    import torch

    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    flush = torch.empty(2 * l2, dtype=torch.int8, device="cuda")
    out = {}
    torch.manual_seed(0)
    for case, numel in (("matmul_2048", 2048 * 2048), ("copy_256mib", 64 << 20)):
        x = torch.randn(numel, device="cuda")
        y = torch.zeros_like(x)
        if case == "matmul_2048":
            a, b = x.view(2048, 2048), y.view(2048, 2048)
            call = functools.partial(torch.matmul, a, a, out=b)
        else:
            call = functools.partial(y.copy_, x)
        for _ in range(20):
            call()
        spans = []
        for _ in range(repeat):
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            spans.append(start.elapsed_time(end))
        mean = statistics.fmean(spans)
        out[case] = {
            "latency_ms_median": statistics.median(spans),
            "cv": statistics.pstdev(spans) / mean,
            "cupti": _local_cupti(call, flush, repeat),
        }
        print(
            f"  local {case}: median {out[case]['latency_ms_median']:.5f} cv {out[case]['cv']:.4f}"
        )
    return out


def _local_cupti(call: Any, flush: Any, repeat: int) -> dict[str, float]:
    """
    The same calls timed from CUPTI records directly (cupti-python, not
    kcoral's code): each call's first kernel or copy start to its last end,
    the L2 flushed and the device synchronized around each.
    """
    import torch
    from cupti import cupti

    records: list[tuple[int, int]] = []
    kinds = (cupti.ActivityKind.CONCURRENT_KERNEL, cupti.ActivityKind.MEMCPY)

    def completed(activities: list[Any]) -> None:
        records.extend((a.start, a.end) for a in activities if a.kind in kinds)

    windows = []
    cupti.activity_register_callbacks(lambda: (8 << 20, 0), completed)
    for kind in kinds:
        cupti.activity_enable(kind)
    try:
        for _ in range(repeat):
            flush.zero_()
            torch.cuda.synchronize()
            start = cupti.get_timestamp()
            call()
            torch.cuda.synchronize()
            windows.append((start, cupti.get_timestamp()))
        cupti.activity_flush_all(1)
    finally:
        for kind in kinds:
            cupti.activity_disable(kind)
    spans = []
    for start, end in windows:
        inside = [r for r in records if start <= r[0] <= end]
        if inside:
            spans.append((max(r[1] for r in inside) - min(r[0] for r in inside)) / 1e6)
    mean = statistics.fmean(spans)
    return {
        "latency_ms_median": statistics.median(spans),
        "cv": statistics.pstdev(spans) / mean,
        "iterations": len(spans),
    }


def cost(rounds: int) -> dict[str, Any]:
    """Wall time of a 10 + 100 iteration benchmark: CUPTI loop against the event timer."""
    import torch

    from kcoral.worker import gpu_builtins
    from kcoral.worker.devices import make_backend, prepare_backend
    from kcoral.worker.gpu_builtins.timing import EventTimer

    prepare_backend("gpu", tensor_api="torch")
    backend = make_backend("gpu", tensor_api="torch")
    gpu_builtins.use_backend(backend)
    x = torch.randn(2048, 2048, device="cuda")
    y = torch.zeros_like(x)

    def kernel(a: Any, b: Any) -> None:
        torch.matmul(a, a, out=b)

    def events() -> None:
        timer = EventTimer(backend, True)
        timer.run(kernel, (x, y), 10)
        timer.run(kernel, (x, y), 100)

    def activity() -> None:
        result = gpu_builtins.benchmark(kernel, x, y, {"warmup": 10, "repeat": 100})
        assert result["timing"] == "cupti_activity", result

    from kcoral.worker.gpu_builtins import timing
    from kcoral.worker.gpu_builtins.activity import Driver, activity_trace

    first = time.perf_counter()
    activity()
    first_ms = (time.perf_counter() - first) * 1000.0
    first_phases = dict(timing.LAST_PHASES)
    trace, driver = activity_trace(), Driver()
    assert trace is not None
    sessions = []
    for _ in range(rounds):
        started = time.perf_counter()
        with trace.session(driver):
            pass
        sessions.append((time.perf_counter() - started) * 1000.0)
    walls: dict[str, list[float]] = {"events": [], "cupti_activity": []}
    for _ in range(rounds):
        for name, fn in (("events", events), ("cupti_activity", activity)):
            torch.cuda.synchronize()
            started = time.perf_counter()
            fn()
            walls[name].append((time.perf_counter() - started) * 1000.0)
    medians = {name: statistics.median(v) for name, v in walls.items()}
    result = {
        "first_benchmark_ms": first_ms,
        "events_ms": medians["events"],
        "cupti_activity_ms": medians["cupti_activity"],
        "ratio": medians["cupti_activity"] / medians["events"],
        "rounds": rounds,
        "first_phases_ms": first_phases,
        "last_phases_ms": dict(timing.LAST_PHASES),
        "empty_session_ms": statistics.median(sessions),
    }
    print(f"  cost: {json.dumps(result)}")
    return result


#: Runs with the reference client: a real benchmark against kcoral.
REFERENCE_CLIENT = r"""
import json, sys
from kcoral import Client, Program
p = Program()
k = p.upload(kind="module", source=sys.argv[2], id="k")
kern = p.get_function(module=k, name="kernel", id="kern")
h = p.upload(kind="module", source=sys.argv[3], id="h")
m = p.get_function(module=h, name="measure", id="m")
r = p.run(fn=m, args=[kern, {"warmup": 5, "repeat": 30}, "matmul", False], id="run")
p.return_(key="r", value=r)
result = Client(sys.argv[1]).execute(p)
print("@@REF@@" + json.dumps({"status": result.status, "r": result.results.get("r")}))
"""


def reference_client(port: int, site: str) -> dict[str, Any]:
    """The reference client runs a benchmark on kcoral (the response has measurements)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = site
    done = subprocess.run(
        [sys.executable, "-c", REFERENCE_CLIENT, f"http://127.0.0.1:{port}"]
        + [corpus.MATMUL, corpus.HARNESS],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd="/tmp",
    )
    lines = [x for x in done.stdout.splitlines() if x.startswith("@@REF@@")]
    if done.returncode != 0 or not lines:
        return {"error": done.stderr[-2000:]}
    out: dict[str, Any] = json.loads(lines[0][len("@@REF@@") :])
    print(f"  reference client on kcoral: {json.dumps(out)[:400]}")
    return out


def start_reference(site: str, port: int, logs: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(PYTHONPATH=site, TVM_FFI_DISABLE_TORCH_C_DLPACK="1", PYTHONUNBUFFERED="1")
    logs.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "kcoral", "server", "--device", "gpu", "--gpus", "0"]
    argv += ["--workers-per-gpu", "8", "--max-requests-per-worker", "1", "--sandbox", "none"]
    argv += ["--port", str(port), "--log-dir", str(logs)]
    with open(logs / "server.out", "wb") as log:
        process = subprocess.Popen(argv, env=env, cwd="/tmp", stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    import http.client

    while time.monotonic() < deadline:
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                return process
        except OSError:
            pass
        if process.poll() is not None:
            raise RuntimeError(
                f"the reference server exited: {(logs / 'server.out').read_text()[-2000:]}"
            )
        time.sleep(1)
    raise RuntimeError("the reference server did not answer /health in 180 s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ref-site", default="/opt/kcoral-ref")
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--skip", default="", help="comma-separated: reference, corpus, fidelity, cost"
    )
    parser.add_argument("--output", default=str(common.RESULTS / "trusted_timing.json"))
    args = parser.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    report: dict[str, Any] = {"benchmark": "trusted_timing"}
    logs = Path("/tmp/trusted-timing-logs")
    (logs / "kcoral").mkdir(parents=True, exist_ok=True)
    server = ServerProcess(
        ["--device", "gpu", "--gpus", "0", "--workers-per-gpu", "2"]
        + ["--max-requests-per-worker", "1", "--log-dir", str(logs / "kcoral")]
        + ["--tensor-api", "torch", *corpus.readonly_flags()],
        log_path=logs / "kcoral.out",
    )
    server.start(timeout=240)
    try:
        if "corpus" not in skip:
            print("corpus on kcoral")
            report["kcoral"] = run_corpus(server.port, "kcoral")
        if os.path.isdir(args.ref_site):
            report["reference_client_on_kcoral"] = reference_client(server.port, args.ref_site)
        if "fidelity" not in skip:
            print("fidelity and noise")
            report["fidelity_kcoral"] = fidelity(server.port, args.repeat)
    finally:
        server.stop()
    if "fidelity" not in skip:
        report["fidelity_local"] = local_timing(args.repeat)
    if "reference" not in skip and "corpus" not in skip and os.path.isdir(args.ref_site):
        port = free_port()
        print("corpus on the reference server")
        process = start_reference(args.ref_site, port, logs / "reference")
        try:
            report["reference"] = run_corpus(port, "reference")
        finally:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
    if "cost" not in skip:
        report["cost"] = cost(args.rounds)
    if "fidelity_kcoral" in report and "fidelity_local" in report:
        for case, local in report["fidelity_local"].items():
            ours = report["fidelity_kcoral"][case]
            if "latency_ms_median" in ours:
                ours["vs_local_events"] = ours["latency_ms_median"] / local["latency_ms_median"] - 1
                ours["vs_local_cupti"] = (
                    ours["latency_ms_median"] / local["cupti"]["latency_ms_median"] - 1
                )
    common.write_result(args.output, report)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "trusted_timing.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1)[:6000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
