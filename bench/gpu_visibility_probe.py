"""
What a sandboxed GPU worker can see: run a tiny CUDA probe under the
project's own bubblewrap command line with different device bindings and
C{CUDA_VISIBLE_DEVICES} values, and print one JSON line per case.

Run on a GPU machine (two GPUs for the interesting cases)::

    python3 bench/gpu_visibility_probe.py --readonly-path DIR ...

Also prints what the host reports (nvidia-smi, the driver's /proc files), so
the server's GPU discovery can be checked against it.
"""

from __future__ import annotations

import argparse
import glob
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from kcoral.server.leases.gpus import discover_gpus
from kcoral.server.sandbox.bubblewrap import BubblewrapSandbox

PROBE = """
import json, os
out = {"cvd": os.environ.get("CUDA_VISIBLE_DEVICES"), "dev": sorted(
    n for n in os.listdir("/dev") if n.startswith("nvidia"))}
out["proc_gpus"] = sorted(os.listdir("/proc/driver/nvidia/gpus")) if os.path.isdir(
    "/proc/driver/nvidia/gpus") else None
try:
    import pycuda.driver as d
    d.init()
    out["count"] = d.Device.count()
    out["pci"] = [d.Device(i).pci_bus_id() for i in range(out["count"])]
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"
print(json.dumps(out), flush=True)
"""


def _host_facts() -> dict[str, object]:
    facts: dict[str, object] = {}
    smi = shutil.which("nvidia-smi")
    if smi:
        query = "--query-gpu=index,uuid,pci.bus_id"
        facts["nvidia_smi"] = subprocess.run(
            [smi, query, "--format=csv,noheader"], capture_output=True, text=True
        ).stdout
    facts["dev"] = sorted(glob.glob("/dev/nvidia*"))
    info = {}
    for path in sorted(glob.glob("/proc/driver/nvidia/gpus/*/information")):
        with open(path) as f:
            info[path] = f.read()
    facts["proc_information"] = info
    facts["discovered"] = [device.as_log_dict() for device in discover_gpus()]
    return facts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--readonly-path", action="append", default=[])
    parser.add_argument("--uuid", action="append", default=[], help="GPU UUIDs to try as CVD")
    args = parser.parse_args()
    facts = _host_facts()
    print(json.dumps(facts, indent=1), flush=True)
    uuids = [device.uuid for device in discover_gpus() if device.uuid]
    sandbox = BubblewrapSandbox(tuple(args.readonly_path))
    sandbox.executable = shutil.which("bwrap")
    seat = Path(tempfile.mkdtemp(prefix="kcoral-probe-"))
    work = sandbox.prepare_seat(seat)
    cases: list[tuple[list[str], str | None]] = [([], None)]
    for nodes in (["0"], ["1"], ["0", "1"]):
        for cvd in (None, "0", "1", "0,1", *uuids, *args.uuid):
            cases.append((nodes, cvd))
    for nodes, cvd in cases:
        tail = [sys.executable, "-c", PROBE]
        _exe, argv, env = sandbox._command(tail, work, nodes)
        env.pop("CUDA_VISIBLE_DEVICES", None)
        if cvd is not None:
            env["CUDA_VISIBLE_DEVICES"] = cvd
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        run = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
        line = run.stdout.strip().splitlines()[-1:] or [run.stderr[-400:]]
        print(json.dumps({"nodes": nodes, "cvd": cvd, "rc": run.returncode, "out": line[0]}))
        sandbox.clear_workspace(work)
    shutil.rmtree(seat, ignore_errors=True)


if __name__ == "__main__":
    main()
