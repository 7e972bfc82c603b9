# -*- test-case-name: tests.integration.test_remote_compile_flow -*-
"""
The remote-compilation flow on kcoral's own client (examples/remote_compile.py)
against real CPU servers: the CPU half (nvcc compiles for a GPU target the
test names) and the example's answer when its C{--gpu} server is a CPU node.
The GPU half is tests/gpu/test_gpu_server.py::test_remote_compile_example.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from kcoral import Client, InstructionError
from kcoral.compilers.nvcc import find_nvcc
from kcoral.testing.live_server import ServerProcess

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
NVCC, WHY_NOT = find_nvcc()


def example() -> ModuleType:
    path = ROOT / "examples" / "remote_compile.py"
    spec = importlib.util.spec_from_file_location("kcoral_example_remote_compile", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def cpu_url(cpu_server: Callable[..., ServerProcess]) -> str:
    return f"http://127.0.0.1:{cpu_server('--sandbox', 'none').port}"


@pytest.mark.skipif(NVCC is None, reason=f"no nvcc: {WHY_NOT}")
def test_cpu_server_compiles_with_kcoral_client(cpu_url: str) -> None:
    """
    The example's compile step, on C{kcoral.Client}: a CUDA module and
    C{builtin.compile_cuda_binary} give an ELF cubin for the named arch.
    """
    with Client(cpu_url) as cpu:
        image = example().compile_saxpy(cpu, "sm_90a")
    assert image[:4] == b"\x7fELF"


@pytest.mark.skipif(NVCC is None, reason=f"no nvcc: {WHY_NOT}")
def test_compile_error_is_an_instruction_error(cpu_url: str) -> None:
    """nvcc's diagnostics come back as a C{compile} InstructionError from check()."""
    from kcoral import Program

    p = Program()
    source = p.upload(kind="module", language="cuda", source="__global__ void k( {}\n")
    kernel = p.get_function(module=source, name="k")
    p.return_(
        key="image",
        value=p.run(fn="builtin.compile_cuda_binary", args=[kernel, {"arch": "sm_90a"}]),
    )
    with Client(cpu_url) as cpu, pytest.raises(InstructionError) as caught:
        cpu.execute(p, timeout_seconds=300).check()
    assert caught.value.kind == "compile"
    assert "error" in caught.value.message


def test_gpu_flag_on_a_cpu_node(cpu_url: str) -> None:
    """C{--gpu <a CPU node>}: one line saying it has no GPU target, no traceback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KCORAL_")}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "remote_compile.py"),
         "--cpu", cpu_url, "--gpu", cpu_url],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 1
    assert done.stderr == f"{cpu_url} has no GPU target (a CPU node?): pass a GPU server as --gpu\n"
    assert "Traceback" not in done.stdout + done.stderr
