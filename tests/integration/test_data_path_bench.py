"""
The data-path benchmarks in CI form, on a CPU server for a few seconds
each: C{bench/tensor_roundtrip.py} (every flow, bytes compared),
C{bench/gpu_tensor_path.py --cpu} (the client flow with the server's own
up and down figures) and C{bench/result_memory.py} (the server's peak RSS
while it returns a result).

No time is asserted.  What is asserted is what a regression of the data
path would break: the bytes come back identical, large parts leave the
server from shared buffers (C{response_streamed.shared_bytes}), at least
partly with C{sendfile} (C{sent_directly}), and the
server's peak RSS while it returns a 32 MiB result grows by less than half
the result (it held two or three copies before results were streamed).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kcoral.ipc import shared

from .benchscripts import run_bench

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not shared.available(), reason="no sealed memfds here"),
]

SPAWN = "--device cpu --num-workers 1 --log-dir '' --sandbox none --max-requests-per-worker 0"


def test_tensor_roundtrip(tmp_path: Path) -> None:
    output = tmp_path / "tensor_roundtrip.json"
    run_bench(
        "tensor_roundtrip.py",
        "--spawn",
        SPAWN,
        "--size-mib",
        "4",
        "--iterations",
        "2",
        "--output",
        str(output),
    )
    result = json.loads(output.read_text())
    assert set(result["flows"]) == {"direct", "client_flow", "cached"}
    for flow in result["flows"].values():
        assert flow["bytes_verified"] is True


def test_server_side_figures(tmp_path: Path) -> None:
    output = tmp_path / "gpu_tensor_path.json"
    run_bench(
        "gpu_tensor_path.py",
        "--cpu",
        "--size-mib",
        "4",
        "--iterations",
        "2",
        "--output",
        str(output),
    )
    result = json.loads(output.read_text())
    samples = result["server"]["samples"]
    assert len(samples) == 2
    for sample in samples:
        assert sample["server_up_ms"] is not None
        assert sample["server_down_ms"] is not None
    # The 4 MiB part left the server from the worker's sealed buffer.
    events = [
        json.loads(line)
        for path in Path(result["server"]["log_dir"]).rglob("events.jsonl*")
        for line in path.read_text().splitlines()
    ]
    streamed = [e for e in events if e.get("event") == "response_streamed"]
    assert streamed and all(e["shared_bytes"] == 4 << 20 for e in streamed)
    # Over plain TCP with a Content-Length, at least part of it went from the
    # memfd into the socket with sendfile (none of it copied in the parent).
    assert all(0 < e["sent_directly"] <= 4 << 20 for e in streamed)


def test_result_memory(tmp_path: Path) -> None:
    output = tmp_path / "result_memory.json"
    run_bench("result_memory.py", "--size-mib", "32", "--repeat", "2", "--output", str(output))
    result = json.loads(output.read_text())
    assert result["peak_over_before_mib"] < 16, result


def test_response_path(tmp_path: Path) -> None:
    """Both ways of sending a shared part deliver it whole; sendfile carries it when the client keeps up."""
    output = tmp_path / "response_path.json"
    run_bench(
        "probes/response_path.py", "--size-mib", "8", "--rounds", "1", "--output", str(output)
    )
    result = json.loads(output.read_text())
    assert result["size_bytes"] == 8 << 20
    assert result["pread"]["direct_share"] == 0
    assert 0 < result["sendfile"]["direct_share"] <= 1


def test_transfer_profile(tmp_path: Path) -> None:
    """
    Blobs past the threads' hand-over, each uploaded and returned whole
    (the script checks the bytes), with the server's own up and down figures.
    """
    output = tmp_path / "transfer_profile.json"
    run_bench(
        "transfer_profile.py",
        *("--size-mib", "8", "--uploads", "2", "--download", "--output", str(output)),
    )
    result = json.loads(output.read_text())
    assert len(result["body_ready_ms"]) == len(result["down_ms"]) == 2
    assert all(
        ready >= arrived
        for arrived, ready in zip(result["body_ms"], result["body_ready_ms"], strict=True)
    )
    assert all(0 < sent <= 8 << 20 for sent in result["sent_directly"])
