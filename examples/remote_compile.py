"""
Compile CUDA C on a CPU server, then load, run, check and benchmark it on a
GPU server.

    kcoral server --device cpu --num-workers 2 --port 8000            # anywhere
    kcoral server --device gpu --gpus 0 --workers-per-gpu 8 --port 8001  # on the GPU node
    python examples/remote_compile.py --cpu http://127.0.0.1:8000 --gpu http://127.0.0.1:8001

Standard library and numpy only: it speaks the wire protocol with
kcoral.testing.live_server's helpers (multipart in, JSON or multipart out).
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.parse

import numpy as np

from kcoral.testing.live_server import multipart_body, request, sha256
from kcoral.wire.multipart import decode_response
from kcoral.wire.values import decode_results

SAXPY = r"""
__global__ void saxpy(float a, const float *x, float *y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
"""


def _address(url: str) -> tuple[str, int]:
    """The host and port of an http:// URL (IPv6 literals without brackets)."""
    parts = urllib.parse.urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 80


def _run(url: str, program: dict, blobs: list[bytes] = ()) -> dict:
    host, port = _address(url)
    content_type, payload = multipart_body(program, list(blobs))
    response = request(port, "POST", "/execute", payload, {"Content-Type": content_type}, host=host)
    body, parts = decode_response(response.headers["content-type"], response.body)
    if response.status != 200 or body["status"] != "COMPLETED":
        sys.exit(f"{url}: {json.dumps(body.get('error'), indent=2)}")
    return decode_results(body["results"], parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--cpu", default="http://127.0.0.1:8000", help="CPU (compile) server")
    parser.add_argument("--gpu", default="http://127.0.0.1:8001", help="GPU server")
    parser.add_argument("-n", type=int, default=1 << 20, help="vector length")
    args = parser.parse_args()

    # 1. The target comes from the GPU server: compile for exactly that arch.
    gpu_host, gpu_port = _address(args.gpu)
    health = request(gpu_port, "GET", "/health", host=gpu_host).json()
    arch = health["target"]["arch"]
    print(f"GPU server target: {arch}")

    # 2. Compile on the CPU server (nvcc, no GPU needed there).
    compiled = _run(
        args.cpu,
        {
            "instructions": [
                {
                    "op": "upload",
                    "kind": "module",
                    "id": "src",
                    "language": "cuda",
                    "source": SAXPY,
                },
                {"op": "get_function", "id": "fn", "module": {"$ref": "src"}, "name": "saxpy"},
                {
                    "op": "run",
                    "id": "image",
                    "fn": "builtin.compile_cuda_binary",
                    "args": [{"$ref": "fn"}, {"arch": arch, "extra_cuda_cflags": ["-O3"]}],
                },
                {"op": "return", "key": "image", "value": {"$ref": "image"}},
            ]
        },
    )
    image = compiled["image"]
    print(f"compiled a {len(image)}-byte cubin for {arch} on the CPU server")

    # 3. Load it on the GPU server, run, check against numpy, benchmark.
    n = args.n
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    launch = {"grid": [(n + 255) // 256], "block": [256], "arg_types": ["f32", "ptr", "ptr", "i32"]}
    results = _run(
        args.gpu,
        {
            "instructions": [
                {"op": "upload", "kind": "library", "id": "lib", "blob": sha256(image)},
                {
                    "op": "run",
                    "id": "k",
                    "fn": "builtin.kernel",
                    "args": [{"$ref": "lib"}, "saxpy", launch],
                },
                {
                    "op": "upload",
                    "kind": "tensor",
                    "id": "x",
                    "blob": sha256(x.tobytes()),
                    "dtype": "float32",
                    "shape": [n],
                },
                {
                    "op": "run",
                    "id": "y",
                    "fn": "builtin.zeros",
                    "args": [{"shape": [n], "dtype": "float32"}],
                },
                {
                    "op": "run",
                    "id": "go",
                    "fn": {"$ref": "k"},
                    "args": [2.0, {"$ref": "x"}, {"$ref": "y"}, n],
                },
                {"op": "return", "key": "y", "value": {"$ref": "y"}},
                {
                    "op": "run",
                    "id": "timing",
                    "fn": "builtin.benchmark",
                    "args": [
                        {"$ref": "k"},
                        2.0,
                        {"$ref": "x"},
                        {"$ref": "y"},
                        n,
                        {"warmup_ms": 25, "repeat_ms": 100},
                    ],
                },
                {"op": "return", "key": "timing", "value": {"$ref": "timing"}},
            ]
        },
        [image, x.tobytes()],
    )
    np.testing.assert_allclose(results["y"], 2.0 * x, rtol=1e-6)
    timing = results["timing"]
    print("result matches numpy")
    print(
        f"saxpy n={n}: median {timing['latency_ms_median'] * 1000:.2f} us "
        f"(min {timing['latency_ms_min'] * 1000:.2f}, max {timing['latency_ms_max'] * 1000:.2f}, "
        f"{timing['repeat']} timed calls, flush_l2={timing['flush_l2']})"
    )


if __name__ == "__main__":
    main()
