"""
Compile CUDA C on a CPU server, then load, run, check and benchmark it on a
GPU server, with kcoral's own client.

    kcoral server --device cpu --num-workers 2 --port 8000            # anywhere
    kcoral server --device gpu --gpus 0 --workers-per-gpu 8 --port 8001  # on the GPU node
    python examples/remote_compile.py --cpu http://127.0.0.1:8000 --gpu http://127.0.0.1:8001
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np

from kcoral import (
    Client,
    InstructionError,
    KCoralError,
    Program,
    ProtocolError,
    TransportError,
)

SAXPY = r"""
__global__ void saxpy(float a, const float *x, float *y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
"""


def compile_program(arch: str) -> Program:
    """Compile L{SAXPY} for C{arch}; the cubin comes back as C{image}."""
    p = Program()
    source = p.upload(kind="module", language="cuda", source=SAXPY)
    kernel = p.get_function(module=source, name="saxpy")
    image = p.run(
        fn="builtin.compile_cuda_binary",
        args=[kernel, {"arch": arch, "extra_cuda_cflags": ["-O3"]}],
    )
    p.return_(key="image", value=image)
    return p


def run_program(image: bytes, x: np.ndarray) -> Program:
    """Load C{image}, run y = 2x, check it against 2x on the GPU, and time it."""
    n = len(x)
    p = Program()
    library = p.upload(kind="library", value=image)
    launch = {"grid": [(n + 255) // 256], "block": [256], "arg_types": ["f32", "ptr", "ptr", "i32"]}
    saxpy = p.run(fn="builtin.kernel", args=[library, "saxpy", launch])
    x_gpu = p.upload(kind="tensor", value=x)
    y = p.run(fn="builtin.zeros", args=[{"shape": [n], "dtype": "float32"}])
    p.run(fn=saxpy, args=[2.0, x_gpu, y, n])
    expected = p.upload(kind="tensor", value=2.0 * x)
    p.return_(key="check", value=p.run(fn="builtin.check_close", args=[y, expected]))
    p.return_(key="y", value=y)
    timing = p.run(
        fn="builtin.benchmark",
        args=[saxpy, 2.0, x_gpu, y, n, {"warmup_ms": 25, "repeat_ms": 100}],
    )
    p.return_(key="timing", value=timing)
    return p


def compile_saxpy(cpu: Client, arch: str) -> bytes:
    """Compile on a CPU server (nvcc there, no GPU needed): the cubin's bytes."""
    image: bytes = cpu.execute(compile_program(arch), timeout_seconds=300).check()["image"]
    return image


def run_saxpy(gpu: Client, image: bytes, x: np.ndarray) -> dict[str, Any]:
    """Run, check and time the kernel on a GPU server: the returned values."""
    return gpu.execute(run_program(image, x), timeout_seconds=300).check().results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--cpu", default="http://127.0.0.1:8000", help="CPU (compile) server")
    parser.add_argument("--gpu", default="http://127.0.0.1:8001", help="GPU server")
    parser.add_argument("-n", type=int, default=1 << 20, help="vector length")
    args = parser.parse_args(argv)

    with Client(args.cpu) as cpu, Client(args.gpu) as gpu:
        try:
            # 1. The target comes from the GPU server: compile for exactly that arch.
            try:
                arch = gpu.target()["arch"]
            except ProtocolError:
                sys.exit(f"{args.gpu} has no GPU target (a CPU node?): pass a GPU server as --gpu")
            print(f"GPU server target: {arch}")

            # 2. Compile on the CPU server (nvcc, no GPU needed there).
            image = compile_saxpy(cpu, arch)
            print(f"compiled a {len(image)}-byte cubin for {arch} on the CPU server")

            # 3. Load it on the GPU server, run, check against 2x, benchmark.
            x = np.random.default_rng(0).standard_normal(args.n).astype(np.float32)
            results = run_saxpy(gpu, image, x)
        except (InstructionError, KCoralError, TransportError, ProtocolError) as e:
            sys.exit(f"{type(e).__name__}: {e}")
    check, timing = results["check"], results["timing"]
    np.testing.assert_allclose(results["y"], 2.0 * x, rtol=1e-6)
    print(f"result matches: max_abs_err={check['max_abs_err']:.3g} (passed={check['passed']})")
    print(
        f"saxpy n={args.n}: median {timing['latency_ms_median'] * 1000:.2f} us "
        f"(min {timing['latency_ms_min'] * 1000:.2f}, max {timing['latency_ms_max'] * 1000:.2f}, "
        f"{timing['repeat']} timed calls, flush_l2={timing['flush_l2']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
